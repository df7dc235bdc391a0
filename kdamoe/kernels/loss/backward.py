"""Triton backward of the causal-LM cross-entropy: one launch writes the logits gradient from the forward row maxima
and log-sums. The formulas are in ``forward.py``."""

import torch
import triton
import triton.language as tl

from ..launch import fast_launch
from .forward import _launch_config


@fast_launch
@triton.jit
def _backward_kernel(X, TARGET, ROW_MAX, LOG_SUM, DLOSS, DX, V, stride_x, stride_dloss, ignore_index,
                     BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    target = tl.load(TARGET + row)
    active = target != ignore_index
    in_range = (target >= 0) & (target < V)
    # stride_dloss may be 0: the gradient of a sum arrives as one value expanded over the rows.
    g = tl.load(DLOSS + row.to(tl.int64) * stride_dloss).to(tl.float32)
    scale = tl.where(active, g, 0.0)  # where, not a product: an ignored row is 0 even when g is inf (0 / 0 counts)
    scale = tl.where(active & ~in_range, float("nan"), scale)
    m = tl.load(ROW_MAX + row)
    r = tl.load(LOG_SUM + row)
    x_row = X + row.to(tl.int64) * stride_x
    dx_row = DX + row.to(tl.int64) * V
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        in_row = offs < V
        x = tl.load(x_row + offs, mask=in_row & active, other=float("-inf")).to(tl.float32)
        p = tl.exp((x - m) - r)  # softmax(x)_v; 0 on an ignored row (x = −inf, m = r = 0)
        p = tl.where((offs == target) & active, p - 1.0, p)  # `active`: an ignore_index inside [0, V) is no target
        tl.store(dx_row + offs, (p * scale).to(DX.dtype.element_ty), mask=in_row)


def cross_entropy_backward(logits: torch.Tensor, target: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor,
                           dloss: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``dlogits [N, V]`` (contiguous, logits' dtype) from the forward's inputs, its ``row_max`` / ``log_sum`` and
    ``dloss [N]`` (any float dtype, any stride, 0 included)."""
    N, V = logits.shape
    dx = torch.empty((N, V), dtype=logits.dtype, device=logits.device)
    if N:
        block, warps = _launch_config(V)
        _backward_kernel[(N,)](logits, target, row_max, log_sum, dloss, dx, V, logits.stride(0), dloss.stride(0),
                               ignore_index, BLOCK_V=block, num_warps=warps)
    return dx
