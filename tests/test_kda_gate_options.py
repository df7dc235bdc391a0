"""The KDA gate options for Kimi Linear checkpoints (``kda_lower_bound=None``, ``kda_use_A_log``,
``kda_output_gate_bias``): the gate against a float64 brute force and transformers' ``KimiLinearForgetGate``, one layer
against transformers' ``KimiLinearDeltaAttention`` (full, left-padded, cached), every model path with the options,
the backend choice for the unbounded gate, and old folders loading unchanged. CPU, float32."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache, KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention, KimiLinearForgetGate

import kdamoe.model.kernel_dispatch as dispatch
from kdamoe import KDAMoECache, KDAMoEForCausalLM
from kdamoe.model.kda_torch import kda_gate
from kdamoe.model.modeling_kdamoe import KDAMoEDeltaAttention, check_pad_gate_exact
from kdamoe.training.train_graph import TrainStepGraph
from tests.helpers import tiny_config

H, K, D = 2, 16, 32  # heads, head dim, hidden size of the layer tests
KIMI = dict(kda_lower_bound=None, kda_use_A_log=True, kda_output_gate_bias=False)


def _softplus64(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x) in float64 without a threshold: max(x, 0) + log1p(e^−|x|)."""
    x = x.double()
    return x.clamp_min(0) + torch.log1p(torch.exp(-x.abs()))


# ---------------------------------------------------------------------------------------------------------------
# The gate
# ---------------------------------------------------------------------------------------------------------------
def test_unbounded_gate_equals_float64_brute_force_and_transformers_forget_gate():
    gen = torch.Generator().manual_seed(0)
    config = KimiLinearConfig(hidden_size=D, linear_num_heads=H, linear_head_dim=K, num_hidden_layers=1,
                              layer_types=["linear_attention"], pad_token_id=None, bos_token_id=None, eos_token_id=None)
    ref = KimiLinearForgetGate(config)
    with torch.no_grad():
        ref.f_a_proj.weight.copy_(torch.randn(K, D, generator=gen) * 0.6)
        ref.f_b_proj.weight.copy_(torch.randn(H * K, K, generator=gen) * 0.6)
        ref.dt_bias.copy_(torch.randn(H * K, generator=gen) * 3)
        ref.A_log.copy_(torch.tensor([-1.3, 2.1]).view(1, 1, H, 1))
    x = torch.randn(3, 11, D, generator=gen) * 2
    with torch.no_grad():
        f = ref.f_b_proj(ref.f_a_proj(x)).view(3, 11, H, K)
        want = ref(x)
        A_log = ref.A_log.view(H)
        got = kda_gate(f, ref.dt_bias, None, A_log)
    pre = f.double() + ref.dt_bias.double().view(H, K)
    assert pre.max() > 25 and pre.min() < -25  # both sides of the softplus threshold 20 are exercised
    brute = -torch.exp(A_log.double()).view(H, 1) * _softplus64(pre)
    assert got.dtype == torch.float32 and got.shape == f.shape
    torch.testing.assert_close(got.double(), brute, rtol=2e-6, atol=1e-9)
    # transformers computes log(1 + e^x), which rounds to 0 below x ≈ −16.6 where log1p keeps e^x: |Δ| < 6e-8·e^A.
    torch.testing.assert_close(got, want, rtol=2e-6, atol=6e-8 * math.exp(2.1))
    # The float64 input path (gradchecks) is float64 throughout.
    torch.testing.assert_close(kda_gate(f.double(), ref.dt_bias, None, A_log), brute, rtol=1e-12, atol=1e-12)


def test_bounded_gate_with_A_log_equals_float64_brute_force():
    gen = torch.Generator().manual_seed(1)
    f, dt_bias, A_log = torch.randn(2, 5, H, K, generator=gen) * 4, torch.randn(H * K, generator=gen), torch.randn(H)
    got = kda_gate(f, dt_bias, -3.5, A_log)
    x = torch.exp(A_log.double()).view(H, 1) * (f.double() + dt_bias.double().view(H, K))
    torch.testing.assert_close(got.double(), -3.5 / (1 + torch.exp(-x)), rtol=2e-6, atol=1e-9)


def test_padded_positions_get_an_exactly_zero_gate():
    pad = torch.full((1, 1, H, K), KDAMoEDeltaAttention.PAD_GATE_INPUT)
    for dt in (-100.0, 0.0, 9000.0):
        dt_bias = torch.full((H * K,), dt)
        for A_log in (torch.tensor([-10.0, 10.0]), torch.tensor([0.0, math.log(16.0)])):
            assert torch.equal(kda_gate(pad, dt_bias, None, A_log), torch.zeros_like(pad))  # softplus underflows
        assert torch.equal(kda_gate(pad, dt_bias, -5.0, torch.tensor([0.0, math.log(16.0)])), torch.zeros_like(pad))
        assert torch.equal(kda_gate(pad, dt_bias, -5.0, None), torch.zeros_like(pad))
    # A per-head scale below ~0.009 would break the bounded gate's exact zero: the check names it.
    small = torch.tensor([0.0, -6.0])
    assert kda_gate(pad, torch.zeros(H * K), -5.0, small)[..., 1, :].ne(0).all()
    with pytest.raises(ValueError, match="A_log"):
        check_pad_gate_exact(small)
    check_pad_gate_exact(torch.tensor([0.0, math.log(16.0)]))


