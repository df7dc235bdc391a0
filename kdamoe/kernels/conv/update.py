"""One decoding step of the causal depthwise convolution + SiLU with a cached state.

``new_state = [state[:, :, 1:], x]`` (the W most recent inputs, oldest first) and
``y = SiLU(Σ_m new_state[:, :, m] · w[:, m])``; one program per (BC channels, batch row), one launch per step.
"""

import torch
import triton
import triton.language as tl

from ..launch import autotune
from ..utils import cdiv, next_power_of_2

_UPDATE_CONFIGS = [triton.Config({"BC": 128}, num_warps=4), triton.Config({"BC": 256}, num_warps=4),
                   triton.Config({"BC": 64}, num_warps=2), triton.Config({"BC": 512}, num_warps=8)]


@autotune(configs=_UPDATE_CONFIGS, key=["C", "W"])
@triton.jit
def _conv_update_kernel(x, state, weight, y, new_state, C, W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
    i_c, i_b = tl.program_id(0), tl.program_id(1)
    cols = i_c * BC + tl.arange(0, BC)
    mcol = cols < C
    slot = tl.arange(0, BW)
    soff = (i_b * C + cols).to(tl.int64)[:, None] * W + slot[None, :]
    # slot m of the new state is slot m + 1 of the old one; the last slot is the new input
    shifted = tl.load(state + soff + 1, mask=mcol[:, None] & (slot < W - 1)[None, :], other=0.).to(tl.float32)
    b_x = tl.load(x + i_b.to(tl.int64) * C + cols, mask=mcol, other=0.).to(tl.float32)
    window = tl.where((slot == W - 1)[None, :], b_x[:, None], shifted)
    w = tl.load(weight + cols[:, None] * W + slot[None, :], mask=mcol[:, None] & (slot < W)[None, :],
                other=0.).to(tl.float32)
    pre = tl.sum(window * w, 1)
    tl.store(y + i_b.to(tl.int64) * C + cols, (pre * tl.sigmoid(pre)).to(y.dtype.element_ty), mask=mcol)
    tl.store(new_state + soff, window.to(new_state.dtype.element_ty), mask=mcol[:, None] & (slot < W)[None, :])


def conv_update(x, state, weight):
    """Contiguous ``x [B, C]``, ``state [B, C, W]``, ``weight [C, W]`` → ``(y [B, C] like x, new_state [B, C, W]
    in x's dtype)``; ``state`` is not modified."""
    B, C = x.shape
    W = weight.shape[1]
    y = torch.empty_like(x)
    new_state = torch.empty(B, C, W, dtype=x.dtype, device=x.device)
    if B * C > 0:
        grid = lambda meta: (cdiv(C, meta["BC"]), B)
        _conv_update_kernel[grid](x, state, weight, y, new_state, C, W=W, BW=next_power_of_2(W))
    return y, new_state
