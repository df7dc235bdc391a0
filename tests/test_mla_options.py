"""Kimi Linear options of the MLA layer and the MLP layout: the shared (un-rotated) key part ``qk_rope_head_dim``,
``mla_rms_norm_eps`` and ``mlp_layer_types``.

References are independent of the code under test: transformers' own ``KimiLinearAttention`` (with our weights copied
in; its ``q_a_layernorm`` / ``kv_a_layernorm`` use eps 1e-6 by its constructor default) and its ``DynamicCache``; a
float64 brute-force softmax for the latent op; and, for the whole model, the single-pass forward without a cache
(expanded per-head keys and values, SDPA). Model paths run in float64 (RMSNorms and the router compute in float32 by
design, so paths that sum the same terms in another order agree to ~1e-7).
"""

import os

import pytest
import torch
from transformers import DynamicCache
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

from kdamoe import KDAMoEConfig, KDAMoEForCausalLM
from kdamoe.model.cache_kdamoe import KDAMoECache
from kdamoe.model.mla_torch import latent_attention_torch
from kdamoe.model.modeling_kdamoe import (
    LATENT_ATTENTION_MAX_TOKENS,
    KDAMoEAttention,
    KDAMoEMLP,
    KDAMoESparseMoeBlock,
)
from tests.helpers import tiny_config

TOL = dict(rtol=1e-5, atol=1e-6)
# A head of 16 per-head + 8 shared key columns, values of 12 (three different widths), a small latent; the MLA
# norms' eps differs from the other norms' and matters at the layer tests' small input scale.
MLA = dict(num_attention_heads=2, kv_lora_rank=16, qk_head_dim=24, qk_rope_head_dim=8, v_head_dim=12,
           rms_norm_eps=1e-5, mla_rms_norm_eps=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# One layer against transformers' KimiLinearAttention
# ---------------------------------------------------------------------------------------------------------------
def _layer_pair(q_lora_rank, seed=0):
    """Our layer (layer 0 of a one-MLA-layer config) and transformers' with the same perturbed weights, float32."""
    config = tiny_config(num_hidden_layers=1, layer_types=["full_attention"], first_k_dense_replace=1,
                         attnres_num_blocks=1, q_lora_rank=q_lora_rank, **MLA)
    config._attn_implementation = "sdpa"  # what the model sets; a bare config has none
    torch.manual_seed(seed)
    ours = KDAMoEAttention(config, 0).eval()
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 1:  # RMSNorm weights: away from the ones they start at
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
    theirs_config = KimiLinearConfig(
        hidden_size=config.hidden_size, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
        q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_hidden_layers=1,
        rms_norm_eps=1e-5, attention_bias=False,
    )
    theirs_config._attn_implementation = "eager"
    theirs = KimiLinearAttention(theirs_config, 0).eval()
    names = {"kv_a_proj_with_mqa": "kv_a_proj"}
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            module, _, leaf = name.rpartition(".")
            p.copy_(ours.get_parameter(f"{names.get(module, module)}.{leaf}"))
    assert theirs.kv_a_layernorm.variance_epsilon == 1e-6  # the reference's eps, which ours must reproduce
    return config, ours, theirs


def _hidden(seed, B, T, d=32):
    # small inputs: the latent's mean square (~3e-6 here) is of the order of the eps, so a wrong eps shows
    return 1e-3 * torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed))


