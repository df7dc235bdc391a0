"""Backward of the causal depthwise convolution + SiLU: dx, per-block partial dweight and d(state).

With ``dpre[t] = dy[t] · σ(pre[t]) · (1 + pre[t] · (1 − σ(pre[t])))`` (SiLU'), the gradients of
``pre[t, c] = Σ_j w[c, W−1−j] · x[t−j, c] · [id(t−j) = id(t)]`` (Mamba, Gu & Dao 2023 §3.4; the causal-conv1d
convention) are::

    dx[s]            = Σ_i dpre[s+i] · w[W−1−i] · [s+i < T] · [id(s+i) = id(s)]
    dw[c, W−1−j]     = Σ_t dpre[t] · x[t−j] · [id(t−j) = id(t)]
    dstate[b, c, m]  = Σ_{r<m} dpre[r] · w[m−1−r] · [id(r) = first id]      (slot m holds position m − W)

Two kernels, each over (BT rows, BC channels, batch row) tiles:

1. ``_conv_bwd_dpre_kernel`` reads x (W shifted tiles through ``conv_rows``, the forward's helper, so ``pre`` is
   the forward's to the bit) and dy, writes ``dpre`` once to a float32 scratch ``[B, T, C]`` and one dweight
   partial ``[C, W]`` per program (the W shifted x tiles reloaded, L1/L2 hits; the partials are summed in
   PyTorch: deterministic, no atomics). Its row tile is fixed (``BT_DPRE``) since it sets the partials' count.
2. ``_conv_bwd_dx_kernel`` reads the scratch (W shifted tiles, again L1/L2 hits after the first) and writes dx in
   x's dtype; the programs holding row 0 also write dstate from the scratch's first W − 1 rows.

Why two: dx[s] needs dpre at s … s+W−1, i.e. ``pre`` past the tile's end; computed in one kernel that is ``pre``
at W shifted row sets (W² shifted x tiles and W cross-warp reductions per program). Saving dpre costs 8 bytes per
element of DRAM traffic but removes that recomputation. Per element (bf16 x, dy, dx): x 2 + dy 2 + dpre 4 bytes
written by the first kernel, dpre 4 + dx 2 by the second, about 14 bytes against a floor of 6 (x, dy, dx once).
At B = 1, T = 32768, C = 1024, W = 4, x a column slice: 14 B × 2²⁵ elements ≈ 470 MB (plus 8 MB of dweight
partials), so the prediction on an H200 (about 4 TB/s) is ≤ 0.2 ms per call, against 0.65 ms for the single kernel
it replaces. The scratch is ``4·B·T·C`` bytes, held during the call.

Parts (``conv_bwd`` with several ``dys``, the KDA layer's q|k|v; see ``forward.py``): the dpre kernel's channel
blocks lie within one part and read that part's own contiguous ``dy``; the scratch, the partials, dx and dstate are
over the global channels, so the dx kernel does not know about parts and dx is one ``[B, T, C]`` tensor. One call
covers the three parts (C = 3072 in the KDA layer at H·K = 1024) where three calls of C = 1024 ran before.
"""

import torch
import triton
import triton.language as tl

from ..utils import autotune
from .forward import MAX_PARTS, conv_rows, conv_tap, part_cols, part_ptr

BT_DPRE = 64  # fixed: it sets the number of dweight partials (one per BT_DPRE rows of each batch row)

# At most 64×128 float32 live values per 4 warps; all spill-free for sm_90a at C = 1024, W = 4, bf16, triton 3.7
# (``benchmarks/kernel_resources.py --family conv``), where the dpre kernel's BC = 128 on 4 warps and BC = 256 on 8,
# and the dx kernel's 64×128 on 4 warps, spill.
_DPRE_CONFIGS = [triton.Config({"BC": 64}, num_warps=4), triton.Config({"BC": 32}, num_warps=4),
                 triton.Config({"BC": 64}, num_warps=8), triton.Config({"BC": 128}, num_warps=8),
                 triton.Config({"BC": 128}, num_warps=16)]
_DX_CONFIGS = [triton.Config({"BT": 64, "BC": 64}, num_warps=4), triton.Config({"BT": 32, "BC": 128}, num_warps=4),
               triton.Config({"BT": 64, "BC": 64}, num_warps=8), triton.Config({"BT": 128, "BC": 64}, num_warps=8),
               triton.Config({"BT": 64, "BC": 128}, num_warps=8), triton.Config({"BT": 16, "BC": 256}, num_warps=4)]


