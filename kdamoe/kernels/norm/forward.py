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

from ..launch import fast_launch
from ..utils import cdiv, row_tile

MAX_D = 8192  # the whole last dim sits in one block


BLOCK_ELEMS = 4096  # rows × columns of one forward / backward tile (fp32 registers per program)


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