def _additive(allowed):
    """Boolean ``[B, 1, T, S]`` (True = attend) → the additive float mask transformers' eager attention adds."""
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _close(got, want):
    """1e-5 relative to the largest |want|."""
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), (got - want).abs().max()


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_layer_forward_matches_kimi_linear_attention(q_lora_rank):
    _, ours, theirs = _layer_pair(q_lora_rank)
    B, T = 2, 9
    x = _hidden(1, B, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
    with torch.no_grad():
        want = theirs(x, _additive(causal))[0]
        got = ours(x, {"full_attention": None, "latent": False, "key_mask": None})[0]
        _close(got, want)
        # row 1 left-padded by 3: its real queries see only its real keys
        keys_ok = torch.ones(B, T, dtype=torch.bool)
        keys_ok[1, :3] = False
        allowed = causal & keys_ok[:, None, None, :]
        want = theirs(x, _additive(allowed))[0]
        got = ours(x, {"full_attention": allowed, "latent": False, "key_mask": None})[0]
    _close(got[0], want[0])
    _close(got[1, 3:], want[1, 3:])


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_layer_latent_decode_matches_kimi_linear_on_a_dynamic_cache(q_lora_rank):
    """Prefill 6 tokens (row 1 left-padded by 2), then 5 tokens one at a time: ours in the latent space on a
    KDAMoECache (rows [c | k_shared]), theirs expanding its cached latents and shared keys per step."""
    config, ours, theirs = _layer_pair(q_lora_rank, seed=1)
    B, prompt, T = 2, 6, 11
    x = _hidden(2, B, T)
    keys_ok = torch.ones(B, T, dtype=torch.bool)
    keys_ok[1, :2] = False
    cache, their_cache = KDAMoECache(config), DynamicCache()
    with torch.no_grad():
        causal = torch.ones(prompt, prompt, dtype=torch.bool).tril()[None, None]
        allowed = causal & keys_ok[:, None, None, :prompt]
        cache.begin_forward(prompt, x.device)
        ours(x[:, :prompt], {"full_attention": allowed, "latent": False, "key_mask": None}, cache)
        cache.end_forward(prompt)
        theirs(x[:, :prompt], _additive(allowed), cache=their_cache)
        assert cache.layers[0].latents.shape[-1] == 16 + 8
        for t in range(prompt, T):
            cache.begin_forward(1, x.device)
            got = ours(x[:, t : t + 1], {"full_attention": None, "latent": True, "key_mask": keys_ok[:, : t + 1]},
                       cache)[0]
            cache.end_forward(1)
            want = theirs(x[:, t : t + 1], _additive(keys_ok[:, None, None, : t + 1]), cache=their_cache)[0]
            _close(got, want)


# ---------------------------------------------------------------------------------------------------------------
# The latent op with a shared key part, against a float64 brute force
# ---------------------------------------------------------------------------------------------------------------
def test_latent_op_scores_whole_rows_and_returns_the_value_columns():
    gen = torch.Generator().manual_seed(3)
    B, T, H, R, Dr, S = 2, 3, 4, 16, 8, 20
    q = torch.randn(B, T, H, R + Dr, generator=gen)
    rows = torch.randn(B, S, R + Dr, generator=gen)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :4] = False
    n, scale = 17, 0.3
    want = torch.zeros(B, T, H, R, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(n - T + t + 1) if mask[b, s]]
            k = rows[b, keys].double()
            p = torch.softmax(scale * q[b, t].double() @ k.T, dim=-1)
            want[b, t] = p @ k[:, :R]
    got = latent_attention_torch(q, rows, torch.tensor(n), scale, mask, value_dim=R)
    assert got.shape == (B, T, H, R)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    for bad in (0, R + Dr + 1, 2.0):
        with pytest.raises(ValueError, match="value_dim"):
            latent_attention_torch(q, rows, torch.tensor(n), scale, mask, value_dim=bad)


# ---------------------------------------------------------------------------------------------------------------
# The whole model with the options
# ---------------------------------------------------------------------------------------------------------------
MODEL = dict(MLA, qk_head_dim=24, v_head_dim=16, q_lora_rank=12,
             layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
             mlp_layer_types=["sparse", "dense", "sparse", "dense"])


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = KDAMoEForCausalLM(tiny_config(**{**MODEL, **overrides}))
    with torch.no_grad():
        for router in model._routers():
            router.e_score_correction_bias.copy_(0.05 * torch.randn(router.num_experts))
    return model.double().eval()


def _ids(seed, B, T, vocab=97):
    return torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _decode(model, ids, prompt, cache, mask=None):
    kwargs = {} if mask is None else {"attention_mask": mask[:, :prompt]}
    out = model(ids[:, :prompt], cache=cache, use_cache=True, **kwargs)
    logits = [out.logits]
    for t in range(prompt, ids.shape[1]):
        kwargs = {} if mask is None else {"attention_mask": mask[:, : t + 1]}
        out = model(ids[:, t : t + 1], cache=out.cache, use_cache=True, **kwargs)
        logits.append(out.logits)
    return torch.cat(logits, 1), out.cache


def test_model_latent_decode_and_per_head_cache_equal_the_full_forward():
    model = _model()
    ids = _ids(4, 2, 24)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        latent, cache = _decode(model, ids, 17, KDAMoECache(model.config))
        per_head, dynamic = _decode(model, ids, 17, DynamicCache(config=model.config))
    assert cache.layers[0].latents.shape[-1] == 16 + 8
    assert dynamic.layers[0].keys.shape[-1] == 24 and dynamic.layers[0].values.shape[-1] == 16
    torch.testing.assert_close(latent, full, **TOL)
    torch.testing.assert_close(per_head, full, **TOL)