def test_init_of_the_gate_parameters():
    torch.manual_seed(2)
    model = KDAMoEForCausalLM(tiny_config(kda_head_dim=16, hidden_act="silu", **KIMI))
    layer = model.model.layers[0].self_attn
    assert layer.A_log.shape == (H,) and layer.A_log.dtype == torch.float32 and layer.g_b_proj.bias is None
    assert 0.0 <= layer.A_log.min() and layer.A_log.max() <= math.log(16.0)
    decay = _softplus64(layer.dt_bias.detach())  # −g at zero input before the A_log scale: Kimi Linear's [1e-3, 0.1]
    assert decay.min() >= 1e-3 * (1 - 1e-5) and decay.max() <= 0.1 * (1 + 1e-5)
    torch.manual_seed(3)
    bounded = KDAMoEForCausalLM(tiny_config(kda_head_dim=16, kda_use_A_log=True)).model.layers[0].self_attn
    assert bounded.g_b_proj.bias is not None
    # Bounded gate with A_log: exp(g) at zero input is still in [0.9, 0.999] (dt_bias divided by exp(A_log)).
    g0 = kda_gate(torch.zeros(1, H, 16), bounded.dt_bias.detach(), -5.0, bounded.A_log.detach()).double()
    assert g0.exp().min() >= 0.9 - 1e-6 and g0.exp().max() <= 0.999 + 1e-6


# ---------------------------------------------------------------------------------------------------------------
# One layer against transformers' KimiLinearDeltaAttention
# ---------------------------------------------------------------------------------------------------------------
def _layer_pair():
    """Our KDA layer with Kimi Linear's options and transformers' layer holding the same noisy weights."""
    config = tiny_config(hidden_size=D, kda_num_heads=H, kda_head_dim=K, hidden_act="silu", rms_norm_eps=1e-6,
                         kda_chunk_size=16, **KIMI)
    ours = KDAMoEDeltaAttention(config, layer_idx=0)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            scale = {"dt_bias": 1.5, "A_log": 0.7, "conv1d.weight": 0.5, "o_norm.weight": 0.3}.get(name, 0.25)
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if name == "o_norm.weight" else 0.0))
    kimi_config = KimiLinearConfig(hidden_size=D, linear_num_heads=H, linear_head_dim=K, linear_conv_kernel_dim=4,
                                   hidden_act="silu", rms_norm_eps=1e-6, num_hidden_layers=1, vocab_size=97,
                                   layer_types=["linear_attention"], pad_token_id=None, bos_token_id=None,
                                   eos_token_id=None)
    theirs = KimiLinearDeltaAttention(kimi_config, layer_idx=0)
    own = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            source = name.removeprefix("forget_gate.")
            p.copy_(own[source].view(p.shape))  # A_log [H] → [1, 1, H, 1]; every other name and shape are ours
    assert set(own) == {n.removeprefix("forget_gate.") for n, _ in theirs.named_parameters()}
    return config, ours.eval(), kimi_config, theirs.eval()


def _close(got, want):
    scale = want.abs().max()
    assert scale > 0.05
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(scale))


def test_layer_equals_transformers_kimi_linear_layer_full_padded_and_cached():
    config, ours, kimi_config, theirs = _layer_pair()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 70, D, generator=gen)
    with torch.no_grad():
        _close(ours(x), theirs(x))  # 70 tokens: several chunks of ours (16) and of theirs (64)

        mask = torch.ones(2, 21, dtype=torch.long)
        mask[0, :6] = 0
        xp = x[:, :21].clone()
        xp[0, :6] = torch.randn(6, D, generator=gen) * 5  # padded inputs that must not matter
        got, want = ours(xp, attention_mask=mask), theirs(xp, attention_mask=mask)
        real = mask.bool()
        _close(got[real], want[real])
        _close(got[0, 6:], theirs(x[:1, 6:21])[0])

        cache, kimi_cache = KDAMoECache(config), DynamicCache(config=kimi_config)
        pieces, kimi_pieces = [ours(x[:, :9], cache=cache)], [theirs(x[:, :9], cache=kimi_cache)]
        for t in range(9, 15):
            pieces.append(ours(x[:, t:t + 1], cache=cache))
            kimi_pieces.append(theirs(x[:, t:t + 1], cache=kimi_cache))
        _close(torch.cat(pieces, 1), torch.cat(kimi_pieces, 1))
        _close(torch.cat(pieces, 1), theirs(x[:, :15]))


