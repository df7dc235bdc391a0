"""The fused causal-LM cross-entropy (``kdamoe.kernels.causal_lm_loss``) against an independent reference: float64
``log_softmax`` + NLL on the CPU, differentiated by torch.autograd, with the shift and reduction of transformers'
``ForCausalLMLoss`` written out here. The result dtype is compared with ``ForCausalLMLoss`` itself. Cases: ignored
rows, all rows ignored, ``num_items_in_batch`` as an int and as tensors, ``shift_labels``, an ``ignore_index`` inside
the vocabulary, vocabularies that are not a multiple of the kernel's block (odd, V = 1, V > one block), −inf logits,
strided logits, out-of-range targets, argument errors, the dispatch.

Runs on the CPU interpreter (tests/conftest.py) in float32 and float16; with KDAMOE_TEST_ON_GPU=1 on a CUDA machine
the same tests run on the GPU (add bfloat16 there: the interpreter mishandles it).
"""

import math
import os

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from kdamoe.kernels import causal_lm_loss
from kdamoe.kernels.loss.forward import MAX_BLOCK_V
from kdamoe.model import kernel_dispatch

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# Relative L2 error of the gradient against float64: float32 math inside, one rounding to the logits' dtype.
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
IGNORE = -100


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def make_case(shape, dtype, seed, ignored=0.25, ignore_index=IGNORE):
    """Logits ``shape = (..., V)`` of scale 3 (so the softmax is far from uniform) in ``dtype`` and labels of the
    leading dims, a fraction ``ignored`` of them set to ``ignore_index``."""
    gen = torch.Generator().manual_seed(seed)
    V = shape[-1]
    logits = (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype).requires_grad_()
    labels = torch.randint(0, V, shape[:-1], generator=gen)
    labels[torch.rand(shape[:-1], generator=gen) < ignored] = ignore_index
    return logits, labels.to(DEVICE)


def float64_reference(logits, labels, num_items_in_batch=None, ignore_index=IGNORE, shift_labels=None, upstream=1.0):
    """``(loss, dlogits)`` in float64 on the CPU: the causal shift, log_softmax, NLL of the kept targets, the sum over
    ``num_items_in_batch`` or the mean; the gradient of ``upstream · loss``."""
    x = logits.detach().cpu().double().requires_grad_()
    if shift_labels is None:
        labels = labels.cpu()
        shift_labels = torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], ignore_index)], -1)
    targets = shift_labels.cpu().reshape(-1)
    keep = targets != ignore_index
    logp = torch.log_softmax(x.reshape(-1, x.shape[-1]), -1)
    total = -logp[keep.nonzero().squeeze(-1), targets[keep]].sum()
    denom = keep.sum().double() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch).double()
    loss = total / denom
    (grad,) = torch.autograd.grad(upstream * loss, x)
    return loss.detach(), grad


def run(logits, labels, upstream=1.0, **kwargs):
    loss = causal_lm_loss(logits, labels, logits.shape[-1], **kwargs)
    (grad,) = torch.autograd.grad(upstream * loss, logits)
    return loss, grad


