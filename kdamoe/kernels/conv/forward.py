"""Forward of the causal depthwise convolution + SiLU, and the shared per-row convolution helper.

For channel c and a row whose token is t (W taps, tap j looks j steps back; Mamba / causal-conv1d
convention, Gu & Dao 2023 §3.4)::

    pre[t, c] = Σ_{j<W} w[c, W−1−j] · x[t−j, c] · [id(t−j) = id(t)],      y = pre · σ(pre)

Positions t−j < 0 read the cached state ``state[b, c, W + t − j]`` (the W inputs before x, oldest first),
which counts as the row's first sequence id. One program per (BT rows, BC channels, batch row); the W
shifted tiles overlap, so after the first one they come from L1/L2 and DRAM sees x about once.

The C channels may be ``PARTS`` equal parts of ``CP = C / PARTS`` channels (the KDA layer's q|k|v) whose outputs are
separate contiguous ``[B, T, CP]`` tensors: a channel block never straddles two parts (``cdiv(CP, BC)`` blocks per
part, the last one masked when BC does not divide CP), so a program stores to one part's tensor, picked by
:func:`part_ptr`. x, weight and the state stay indexed by the global channel ``p·CP + c``.
"""

import torch
import triton
import triton.language as tl

from ..launch import autotune
from ..utils import cdiv

TILE_CONFIGS = [triton.Config({"BT": 64, "BC": 64}, num_warps=4), triton.Config({"BT": 32, "BC": 128}, num_warps=4),
                triton.Config({"BT": 128, "BC": 64}, num_warps=8), triton.Config({"BT": 64, "BC": 128}, num_warps=8),
                triton.Config({"BT": 16, "BC": 256}, num_warps=4)]


@triton.jit
def conv_tap(x, state, seq_idx, i_b, rows, mrow, ids, cols, mcol, T, C, SX, first_id, j,
             W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_SEQ: tl.constexpr):
    """Tap ``j`` of the rows ``rows`` (``mrow``: rows inside [0, T); ``ids``: their sequence ids): the float32 tile
    ``x[t − j]`` (the cached state where t − j < 0), zero where that input belongs to another sequence. Token ``t``
    of row ``b`` of x starts ``(b·T + t)·SX`` elements in (``SX ≥ C``: x may be a column slice of a wider tensor)."""
    src = rows - j
    m_x = mrow & (src >= 0)
    off = (i_b * T + src).to(tl.int64) * SX
    tap = tl.load(x + off[:, None] + cols[None, :], mask=m_x[:, None] & mcol[None, :], other=0.).to(tl.float32)
    if HAS_STATE:
        m_s = mrow & (src < 0)
        soff = (i_b * C + cols).to(tl.int64) * W
        tap += tl.load(state + soff[None, :] + (W + src)[:, None], mask=m_s[:, None] & mcol[None, :],
                       other=0.).to(tl.float32)
    if HAS_SEQ:
        # the cached state (src < 0) belongs to the row's first sequence
        src_ids = tl.load(seq_idx + i_b * T + src, mask=m_x, other=first_id).to(tl.int64)
        tap = tl.where((src_ids == ids)[:, None], tap, 0.)
    return tap


@triton.jit
def conv_rows(x, weight, state, seq_idx, i_b, rows, cols, mcol, T, C, SX, first_id,
              W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_SEQ: tl.constexpr):
    """Pre-activation ``pre [len(rows), BC]`` (float32) at token rows ``rows`` (any int, masked outside
    [0, T)) and the sequence ids of those rows (``-1`` outside [0, T); all 0 without ``seq_idx``)."""
    mrow = (rows >= 0) & (rows < T)
    ids = tl.zeros(rows.shape, dtype=tl.int64)
    if HAS_SEQ:
        ids = tl.load(seq_idx + i_b * T + rows, mask=mrow, other=-1).to(tl.int64)
    acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    for j in tl.static_range(W):
        tap = conv_tap(x, state, seq_idx, i_b, rows, mrow, ids, cols, mcol, T, C, SX, first_id, j, W, HAS_STATE,
                       HAS_SEQ)
        w_j = tl.load(weight + cols * W + (W - 1 - j), mask=mcol, other=0.).to(tl.float32)
        acc += tap * w_j[None, :]
    return acc, ids


