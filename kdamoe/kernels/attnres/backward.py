"""Triton backward of the Block AttnRes mix: one launch computes every source gradient and per-program partial sums of
the query and key-norm weight gradients. The formulas and layout are in ``forward.py``."""

import torch
import triton
import triton.language as tl

from ..launch import fast_launch
from ..utils import cdiv, partial_programs, row_tile
from .forward import BLOCK_ELEMS, _key_logit

BACKWARD_PROGRAMS_PER_SM = 4  # enough programs to fill the SMs; fewer means a smaller u partial buffer


@fast_launch
@triton.jit
def _backward_kernel(V, Q, G, DH, LSE, DV, U, n_rows, D, eps, n_blocks, P,
                     S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = (tl.load(Q + cols, mask=col_ok, other=0.).to(tl.float32)
         * tl.load(G + cols, mask=col_ok, other=0.).to(tl.float32))
    u = tl.zeros([BLOCK_D], dtype=tl.float32)
    for blk in range(pid, n_blocks, P):
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = rows[:, None].to(tl.int64) * D + cols[None, :]
        dh = tl.load(DH + offsets, mask=mask, other=0.).to(tl.float32)
        lse = tl.load(LSE + rows, mask=row_ok, other=0.)
        # Pass 1: δ = Σ_i p_i (dh · v_i) in float32 (not dh · h: h is rounded to the input dtype).
        delta = tl.zeros([BLOCK_M], dtype=tl.float32)
        for i in tl.static_range(S):
            v = tl.load(V[i] + offsets, mask=mask, other=0.).to(tl.float32)
            _, l = _key_logit(v, w, D, eps)
            delta += tl.exp(l - lse) * tl.sum(dh * v, axis=1)
        # Pass 2: the gradient of each source and this block's share of u.
        for i in tl.static_range(S):
            v = tl.load(V[i] + offsets, mask=mask, other=0.).to(tl.float32)
            r, l = _key_logit(v, w, D, eps)
            p = tl.exp(l - lse)
            dl = p * (tl.sum(dh * v, axis=1) - delta)
            c = dl * r
            dv = p[:, None] * dh + c[:, None] * (w[None, :] - v * (r * l / D)[:, None])
            tl.store(DV[i] + offsets, dv.to(DV[i].dtype.element_ty), mask=mask)
            u += tl.sum(c[:, None] * v, axis=0)
    tl.store(U + pid.to(tl.int64) * D + cols, u, mask=col_ok)


def attnres_backward(sources, query, key_weight, lse, dh, eps):
    """Backward launch: ``(dv tuple of [N, d], each in its source's dtype, u [d] float32)`` with ``dq = γ u``,
    ``dγ = q u`` (see the module docstring)."""
    n_rows, D = sources[0].shape
    dv = tuple(torch.empty_like(v) for v in sources)
    if n_rows == 0:
        return dv, torch.zeros(D, dtype=torch.float32, device=dh.device)
    block_m, block_d, warps = row_tile(n_rows, D, BLOCK_ELEMS)
    n_blocks = cdiv(n_rows, block_m)
    programs = partial_programs(n_blocks, dh.device, BACKWARD_PROGRAMS_PER_SM)
    partial = torch.empty((programs, D), dtype=torch.float32, device=dh.device)
    _backward_kernel[(programs,)](
        tuple(sources), query, key_weight, dh, lse, dv, partial, n_rows, D, eps, n_blocks, programs,
        S=len(sources), BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps,
    )
    return dv, partial.sum(0)
