"""Triton backward of RMSNorm, the gated RMSNorm and the residual add + RMSNorm: one launch computes dx (the residual
stream gradient added before the rounding), dgate and per-program dw partial sums. The formulas, rounding points and
layout are in ``forward.py``."""

import torch
import triton
import triton.language as tl

from ..launch import autotune
from ..utils import cdiv, partial_programs, row_tile
from .forward import _CODES, BLOCK_ELEMS, _normalise, _round

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
