"""The model's loss: ``KDAMoEForCausalLM`` runs transformers' default causal-LM loss through
``kernel_dispatch.causal_lm_loss`` (the fused Triton cross-entropy on the kernel backend), falls back to
``self.loss_function`` for anything else, and rejects out-of-range labels in its one input sync.

The triton-backend test runs the kernels on the CPU interpreter (float32, a two-layer tiny model).
"""

import math
import os

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

import kdamoe.kernels as kernels
import kdamoe.model.modeling_kdamoe as modeling
from kdamoe import KDAMoEForCausalLM
from tests.helpers import tiny_config

V = 97  # tiny_config's vocabulary


def _model(**overrides):
    torch.manual_seed(0)
    return KDAMoEForCausalLM(tiny_config(**overrides)).train()


def _batch(B=2, T=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt that is not trained on
    return ids, labels


def _spy_dispatch(monkeypatch) -> list:
    """Record the model's calls of ``kernel_dispatch.causal_lm_loss`` (as imported by the modeling file)."""
    calls = []
    real = modeling.causal_lm_loss

    def spy(*args, **kwargs):
        calls.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    monkeypatch.setattr(modeling, "causal_lm_loss", spy)
    return calls


def _loss_and_grads(model, ids, labels, **kwargs):
    """``(loss, lm_head weight gradient, gradient of the hidden states entering lm_head)``."""
    seen = {}

    def keep_input(module, args):
        seen["hidden"] = args[0]
        args[0].retain_grad()

    handle = model.lm_head.register_forward_pre_hook(keep_input)
    try:
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=labels, **kwargs)
        out.loss.backward()
    finally:
        handle.remove()
    return out, model.lm_head.weight.grad.clone(), seen["hidden"].grad.clone()