def test_model_left_padded_latent_decode_equals_each_row_alone():
    model = _model(seed=1)
    pads = [0, 5]
    ids = _ids(5, 2, 20)
    mask = torch.ones_like(ids)
    for b, n in enumerate(pads):
        ids[b, :n], mask[b, :n] = 0, 0
    with torch.no_grad():
        batched, _ = _decode(model, ids, 12, None, mask)
        for b, n in enumerate(pads):
            alone = model(ids[b : b + 1, n:], use_cache=False).logits
            torch.testing.assert_close(batched[b, n:], alone[0], **TOL)


@pytest.mark.parametrize("chunk", [6, LATENT_ATTENTION_MAX_TOKENS + 3])
def test_model_chunked_prefill_equals_one_pass(chunk):
    """Chunks of up to 64 tokens attend in the latent space; longer ones expand and merge the cached prefix with the
    chunk's own causal part (``_prefix_then_causal``, whose CPU kernel needs equal key and value widths)."""
    model = _model(seed=2)
    ids = _ids(6, 2, 2 * chunk + 9)
    with torch.no_grad():
        full = model(ids, use_cache=False, prefill_chunk_size=0).logits
        chunked = model(ids, use_cache=True, prefill_chunk_size=chunk)
    torch.testing.assert_close(chunked.logits, full, **TOL)
    assert chunked.cache.get_seq_length() == ids.shape[1]


def test_model_packed_rows_equal_separate_rows_and_a_continuation_equals_the_full_forward():
    model = _model(seed=3)
    a, b = _ids(7, 1, 11), _ids(8, 1, 14)
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), use_cache=False,
                       position_ids=torch.cat([torch.arange(11), torch.arange(14)])[None]).logits
        torch.testing.assert_close(packed[:, :11], model(a, use_cache=False).logits, **TOL)
        torch.testing.assert_close(packed[:, 11:], model(b, use_cache=False).logits, **TOL)
        ids = _ids(9, 2, 30)
        full = model(ids, use_cache=False).logits
        first = model(ids[:, :20], use_cache=True)
        turn = model(ids[:, 20:], cache=first.cache, use_cache=True).logits
    torch.testing.assert_close(turn, full[:, 20:], **TOL)


def test_gradients_through_a_latent_continuation_equal_the_full_forward():
    """A forward with grad continuing a cache by a few tokens attends in the latent space (the differentiable torch
    op); every parameter, k_shared's columns of kv_a_proj included, gets the gradient of one full forward."""
    model = _model(seed=4).train()
    ids = _ids(14, 2, 15)
    params = [p for p in model.parameters() if p.requires_grad]
    first = model(ids[:, :10], use_cache=True)
    second = model(ids[:, 10:], cache=first.cache, use_cache=True)
    loss = first.logits.logsumexp(-1).mean() + second.logits.logsumexp(-1).mean()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    full = model(ids, use_cache=False).logits
    loss_ref = full[:, :10].logsumexp(-1).mean() + full[:, 10:].logsumexp(-1).mean()
    grads_ref = torch.autograd.grad(loss_ref, params, allow_unused=True)
    torch.testing.assert_close(loss, loss_ref, **TOL)
    for (name, _), got, want in zip(model.named_parameters(), grads, grads_ref, strict=True):
        assert (got is None) == (want is None), name
        if want is not None:
            torch.testing.assert_close(got, want, **TOL, msg=name)
    by_name = dict(zip((n for n, _ in model.named_parameters()), grads, strict=True))
    assert by_name["model.layers.0.self_attn.kv_a_proj.weight"][16:].abs().max() > 0  # the shared part's rows


def test_a_cache_of_latent_rows_without_the_shared_part_is_refused():
    model = _model()
    other = _model(qk_rope_head_dim=0, qk_head_dim=16)
    with torch.no_grad():
        cache = other(_ids(10, 1, 5), use_cache=True).cache
        with pytest.raises(ValueError, match="kv_lora_rank \\+ qk_rope_head_dim"):
            model(_ids(11, 1, 1), cache=cache)


def test_mla_norm_eps_defaults_to_rms_norm_eps_and_the_shared_part_widens_kv_a_proj():
    attn = KDAMoEAttention(tiny_config(q_lora_rank=12, rms_norm_eps=1e-5), 3)
    assert attn.q_a_layernorm.variance_epsilon == 1e-5 and attn.kv_a_layernorm.variance_epsilon == 1e-5
    attn = KDAMoEAttention(tiny_config(**MODEL), 0)
    assert attn.q_a_layernorm.variance_epsilon == 1e-6 and attn.kv_a_layernorm.variance_epsilon == 1e-6
    assert attn.kv_a_proj.weight.shape == (16 + 8, 32) and attn.kv_b_proj.weight.shape == (2 * (16 + 16), 16)
    assert attn.kv_a_layernorm.weight.shape == (16,)