# ---------------------------------------------------------------------------------------------------------------
# Every path of the model with the options
# ---------------------------------------------------------------------------------------------------------------
OPTIONS = [KIMI, dict(kda_lower_bound=-3.0, kda_use_A_log=True, kda_output_gate_bias=True)]
TOL = dict(rtol=1e-5, atol=1e-5)


def _model(options):
    torch.manual_seed(6)
    model = KDAMoEForCausalLM(tiny_config(hidden_act="silu", **options))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # A_log off its init (some heads below 0) so that its scale matters
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "A_log"):
                layer.self_attn.A_log.copy_(torch.randn(layer.self_attn.A_log.shape, generator=gen))
    return model.eval()


def _ids(seed, B, T):
    return torch.randint(3, 97, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("options", OPTIONS, ids=["unbounded", "bounded+A_log"])
def test_model_paths_agree_with_the_gate_options(options):
    model = _model(options)
    ids = _ids(8, 2, 30)
    with torch.no_grad():
        full = model(ids, use_cache=False, prefill_chunk_size=0).logits
        torch.testing.assert_close(model(ids, use_cache=True, prefill_chunk_size=7).logits, full, **TOL)

        out = model(ids[:, :17], use_cache=True)
        pieces = [out.logits]
        for t in range(17, 21):
            out = model(ids[:, t:t + 1], cache=out.cache, use_cache=True)
            pieces.append(out.logits)
        pieces.append(model(ids[:, 21:], cache=out.cache, use_cache=True).logits)
        torch.testing.assert_close(torch.cat(pieces, 1), full, **TOL)

        docs = [ids[:1, :11], ids[1:, :19]]
        position_ids = torch.cat([torch.arange(11), torch.arange(19)]).unsqueeze(0)
        packed = model(torch.cat(docs, 1), position_ids=position_ids, use_cache=False).logits
        alone = torch.cat([model(d, use_cache=False).logits for d in docs], 1)
        torch.testing.assert_close(packed, alone, **TOL)


# ---------------------------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------------------------
def test_triton_backend_refuses_the_unbounded_gate():
    with pytest.raises(ValueError, match="kda_lower_bound"):
        tiny_config(kda_lower_bound=None, kernel_backend="triton")
    for bad in (dict(kda_lower_bound="none"), dict(kda_lower_bound=True), dict(kda_use_A_log=1),
                dict(kda_output_gate_bias=None)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            tiny_config(**bad)
    q = torch.zeros(1, 4, H, K)
    beta = torch.zeros(1, 4, H)
    with pytest.raises(ValueError, match="unbounded"):
        dispatch._unbounded_gate_backend("triton", torch.device("cuda"), "chunk_kda")
    if dispatch.kdamoe_kernels() is not None:  # under TRITON_INTERPRET=1 "triton" runs kdamoe's kernel on CPU
        with pytest.raises(ValueError, match="unbounded"):
            dispatch.chunk_kda(q, q, q, q, beta, use_gate_in_kernel=True, lower_bound=None, backend="triton")


def test_auto_runs_fla_or_torch_for_the_unbounded_gate(monkeypatch):
    calls = []

    def fake(name):
        def op(q, k, v, g, beta, **kwargs):
            calls.append((name, kwargs))
            return torch.zeros_like(v), None
        return op

    cuda = torch.device("cuda")
    monkeypatch.setattr(dispatch, "resolve", lambda backend, device, op: "kdamoe")  # kdamoe kernels "available"
    unbounded = dict(use_gate_in_kernel=True, A_log=None, dt_bias=None, lower_bound=None)
    assert dispatch._kda_impl("auto", cuda, "chunk_kda", dict(unbounded, lower_bound=-5.0)) == "kdamoe"
    monkeypatch.setattr(dispatch, "fla_kernels", lambda: None)
    assert dispatch._kda_impl("auto", cuda, "chunk_kda", unbounded) == "torch"
    fla = SimpleNamespace(chunk_kda=fake("chunk_kda"), fused_recurrent_kda=fake("fused_recurrent_kda"))
    monkeypatch.setattr(dispatch, "fla_kernels", lambda: fla)
    assert dispatch._kda_impl("auto", cuda, "fused_recurrent_kda", unbounded) == "fla"
    # fla's arguments: A_log given (zeros for "no A_log"), no safe_gate, lower_bound None.
    monkeypatch.setattr(dispatch, "_kda_impl", lambda backend, device, op, gate: "fla")
    q, beta = torch.zeros(1, 4, H, K), torch.zeros(1, 4, H)
    dispatch.chunk_kda(q, q, q, q, beta, use_gate_in_kernel=True, lower_bound=None, backend="auto")
    A_log = torch.full((H,), 0.3)
    dispatch.fused_recurrent_kda(q, q, q, q, beta, use_gate_in_kernel=True, A_log=A_log, backend="auto")
    (name_c, chunk_kwargs), (name_r, rec_kwargs) = calls
    assert name_c == "chunk_kda" and "safe_gate" not in chunk_kwargs and chunk_kwargs["lower_bound"] is None
    assert torch.equal(chunk_kwargs["A_log"], torch.zeros(H)) and chunk_kwargs["A_log"].dtype == torch.float32
    assert name_r == "fused_recurrent_kda" and rec_kwargs["A_log"] is A_log and rec_kwargs["lower_bound"] is None


def test_decode_and_training_graphs_leave_the_unbounded_gate_alone(monkeypatch):
    monkeypatch.setattr(dispatch, "resolve", lambda backend, device, op: "kdamoe")
    cuda = torch.device("cuda")
    assert dispatch.decode_graphs_supported("auto", cuda)
    assert not dispatch.decode_graphs_supported("auto", cuda, bounded_gate=False)
    model = KDAMoEForCausalLM(tiny_config(**KIMI))
    with pytest.raises(ValueError, match="unbounded KDA gate"):
        TrainStepGraph(model)


# ---------------------------------------------------------------------------------------------------------------
# Old folders
# ---------------------------------------------------------------------------------------------------------------
def test_a_saved_folder_without_the_new_keys_loads_unchanged(tmp_path):
    torch.manual_seed(9)
    model = KDAMoEForCausalLM(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    for key in ("kda_use_A_log", "kda_output_gate_bias", "kda_lower_bound"):
        data.pop(key)  # a config.json written before these fields existed
    path.write_text(json.dumps(data))
    loaded = KDAMoEForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.kda_lower_bound == -5.0 and loaded.config.kda_use_A_log is False
    assert loaded.config.kda_output_gate_bias is True
    ids = _ids(10, 2, 12)
    with torch.no_grad():
        assert torch.equal(loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    # And a Kimi-style folder keeps A_log in float32 when loaded in bfloat16.
    KDAMoEForCausalLM(tiny_config(**KIMI)).save_pretrained(tmp_path / "kimi")
    kimi = KDAMoEForCausalLM.from_pretrained(tmp_path / "kimi", dtype=torch.bfloat16)
    attn = kimi.model.layers[0].self_attn
    assert attn.A_log.dtype == torch.float32 and attn.q_proj.weight.dtype == torch.bfloat16
    assert kimi.config.kda_lower_bound is None


# ---------------------------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------------------------
def test_unbounded_gate_gradients_equal_finite_differences():
    gen = torch.Generator().manual_seed(11)
    f = (torch.randn(1, 3, H, 4, generator=gen, dtype=torch.float64) * 8).requires_grad_()
    dt_bias = torch.randn(H * 4, generator=gen, dtype=torch.float64).requires_grad_()
    A_log = torch.randn(H, generator=gen, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda *xs: kda_gate(xs[0], xs[1], None, xs[2]), (f, dt_bias, A_log))


def test_bounded_gate_with_A_log_on_the_triton_kernels_equals_the_torch_path():
    """One layer, ``kernel_backend="triton"`` (the kdamoe kernels, on the CPU interpreter) against ``"torch"``: the
    output and the gradients of A_log, dt_bias and the input agree in float32."""
    if dispatch.kdamoe_kernels() is None:
        pytest.skip("kdamoe.kernels does not import here")
    config = tiny_config(hidden_size=D, kda_num_heads=H, kda_head_dim=K, kda_lower_bound=-4.0, kda_use_A_log=True)
    torch.manual_seed(12)
    layer = KDAMoEDeltaAttention(config, layer_idx=0)
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(2, 21, D, generator=gen)
    dy = torch.randn(2, 21, D, generator=gen)
    results = {}
    for backend in ("torch", "triton"):
        layer.zero_grad(set_to_none=True)
        config.kernel_backend = backend
        xg = x.clone().requires_grad_()
        y = layer(xg)
        y.backward(dy)
        results[backend] = (y.detach(), xg.grad, layer.A_log.grad.clone(), layer.dt_bias.grad.clone())
    assert results["torch"][2].abs().min() > 0  # A_log takes part
    for got, want in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_training_step_with_the_unbounded_gate_reaches_every_gate_parameter():
    model = _model(KIMI).train()
    ids = _ids(14, 2, 20)
    model(ids, labels=ids, use_cache=False).loss.backward()
    for layer in model.model.layers:
        attn = layer.self_attn
        if isinstance(attn, KDAMoEDeltaAttention):
            for p in (attn.A_log, attn.dt_bias, attn.f_b_proj.weight):
                assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0