@pytest.mark.skipif(bool(os.environ.get("KDAMOE_TEST_ON_GPU")), reason="CPU-interpreter test")
def test_triton_backend_fused_loss_matches_torch_backend(monkeypatch):
    """With labels, ignored positions and the trainer's int64 ``num_items_in_batch``, the model on the triton backend
    (the fused kernel) gives the torch backend's loss (transformers' ForCausalLMLoss), lm_head gradient and gradient
    of the hidden states within float32 tolerance; the logits stay lm_head's output."""
    kernel_calls = []
    real_kernel = kernels.causal_lm_loss
    monkeypatch.setattr(kernels, "causal_lm_loss", lambda *a: kernel_calls.append(1) or real_kernel(*a))
    calls = _spy_dispatch(monkeypatch)
    model = _model(kda_head_dim=16, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    ids, labels = _batch()
    count = (labels[:, 1:] != -100).sum()  # an int64 tensor, as micro_batch_loss passes it
    results = {}
    for backend in ("torch", "triton"):
        model.config.kernel_backend = backend
        results[backend] = _loss_and_grads(model, ids, labels, num_items_in_batch=count)
    assert calls == ["torch", "triton"] and kernel_calls == [1]
    (ref, ref_dw, ref_dh), (out, dw, dh) = results["torch"], results["triton"]
    assert out.loss.dtype == ref.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    for got, want in ((dw, ref_dw), (dh, ref_dh)):
        assert float((got - want).norm() / want.norm()) < 1e-4
    torch.testing.assert_close(out.loss, ForCausalLMLoss(out.logits, labels, V, num_items_in_batch=count))
    assert out.logits.dtype == torch.float32 and out.logits.shape == (2, 12, V)


def test_default_loss_goes_through_the_dispatch_with_its_keywords(monkeypatch):
    """The default loss with ``num_items_in_batch`` / ``ignore_index`` / ``shift_labels`` runs through
    ``kernel_dispatch.causal_lm_loss`` (torch backend here: transformers' loss) with the same result."""
    calls = _spy_dispatch(monkeypatch)
    model = _model()
    ids, labels = _batch()
    shift = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    shift[1, 2:5] = -1
    with torch.no_grad():
        for kwargs in ({}, {"num_items_in_batch": 9}, {"ignore_index": -1, "shift_labels": shift}):
            out = model(ids, labels=labels, **kwargs)
            torch.testing.assert_close(out.loss, ForCausalLMLoss(out.logits, labels, V, **kwargs))
    assert calls == ["torch"] * 3


def test_keywords_the_default_loss_ignores_keep_the_dispatch(monkeypatch):
    """A keyword ``ForCausalLMLoss`` does not read (it ignores ``**kwargs``; here one the backbone ignores too) still
    goes through the dispatch, with the same loss as ``ForCausalLMLoss`` given every keyword. It fell back before, so a
    packing collator's extra keywords cost the fused kernel."""
    calls = _spy_dispatch(monkeypatch)
    model = _model()
    ids, labels = _batch()
    with torch.no_grad():
        out = model(ids, labels=labels, num_items_in_batch=9, label_smoothing_note=0.1)
    assert calls == ["torch"]
    torch.testing.assert_close(out.loss, ForCausalLMLoss(out.logits, labels, V, num_items_in_batch=9,
                                                         label_smoothing_note=0.1))


@pytest.mark.parametrize("change", ["loss_type", "loss_function"])
def test_anything_else_falls_back_to_the_model_loss_function(monkeypatch, change):
    """A custom ``loss_type`` (transformers then picks another LOSS_MAPPING entry) or a custom ``loss_function``:
    ``self.loss_function`` is called with every keyword, the dispatch is not, and the labels are not range-checked
    (a custom loss may read them differently)."""
    calls = _spy_dispatch(monkeypatch)
    model = _model()
    ids, labels = _batch()
    seen = []
    kwargs = {}
    if change == "loss_type":
        model.loss_type = "ForMaskedLM"
        assert model.loss_function is ForMaskedLMLoss
    elif change == "loss_function":
        def custom(logits, labels, vocab_size, **kw):
            seen.append(sorted(kw))
            return ForCausalLMLoss(logits, labels, vocab_size, **kw)

        model.loss_function = custom
    with torch.no_grad():
        out = model(ids, labels=labels, num_items_in_batch=9, **kwargs)
        expected = model.loss_function(out.logits, labels, V, num_items_in_batch=9, **kwargs)
    assert calls == [] and torch.equal(out.loss, expected)
    if change == "loss_function":
        assert seen == [["num_items_in_batch"]] * 2


def test_out_of_range_labels_raise_in_the_input_check_sync(monkeypatch):
    """A target outside [0, vocab_size) that is not ignore_index raises ValueError naming it, on any backend, from
    the input check's one ``tolist`` (a forward with labels reads the device as often as one without). The first
    label is never a target (transformers drops it in the shift); ``shift_labels`` are checked instead of labels."""
    model = _model()
    ids, labels = _batch()
    tolists = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: tolists.append(1) or real_tolist(self))
    with torch.no_grad():
        model(ids)
        without = len(tolists)
        model(ids, labels=labels)
        assert len(tolists) == 2 * without

        for bad_value, where in ((V, (1, 5)), (-3, (0, 7)), (10**6, (1, 11))):
            bad = labels.clone()
            bad[where] = bad_value
            with pytest.raises(ValueError, match=rf"contain {bad_value}, outside \[0, vocab_size=97\)"):
                model(ids, labels=bad)
        first = labels.clone()
        first[:, 0] = 10**6
        assert math.isfinite(model(ids, labels=first).loss.item())
        custom = labels.masked_fill(labels == -100, -1)  # another ignore_index: -1 is fine, -100 is not
        assert math.isfinite(model(ids, labels=custom, ignore_index=-1).loss.item())
        with pytest.raises(ValueError, match="contain -100, outside"):
            model(ids, labels=labels, ignore_index=-1)
        shift = labels.clone()
        shift[0, 0] = V
        with pytest.raises(ValueError, match="contain 97, outside"):
            model(ids, labels=first, shift_labels=shift)
        with pytest.raises(ValueError, match="integer tensor of class ids"):
            model(ids, labels=labels.float())


def test_loss_targets_is_not_a_user_keyword():
    """``loss_targets`` is what the CausalLM hands its backbone's input check; passed by a caller it collided with that
    (a TypeError printing the whole model), now a ValueError saying what to pass instead."""
    model = _model()
    ids, labels = _batch()
    with pytest.raises(ValueError, match="loss_targets is set by KDAMoEForCausalLM.forward"):
        model(ids, labels=labels, loss_targets=labels)