# ---------------------------------------------------------------------------------------------------------------
# Config: the new fields, their defaults and their checks
# ---------------------------------------------------------------------------------------------------------------
def test_mlp_layer_types_in_mixed_order_build_those_mlps_and_count_those_routers():
    model = _model()
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [KDAMoESparseMoeBlock, KDAMoEMLP, KDAMoESparseMoeBlock, KDAMoEMLP]
    assert model.config.num_sparse_layers == 2
    model.train()
    out = model(_ids(12, 2, 8), output_router_logits=True)
    assert len(out.router_logits) == 2 and model.expert_load().shape == (2, 8)
    assert model.expert_load().sum(-1).tolist() == [32.0, 32.0]  # per sparse layer: 2·8 tokens, 2 experts each


def test_config_defaults_keep_saved_folders_unchanged_and_round_trip():
    old = tiny_config(first_k_dense_replace=2).to_dict()
    for key in ("qk_rope_head_dim", "mla_rms_norm_eps", "mlp_layer_types"):
        old.pop(key)
    config = KDAMoEConfig.from_dict(old)  # a folder saved before these fields existed
    assert config.mlp_layer_types == ["dense", "dense", "sparse", "sparse"] and config.num_sparse_layers == 2
    assert config.qk_rope_head_dim == 0 and config.qk_nope_head_dim == config.qk_head_dim == 16
    assert config.mla_rms_norm_eps is None
    again = KDAMoEConfig.from_dict(tiny_config(**MODEL).to_dict())
    assert again.mlp_layer_types == MODEL["mlp_layer_types"] and again.qk_rope_head_dim == 8
    assert again.qk_nope_head_dim == 16 and again.mla_rms_norm_eps == 1e-6


def test_a_qk_nope_head_dim_keyword_sets_the_total_head_dim_or_must_agree_with_it():
    assert tiny_config(qk_nope_head_dim=16, qk_rope_head_dim=8).qk_head_dim == 24
    assert tiny_config(qk_nope_head_dim=16, qk_rope_head_dim=8, qk_head_dim=24).qk_nope_head_dim == 16
    with pytest.raises(ValueError, match="qk_nope_head_dim"):
        tiny_config(qk_nope_head_dim=16, qk_rope_head_dim=8, qk_head_dim=16)


@pytest.mark.parametrize("overrides,match", [
    (dict(mlp_layer_types=["sparse", "dense", "moe", "dense"]), r"mlp_layer_types\[2\]"),
    (dict(mlp_layer_types=["sparse", "dense"]), "mlp_layer_types"),
    (dict(qk_rope_head_dim=16, qk_head_dim=16), "qk_rope_head_dim"),
    (dict(qk_rope_head_dim=-1), "qk_rope_head_dim"),
    (dict(mla_rms_norm_eps=0.0), "mla_rms_norm_eps"),
    (dict(mla_rms_norm_eps=float("nan")), "mla_rms_norm_eps"),
])
def test_bad_new_fields_are_refused_naming_them(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


@pytest.mark.skipif(bool(os.environ.get("KDAMOE_TEST_ON_GPU")), reason="CPU-interpreter test")
def test_model_decode_with_the_triton_kernels_matches_the_torch_full_forward():
    """The model's decode steps through the Triton latent kernel (CPU interpreter) with rows [c | k_shared]."""
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(**{**MODEL, "kda_head_dim": 16})).eval()  # the kernels need K >= 16
    ids = _ids(13, 2, 14)
    with torch.no_grad():
        model.config.kernel_backend = "torch"
        full = model(ids, use_cache=False).logits
        model.config.kernel_backend = "triton"
        logits, cache = _decode(model, ids, 10, None)
    assert cache.layers[0].latents.shape[-1] == 16 + 8
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)


def test_every_kimi_linear_option_together_decodes_as_the_full_forward():
    """The MLA options with the KDA gate options (unbounded gate, A_log, no output-gate bias) in one model."""
    model = _model(seed=5, kda_lower_bound=None, kda_use_A_log=True, kda_output_gate_bias=False)
    assert model.model.layers[1].self_attn.A_log.shape == (2,)
    ids = _ids(15, 2, 20)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        latent, _ = _decode(model, ids, 14, KDAMoECache(model.config))
    torch.testing.assert_close(latent, full, **TOL)