# (shape, seed, kwargs): odd V; V above one block and not a multiple of it; V = 1; an ignore_index inside the
# vocabulary (0: rows with target 0 are skipped, and column 0 is no target); num_items_in_batch as an int and as an
# int64 tensor (our trainer's); shift_labels given (labels then unused).
CASES = [
    ((2, 9, 97), 0, {}),
    ((1, 6, MAX_BLOCK_V + 37), 1, {"num_items_in_batch": 7}),
    ((3, 5, 1), 2, {}),
    ((2, 7, 130), 3, {"ignore_index": 0}),
    ((3, 5, 512), 4, {"num_items_in_batch": torch.tensor(11)}),
    ((2, 6, 300), 5, {"shift_labels": True}),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, seed, kwargs", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_loss_and_gradient_match_float64_reference(dtype, shape, seed, kwargs):
    ignore_index = kwargs.get("ignore_index", IGNORE)
    logits, labels = make_case(shape, dtype, seed, ignore_index=ignore_index)
    kwargs = dict(kwargs)
    if kwargs.pop("shift_labels", False):
        _, shifted = make_case(shape, dtype, seed + 100)
        kwargs["shift_labels"] = shifted
        labels = torch.full_like(labels, 10**6)  # never read when shift_labels is given
    loss, grad = run(logits, labels, upstream=2.5, **kwargs)
    loss64, grad64 = float64_reference(logits, labels, upstream=2.5, **kwargs)
    expected = ForCausalLMLoss(logits.detach().float(), labels, shape[-1], **kwargs)

    assert loss.shape == () and loss.dtype == expected.dtype == torch.float32
    assert abs(loss.item() - loss64.item()) <= 1e-5 * abs(loss64.item()) + 1e-6
    assert grad.dtype == dtype and grad.shape == logits.shape
    if shape[-1] == 1:  # one class: the loss and its gradient are exactly 0
        assert loss.item() == 0 and torch.all(grad == 0)
    else:
        assert rel(grad, grad64) < GRAD_TOL[dtype]
    # Ignored rows (here: whatever the reference left at zero) get exactly zero.
    zero_rows = (grad64.reshape(-1, shape[-1]) == 0).all(-1)
    assert torch.all(grad.reshape(-1, shape[-1])[zero_rows.to(grad.device)] == 0)


@pytest.mark.parametrize("num_items_in_batch", [None, 0, torch.tensor(5)], ids=["mean", "int 0", "tensor"])
def test_all_targets_ignored_gives_what_torch_gives(num_items_in_batch):
    """Mean over no target: 0 / 0 = NaN, as F.cross_entropy; a sum divided by a count: 0 (or 0 / 0 = NaN). The
    gradient is zero in every case (torch's NLL backward writes 0 for ignored rows whatever the upstream value)."""
    logits, labels = make_case((2, 4, 33), torch.float32, seed=6, ignored=1.0)
    loss, grad = run(logits, labels, num_items_in_batch=num_items_in_batch)
    expected = ForCausalLMLoss(logits, labels, 33, num_items_in_batch=num_items_in_batch)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    assert loss.dtype == expected.dtype
    assert (math.isnan(loss.item()) and math.isnan(expected.item())) or loss.item() == expected.item() == 0
    assert torch.equal(grad, torch.zeros_like(grad)) and torch.equal(expected_grad, torch.zeros_like(grad))


def test_num_items_in_batch_follows_torch_type_promotion():
    """The division is the same torch op as transformers': an int64 or float32 count keeps float32, a float64 one
    promotes to float64 (as ForCausalLMLoss does), a Python float keeps float32."""
    logits, labels = make_case((1, 8, 40), torch.float32, seed=7)
    for count in (9, 9.0, torch.tensor(9), torch.tensor(9.0), torch.tensor(9.0, dtype=torch.float64)):
        loss = causal_lm_loss(logits, labels, 40, num_items_in_batch=count)
        expected = ForCausalLMLoss(logits, labels, 40, num_items_in_batch=count)
        assert loss.dtype == expected.dtype, count
        torch.testing.assert_close(loss, expected)


def test_large_and_infinite_logits():
    """Logits around ±1e4 (exp would overflow without the running max), a vocabulary masked with −inf (one whole
    block of −inf, then finite columns: the running max starts at −inf) and a target whose logit is the maximum."""
    V = MAX_BLOCK_V + 10
    logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(8))
    logits[0] += 1e4
    logits[1] -= 1e4
    logits[1, :, :MAX_BLOCK_V] = float("-inf")
    logits = logits.to(DEVICE).requires_grad_()
    labels = torch.tensor([[0, 5, 17], [0, MAX_BLOCK_V + 3, MAX_BLOCK_V]], device=DEVICE)
    loss, grad = run(logits, labels)
    loss64, grad64 = float64_reference(logits, labels)
    assert abs(loss.item() - loss64.item()) < 1e-5 * abs(loss64.item())
    assert torch.all(grad[1, :, :MAX_BLOCK_V] == 0)
    assert rel(grad, grad64) < 1e-5


