"""Backward of the causal depthwise convolution + SiLU: dx, per-block partial dweight and d(state).

With ``dpre[t] = dy[t] · σ(pre[t]) · (1 + pre[t] · (1 − σ(pre[t])))`` (SiLU'), the gradients of
``pre[t, c] = Σ_j w[c, W−1−j] · x[t−j, c] · [id(t−j) = id(t)]`` (Mamba, Gu & Dao 2023 §3.4; the causal-conv1d
convention) are::

    dx[s]            = Σ_i dpre[s+i] · w[W−1−i] · [s+i < T] · [id(s+i) = id(s)]
    dw[c, W−1−i]     = Σ_s dpre[s+i] · x[s] · [s+i < T] · [id(s+i) = id(s)]
                       + Σ_{t<i} dpre[t] · state[W+t−i] · [id(t) = first id]
    dstate[b, c, m]  = Σ_{r<m} dpre[r] · w[m−1−r] · [id(r) = first id]      (slot m holds position m − W)

Two kernels, each over (BT rows, BC channels, batch row) tiles:

1. ``_conv_bwd_dpre_kernel`` reads x (W shifted tiles through ``conv_rows``, the forward's helper, so ``pre`` is
   the forward's to the bit) and dy, and writes ``dpre`` once to a scratch ``[B, T, C]``: bfloat16 for bfloat16 x
   (float32's range; one rounding, relative 2^-9, where a float32 scratch cost 4 more bytes per element, written
   once and read W times), float32 otherwise (float16's range would overflow where dx does not, and its subnormals
   would lose small gradients).
2. ``_conv_bwd_dx_kernel`` reads the scratch (W shifted tiles, L1/L2 hits after the first) and x's own rows once,
   writes dx in x's dtype, and one dweight partial ``[C, W]`` per program: the shifted ``dpre`` tiles that dx
   needs are the ones dweight needs, so dweight costs one x tile and W row reductions there (the partials are
   summed in PyTorch: deterministic, no atomics). Its row tile is fixed (``BT_DX``) since it sets the partials'
   count. The programs holding row 0 add the cached state's share of dweight and write dstate.

Why two: dx[s] needs dpre at s … s+W−1, i.e. ``pre`` past the tile's end; computed in one kernel that is ``pre``
at W shifted row sets (W² shifted x tiles and W cross-warp reductions per program). Saving dpre costs 4 bytes per
element of DRAM traffic (bf16) but removes that recomputation. Per element (bf16 x, dy, dx): x 2 + dy 2 + dpre 2
bytes by the first kernel, dpre 2 + x 2 + dx 2 by the second, about 12 bytes against a floor of 6 (x, dy, dx once).
At C = 3,072, T = 32K on the H200 the pair took 0.92 ms a call with the bf16 scratch against 1.00 with float32.

dweight sat in the first kernel before (each program reloading its W shifted x tiles after computing dpre): at the
KDA layer's C = 3072, T = 32768 on an H200 that kernel took 1.13 ms a call (0.7 TB/s; issue #14's profile); moved,
the first kernel is the forward's loads plus one dy tile, and the second reads one more x tile.

Parts (``conv_bwd`` with several ``dys``, the KDA layer's q|k|v; see ``forward.py``): the dpre kernel's channel
blocks lie within one part and read that part's own contiguous ``dy``; the scratch, the partials, dx and dstate are
over the global channels, so the dx kernel does not know about parts and dx is one ``[B, T, C]`` tensor. One call
covers the three parts (C = 3072 in the KDA layer at H·K = 1024) where three calls of C = 1024 ran before.
"""

import torch
import triton
import triton.language as tl

from ..launch import autotune
from ..utils import cdiv
from .forward import MAX_PARTS, TILE_CONFIGS, conv_rows, part_cols, part_ptr

BT_DX = 64  # fixed: it sets the number of dweight partials (one per BT_DX rows of each batch row)

