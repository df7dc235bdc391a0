"""The model with ``kernel_backend="triton"`` (kernels on the CPU interpreter) against the torch path."""

import os
import traceback

import pytest
import torch
import triton.runtime.interpreter as interpreter

import kdamoe.kernels as kernels
import kdamoe.kernels.moe.experts as experts
from kdamoe import KDAMoEForCausalLM
from kdamoe.model.modeling_kdamoe import (
    KDAMoEBlockAttnRes,
    KDAMoEDeltaAttention,
    KDAMoEGatedRMSNorm,
    KDAMoERMSNorm,
    _dt_bias_init,
)
from tests.helpers import tiny_config

# These run the model with kernel_backend="triton" on CPU tensors through the Triton interpreter; on a GPU machine
# (KDAMOE_TEST_ON_GPU=1) the same code paths are checked on CUDA by tests/test_gpu_backends.py and the benchmarks'
# agreement columns.
pytestmark = pytest.mark.skipif(bool(os.environ.get("KDAMOE_TEST_ON_GPU")), reason="CPU-interpreter test")


def _relative_l2(a, b):
    return float((a - b).double().norm() / b.double().norm().clamp(min=1e-30))


def _model(**overrides):
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(kda_head_dim=16, **overrides))  # the kernels need head dims >= 16
    with torch.no_grad():
        for router in model._routers():
            router.e_score_correction_bias.copy_(0.05 * torch.randn(router.num_experts))
    return model


def _count_norm_kernel_calls(monkeypatch) -> dict:
    """``{op: calls}`` of the norm kernels (and the AttnRes mix, which fuses a key norm) of ``kdamoe.kernels``,
    counted from now on."""
    calls = {"rms_norm": 0, "add_rms_norm": 0, "gated_rms_norm": 0, "block_attnres": 0}
    def counting(name, real):
        def counted(*args):
            calls[name] += 1
            return real(*args)

        return counted

    for name in calls:
        monkeypatch.setattr(kernels, name, counting(name, getattr(kernels, name)))
    return calls