def test_strided_logits_are_read_in_place_and_match_contiguous():
    """A slice of a wider tensor (row stride V + 3) is read through its row stride; a transposed one (last dim not
    unit-stride) is copied first. Both give the contiguous result; the gradient has the input's shape."""
    gen = torch.Generator().manual_seed(9)
    wide = torch.randn(2, 5, 67, generator=gen).to(DEVICE)
    labels = torch.randint(0, 64, (2, 5), generator=gen).to(DEVICE)
    columns_last = torch.randn(2, 64, 5, generator=gen).to(DEVICE).transpose(1, 2)
    for strided in (wide[..., :64], columns_last):
        strided = strided.detach().requires_grad_()
        dense = strided.detach().contiguous().requires_grad_()
        loss, grad = run(strided, labels)
        loss_dense, grad_dense = run(dense, labels)
        assert torch.equal(loss, loss_dense) and torch.equal(grad, grad_dense) and grad.shape == strided.shape


def test_out_of_range_target_gives_nan_not_a_wrong_value():
    """The kernel reads no target value on the host: a target outside [0, V) that is not ignore_index makes the loss
    and that row's gradient NaN (the model rejects such labels with a ValueError before; see test_model_loss.py)."""
    logits, labels = make_case((1, 4, 16), torch.float32, seed=10, ignored=0.0)
    labels[0, 2] = 16  # the target of row 1
    loss, grad = run(logits, labels)
    assert math.isnan(loss.item())
    assert torch.isnan(grad[0, 1]).all() and torch.isfinite(grad[0, [0, 2, 3]]).all()


def test_empty_input_is_nan_like_torch():
    logits = torch.zeros(0, 5, 8, device=DEVICE, requires_grad=True)
    labels = torch.zeros(0, 5, dtype=torch.long, device=DEVICE)
    loss, grad = run(logits, labels)
    assert math.isnan(loss.item()) and math.isnan(ForCausalLMLoss(logits, labels, 8).item()) and grad.shape == (0, 5, 8)


def test_bad_arguments_raise_value_errors_naming_them():
    logits, labels = make_case((2, 3, 8), torch.float32, seed=11)
    with pytest.raises(ValueError, match="logits dtype torch.float64"):
        causal_lm_loss(logits.double(), labels, 8)
    with pytest.raises(ValueError, match="8 classes in their last dim but vocab_size is 9"):
        causal_lm_loss(logits, labels, 9)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1"):
        causal_lm_loss(logits[..., :0], labels, 0)
    with pytest.raises(ValueError, match=r"labels have shape \[3, 2\]; expected the logits' leading dims \[2, 3\]"):
        causal_lm_loss(logits, labels.t(), 8)
    with pytest.raises(ValueError, match=r"labels has shape \[2, 2\] \(4 targets\) but the logits"):
        causal_lm_loss(logits, labels[:, :2], 8)
    with pytest.raises(ValueError, match="labels dtype torch.float32"):
        causal_lm_loss(logits, labels.float(), 8)
    with pytest.raises(ValueError, match="labels must be a torch.Tensor"):
        causal_lm_loss(logits, None, 8)
    with pytest.raises(ValueError, match=r"shift_labels has shape \[5\]"):
        causal_lm_loss(logits, labels, 8, shift_labels=labels.reshape(-1)[:5])
    with pytest.raises(ValueError, match="ignore_index must be an int"):
        causal_lm_loss(logits, labels, 8, ignore_index=-100.0)
    with pytest.raises(ValueError, match="num_items_in_batch must be None, a number or a one-element tensor"):
        causal_lm_loss(logits, labels, 8, num_items_in_batch=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="logits are on meta"):
        causal_lm_loss(logits.to("meta"), labels.to("meta"), 8)


def test_dispatch_picks_the_kernel_or_transformers_loss(monkeypatch):
    """``kernel_dispatch.causal_lm_loss`` runs the kdamoe kernel with backend="triton" (CPU under the interpreter) and
    transformers' ForCausalLMLoss with "torch" (and with "auto" on the CPU); the results agree."""
    calls = []
    kernels = kernel_dispatch.kdamoe_kernels()
    real = kernels.causal_lm_loss
    monkeypatch.setattr(kernels, "causal_lm_loss", lambda *a: calls.append("kernel") or real(*a))
    logits, labels = make_case((2, 5, 50), torch.float32, seed=12)
    count = torch.tensor(6)
    results = {backend: kernel_dispatch.causal_lm_loss(logits, labels, 50, count, backend=backend)
               for backend in ("torch", "triton") + (() if ON_GPU else ("auto",))}
    assert calls == ["kernel"]
    for loss in results.values():
        torch.testing.assert_close(loss, ForCausalLMLoss(logits, labels, 50, num_items_in_batch=count))
