"""Triton kernels of RMSNorm, the gated RMSNorm and the residual add + RMSNorm: one launch forward, one backward.

Semantics and rounding points are those of ``kdamoe.model.norm_torch`` (the reference), on ``[rows, D]`` views with a
unit last stride. Per row, with ``x̂ = float32(x)``, ``r = rsqrt(mean(x̂²) + eps)``, ``y = cast_x(x̂ r)`` (the
normalised value rounded to x's dtype), ``n = cast_o(w y)`` (the weighted value in ``o = promote(x, w)``) and,
for the gated op, ``s = σ(float32(gate))``::

    forward   out = n                       (plain, dtype o)
              out = cast_x(n s)             (gated, dtype x)
    backward  dn  = dout                    (plain)
              dn  = cast_o(dout s),  dgate = dout n s (1 − s)       (gated: autograd of the two casts)
              dy  = cast_x(dn w)                                     (autograd casts the grad to y's dtype)
              dx  = r dy − x̂ r³ mean(dy x̂),   dw = Σ_rows dn y      (float32 sums)

Residual add + RMSNorm: the normalised input is ``h = cast_h(x̂ + r̂)`` (``h`` in ``promote(x, r)``, torch's add: one
rounding of the float32 sum), stored as a second output; the backward adds the residual stream's gradient ``dh``
to ``dx`` in float32 before the one rounding (autograd of the unfused ops rounds ``dx`` to h's dtype first, then the
sum: one rounding fewer here).

``cast_*`` are rounding steps done in float32 registers (exact for the products involved: the operands of
``w y`` carry at most 24 + 11 significant bits and a rounding of their float32 product to float16 / bfloat16
equals torch's rounding of the same product).

Layout: a program holds ``BLOCK_M`` rows × the whole last dim (``BLOCK_D = next_pow2(D)``, D ≤ 8192): small
head-dim rows (the KDA output norm, D = 128) are batched, one hidden-size row (D = 2048) fills a program. The
backward runs ``P`` programs over the row blocks ``pid, pid + P, …`` and accumulates its share of ``dw`` in
registers; each writes one float32 row of a ``[P, D]`` partial buffer that the caller sums (no atomics, so the
result is deterministic). Nothing reads a device value on the host (CUDA-graph capturable).
"""

import torch
import triton
import triton.language as tl

from ..launch import autotune, fast_launch
from ..utils import cdiv, partial_programs, row_tile

MAX_D = 8192  # the whole last dim sits in one block
BLOCK_ELEMS = 4096  # rows × columns of one forward / backward tile (fp32 registers per program)
# Programs per SM of the backward: the dw partial buffer grows with it; 8 against 4 took a [32768, 2048] bf16
# backward from 0.185 to 0.149 ms and the gated [262144, 128] from 0.176 to 0.170 ms on the H200
# (benchmarks/tuning/tune_norm.py, results in benchmarks/results/norm_tune_h200.json; 16 gave no more). Swept at hidden
# 2048, not the e2e shape's 1024; there the step's norm backward went from 9.2 to 8.0 ms at 32K with this and the
# fused residual add together (e2e results measured at f5f2d34 and 99300f8; git history of benchmarks/results/).
BACKWARD_PROGRAMS_PER_SM = 8
# The backward's loop over its row blocks is software-pipelined ``STAGES`` deep (``tl.range(num_stages=...)``): with
# 2 the next block's loads are issued as asynchronous copies into shared memory before the current block is
# computed (compiled for sm_90a: cp.async, 24-32 KB of shared memory per program at D = 1024); 1 is the plain loop
# (each program waits for its loads, computes, stores, then loads again). Autotuned together with the warps (the
# outputs are written, never accumulated, so a tuning run leaves nothing behind); the interpreter runs the first.
# In the e2e step at 32K on the H200 the 50 norm backwards took 4.6 ms against 8.1 ms with the plain loop
# (profiles measured at 80d5d19 and ee44576; git history of benchmarks/results/).
_BACKWARD_CONFIGS = [triton.Config({"STAGES": 2}, num_warps=8), triton.Config({"STAGES": 1}, num_warps=8),
                     triton.Config({"STAGES": 3}, num_warps=8), triton.Config({"STAGES": 2}, num_warps=4)]
_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # dtype of n, passed as a constexpr


@triton.jit
def _round(v, CODE: tl.constexpr):
    """``v`` (float32) rounded to the dtype of ``CODE`` (0 float32, 1 float16, 2 bfloat16), back in float32."""
    if CODE == 1:
        v = v.to(tl.float16).to(tl.float32)
    elif CODE == 2:
        v = v.to(tl.bfloat16).to(tl.float32)
    return v


