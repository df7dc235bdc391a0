"""Backward of the causal depthwise convolution + SiLU: dx, per-block partial dweight and d(state).

With ``dpre[t] = dy[t] · σ(pre[t]) · (1 + pre[t] · (1 − σ(pre[t])))`` (SiLU'), the gradients of
``pre[t, c] = Σ_j w[c, W−1−j] · x[t−j, c] · [id(t−j) = id(t)]`` are::

    dx[s]            = Σ_i dpre[s+i] · w[W−1−i] · [id(s+i) = id(s)]
    dw[c, W−1−j]     = Σ_t dpre[t] · x[t−j] · [id(t−j) = id(t)]
    dstate[b, c, m]  = Σ_{r<m} dpre[r] · w[m−1−r] · [id(r) = first id]      (slot m holds position m − W)

One program per (64 rows, BC channels, batch row). ``pre`` is recomputed for the rows s+i instead of being
saved (W² reloads of x that hit L1/L2, no extra DRAM traffic); dweight is summed per program and the
partials are reduced in PyTorch (deterministic, no atomics).
"""

import torch
import triton
import triton.language as tl

from ..utils import autotune
from .forward import conv_rows

BT_BWD = 64  # fixed: it sets the number of dweight partials the caller allocates

_BWD_CONFIGS = [triton.Config({"BC": 64}, num_warps=4), triton.Config({"BC": 32}, num_warps=4),
                triton.Config({"BC": 64}, num_warps=8), triton.Config({"BC": 128}, num_warps=8)]


@autotune(configs=_BWD_CONFIGS, key=["C", "W", "HAS_STATE", "HAS_SEQ", "STATE_GRAD"])
@triton.jit
def _conv_bwd_kernel(x, weight, state, seq_idx, dy, dx, dw_part, dstate, T, C, SX, NT, W: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr, HAS_STATE: tl.constexpr, HAS_SEQ: tl.constexpr,
                     STATE_GRAD: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_t * BT + tl.arange(0, BT)
    cols = i_c * BC + tl.arange(0, BC)
    mcol = cols < C
    first_id = 0
    if HAS_SEQ:
        first_id = tl.load(seq_idx + i_b * T).to(tl.int64)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for i in tl.static_range(W):
        r = rows + i
        pre, ids_r = conv_rows(x, weight, state, seq_idx, i_b, r, cols, mcol, T, C, SX, first_id, W,
                               HAS_STATE, HAS_SEQ)
        mr = r < T
        off = (i_b * T + r).to(tl.int64) * C
        g = tl.load(dy + off[:, None] + cols[None, :], mask=mr[:, None] & mcol[None, :], other=0.).to(tl.float32)
        sg = tl.sigmoid(pre)
        dpre = g * sg * (1. + pre * (1. - sg))
        if i == 0:
            ids_s = ids_r
            part = (i_b * NT + i_t).to(tl.int64) * C * W + cols * W
            for j in tl.static_range(W):
                src = rows - j
                m_x = (rows < T) & (src >= 0)
                xoff = (i_b * T + src).to(tl.int64) * SX
                tap = tl.load(x + xoff[:, None] + cols[None, :], mask=m_x[:, None] & mcol[None, :],
                              other=0.).to(tl.float32)
                if HAS_STATE:
                    m_s = (rows < T) & (src < 0)
                    soff = (i_b * C + cols).to(tl.int64) * W
                    tap += tl.load(state + soff[None, :] + (W + src)[:, None], mask=m_s[:, None] & mcol[None, :],
                                   other=0.).to(tl.float32)
                if HAS_SEQ:
                    src_ids = tl.load(seq_idx + i_b * T + src, mask=m_x, other=first_id).to(tl.int64)
                    tap = tl.where((src_ids == ids_s)[:, None], tap, 0.)
                tl.store(dw_part + part + (W - 1 - j), tl.sum(dpre * tap, 0), mask=mcol)
            if STATE_GRAD:
                if i_t == 0:
                    d0 = dpre
                    if HAS_SEQ:
                        d0 = tl.where((ids_s == first_id)[:, None], d0, 0.)
                    soff = (i_b * C + cols).to(tl.int64) * W
                    for m in tl.static_range(1, W):
                        ds = tl.zeros([BC], dtype=tl.float32)
                        for rr in tl.static_range(m):
                            w_k = tl.load(weight + cols * W + (m - 1 - rr), mask=mcol, other=0.).to(tl.float32)
                            ds += tl.sum(tl.where((rows == rr)[:, None], d0, 0.), 0) * w_k
                        tl.store(dstate + soff + m, ds, mask=mcol)
        else:
            if HAS_SEQ:
                dpre = tl.where((ids_r == ids_s)[:, None], dpre, 0.)
        w_i = tl.load(weight + cols * W + (W - 1 - i), mask=mcol, other=0.).to(tl.float32)
        acc += dpre * w_i[None, :]
    off = (i_b * T + rows).to(tl.int64) * C
    tl.store(dx + off[:, None] + cols[None, :], acc.to(dx.dtype.element_ty), mask=(rows < T)[:, None] & mcol[None, :])


def conv_bwd(x, weight, state, seq_idx, dy, state_grad):
    """Gradients of :func:`conv_fwd`'s output, for its inputs (``x`` with token stride ``x.stride(1)``) and a
    contiguous ``dy [B, T, C]``.

    Returns ``(dx [B, T, C] contiguous in x's dtype, dweight [C, W] float32, dstate [B, C, W] float32 or None)``.
    """
    B, T, C = x.shape
    W = weight.shape[1]
    NT = triton.cdiv(T, BT_BWD)
    dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    dw_part = torch.zeros(B * NT, C, W, dtype=torch.float32, device=x.device)
    dstate = torch.zeros(B, C, W, dtype=torch.float32, device=x.device) if state_grad else None
    if B * T * C > 0:
        grid = lambda meta: (NT, triton.cdiv(C, meta["BC"]), B)
        _conv_bwd_kernel[grid](x, weight, state, seq_idx, dy, dx, dw_part, dstate, T, C, x.stride(1), NT, W=W,
                               BT=BT_BWD,
                               HAS_STATE=state is not None, HAS_SEQ=seq_idx is not None,
                               STATE_GRAD=bool(state_grad))
    return dx, dw_part.sum(0), dstate
