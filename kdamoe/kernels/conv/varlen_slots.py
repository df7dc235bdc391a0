"""The causal depthwise convolution + SiLU over packed sequences of any length whose windows live in a slot pool,
read and written back in place: the short conv of a rollout-engine step's prompt chunks and tool-result turns.

The rollout engine keeps one conv window ``[C, W]`` (the W most recent inputs, oldest first) per cache slot in a pool
``[P, C, W]`` per KDA layer. For sequence n, tokens ``[bos, eos) = [cu[n], cu[n+1])`` of the packed ``x [T, C]``, on
slot ``s = cache_indices[n]`` (Mamba, Gu & Dao 2023 §3.4; the varlen convention of causal-conv1d: ``conv_states``,
``cache_indices``, ``has_initial_state``)::

    pre[t, c] = Σ_{j<W} w[c, W−1−j] · x̃[t−j, c],      y = pre · σ(pre)
    x̃[t] = x[t] for t ≥ bos,      x̃[bos − i] = pool[s][:, W − i] for 1 ≤ i ≤ W (zeros without an initial state)

and afterwards ``pool[s] ← [x̃[eos − W], …, x̃[eos − 1]]``: the window the sequence's next token continues from. One
program per (BC channels, sequence) walks the sequence's tokens in BT-row tiles (``forward.conv_rows``, the
cached-state taps in the first tile only), then writes the window: its reads
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
from .forward import MAX_PARTS, TILE_CONFIGS, conv_rows, part_cols, part_ptr


@triton.jit
def _tile(x, weight, state, y, rows, L, cols, local, mcol, C, CP, SX, W: tl.constexpr, WITH_STATE: tl.constexpr):
    """SiLU(conv) of a sequence's rows ``rows`` (``[BT]`` int32, relative to its first token, masked from ``L`` on;
    ``x`` and ``y`` point at that first token) stored to its part ``y``: :func:`.forward.conv_rows` with one row of
    one sequence, ``state`` its slot's window (read by the taps before the first token when ``WITH_STATE``)."""
    pre, _ = conv_rows(x, weight, state, None, 0, rows, cols, mcol, L, C, SX, 0, W, WITH_STATE, False)
    out = pre * tl.sigmoid(pre)
    tl.store(y + rows.to(tl.int64)[:, None] * CP + local[None, :], out.to(y.dtype.element_ty),
             mask=(rows < L)[:, None] & mcol[None, :])


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
    L = (tl.load(cu_seqlens + i_n + 1) - tl.load(cu_seqlens + i_n)).to(tl.int32)
    slot = tl.load(cache_indices + i_n).to(tl.int64)
    # the sequence's first token in x and in its part's output, and its slot's window [C, W]: the tiles index rows
    # from 0 in int32 (int64 row vectors made the sm_90 build spill registers)
    x_n = x + bos * SX
    y_n = part_ptr(p, y0, y1, y2, PARTS) + bos * CP
    state = pool + slot * C * W
    rows = tl.arange(0, BT)
    # only the first tile reads the window (its first W − 1 rows; BT ≥ 16 > W − 1)
    if HAS_FLAG:
        if tl.load(has_init + i_n) != 0:
            _tile(x_n, weight, state, y_n, rows, L, cols, local, mcol, C, CP, SX, W, True)
        else:
            _tile(x_n, weight, state, y_n, rows, L, cols, local, mcol, C, CP, SX, W, False)
    else:
        _tile(x_n, weight, state, y_n, rows, L, cols, local, mcol, C, CP, SX, W, True)
    for i_t in range(1, tl.cdiv(L, BT)):
        _tile(x_n, weight, state, y_n, i_t * BT + rows, L, cols, local, mcol, C, CP, SX, W, False)
    # the new window: the last W inputs of (old window ++ the sequence's tokens), zeros for the old window's part
    # without an initial state
    tap = tl.arange(0, BW)
    pos = L - W + tap  # relative to the first token; < 0: the old window's column W + pos
    mtap = tap < W
    from_x = mtap & (pos >= 0)
    from_s = mtap & (pos < 0)
    if HAS_FLAG:
        from_s = from_s & (tl.load(has_init + i_n) != 0)
    soff = cols.to(tl.int64)[:, None] * W
    b_x = tl.load(x_n + pos.to(tl.int64)[None, :] * SX + cols[:, None], mask=mcol[:, None] & from_x[None, :],
                  other=0.)
    b_s = tl.load(state + soff + (W + pos)[None, :], mask=mcol[:, None] & from_s[None, :], other=0.)
    window = tl.where(from_x[None, :], b_x.to(tl.float32), b_s.to(tl.float32))
    # every thread of the program has read the old window (the first tile's taps, whose outputs are stored above,
    # and b_s) before any thread overwrites it
    tl.debug_barrier()
    tl.store(state + soff + tap[None, :], window.to(pool.dtype.element_ty), mask=mcol[:, None] & mtap[None, :])


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
