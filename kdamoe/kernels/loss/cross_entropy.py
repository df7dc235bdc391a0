"""The causal-LM cross-entropy on the Triton kernels of ``forward.py`` and ``backward.py``: public function and its
autograd Function.

Semantics are those of transformers' ``ForCausalLMLoss`` (``transformers/loss/loss_utils.py``, 5.x): labels shifted
by one position (or ``shift_labels`` as given), ``ignore_index`` targets skipped, the sum of the per-token losses
divided by ``num_items_in_batch`` when it is given, else their mean over the targets that are not ignored, a float32
result. That function first copies the logits to float32 (``logits.float()``: at T = 32K, V = 32000 a 4.2 GB copy)
and runs PyTorch's log-softmax and NLL kernels on it, forward and backward; here the float32 math happens in
registers on the logits as they are (float16 / bfloat16 / float32), and the gradient is written once in their dtype.

Only the per-row kernels live in the autograd Function; the shift, the count and the reduction are a few small torch
ops on ``[N]`` tensors, so the division by ``num_items_in_batch`` follows torch's type rules exactly as
transformers' does, and no value is read back on the host.
"""

import numbers

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..utils import is_interpreter
from .backward import cross_entropy_backward
from .forward import cross_entropy_forward

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_TARGETS = (torch.int64, torch.int32)


class _RowCrossEntropy(torch.autograd.Function):
    """Autograd of the per-row losses ``[N]`` float32 of ``logits [N, V]``; differentiable in the logits only."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        loss, row_max, log_sum = cross_entropy_forward(logits, target, ignore_index)
        ctx.save_for_backward(logits, target, row_max, log_sum)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    @once_differentiable  # the backward is a kernel: a double backward raises instead of treating it as constant
    def backward(ctx, dloss):
        logits, target, row_max, log_sum = ctx.saved_tensors
        return cross_entropy_backward(logits, target, row_max, log_sum, dloss, ctx.ignore_index), None, None


def _check_labels(name: str, labels, logits: torch.Tensor) -> None:
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of class ids, got {type(labels).__name__}")
    if labels.dtype not in _TARGETS:
        raise ValueError(f"{name} dtype {labels.dtype}: expected int64 or int32 class ids")
    if labels.numel() != logits.numel() // logits.shape[-1]:
        raise ValueError(f"{name} has shape {list(labels.shape)} ({labels.numel()} targets) but the logits "
                         f"{list(logits.shape)} have {logits.numel() // logits.shape[-1]} rows")


def _validate(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels) -> None:
    """Host-side checks only (shapes, dtypes, devices, types): nothing here reads a device value."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError(f"logits must be a tensor [..., V], got {type(logits).__name__}"
                         + (f" of shape {list(logits.shape)}" if isinstance(logits, torch.Tensor) else ""))
    if logits.dtype not in _FLOATS:
        raise ValueError(f"logits dtype {logits.dtype}: the kernels take float16, bfloat16 or float32")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    if logits.shape[-1] != vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} classes in their last dim but vocab_size is {vocab_size}")
    if logits.device.type != "cuda" and not (logits.device.type == "cpu" and is_interpreter()):
        raise ValueError(f"logits are on {logits.device}: the Triton kernels need a CUDA tensor (or CPU with "
                         "TRITON_INTERPRET=1)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if shift_labels is not None:
        _check_labels("shift_labels", shift_labels, logits)
    else:
        _check_labels("labels", labels, logits)
        if tuple(labels.shape) != tuple(logits.shape[:-1]):  # the shift runs along the last dim of both
            raise ValueError(f"labels have shape {list(labels.shape)}; expected the logits' leading dims "
                             f"{list(logits.shape[:-1])}")
    if num_items_in_batch is not None and not (
            (isinstance(num_items_in_batch, numbers.Number) and not isinstance(num_items_in_batch, bool))
            or (isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() == 1)):
        raise ValueError("num_items_in_batch must be None, a number or a one-element tensor, "
                         f"got {num_items_in_batch!r}")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int,
                   num_items_in_batch: int | torch.Tensor | None = None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    r"""Causal-LM cross-entropy, one Triton launch forward and one backward; differentiable in ``logits``.

    The loss of transformers' ``ForCausalLMLoss`` (same arguments): with targets ``t = labels`` shifted left by one
    along the last dim (the last position gets ``ignore_index``), or ``t = shift_labels`` as given, and
    ``ℓ_n = logsumexp(x_n) − x_{n, t_n}`` in float32 (0 where ``t_n == ignore_index``),
    ``loss = Σ_n ℓ_n / num_items_in_batch`` when that is given, else ``Σ_n ℓ_n / #{n : t_n ≠ ignore_index}``
    (NaN when every target is ignored, as in ``torch.nn.functional.cross_entropy``). The gradient is the softmax
    cross-entropy's, ``∂ℓ_n/∂x_n = softmax(x_n) − onehot(t_n)``, scaled by the reduction's factor and written in the
    logits' dtype (ignored rows: zeros).

    Args:
        logits: ``[..., V]`` float16 / bfloat16 / float32 on CUDA (CPU under ``TRITON_INTERPRET=1``), read in place
            (a view of ``[N, V]`` rows; copied only if the last dim is not unit-stride).
        labels: ``[...]`` int64 / int32 (the logits' leading dims); ignored when ``shift_labels`` is given.
        vocab_size: ``V``, the logits' last dim.
        num_items_in_batch: the divisor of the summed loss (int or a one-element tensor, e.g. the int64 global
            target count of a data-parallel step); None for the mean.
        ignore_index: the target value that contributes nothing (default −100).
        shift_labels: ``[...]`` int64 / int32 already-shifted targets, one per logits row.

    Returns:
        The 0-d loss in nats per target, float32 (the dtype of torch's division by ``num_items_in_batch``, as in
        transformers: float32 for a Python number or an integer / float32 tensor, float64 for a float64 tensor).

    Raises:
        ValueError: bad shapes, dtypes, devices or argument types (checked on the host, no device read).
            Target values are not checked here (that would cost a host sync): a target outside ``[0, V)`` that is
            not ``ignore_index`` gives a NaN loss and NaN gradient row; :class:`kdamoe.KDAMoEForCausalLM` rejects
            such labels with a ValueError in its input check.
    """
    _validate(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels)
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # tokens < n predict n
    target = shift_labels.reshape(-1).to(logits.device).contiguous()
    rows = logits.reshape(-1, vocab_size)
    if rows.stride(-1) != 1 and vocab_size > 1:
        rows = rows.contiguous()
    total = _RowCrossEntropy.apply(rows, target, int(ignore_index)).sum()
    if num_items_in_batch is None:
        # F.cross_entropy's "mean": the sum over the total weight of the targets that count (0 / 0 = NaN if none).
        return total / (target != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
