"""Output stage of chunked KDA and its first backward step (both chunk-parallel).

    o  = qg h[c] + A_qk δ,   qg = scale · q ⊙ Γ     (forward; A_qk already holds scale and the causal mask)
    dδ_local = A_qkᵀ dO                                (backward; the state pass adds kg dS)
"""

import torch
import triton
import triton.language as tl

from ..launch import autotune, fast_launch
from ..utils import cdiv
from .prepare import BT, chunk_bounds

OUT_BV = 64
# Value-block width of the output stage: BV = V reads qg and A_qk once per chunk instead of V/BV times.
# The CPU interpreter runs the first config (kdamoe.kernels.utils.autotune).
_OUT_CONFIGS = [triton.Config({'BV': 64}, num_warps=4), triton.Config({'BV': 128}, num_warps=8),
                triton.Config({'BV': 128}, num_warps=4)]


@autotune(configs=_OUT_CONFIGS, key=['H', 'K', 'V'])
@triton.jit
def _output_fwd_kernel(qg, h, vnew, Aqk, o, chunk_idx, cu_seqlens,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, eos = chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    rows = t0 + tl.arange(0, BT)
    mrow = rows < eos
    tok = (rows * H + i_h).to(tl.int64)
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    mv = cv < V
    ct = tl.arange(0, BT)
    dt = vnew.dtype.element_ty
    b_qg = tl.load(qg + tok[:, None] * K + ck[None, :], mask=mrow[:, None], other=0.)
    hoff = (i_c * H + i_h).to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]
    b_h = tl.load(h + hoff, mask=mv[None, :], other=0.)
    b_A = tl.load(Aqk + tok[:, None] * BT + ct[None, :],
                  mask=mrow[:, None] & (ct[None, :] <= tl.arange(0, BT)[:, None]), other=0.)
    b_d = tl.load(vnew + tok[:, None] * V + cv[None, :], mask=mrow[:, None] & mv[None, :], other=0.)
    b_o = tl.dot(b_qg, b_h) + tl.dot(b_A.to(dt), b_d)
    tl.store(o + tok[:, None] * V + cv[None, :], b_o.to(o.dtype.element_ty), mask=mrow[:, None] & mv[None, :])


def output_fwd(qg, h, vnew, Aqk, chunk_idx, cu_seqlens, NC):
    """``o = qg h[c] + A_qk δ`` per chunk, ``[1, T, H, V]`` in δ's dtype."""
    _, T, H, K = qg.shape
    V = vnew.shape[-1]
    o = torch.empty_like(vnew)
    if NC > 0:
        grid = lambda meta: (NC, H, cdiv(V, meta['BV']))
        _output_fwd_kernel[grid](qg, h, vnew, Aqk, o, chunk_idx, cu_seqlens, H=H, K=K, V=V, BT=BT)
    return o


@fast_launch
@triton.jit
def _dv_local_kernel(Aqk, do, dvl, chunk_idx, cu_seqlens,
                     H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, eos = chunk_bounds(chunk_idx, cu_seqlens, i_c, BT)
    rows = t0 + tl.arange(0, BT)
    mrow = rows < eos
    tok = (rows * H + i_h).to(tl.int64)
    cv = i_v * BV + tl.arange(0, BV)
    ct = tl.arange(0, BT)
    b_A = tl.load(Aqk + tok[:, None] * BT + ct[None, :],
                  mask=mrow[:, None] & (ct[None, :] <= tl.arange(0, BT)[:, None]), other=0.)
    b_do = tl.load(do + tok[:, None] * V + cv[None, :], mask=mrow[:, None], other=0.)
    b_dv = tl.dot(tl.trans(b_A.to(b_do.dtype)), b_do)
    tl.store(dvl + tok[:, None] * V + cv[None, :], b_dv, mask=mrow[:, None])


def dv_local(Aqk, do, chunk_idx, cu_seqlens, NC):
    """``A_qkᵀ dO`` per chunk, float32 ``[1, T, H, V]``."""
    _, T, H, V = do.shape
    dvl = torch.empty(do.shape, dtype=torch.float32, device=do.device)
    BV = min(OUT_BV, V)
    if NC > 0:
        _dv_local_kernel[(NC, H, V // BV)](Aqk, do, dvl, chunk_idx, cu_seqlens, H=H, V=V, BT=BT, BV=BV,
                                            num_warps=4)
    return dvl
