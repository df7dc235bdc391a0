"""One decoding step of the causal depthwise convolution + SiLU on states kept in a slot pool, updated in place.

The rollout engine keeps one conv window ``[C, W]`` per cache slot in a pool ``[num_slots, C, W]`` per KDA layer.
For sequence n on slot ``s = slot_ids[n]``: ``pool[s] ← [pool[s][:, 1:], x[n]]`` (the W most recent inputs, oldest
first) and ``y[n] = SiLU(Σ_m pool[s][:, m] · w[:, m])`` with the new window, as :mod:`.update` computes it for a
batch of states, but read from and written back to the pool: no gather, no scatter. One program per (BC channels,
sequence), one launch per step.
"""

import torch
import triton
import triton.language as tl

from ..launch import autotune
from ..utils import cdiv, next_power_of_2
from .update import _UPDATE_CONFIGS


# The launch updates the pool in place, so the autotuner's timing runs (each config several times, on the first call
# at a shape) must put it back after each run: restore_value.
@autotune(configs=_UPDATE_CONFIGS, key=["C", "W"], restore_value=["pool"])
@triton.jit
def _conv_update_slots_kernel(x, pool, slot_ids, weight, y, C, SX, W: tl.constexpr, BW: tl.constexpr,
                              BC: tl.constexpr):
    i_c, i_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ids + i_n).to(tl.int64)
    cols = i_c * BC + tl.arange(0, BC)
    mcol = cols < C
    tap = tl.arange(0, BW)
    soff = (slot * C + cols)[:, None] * W + tap[None, :]
    # every load of this (slot, channel block) precedes its store, and no other program touches it (distinct
    # slots): the window can be shifted in place
    shifted = tl.load(pool + soff + 1, mask=mcol[:, None] & (tap < W - 1)[None, :], other=0.).to(tl.float32)
    b_x = tl.load(x + i_n.to(tl.int64) * SX + cols, mask=mcol, other=0.).to(tl.float32)
    window = tl.where((tap == W - 1)[None, :], b_x[:, None], shifted)
    w = tl.load(weight + cols[:, None] * W + tap[None, :], mask=mcol[:, None] & (tap < W)[None, :],
                other=0.).to(tl.float32)
    pre = tl.sum(window * w, 1)
    tl.store(y + i_n.to(tl.int64) * C + cols, (pre * tl.sigmoid(pre)).to(y.dtype.element_ty), mask=mcol)
    tl.store(pool + soff, window.to(pool.dtype.element_ty), mask=mcol[:, None] & (tap < W)[None, :])


def conv_update_slots(x, pool, slot_ids, weight):
    """``x [N, C]`` (unit channel stride, any row stride), contiguous ``pool [num_slots, C, W]``, ``slot_ids [N]``,
    contiguous ``weight [C, W]`` → ``y [N, C]`` contiguous in x's dtype; ``pool[slot_ids]`` updated in place."""
    N, C = x.shape
    W = weight.shape[1]
    y = torch.empty(N, C, dtype=x.dtype, device=x.device)
    if N * C > 0:
        grid = lambda meta: (cdiv(C, meta["BC"]), N)
        _conv_update_slots_kernel[grid](x, pool, slot_ids, weight, y, C, x.stride(0), W=W, BW=next_power_of_2(W))
    return y