# The dpre kernel holds the forward's tiles plus dy's, so it takes the forward's configs. The dx kernel holds three
# [BT_DX, BC] float32 tiles (dx's accumulator, x, one shifted dpre); all spill-free for sm_90a at C = 3072, W = 4,
# bf16, triton 3.7 (``benchmarks/tuning/kernel_resources.py --family conv``), where BC = 128 on 4 warps spills.
# The compiler keeps the W shifted tiles live (193 registers at BC = 64 on 4 warps), yet 32-row tiles, spill-free at
# 64 to 200 registers, were slower on the H200: 0.71 against 0.60 ms a call at the KDA layer's C = 3072, T = 32K.
_DX_CONFIGS = [triton.Config({"BC": 64}, num_warps=4), triton.Config({"BC": 32}, num_warps=4),
               triton.Config({"BC": 64}, num_warps=8), triton.Config({"BC": 128}, num_warps=8)]


@autotune(configs=TILE_CONFIGS, key=["C", "CP", "W", "HAS_STATE", "HAS_SEQ"])
@triton.jit
def _conv_bwd_dpre_kernel(x, weight, state, seq_idx, dy0, dy1, dy2, dpre_out, T, C, CP, SX,
                          W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PARTS: tl.constexpr,
                          HAS_STATE: tl.constexpr, HAS_SEQ: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_t * BT + tl.arange(0, BT)
    p, local, cols, mcol = part_cols(i_c, CP, BC)
    first_id = 0
    if HAS_SEQ:
        first_id = tl.load(seq_idx + i_b * T).to(tl.int64)
    pre, _ = conv_rows(x, weight, state, seq_idx, i_b, rows, cols, mcol, T, C, SX, first_id, W, HAS_STATE, HAS_SEQ)
    mask = (rows < T)[:, None] & mcol[None, :]
    dy = part_ptr(p, dy0, dy1, dy2, PARTS)
    g = tl.load(dy + ((i_b * T + rows).to(tl.int64) * CP)[:, None] + local[None, :], mask=mask,
                other=0.).to(tl.float32)
    sg = tl.sigmoid(pre)
    dpre = g * sg * (1. + pre * (1. - sg))  # 0 on rows ≥ T
    tl.store(dpre_out + ((i_b * T + rows).to(tl.int64) * C)[:, None] + cols[None, :],
             dpre.to(dpre_out.dtype.element_ty), mask=mask)


@autotune(configs=_DX_CONFIGS, key=["C", "W", "HAS_STATE", "HAS_SEQ", "STATE_GRAD"])
@triton.jit
def _conv_bwd_dx_kernel(dpre, x, weight, state, seq_idx, dx, dw_part, dstate, T, C, SX, NT, W: tl.constexpr,
                        BT: tl.constexpr, BC: tl.constexpr, HAS_STATE: tl.constexpr, HAS_SEQ: tl.constexpr,
                        STATE_GRAD: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_t * BT + tl.arange(0, BT)
    cols = i_c * BC + tl.arange(0, BC)
    mrow = rows < T
    mcol = cols < C
    first_id = 0
    ids = tl.zeros([BT], dtype=tl.int64)
    if HAS_SEQ:
        first_id = tl.load(seq_idx + i_b * T).to(tl.int64)
        ids = tl.load(seq_idx + i_b * T + rows, mask=mrow, other=-1).to(tl.int64)
    xs = tl.load(x + ((i_b * T + rows).to(tl.int64) * SX)[:, None] + cols[None, :],
                 mask=mrow[:, None] & mcol[None, :], other=0.).to(tl.float32)
    w_off = (i_b * NT + i_t).to(tl.int64) * C * W + cols * W
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for i in tl.static_range(W):
        r = rows + i
        mr = r < T
        d = tl.load(dpre + ((i_b * T + r).to(tl.int64) * C)[:, None] + cols[None, :],
                    mask=mr[:, None] & mcol[None, :], other=0.).to(tl.float32)
        if HAS_SEQ:
            if i > 0:
                ids_r = tl.load(seq_idx + i_b * T + r, mask=mr, other=-1).to(tl.int64)
                d = tl.where((ids_r == ids)[:, None], d, 0.)
        w_i = tl.load(weight + cols * W + (W - 1 - i), mask=mcol, other=0.).to(tl.float32)
        acc += d * w_i[None, :]
        dw_i = tl.sum(d * xs, 0)  # tap W−1−i over this tile's source rows s (the targets s + i)
        if HAS_STATE:
            if i > 0:
                if i_t == 0:
                    # targets t < i read the cached state's slot W + t − i; it belongs to the first sequence
                    for t in tl.static_range(i):
                        m_t = mcol & (t < T)
                        d_t = tl.load(dpre + (i_b * T + t).to(tl.int64) * C + cols, mask=m_t, other=0.).to(tl.float32)
                        if HAS_SEQ:
                            id_t = tl.load(seq_idx + i_b * T + t, mask=t < T, other=first_id).to(tl.int64)
                            d_t = tl.where(id_t == first_id, d_t, 0.)
                        s_t = tl.load(state + (i_b * C + cols).to(tl.int64) * W + (W + t - i), mask=mcol,
                                      other=0.).to(tl.float32)
                        dw_i += d_t * s_t
        tl.store(dw_part + w_off + (W - 1 - i), dw_i, mask=mcol)
    off = (i_b * T + rows).to(tl.int64) * C
    tl.store(dx + off[:, None] + cols[None, :], acc.to(dx.dtype.element_ty), mask=mrow[:, None] & mcol[None, :])
    if STATE_GRAD:
        if i_t == 0:
            # slot m (position m − W) reaches rows r < m, through tap m − 1 − r; only the first sequence sees it
            soff = (i_b * C + cols).to(tl.int64) * W
            for m in tl.static_range(1, W):
                ds = tl.zeros([BC], dtype=tl.float32)
                for rr in tl.static_range(m):
                    m_rr = mcol & (rr < T)  # its own name: the compiler refuses a [BC] redefinition of mr [BT]
                    d_r = tl.load(dpre + (i_b * T + rr).to(tl.int64) * C + cols, mask=m_rr, other=0.).to(tl.float32)
                    if HAS_SEQ:
                        id_r = tl.load(seq_idx + i_b * T + rr, mask=rr < T, other=first_id).to(tl.int64)
                        d_r = tl.where(id_r == first_id, d_r, 0.)
                    w_k = tl.load(weight + cols * W + (m - 1 - rr), mask=mcol, other=0.).to(tl.float32)
                    ds += d_r * w_k
                tl.store(dstate + soff + m, ds, mask=mcol)


def _scratch_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the dpre scratch for inputs of ``dtype`` (module docstring, kernel 1)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def conv_bwd(x, weight, state, seq_idx, dys, state_grad):
    """Gradients of :func:`conv_fwd`'s outputs, for its inputs (``x`` with token stride ``x.stride(1)``) and the
    contiguous gradients ``dys`` of its ``len(dys)`` parts (each ``[B, T, C / len(dys)]``).

    Returns ``(dx [B, T, C] contiguous in x's dtype, dweight [C, W] float32, dstate [B, C, W] float32 or None)``:
    one dx over all parts, so that it is the gradient of x itself (no concatenation).
    """
    B, T, C = x.shape
    W = weight.shape[1]
    parts = len(dys)
    CP = C // parts
    NT = cdiv(T, BT_DX)
    dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    dstate = torch.zeros(B, C, W, dtype=torch.float32, device=x.device) if state_grad else None  # slot 0 stays 0
    if B * T * C == 0:
        return dx, torch.zeros(C, W, dtype=torch.float32, device=x.device), dstate
    dpre = torch.empty(B, T, C, dtype=_scratch_dtype(x.dtype), device=x.device)
    dw_part = torch.empty(B * NT, C, W, dtype=torch.float32, device=x.device)  # every entry is written
    has_state, has_seq = state is not None, seq_idx is not None
    dy0, dy1, dy2 = (list(dys) + [dys[0]] * MAX_PARTS)[:MAX_PARTS]
    _conv_bwd_dpre_kernel[lambda meta: (cdiv(T, meta["BT"]), parts * cdiv(CP, meta["BC"]), B)](
        x, weight, state, seq_idx, dy0, dy1, dy2, dpre, T, C, CP, x.stride(1), W=W, PARTS=parts,
        HAS_STATE=has_state, HAS_SEQ=has_seq)
    _conv_bwd_dx_kernel[lambda meta: (NT, cdiv(C, meta["BC"]), B)](
        dpre, x, weight, state, seq_idx, dx, dw_part, dstate, T, C, x.stride(1), NT, W=W, BT=BT_DX,
        HAS_STATE=has_state, HAS_SEQ=has_seq, STATE_GRAD=bool(state_grad))
    return dx, dw_part.sum(0), dstate
