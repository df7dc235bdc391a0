"""Regressions of the foundation review: packing with a cache, all-linear models, input and config checks,
transformers' experts interface, output recording and ``return_dict``."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kdamoe import KDAMoEForCausalLM, KDAMoEForSequenceClassification
from kdamoe.model.moe_torch import moe_experts_torch
from tests.helpers import tiny_config


def _model(seed=0, cls=KDAMoEForCausalLM, **overrides):
    torch.manual_seed(seed)
    model = cls(tiny_config(**overrides))
    with torch.no_grad():
        for router in model._routers():
            router.e_score_correction_bias.copy_(0.05 * torch.randn(router.num_experts))
    return model.eval()


def _ids(seed, B, T, vocab=97):
    return torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _packed(docs):
    ids = torch.cat(docs, 1)
    position_ids = torch.cat([torch.arange(d.shape[1]) for d in docs]).unsqueeze(0)
    return ids, position_ids


# ---------------------------------------------------------------------------------------------------------------
# Packing is honoured whatever use_cache says
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_cache", [None, True])
def test_packed_documents_do_not_leak_when_a_cache_is_built(use_cache):
    model = _model()
    docs = [_ids(2, 1, 13), _ids(3, 1, 21)]
    ids, position_ids = _packed(docs)
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, use_cache=use_cache).logits
        alone = torch.cat([model(d, use_cache=False).logits for d in docs], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


def test_packed_training_loss_with_default_use_cache_equals_documents_alone():
    model = _model().train()
    docs = [_ids(4, 1, 13), _ids(5, 1, 21)]
    ids, position_ids = _packed(docs)
    labels = ids.clone()
    labels[0, 13] = -100  # the second document's first token is not predicted from the first document
    out = model(ids, position_ids=position_ids, labels=labels)
    assert out.cache is None  # a training forward builds no cache
    with torch.no_grad():
        model.eval()  # same weights; eval only stops the router statistics
        logits = torch.cat([model(d, use_cache=False).logits for d in docs], 1)
    ref = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-5)


def test_packed_continuation_of_a_cache_isolates_the_later_documents():
    model = _model()
    prefix, tail, other = _ids(6, 1, 10), _ids(7, 1, 6), _ids(8, 1, 9)
    with torch.no_grad():
        out = model(prefix, use_cache=True)
        ids = torch.cat([tail, other], 1)
        position_ids = torch.cat([torch.arange(10, 16), torch.arange(9)]).unsqueeze(0)
        cont = model(ids, position_ids=position_ids, cache=out.cache, use_cache=True).logits
        ref_tail = model(torch.cat([prefix, tail], 1), use_cache=False).logits[:, 10:]
        ref_other = model(other, use_cache=False).logits
    torch.testing.assert_close(cont, torch.cat([ref_tail, ref_other], 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_hidden_layers, layer_types", [(4, None), (2, ["full_attention", "full_attention"])])
def test_decoding_after_a_packed_prefill_continues_the_last_document_only(num_hidden_layers, layer_types):
    model = _model(num_hidden_layers=num_hidden_layers, layer_types=layer_types, first_k_dense_replace=1,
                   attnres_num_blocks=0, initializer_range=0.2)
    a, b, nxt = _ids(20, 1, 9), _ids(21, 1, 7), _ids(22, 1, 1)
    ids, position_ids = _packed([a, b])
    with torch.no_grad():
        out = model(ids, position_ids=position_ids, use_cache=True)
        step = model(nxt, cache=out.cache, use_cache=True).logits
        ref = model(torch.cat([b, nxt], 1), use_cache=False).logits[:, -1:]
    torch.testing.assert_close(step, ref, rtol=1e-4, atol=1e-4)


def test_packed_rows_whose_last_documents_start_apart_refuse_a_cache():
    model = _model()
    ids = _ids(23, 2, 10)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match="use_cache=False"):
        model(ids, position_ids=position_ids, use_cache=True)
    model(ids, position_ids=position_ids, use_cache=False)


# ---------------------------------------------------------------------------------------------------------------
# Models without a full-attention layer
# ---------------------------------------------------------------------------------------------------------------
def test_all_linear_model_forward_cache_and_generate():
    model = _model(num_hidden_layers=3, first_k_dense_replace=1, attnres_num_blocks=0)
    assert "full_attention" not in model.config.layer_types
    ids = _ids(9, 2, 12)
    with torch.no_grad():
        full = model(ids).logits  # default use_cache in eval builds a cache
        out = model(ids[:, :7], use_cache=True)
        step = model(ids[:, 7:], cache=out.cache, use_cache=True).logits
        torch.testing.assert_close(torch.cat([out.logits, step], 1), full, rtol=1e-4, atol=1e-4)
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
        # greedy tokens equal the argmax of re-running the whole sequence each step
        seq = ids
        for _ in range(4):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(gen, seq)


# ---------------------------------------------------------------------------------------------------------------
# Inputs: ValueError naming the value, before any kernel runs
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_ids=torch.tensor([[3, 97]])), "97"),
        (dict(input_ids=torch.tensor([[3, -1]])), "-1"),
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), r"\[1, 0\]"),
        (dict(input_ids=torch.zeros(0, 5, dtype=torch.long)), r"\[0, 5\]"),
        (dict(input_ids=torch.tensor([3, 4, 5])), "2-D"),
        (dict(input_ids=torch.tensor([[3.0, 4.0]])), "float"),
        (dict(input_ids=torch.tensor([[3, 4]], dtype=torch.int16)), "int16"),  # before: the embedding's RuntimeError
        (dict(input_ids=torch.tensor([[3, 4]], dtype=torch.uint8)), "uint8"),
        (dict(input_ids=torch.tensor([[True, False]])), "bool"),
        (dict(input_ids=torch.tensor([[3, 4, 5]]), position_ids=torch.tensor([[0.0, 1.0, 2.0]])), "position_ids"),
        (dict(input_ids=torch.tensor([[3, 4, 5]]), attention_mask=torch.ones(1, 2)), "attention_mask"),
        (dict(input_ids=torch.tensor([[3, 4, 5]]), position_ids=torch.zeros(1, 2, dtype=torch.long)), "position_ids"),
        (dict(inputs_embeds=torch.zeros(1, 3, 7)), "inputs_embeds"),
    ],
)
def test_bad_inputs_raise_value_error_naming_them(kwargs, match):
    model = _model()
    with pytest.raises(ValueError, match=match):
        model(**kwargs)


def test_output_attentions_is_refused_or_returned():
    model = _model()
    ids = _ids(10, 1, 6)
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)
    model.set_attn_implementation("eager")
    out = model(ids, output_attentions=True)
    n_full = model.config.layer_types.count("full_attention")
    assert len(out.attentions) == n_full and out.attentions[0].shape == (1, 2, 6, 6)
    # rows of a causal softmax sum to one and never look ahead
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(1, 2, 6))
    assert float(out.attentions[0].triu(1).abs().max()) == 0.0


@pytest.mark.parametrize(
    "field, value",
    [("rms_norm_eps", -1.0), ("rms_norm_eps", float("nan")), ("situ_beta", float("inf")),
     ("situ_linear_beta", float("inf")), ("initializer_range", -0.1), ("routed_scaling_factor", 0.0),
     ("router_bias_update_rate", float("nan")), ("kda_head_dim", 48), ("kda_head_dim", 96), ("kda_head_dim", 200)],
)
def test_bad_config_values_raise_at_config_time(field, value):
    with pytest.raises(ValueError, match=field):
        tiny_config(**{field: value, "kernel_backend": "auto"})


@pytest.mark.parametrize("field, value", [("situ_beta", float("inf")), ("rms_norm_eps", -1.0), ("rms_norm_eps", True),
                                          ("tie_word_embeddings", "yes"), ("kda_lower_bound", -50.0)])
def test_bad_values_set_after_the_config_are_refused_when_the_model_is_built(tmp_path, field, value):
    config = tiny_config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        KDAMoEForCausalLM(config)
    KDAMoEForCausalLM(tiny_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=field):  # keyword overrides of from_pretrained are set as attributes
        AutoModelForCausalLM.from_pretrained(tmp_path, **{field: value})


def test_kernel_incompatible_head_dim_is_allowed_on_the_torch_backend():
    config = tiny_config(kda_head_dim=12, kernel_backend="torch")
    model = KDAMoEForCausalLM(config).eval()
    assert model(_ids(11, 1, 5)).logits.shape == (1, 5, 97)


# ---------------------------------------------------------------------------------------------------------------
# transformers' experts interface
# ---------------------------------------------------------------------------------------------------------------
def _experts_inputs(seed, model):
    g = torch.Generator().manual_seed(seed)
    experts = model.model.layers[1].mlp.experts
    N, k = 19, model.config.num_experts_per_tok
    hidden = torch.randn(N, experts.gate_up_proj.shape[-1], generator=g)
    index = torch.stack([torch.randperm(model.config.num_experts, generator=g)[:k] for _ in range(N)])
    index[3, 1] = model.config.num_experts  # a slot owned by another expert-parallel rank
    weights = torch.rand(N, k, generator=g)
    return experts, hidden, index, weights


@pytest.mark.parametrize("hidden_act", ["situ", "silu"])
@pytest.mark.parametrize("implementation", ["eager", "kdamoe", "grouped_mm", "batched_mm"])
def test_experts_implementations_compute_the_configured_activation(implementation, hidden_act):
    model = _model(hidden_act=hidden_act)
    model.set_experts_implementation(implementation)
    experts, hidden, index, weights = _experts_inputs(12, model)
    experts.gate_up_proj.data.mul_(40.0)  # pre-activations well past the SiTU caps, so a dropped cap shows
    if implementation in ("grouped_mm", "batched_mm"):
        # transformers skips the sentinel id only in expert-parallel mode, where dispatch zeroes its weight
        experts._is_expert_parallel = True
        weights[index == model.config.num_experts] = 0.0
    with torch.no_grad():
        out = experts(hidden, index, weights)
        ref = moe_experts_torch(hidden.double(), index, weights.double(), experts.gate_up_proj.double(),
                                experts.down_proj.double(), experts.act_fn)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_experts_implementation_default_and_refusals():
    model = _model()
    assert model.config._experts_implementation == "kdamoe"
    with pytest.raises(ValueError, match="sonicmoe"):
        model.set_experts_implementation("sonicmoe")


# ---------------------------------------------------------------------------------------------------------------
# Outputs: return_dict, router logits through the output recorder, sequence classification
# ---------------------------------------------------------------------------------------------------------------
def test_return_dict_false_gives_tuples():
    model = _model()
    ids = _ids(13, 1, 6)
    out = model(ids, labels=ids, return_dict=False)
    assert isinstance(out, tuple)
    ref = model(ids, labels=ids)
    torch.testing.assert_close(out[0], ref.loss)
    torch.testing.assert_close(out[1], ref.logits)


def test_router_logits_are_raw_logits_per_moe_layer():
    model = _model()
    ids = _ids(14, 2, 5)
    out = model.model(ids, output_router_logits=True, use_cache=False)
    sparse = [layer for layer in model.model.layers if layer.is_sparse]
    assert isinstance(out.router_logits, tuple) and len(out.router_logits) == len(sparse)
    # logits of the first MoE layer recomputed from its own input: W_r x of the normed MoE input
    captured = {}
    handle = sparse[0].mlp.register_forward_pre_hook(lambda m, args: captured.setdefault("x", args[0]))
    model.model(ids, use_cache=False)
    handle.remove()
    x = captured["x"].reshape(-1, model.config.hidden_size)
    torch.testing.assert_close(out.router_logits[0], x.float() @ sparse[0].mlp.gate.weight.float().T)


def test_sequence_classification_reads_the_last_real_token_with_left_or_right_padding():
    model = _model(cls=KDAMoEForSequenceClassification, num_labels=3)
    ids = _ids(15, 1, 7)
    pad = torch.zeros(1, 3, dtype=torch.long)
    alone = model(ids).logits
    right = model(torch.cat([ids, pad], 1), attention_mask=torch.cat([torch.ones(1, 7), torch.zeros(1, 3)], 1)).logits
    left = model(torch.cat([pad, ids], 1), attention_mask=torch.cat([torch.zeros(1, 3), torch.ones(1, 7)], 1)).logits
    torch.testing.assert_close(right, alone, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(left, alone, rtol=1e-4, atol=1e-4)
