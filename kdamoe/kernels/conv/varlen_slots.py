"""The causal depthwise convolution + SiLU over packed sequences of any length whose windows live in a slot pool,
read and written back in place: the short conv of a rollout-engine step's prompt chunks and tool-result turns.

The rollout engine keeps one conv window ``[C, W]`` (the W most recent inputs, oldest first) per cache slot in a pool
``[P, C, W]`` per KDA layer. For sequence n, tokens ``[bos, eos) = [cu[n], cu[n+1])`` of the packed ``x [T, C]``, on
slot ``s = cache_indices[n]`` (Mamba, Gu & Dao 2023 §3.4; the varlen convention of causal-conv1d: ``conv_states``,
``cache_indices``, ``has_initial_state``)::

    pre[t, c] = Σ_{j<W} w[c, W−1−j] · x̃[t−j, c],      y = pre · σ(pre)
    x̃[t] = x[t] for t ≥ bos,      x̃[bos − i] = pool[s][:, W − i] for 1 ≤ i ≤ W (zeros without an initial state)

and afterwards ``pool[s] ← [x̃[eos − W], …, x̃[eos − 1]]``: the window the sequence's next token continues from. One
program per (BC channels, sequence) walks the sequence's tokens in BT-row tiles, then writes the window: its reads
of ``pool[s]`` (the first tile, and the window when the sequence is shorter than W) and its write touch only its own
channel block of its own slot (distinct slots), so the pool is updated in place without a gather or a scatter. The
channels may be ``PARTS`` equal parts whose outputs are separate contiguous tensors (the KDA layer's q|k|v), as in
:mod:`.forward`.
"""

import torch
import triton
import triton.language as tl

from ..launch import autotune
from ..utils import cdiv, next_power_of_2
from .forward import MAX_PARTS, TILE_CONFIGS, part_cols, part_ptr


# The launch updates the pool in place, so the autotuner's timing runs (each config several times, on the first call
# at a shape) must put it back after each run: restore_value.
@autotune(configs=TILE_CONFIGS, key=["C", "CP", "W"], restore_value=["pool"])
@triton.jit
def _conv_varlen_slots_kernel(x, weight, pool, cache_indices, has_init, cu_seqlens, y0, y1, y2, C, CP, SX,
                              W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                              PARTS: tl.constexpr, HAS_FLAG: tl.constexpr):
    i_c, i_n = tl.program_id(0), tl.program_id(1)
    p, local, cols, mcol = part_cols(i_c, CP, BC)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    slot = tl.load(cache_indices + i_n).to(tl.int64)
    flag = 1
    if HAS_FLAG:
        flag = tl.load(has_init + i_n)
    sbase = (slot * C + cols).to(tl.int64) * W  # [BC] start of each channel's window in the pool
    y = part_ptr(p, y0, y1, y2, PARTS)
    for i_t in range(tl.cdiv(eos - bos, BT)):
        rows = bos + i_t * BT + tl.arange(0, BT)
        mrow = rows < eos
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            src = rows - j
            m_x = mrow & (src >= bos)
            tap = tl.load(x + src[:, None] * SX + cols[None, :], mask=m_x[:, None] & mcol[None, :],
                          other=0.).to(tl.float32)
            # inputs before the sequence's first token: the slot's window (only the first tile gets here)
            m_s = mrow & (src < bos) & (flag != 0)
            tap += tl.load(pool + sbase[None, :] + (W + src - bos)[:, None], mask=m_s[:, None] & mcol[None, :],
                           other=0.).to(tl.float32)
            w_j = tl.load(weight + cols * W + (W - 1 - j), mask=mcol, other=0.).to(tl.float32)
            acc += tap * w_j[None, :]
        out = acc * tl.sigmoid(acc)
        tl.store(y + rows[:, None] * CP + local[None, :], out.to(y.dtype.element_ty),
                 mask=mrow[:, None] & mcol[None, :])
    # the new window: the last W inputs of (old window ++ the sequence's tokens)
    tap = tl.arange(0, BW)
    pos = eos - W + tap
    mtap = tap < W
    from_x = mtap & (pos >= bos)
    from_s = mtap & (pos < bos) & (flag != 0)
    b_x = tl.load(x + pos[None, :] * SX + cols[:, None], mask=mcol[:, None] & from_x[None, :], other=0.)
    b_s = tl.load(pool + sbase[:, None] + (W + pos - bos)[None, :], mask=mcol[:, None] & from_s[None, :], other=0.)
    window = tl.where(from_x[None, :], b_x.to(tl.float32), b_s.to(tl.float32))
    # every thread of the program has read the old window (the first tile's taps, stored to y above, and b_s)
    # before any thread overwrites it
    tl.debug_barrier()
    tl.store(pool + sbase[:, None] + tap[None, :], window.to(pool.dtype.element_ty),
             mask=mcol[:, None] & mtap[None, :])


def conv_varlen_slots(x, weight, pool, cache_indices, cu_seqlens, has_initial_state, parts):
    """``x [T, C]`` (unit channel stride, any row stride), contiguous ``weight [C, W]``, contiguous
    ``pool [P, C, W]``, ``cache_indices [N]``, int ``cu_seqlens [N+1]``, ``has_initial_state`` int32 ``[N]`` or
    None, ``parts`` (1 … 3, dividing C) → ``parts`` contiguous ``[T, C / parts]`` tensors in x's dtype, part i
    holding channels ``[i·C/parts, (i+1)·C/parts)``; ``pool[cache_indices]`` updated in place."""
    T, C = x.shape
    W = weight.shape[1]
    N = cache_indices.shape[0]
    CP = C // parts
    ys = [torch.empty(T, CP, dtype=x.dtype, device=x.device) for _ in range(parts)]
    if N * C == 0:
        return ys
    grid = lambda meta: (parts * cdiv(CP, meta["BC"]), N)
    y0, y1, y2 = (ys + ys[:1] * MAX_PARTS)[:MAX_PARTS]
    _conv_varlen_slots_kernel[grid](x, weight, pool, cache_indices, has_initial_state, cu_seqlens, y0, y1, y2, C, CP,
                                    x.stride(0), W=W, BW=next_power_of_2(W), PARTS=parts,
                                    HAS_FLAG=has_initial_state is not None)
    return ys
