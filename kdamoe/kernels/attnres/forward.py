"""Triton kernels of the Block AttnRes mix: one launch forward, one launch backward, sources read in place.

Math (Attention Residuals, arXiv:2603.15031, Block AttnRes), per token row, with the ``S`` sources ``v_i [d]``
read as float32, the pseudo-query ``q`` and the key-norm weight ``γ`` (``w = q ⊙ γ``)::

    r_i = rsqrt(mean_d(v_i²) + eps)                 key RMSNorm scale
    l_i = r_i (v_i · w)                             = q · RMSNorm_γ(v_i)
    p   = softmax(l),   h = Σ_i p_i v_i             (float32, rounded once to the output dtype)

    backward, from dh:
    g_i  = dh · v_i,    δ = Σ_i p_i g_i = dh · h
    dl_i = p_i (g_i − δ)                            softmax backward
    dv_i = p_i dh + dl_i r_i (w − v_i r_i l_i / d)  the mix and the key norm (the RMSNorm backward)
    u    = Σ_rows Σ_i dl_i r_i v_i,   dq = γ ⊙ u,   dγ = q ⊙ u

Everything is float32 in registers with no intermediate rounding to the input dtype (the PyTorch reference rounds
the normalised keys and the softmax weights to it; the kernel is the more exact of the two, both are tested
against float64).

Layout: the sources arrive as a tuple of ``[N, d]`` tensors (unit strides, each in its own dtype; Triton tuple
arguments), so no stacked copy is ever made; ``S`` is a constexpr and the source loop is unrolled. A program holds
``BLOCK_M`` rows × the whole last dim (``BLOCK_D = next_pow2(d)``, d ≤ 8192). The forward reads each source once with an
online softmax (running max and denominator, as in flash attention's forward) and saves only the per-row log-sum-exp
``[N]``. The backward reads each source twice (pass 1: ``δ``; pass 2: ``dv_i`` and ``u``), runs ``P`` programs over the
row blocks ``pid, pid + P, …`` and writes each program's ``u`` into one float32 row of a ``[P, d]`` buffer that the
caller sums (no atomics: deterministic). Nothing reads a device value on the host (CUDA-graph capturable).
"""

import torch
import triton
import triton.language as tl

from ..launch import fast_launch
from ..utils import cdiv, row_tile

MAX_D = 8192  # the whole last dim sits in one block


BLOCK_ELEMS = 4096  # rows × columns of one tile (fp32 registers per program and per live tile)


@triton.jit
def _key_logit(v, w, D, eps):
    """``(r, l)`` of a ``[BLOCK_M, BLOCK_D]`` float32 tile: the key-norm scale and the logit ``r (v · w)``."""
    r = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
    return r, r * tl.sum(v * w[None, :], axis=1)


@fast_launch
@triton.jit
def _forward_kernel(V, Q, G, O, LSE, n_rows, D, eps,
                    S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    row_ok = rows < n_rows
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None].to(tl.int64) * D + cols[None, :]
    w = (tl.load(Q + cols, mask=col_ok, other=0.).to(tl.float32)
         * tl.load(G + cols, mask=col_ok, other=0.).to(tl.float32))
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(S):
        v = tl.load(V[i] + offsets, mask=mask, other=0.).to(tl.float32)
        _, l = _key_logit(v, w, D, eps)
        m_new = tl.maximum(m, l)
        alpha = tl.exp(m - m_new)  # 0 at the first source (m = -inf)
        p = tl.exp(l - m_new)
        den = den * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v
        m = m_new
    tl.store(O + offsets, (acc / den[:, None]).to(O.dtype.element_ty), mask=mask)
    tl.store(LSE + rows, m + tl.log(den), mask=row_ok)


def attnres_forward(sources, query, key_weight, eps, out_dtype):
    """Forward launch on ``sources`` (tuple of ``[N, d]``, unit strides, each its own float dtype):
    ``(h [N, d] in out_dtype, lse [N] float32)``."""
    n_rows, D = sources[0].shape
    out = torch.empty((n_rows, D), dtype=out_dtype, device=sources[0].device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=out.device)
    if n_rows == 0:
        return out, lse
    block_m, block_d, warps = row_tile(n_rows, D, BLOCK_ELEMS)
    _forward_kernel[(cdiv(n_rows, block_m),)](
        tuple(sources), query, key_weight, out, lse, n_rows, D, eps,
        S=len(sources), BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps,
    )
    return out, lse