@pytest.mark.parametrize("attnres_num_blocks", [2, 0], ids=["attnres", "residual"])
def test_training_step_matches_torch_backend_on_packed_batch(monkeypatch, attnres_num_blocks):
    """Logits and every parameter's gradient agree; switching ``config.kernel_backend`` on the built model moves
    every RMSNorm onto the Triton norm kernels (one call per norm module), the KDA output norm onto the gated one and
    every Block AttnRes mix (with its key norm) onto the AttnRes kernel; in the plain residual stream each layer's
    post-attention norm runs fused with the residual add."""
    model = _model(attnres_num_blocks=attnres_num_blocks).train()
    mixes = sum(isinstance(m, KDAMoEBlockAttnRes) for m in model.modules())
    norms = [m for m in model.modules() if isinstance(m, KDAMoERMSNorm)]
    gated = sum(isinstance(m, KDAMoEGatedRMSNorm) for m in norms)
    fused = 0 if attnres_num_blocks else model.config.num_hidden_layers
    assert gated > 0 and (mixes > 0) == (attnres_num_blocks > 0) and len(norms) > gated + mixes + fused
    calls = _count_norm_kernel_calls(monkeypatch)
    ids = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(0))
    position_ids = torch.cat([torch.arange(13), torch.arange(17)]).unsqueeze(0)
    results = {}
    for backend in ("torch", "triton"):
        model.config.kernel_backend = backend
        model.zero_grad(set_to_none=True)
        out = model(ids, position_ids=position_ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[backend] = out.logits.detach(), grads
        expected = 0 if backend == "torch" else 1
        assert calls == {"rms_norm": expected * (len(norms) - gated - mixes - fused), "add_rms_norm": expected * fused,
                         "gated_rms_norm": expected * gated, "block_attnres": expected * mixes}, backend
    (ref_logits, ref_grads), (logits, grads) = results["torch"], results["triton"]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert ref_grads.keys() == grads.keys()
    for name in ref_grads:
        assert _relative_l2(grads[name], ref_grads[name]) < 1e-3, name


def test_incremental_decode_with_kernels_matches_torch_full_forward():
    model = _model().eval()
    ids = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.config.kernel_backend = "torch"
        full = model(ids, use_cache=False).logits
        model.config.kernel_backend = "triton"
        out = model(ids[:, :12], use_cache=True)
        pieces, cache = [out.logits], out.cache
        for t in range(12, 16):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            pieces.append(out.logits)
            cache = out.cache
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(1e4) = inf is the point
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_leaves_kda_states_unchanged_with_the_gate_in_the_op(backend):
    """Right padding after the prompt: every KDA layer's recurrent state equals the unpadded run's. The raw gate
    reaches the op (in-kernel on "triton"), so this holds only if the padded gate input gives g = 0 exactly
    (with f = 0 at the pads instead, g = g_min·σ(dt_bias) ≈ −0.05 per pad and the states drift by ~5%)."""
    model = _model().eval()
    model.config.kernel_backend = backend
    ids = torch.randint(3, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(1, 20, dtype=torch.long)
    mask[:, 13:] = 0
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, use_cache=True).cache
        alone = model(ids[:, :13], use_cache=True).cache
    kda_layers = [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    assert kda_layers
    for i in kda_layers:
        got, want = padded.get_recurrent_state(i), alone.get_recurrent_state(i)
        assert _relative_l2(got, want) < 1e-5, i



class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that copy a device value to the host (``bool(t)``, ``int(t)``, ``t.item()``): on a GPU each
    is a synchronisation that drains the launch queue."""

    READS = ("_local_scalar_dense", "is_nonzero", "item")

    def __init__(self):
        super().__init__()
        self.reads, self.paused = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket.__name__ in self.READS:
            files = [frame.filename for frame in traceback.extract_stack()]
            # transformers' mask builders test a padding mask for "all ones" themselves (library code, not ours)
            self.reads.append("transformers masking" if any(f.endswith("masking_utils.py") for f in files)
                              else func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("inputs", ["padded", "position_ids"])
def test_training_step_reads_nothing_back_from_the_device(monkeypatch, inputs):
    """A training forward + backward with the kernels makes no host read of ours besides the input check's one
    ``tolist`` (which this mode cannot see; it is one sync for all value checks). Before: one per MoE layer (the
    experts op's index check), one for the packed-documents test and, with a mask, one for "no padding". With
    padding, transformers' own mask builders still read back whether the mask is all ones. The interpreter-only
    launch planning of the experts op (``_interpreter_launch``, host syncs that cost nothing on the CPU) is not
    counted."""
    torch.manual_seed(0)  # two layers (KDA, then MLA with MoE) carry every op of the four-layer model
    model = KDAMoEForCausalLM(tiny_config(kda_head_dim=16, num_hidden_layers=2, kernel_backend="triton",
                                          layer_types=["linear_attention", "full_attention"])).train()
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    if inputs == "padded":
        kwargs = {"attention_mask": torch.ones_like(ids)}
        kwargs["attention_mask"][0, :5] = 0
    else:  # given position ids (one document per row): the packed-documents test reads them
        kwargs = {"position_ids": torch.arange(24).unsqueeze(0)}
    mode = _HostReads()

    def planned_unseen(*args, _real=experts._interpreter_launch):
        mode.paused += 1
        try:
            return _real(*args)
        finally:
            mode.paused -= 1

    monkeypatch.setattr(experts, "_interpreter_launch", planned_unseen)
    with mode:
        out = model(input_ids=ids, labels=ids, **kwargs)
        out.loss.backward()
    assert [read for read in mode.reads if read != "transformers masking"] == []
    assert torch.isfinite(out.loss)


class _ActivationCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Records copies (``cat``, ``clone``, ``copy_``, ``_to_copy``) whose output has the activations' leading
    ``[B, T]`` / ``[1, B·T]`` / ``[B·T]`` shape, outside the Triton interpreter's own launches."""

    COPIES = ("cat", "clone", "copy_", "_to_copy", "contiguous")

    def __init__(self, B, T):
        super().__init__()
        self.leading, self.copies, self.paused = ((B, T), (1, B * T), (B * T,)), [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and func.overloadpacket.__name__ in self.COPIES:
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor) and any(tuple(o.shape[:len(p)]) == p for p in self.leading):
                    self.copies.append((func.overloadpacket.__name__, tuple(o.shape)))
        return out


def test_kda_layer_training_step_copies_no_activation(monkeypatch):
    """The KDA layer's forward + backward with the kernels copies one activation-sized tensor: the fused projections'
    gradients, concatenated by autograd for one ∂x and one ∂W GEMM (fewer bytes than a GEMM per output, see
    ``fused_linear``), q|k|v among them as the conv's one gradient. Before, also: q|k|v concatenated for the conv
    (forward), q, k and v copied to contiguous for the KDA op, and their gradients concatenated back. The short conv
    of q, k and v is one kernel launch forward and two backward (before: three and six), at a width (2 heads × 16 =
    32 channels per part) that is not a multiple of the conv's channel block. The layer's output and gradients still
    equal the torch backend's."""
    torch.manual_seed(0)
    layer = KDAMoEDeltaAttention(tiny_config(kda_head_dim=16, kernel_backend="triton"), 0)
    # built alone, the layer skips the model's _init_weights: dt_bias would be torch.empty's bytes
    with torch.no_grad():
        layer.dt_bias.copy_(_dt_bias_init(layer.dt_bias, layer.config.kda_lower_bound))
    B, T = 2, 40
    x = torch.randn(B, T, layer.config.hidden_size, generator=torch.Generator().manual_seed(3), requires_grad=True)
    upstream = torch.randn(B, T, layer.config.hidden_size, generator=torch.Generator().manual_seed(4))
    mode = _ActivationCopies(B, T)

    names = []

    def launch_unseen(self, *args, _real=interpreter.GridExecutor.__call__, **kwargs):
        names.append(self.fn.__name__)
        mode.paused += 1
        try:
            return _real(self, *args, **kwargs)
        finally:
            mode.paused -= 1

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch_unseen)
    with mode:
        out = layer(x)
        grads = torch.autograd.grad((out * upstream).sum(), [x, *layer.parameters()])
    fused_width = sum(m.out_features for m in (layer.q_proj, layer.k_proj, layer.v_proj, layer.f_a_proj,
                                                layer.b_proj, layer.g_a_proj))
    assert mode.copies == [("cat", (B, T, fused_width))]
    conv_launches = [n for n in names if n.startswith("_conv_")]
    assert conv_launches == ["_conv_fwd_kernel", "_conv_bwd_dpre_kernel", "_conv_bwd_dx_kernel"]
    layer.config.kernel_backend = "torch"
    out_ref = layer(x)
    grads_ref = torch.autograd.grad((out_ref * upstream).sum(), [x, *layer.parameters()])
    assert _relative_l2(out, out_ref) < 1e-5
    for got, want in zip(grads, grads_ref, strict=True):
        assert _relative_l2(got, want) < 1e-4


@pytest.mark.parametrize("backend,B", [("triton", 1), ("triton", 2), ("torch", 1)])
def test_gradients_through_a_cache_continuation_equal_the_full_forward(backend, B):
    """A forward with grad that continues a cache by a few tokens (the MLA layer then attends in the latent space)
    gives every parameter the gradient of one full forward over the same tokens. Before: the Triton latent kernel,
    forward only, left the MLA layer's projections without gradients and the earlier layers' wrong, silently; and
    with one row the conv's saved state was the cache buffer the cache then overwrote (an in-place error)."""
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(kda_head_dim=16, num_hidden_layers=2, kernel_backend=backend,
                                          layer_types=["linear_attention", "full_attention"])).train()
    ids = torch.randint(3, 97, (B, 19), generator=torch.Generator().manual_seed(9))
    params = [p for p in model.parameters() if p.requires_grad]
    first = model(ids[:, :11], use_cache=True)
    second = model(ids[:, 11:], past_key_values=first.past_key_values, use_cache=True)
    loss = first.logits.logsumexp(-1).mean() + second.logits.logsumexp(-1).mean()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    full = model(ids, use_cache=False).logits
    loss_ref = full[:, :11].logsumexp(-1).mean() + full[:, 11:].logsumexp(-1).mean()
    grads_ref = torch.autograd.grad(loss_ref, params, allow_unused=True)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    for (name, _), got, want in zip(model.named_parameters(), grads, grads_ref, strict=True):
        assert (got is None) == (want is None), name
        if want is not None:
            assert _relative_l2(got, want) < 1e-4, name


def test_training_after_an_inference_mode_forward_of_the_same_shape():
    """An ``inference_mode`` forward, then a training step at the same (B, T): the kernels' cached index tables
    (e.g. the KDA layer's uniform ``cu_seqlens``) must not be inference tensors, which a training forward cannot save
    for backward (it raised "Inference tensors cannot be saved for backward"). The step's gradients equal those of a
    fresh model that never ran in inference mode."""
    model = _model()
    model.config.kernel_backend = "triton"
    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        model.eval()(ids, use_cache=False)
    model.train()
    model(ids, labels=ids, use_cache=False).loss.backward()
    fresh = _model()
    fresh.config.kernel_backend = "triton"
    fresh(ids, labels=ids, use_cache=False).loss.backward()
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