@triton.jit
def _normalise(x_ptr, rows, cols, mask, stride_x, D, eps, R, H, stride_r, HAS_RES: tl.constexpr):
    """``(x̂, r, y)`` of a tile: x in float32, the per-row rsqrt, the normalised value rounded to x's dtype.

    With ``HAS_RES`` the normalised input is ``h = x + R`` rounded to H's dtype as torch's add rounds it (the sum in
    float32, one rounding); the forward stores it to ``H`` (``[rows, D]``), the backward passes ``H`` as ``x_ptr``."""
    rows64 = rows[:, None].to(tl.int64)
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.).to(tl.float32)
    if HAS_RES:
        x += tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.).to(tl.float32)
        x = x.to(H.dtype.element_ty)
        tl.store(H + rows64 * D + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        y = (x * r[:, None]).to(H.dtype.element_ty).to(tl.float32)
    else:
        r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        y = (x * r[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    return x, r, y


@fast_launch
@triton.jit
def _forward_kernel(X, R, G, W, O, H, n_rows, D, stride_x, stride_r, stride_g, eps,
                    N_CODE: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    _, _, y = _normalise(X, rows, cols, mask, stride_x, D, eps, R, H, stride_r, HAS_RES)
    w = tl.load(W + cols, mask=col_ok, other=0.).to(tl.float32)
    out = _round(w[None, :] * y, N_CODE)
    if HAS_GATE:
        g = tl.load(G + rows[:, None].to(tl.int64) * stride_g + cols[None, :], mask=mask, other=0.).to(tl.float32)
        out = out * tl.sigmoid(g)
    tl.store(O + rows[:, None].to(tl.int64) * D + cols[None, :], out.to(O.dtype.element_ty), mask=mask)


@autotune(configs=_BACKWARD_CONFIGS, key=["D", "N_CODE", "HAS_GATE", "HAS_DRES", "BLOCK_M", "BLOCK_D"])
@triton.jit
def _backward_kernel(X, G, W, DO, DR, DX, DG, DW, n_rows, D, stride_x, stride_g, stride_do, stride_dr, eps, n_blocks,
                     P, N_CODE: tl.constexpr, HAS_GATE: tl.constexpr, HAS_DRES: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_D: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(W + cols, mask=col_ok, other=0.).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for blk in tl.range(pid, n_blocks, P, num_stages=STAGES):
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        x, r, y = _normalise(X, rows, cols, mask, stride_x, D, eps, X, X, stride_x, False)
        rows64 = rows[:, None].to(tl.int64)
        dn = tl.load(DO + rows64 * stride_do + cols[None, :], mask=mask, other=0.).to(tl.float32)
        if HAS_GATE:
            s = tl.sigmoid(tl.load(G + rows64 * stride_g + cols[None, :], mask=mask, other=0.).to(tl.float32))
            n = _round(w[None, :] * y, N_CODE)
            dg = dn * n * s * (1. - s)
            tl.store(DG + rows64 * D + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)
            dn = _round(dn * s, N_CODE)
        dw += tl.sum(dn * y, axis=0)
        dy = (dn * w[None, :]).to(X.dtype.element_ty).to(tl.float32)
        dot = tl.sum(dy * x, axis=1) / D
        dx = r[:, None] * dy - x * (r * r * r * dot)[:, None]
        if HAS_DRES:  # the residual stream's own gradient, added before the one rounding
            dx += tl.load(DR + rows64 * stride_dr + cols[None, :], mask=mask, other=0.).to(tl.float32)
        tl.store(DX + rows64 * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid.to(tl.int64) * D + cols, dw, mask=col_ok)


def norm_forward(x2, gate2, weight, eps, out_dtype, n_dtype, residual2=None, h_dtype=None):
    """Forward launch on ``x2 [rows, D]`` (unit last stride), optional ``gate2`` like x2: ``out [rows, D]``.

    With ``residual2`` (like x2) the input is ``h = x2 + residual2`` in ``h_dtype``; returns ``(out, h [rows, D])``.
    """
    n_rows, D = x2.shape
    out = torch.empty((n_rows, D), dtype=out_dtype, device=x2.device)
    has_res = residual2 is not None
    h = torch.empty((n_rows, D), dtype=h_dtype, device=x2.device) if has_res else None
    if n_rows > 0:
        block_m, block_d, warps = row_tile(n_rows, D, BLOCK_ELEMS)
        has_gate = gate2 is not None
        g = gate2 if has_gate else x2
        r = residual2 if has_res else x2
        _forward_kernel[(cdiv(n_rows, block_m),)](
            x2, r, g, weight, out, h if has_res else out, n_rows, D, x2.stride(0), r.stride(0), g.stride(0), eps,
            N_CODE=_CODES[n_dtype], HAS_GATE=has_gate, HAS_RES=has_res, BLOCK_M=block_m, BLOCK_D=block_d,
            num_warps=warps,
        )
    return (out, h) if has_res else out


def norm_backward(x2, gate2, weight, dout2, eps, n_dtype, dres2=None):
    """Backward launch: ``(dx [rows, D] in x's dtype, dgate like gate2 or None, dw [D] float32)``; ``dres2`` (like
    x2), when given, is added to dx before its rounding (the residual stream's gradient of an add + norm)."""
    n_rows, D = x2.shape
    dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
    has_gate = gate2 is not None
    dg = torch.empty_like(gate2, memory_format=torch.contiguous_format) if has_gate else None
    if n_rows == 0:
        return dx, dg, torch.zeros(D, dtype=torch.float32, device=x2.device)
    block_m, block_d, _ = row_tile(n_rows, D, BLOCK_ELEMS)  # the warps are the autotuned config's
    n_blocks = cdiv(n_rows, block_m)
    programs = partial_programs(n_blocks, x2.device, BACKWARD_PROGRAMS_PER_SM)
    partial = torch.empty((programs, D), dtype=torch.float32, device=x2.device)
    g = gate2 if has_gate else x2
    dr = dres2 if dres2 is not None else dout2
    _backward_kernel[(programs,)](
        x2, g, weight, dout2, dr, dx, dg if has_gate else dx, partial, n_rows, D,
        x2.stride(0), g.stride(0), dout2.stride(0), dr.stride(0), eps, n_blocks, programs,
        N_CODE=_CODES[n_dtype], HAS_GATE=has_gate, HAS_DRES=dres2 is not None, BLOCK_M=block_m, BLOCK_D=block_d,
    )
    return dx, dg, partial.sum(0)