@autotune(configs=_DPRE_CONFIGS, key=["C", "CP", "W", "HAS_STATE", "HAS_SEQ"])
@triton.jit
def _conv_bwd_dpre_kernel(x, weight, state, seq_idx, dy0, dy1, dy2, dpre_out, dw_part, T, C, CP, SX, NT,
                          W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PARTS: tl.constexpr,
                          HAS_STATE: tl.constexpr, HAS_SEQ: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_t * BT + tl.arange(0, BT)
    p, local, cols, mcol = part_cols(i_c, CP, BC)
    mrow = rows < T
    first_id = 0
    if HAS_SEQ:
        first_id = tl.load(seq_idx + i_b * T).to(tl.int64)
    pre, ids = conv_rows(x, weight, state, seq_idx, i_b, rows, cols, mcol, T, C, SX, first_id, W, HAS_STATE, HAS_SEQ)
    mask = mrow[:, None] & mcol[None, :]
    dy = part_ptr(p, dy0, dy1, dy2, PARTS)
    g = tl.load(dy + ((i_b * T + rows).to(tl.int64) * CP)[:, None] + local[None, :], mask=mask,
                other=0.).to(tl.float32)
    sg = tl.sigmoid(pre)
    dpre = g * sg * (1. + pre * (1. - sg))  # 0 on rows ≥ T
    tl.store(dpre_out + ((i_b * T + rows).to(tl.int64) * C)[:, None] + cols[None, :], dpre, mask=mask)
    w_off = (i_b * NT + i_t).to(tl.int64) * C * W + cols * W
    for j in tl.static_range(W):
        tap = conv_tap(x, state, seq_idx, i_b, rows, mrow, ids, cols, mcol, T, C, SX, first_id, j, W, HAS_STATE,
                       HAS_SEQ)
        tl.store(dw_part + w_off + (W - 1 - j), tl.sum(dpre * tap, 0), mask=mcol)


@autotune(configs=_DX_CONFIGS, key=["C", "W", "HAS_SEQ", "STATE_GRAD"])
@triton.jit
def _conv_bwd_dx_kernel(dpre, weight, seq_idx, dx, dstate, T, C, W: tl.constexpr, BT: tl.constexpr,
                        BC: tl.constexpr, HAS_SEQ: tl.constexpr, STATE_GRAD: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_t * BT + tl.arange(0, BT)
    cols = i_c * BC + tl.arange(0, BC)
    mrow = rows < T
    mcol = cols < C
    ids = tl.zeros([BT], dtype=tl.int64)
    if HAS_SEQ:
        ids = tl.load(seq_idx + i_b * T + rows, mask=mrow, other=-1).to(tl.int64)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for i in tl.static_range(W):
        r = rows + i
        mr = r < T
        off = (i_b * T + r).to(tl.int64) * C
        d = tl.load(dpre + off[:, None] + cols[None, :], mask=mr[:, None] & mcol[None, :], other=0.)
        if HAS_SEQ:
            if i > 0:
                ids_r = tl.load(seq_idx + i_b * T + r, mask=mr, other=-1).to(tl.int64)
                d = tl.where((ids_r == ids)[:, None], d, 0.)
        w_i = tl.load(weight + cols * W + (W - 1 - i), mask=mcol, other=0.).to(tl.float32)
        acc += d * w_i[None, :]
    off = (i_b * T + rows).to(tl.int64) * C
    tl.store(dx + off[:, None] + cols[None, :], acc.to(dx.dtype.element_ty), mask=mrow[:, None] & mcol[None, :])
    if STATE_GRAD:
        if i_t == 0:
            # slot m (position m − W) reaches rows r < m, through tap m − 1 − r; only the first sequence sees it
            first_id = 0
            if HAS_SEQ:
                first_id = tl.load(seq_idx + i_b * T).to(tl.int64)
            soff = (i_b * C + cols).to(tl.int64) * W
            for m in tl.static_range(1, W):
                ds = tl.zeros([BC], dtype=tl.float32)
                for rr in tl.static_range(m):
                    m_rr = mcol & (rr < T)  # its own name: the compiler refuses a [BC] redefinition of mr [BT]
                    d_r = tl.load(dpre + (i_b * T + rr).to(tl.int64) * C + cols, mask=m_rr, other=0.)
                    if HAS_SEQ:
                        id_r = tl.load(seq_idx + i_b * T + rr, mask=rr < T, other=first_id).to(tl.int64)
                        d_r = tl.where(id_r == first_id, d_r, 0.)
                    w_k = tl.load(weight + cols * W + (m - 1 - rr), mask=mcol, other=0.).to(tl.float32)
                    ds += d_r * w_k
                tl.store(dstate + soff + m, ds, mask=mcol)


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
    NT = triton.cdiv(T, BT_DPRE)
    dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    dstate = torch.zeros(B, C, W, dtype=torch.float32, device=x.device) if state_grad else None  # slot 0 stays 0
    if B * T * C == 0:
        return dx, torch.zeros(C, W, dtype=torch.float32, device=x.device), dstate
    dpre = torch.empty(B, T, C, dtype=torch.float32, device=x.device)
    dw_part = torch.empty(B * NT, C, W, dtype=torch.float32, device=x.device)  # every entry is written
    has_seq = seq_idx is not None
    dy0, dy1, dy2 = (list(dys) + [dys[0]] * MAX_PARTS)[:MAX_PARTS]
    _conv_bwd_dpre_kernel[lambda meta: (NT, parts * triton.cdiv(CP, meta["BC"]), B)](
        x, weight, state, seq_idx, dy0, dy1, dy2, dpre, dw_part, T, C, CP, x.stride(1), NT, W=W, BT=BT_DPRE,
        PARTS=parts, HAS_STATE=state is not None, HAS_SEQ=has_seq)
    _conv_bwd_dx_kernel[lambda meta: (triton.cdiv(T, meta["BT"]), triton.cdiv(C, meta["BC"]), B)](
        dpre, weight, seq_idx, dx, dstate, T, C, W=W, HAS_SEQ=has_seq, STATE_GRAD=bool(state_grad))
    return dx, dw_part.sum(0), dstate