MAX_PARTS = 3  # the output / gradient pointers a launch takes (q, k, v)


@triton.jit
def part_ptr(p, t0, t1, t2, PARTS: tl.constexpr):
    """The pointer of part ``p`` (a program's scalar part index) among ``t0, t1, t2`` (``PARTS ≤ 3``; the unused
    trailing ones may repeat ``t0``)."""
    ptr = t0
    if PARTS > 1:
        if p == 1:
            ptr = t1
    if PARTS > 2:
        if p == 2:
            ptr = t2
    return ptr


@triton.jit
def part_cols(i_c, CP, BC: tl.constexpr):
    """``(p, local, cols, mcol)`` of channel block ``i_c``: its part ``p``, its channels within the part ``local``
    (``[BC]``), the same as global channels ``cols = p·CP + local`` and the mask ``local < CP``."""
    nb = tl.cdiv(CP, BC)
    p = i_c // nb
    local = (i_c - p * nb) * BC + tl.arange(0, BC)
    return p, local, p * CP + local, local < CP


@autotune(configs=TILE_CONFIGS, key=["C", "CP", "W", "HAS_STATE", "HAS_SEQ"])
@triton.jit
def _conv_fwd_kernel(x, weight, state, seq_idx, y0, y1, y2, T, C, CP, SX, W: tl.constexpr, BT: tl.constexpr,
                     BC: tl.constexpr, PARTS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_SEQ: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_t * BT + tl.arange(0, BT)
    p, local, cols, mcol = part_cols(i_c, CP, BC)
    first_id = 0
    if HAS_SEQ:
        first_id = tl.load(seq_idx + i_b * T).to(tl.int64)
    pre, _ = conv_rows(x, weight, state, seq_idx, i_b, rows, cols, mcol, T, C, SX, first_id, W, HAS_STATE, HAS_SEQ)
    out = pre * tl.sigmoid(pre)
    y = part_ptr(p, y0, y1, y2, PARTS)
    off = (i_b * T + rows).to(tl.int64) * CP
    tl.store(y + off[:, None] + local[None, :], out.to(y.dtype.element_ty), mask=(rows < T)[:, None] & mcol[None, :])


def conv_fwd(x, weight, state, seq_idx, parts):
    """``SiLU(conv(x))`` for ``x [B, T, C]`` with unit channel stride and token stride ``SX = x.stride(1)``
    (``x.stride(0) = T·SX``: contiguous, or a column slice of a contiguous tensor), contiguous ``weight [C, W]``,
    ``state [B, C, W]`` or None, ``seq_idx [B, T]`` or None; returns ``parts`` (1 … 3, dividing C) contiguous
    ``[B, T, C / parts]`` tensors in x's dtype, part i holding channels ``[i·C/parts, (i+1)·C/parts)``."""
    B, T, C = x.shape
    W = weight.shape[1]
    CP = C // parts
    ys = [torch.empty(B, T, CP, dtype=x.dtype, device=x.device) for _ in range(parts)]
    if B * T * C == 0:
        return ys
    grid = lambda meta: (cdiv(T, meta["BT"]), parts * cdiv(CP, meta["BC"]), B)
    y0, y1, y2 = (ys + ys[:1] * MAX_PARTS)[:MAX_PARTS]
    _conv_fwd_kernel[grid](x, weight, state, seq_idx, y0, y1, y2, T, C, CP, x.stride(1), W=W, PARTS=parts,
                           HAS_STATE=state is not None, HAS_SEQ=seq_idx is not None)
    return ys
