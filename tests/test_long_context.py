"""Long context on the CPU: chunked prefill, the latent-only MLA cache and what generate() does with it.

References are independent of the code under test: the single-pass forward without a cache (per-head keys and
values, SDPA) and transformers' own per-head ``DynamicCache``. Models run in float64; the RMSNorms and the router
compute in float32 by design, so paths that add the same terms in another order agree to ~1e-7, far below what any wrong
mask, state or position gives (differences of 1e-2 and more on these models).
"""

import pytest
import torch
from transformers import DynamicCache

from kdamoe import KDAMoEForCausalLM
from kdamoe.model.cache_kdamoe import KDAMoECache, KDAMoELatentCacheLayer, attention_seq_length
from kdamoe.model.decode_graph import DecodeGraph
from kdamoe.model.modeling_kdamoe import LATENT_ATTENTION_MAX_TOKENS
from tests.helpers import tiny_config

TOL = dict(rtol=1e-5, atol=1e-6)


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = KDAMoEForCausalLM(tiny_config(**overrides))
    with torch.no_grad():
        for router in model._routers():
            router.e_score_correction_bias.copy_(0.05 * torch.randn(router.num_experts))
    return model.double().eval()


def _ids(seed, B, T, vocab=97):
    return torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _left_pad(ids, pads):
    """Rows of ``ids`` with ``pads[b]`` leading pad tokens (id 0) masked out."""
    ids = ids.clone()
    mask = torch.ones_like(ids)
    for b, n in enumerate(pads):
        ids[b, :n] = 0
        mask[b, :n] = 0
    return ids, mask


# ---------------------------------------------------------------------------------------------------------------
# Chunked prefill equals the single pass
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attnres_num_blocks", [0, 2])
@pytest.mark.parametrize("chunk", [5, 7, LATENT_ATTENTION_MAX_TOKENS + 3])
def test_chunked_forward_equals_single_pass(chunk, attnres_num_blocks):
    """Chunks of up to 64 tokens attend in the latent space, longer ones expand keys / values (prefix + causal)."""
    model = _model(attnres_num_blocks=attnres_num_blocks)
    ids = _ids(1, 2, 2 * chunk + 23)
    with torch.no_grad():
        full = model(ids, use_cache=False, prefill_chunk_size=0, output_hidden_states=True)
        for use_cache in (False, True):
            out = model(ids, use_cache=use_cache, prefill_chunk_size=chunk, output_hidden_states=True)
            torch.testing.assert_close(out.logits, full.logits, **TOL)
            for got, want in zip(out.hidden_states, full.hidden_states, strict=True):
                torch.testing.assert_close(got, want, **TOL)
            assert (out.cache is None) == (not use_cache)
            if use_cache:
                assert out.cache.get_seq_length() == ids.shape[1]


def test_chunked_forward_of_a_left_padded_batch_equals_single_pass():
    model = _model()
    ids, mask = _left_pad(_ids(2, 3, 29), [0, 6, 13])
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False, prefill_chunk_size=0).logits
        chunked = model(ids, attention_mask=mask, use_cache=True, prefill_chunk_size=6).logits
    real = mask.bool()
    torch.testing.assert_close(chunked[real], full[real], **TOL)


def test_chunking_is_the_config_default_and_a_cache_continues_it():
    model = _model(prefill_chunk_size=9)
    ids = _ids(3, 1, 40)
    with torch.no_grad():
        full = model(ids, use_cache=False, prefill_chunk_size=0).logits
        out = model(ids[:, :31], use_cache=True)  # 4 chunks by the config's default
        rest = model(ids[:, 31:], cache=out.cache, use_cache=True).logits
    torch.testing.assert_close(torch.cat([out.logits, rest], 1), full, **TOL)


def test_chunked_forward_refuses_what_it_cannot_collect_and_bad_chunk_lengths():
    model = _model()
    ids = _ids(4, 1, 20)
    with torch.no_grad():
        with pytest.raises(ValueError, match="prefill_chunk_size=0"):
            model(ids, prefill_chunk_size=8, output_router_logits=True)
        for bad in (-1, 2.5, True):
            with pytest.raises(ValueError, match="prefill_chunk_size"):
                model(ids, prefill_chunk_size=bad)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        tiny_config(prefill_chunk_size=-8)


def test_packed_and_grad_forwards_run_in_one_pass():
    model = _model()
    ids = torch.cat([_ids(5, 1, 11), _ids(6, 1, 14)], 1)
    position_ids = torch.cat([torch.arange(11), torch.arange(14)]).unsqueeze(0)
    with torch.no_grad():
        single = model(ids, position_ids=position_ids, use_cache=False, prefill_chunk_size=0).logits
        asked = model(ids, position_ids=position_ids, use_cache=False, prefill_chunk_size=4).logits
    torch.testing.assert_close(asked, single, **TOL)
    loss = model(ids, labels=ids, prefill_chunk_size=4, output_router_logits=True).loss  # grad on: one pass
    loss.backward()
    assert model.lm_head.weight.grad is not None


# ---------------------------------------------------------------------------------------------------------------
# The latent cache: decode == per-head cache decode == full forward
# ---------------------------------------------------------------------------------------------------------------
def _decode(model, ids, prompt, cache, mask=None):
    """Logits of a prompt forward then one token at a time, ``[B, T, V]`` (positions prompt-1 … T-2 predict)."""
    kwargs = {} if mask is None else {"attention_mask": mask[:, :prompt]}
    out = model(ids[:, :prompt], cache=cache, use_cache=True, **kwargs)
    logits = [out.logits]
    for t in range(prompt, ids.shape[1]):
        kwargs = {} if mask is None else {"attention_mask": mask[:, : t + 1]}
        out = model(ids[:, t : t + 1], cache=out.cache, use_cache=True, **kwargs)
        logits.append(out.logits)
    return torch.cat(logits, 1), out.cache


def test_latent_cache_decode_equals_per_head_cache_and_full_forward():
    model = _model()
    ids = _ids(7, 2, 30)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        latent, cache = _decode(model, ids, 21, KDAMoECache(model.config))
        per_head, _ = _decode(model, ids, 21, DynamicCache(config=model.config))
    assert isinstance(cache.layers[3], KDAMoELatentCacheLayer) and cache.layers[3].latents.shape[-1] == 16
    torch.testing.assert_close(latent, full, **TOL)
    torch.testing.assert_close(per_head, full, **TOL)


def test_latent_decode_of_a_left_padded_batch_equals_each_row_alone():
    model = _model()
    pads = [0, 5, 9]
    ids, mask = _left_pad(_ids(8, 3, 26), pads)
    with torch.no_grad():
        batched, _ = _decode(model, ids, 15, None, mask)
        for b, n in enumerate(pads):
            alone = model(ids[b : b + 1, n:], use_cache=False).logits
            torch.testing.assert_close(batched[b, n:], alone[0], **TOL)


@pytest.mark.parametrize("new_tokens", [3, LATENT_ATTENTION_MAX_TOKENS + 9])
def test_continuation_from_a_returned_cache_equals_re_prefill(new_tokens):
    """A new turn passed with the returned cache: short turns attend in the latent space, long ones expand."""
    model = _model()
    ids = _ids(9, 2, 40 + new_tokens)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        first = model(ids[:, :40], use_cache=True)
        turn = model(ids[:, 40:], cache=first.cache, use_cache=True)
    torch.testing.assert_close(turn.logits, full[:, 40:], **TOL)
    assert turn.cache.get_seq_length() == 40 + new_tokens


def test_latent_cache_preallocates_and_never_copies_the_history_per_step():
    model = _model()
    ids = _ids(10, 2, 12)
    cache = KDAMoECache(model.config, max_cache_len=300)
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        layer = cache.layers[3]
        address, capacity = layer.latents.data_ptr(), layer.capacity
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(20):
            nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert capacity >= 300 and layer.latents.data_ptr() == address and cache.get_seq_length() == 32


def test_latent_cache_grows_by_one_copy_when_outgrown():
    model = _model()
    ids = _ids(11, 1, 300)
    cache = KDAMoECache(model.config, max_cache_len=8)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        a = model(ids[:, :5], cache=cache, use_cache=True).logits
        b = model(ids[:, 5:], cache=cache, use_cache=True).logits  # outgrows the 8 preallocated rows
    torch.testing.assert_close(torch.cat([a, b], 1), full, **TOL)
    assert cache.layers[3].capacity >= 300 + 300 // 8


def test_cache_reorder_repeat_select_and_crop():
    model = _model()
    ids = _ids(12, 3, 14)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, layer = out.cache, out.cache.layers[3]
        before = layer.latents[:, :14].clone()
        address = layer.latents.data_ptr()
        cache.reorder_cache(torch.tensor([2, 0, 0]))
        assert layer.latents.data_ptr() == address
        torch.testing.assert_close(layer.latents[:, :14], before[[2, 0, 0]], rtol=0, atol=0)
        kda_state = cache.layers[0].recurrent_states[0].clone()
        cache.batch_repeat_interleave(2)
        assert layer.latents.shape[0] == 6
        assert torch.equal(cache.layers[0].recurrent_states[0], kda_state.repeat_interleave(2, 0))
        cache.batch_select_indices(torch.tensor([1, 4]))
        assert layer.latents.shape[0] == 2
        layer.crop(-4)  # (transformers' linear-attention layers cannot crop without past recording)
        assert cache.get_seq_length() == 10
        with pytest.raises(ValueError, match="negative"):
            layer.crop(3)


def test_cache_rejects_mismatched_latents():
    model = _model()
    with torch.no_grad():
        out = model(_ids(13, 2, 6), use_cache=True)
        with pytest.raises(ValueError, match="batch"):
            model(_ids(14, 3, 1), cache=out.cache, use_cache=True)
    with pytest.raises(ValueError, match="max_cache_len"):
        KDAMoECache(model.config, max_cache_len=0)


# ---------------------------------------------------------------------------------------------------------------
# generate()
# ---------------------------------------------------------------------------------------------------------------
def test_generate_builds_a_latent_cache_and_matches_the_per_head_cache():
    model = _model()
    model.generation_config.eos_token_id = None  # the reference loop below does not stop either
    ids = _ids(15, 2, 9)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        per_head = model.generate(ids, max_new_tokens=6, do_sample=False, cache=DynamicCache(config=model.config))
        seq = ids
        for _ in range(6):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert isinstance(out.cache, KDAMoECache) and out.cache.layers[3].capacity >= 15
    assert torch.equal(out.sequences, seq) and torch.equal(per_head, seq)


def test_beam_search_with_the_latent_cache_equals_the_per_head_cache():
    model = _model()
    ids = _ids(16, 2, 8)
    with torch.no_grad():
        kwargs = dict(max_new_tokens=5, num_beams=3, do_sample=False, num_return_sequences=2)
        latent = model.generate(ids, **kwargs)
        per_head = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
    assert torch.equal(latent, per_head)


def test_left_padded_generate_equals_each_row_alone():
    model = _model()
    pads = [4, 0]
    ids, mask = _left_pad(_ids(17, 2, 11), pads)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        for b, n in enumerate(pads):
            alone = model.generate(ids[b : b + 1, n:], max_new_tokens=5, do_sample=False)
            assert torch.equal(batched[b, -5:], alone[0, -5:])


@pytest.mark.parametrize("layer_types", [None, ["linear_attention"] * 4])
def test_multi_turn_generate_continues_the_returned_cache(layer_types):
    """A new turn passed to generate() with the returned cache equals generating from scratch; for a model without
    MLA layers this needs the cache to count its tokens (generate() trims the ids it has seen only then — the
    all-KDA case re-fed the history before)."""
    model = _model(layer_types=layer_types)
    model.generation_config.eos_token_id = None
    ids = _ids(18, 2, 10)
    with torch.no_grad():
        first = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        turn = torch.cat([first.sequences, _ids(19, 2, 5)], 1)
        second = model.generate(turn, cache=first.cache, max_new_tokens=4, do_sample=False)
        fresh = model.generate(turn, max_new_tokens=4, do_sample=False)
    assert torch.equal(second, fresh)


# ---------------------------------------------------------------------------------------------------------------
# Regressions found by a fresh-user run
# ---------------------------------------------------------------------------------------------------------------
def test_generate_without_a_cache_from_embeddings_and_with_chunking_off():
    """The config's ``prefill_chunk_size`` once reached generate()'s own chunked prefill (same field name), which
    refused ``use_cache=False``, broke ``inputs_embeds`` and crashed on 0."""
    model = _model()
    model.generation_config.eos_token_id = None
    ids = _ids(20, 2, 12)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False), want)
        embeds = model.get_input_embeddings()(ids)
        assert torch.equal(model.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False), want[:, 12:])
        model.config.prefill_chunk_size = 0
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want)
    assert model.generation_config.prefill_chunk_size is None


def test_caches_built_for_another_model_or_batch_are_refused():
    model = _model()
    ids = _ids(23, 2, 8)
    with torch.no_grad():
        per_head = model(ids, cache=DynamicCache(config=model.config), use_cache=True).cache
        with pytest.raises(ValueError, match="2 rows but the inputs have batch size 3"):
            model(_ids(24, 3, 1), cache=per_head, use_cache=True)
        others = {
            "8 layers": _model(num_hidden_layers=8),
            "is a KDAMoELinearAttentionLayer": _model(layer_types=["linear_attention"] * 4),
            "KDA state of shape": _model(kda_num_heads=4),
            "latents of width": _model(kv_lora_rank=8, layer_types=["linear_attention"] * 3 + ["full_attention"]),
        }
        for message, other in others.items():
            with pytest.raises(ValueError, match=message):
                model(_ids(25, 2, 1), cache=other(ids, use_cache=True).cache, use_cache=True)


def test_hybrid_cache_refuses_what_it_cannot_do():
    model = _model()
    with torch.no_grad():
        cache = model(_ids(26, 2, 8), use_cache=True).cache
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(-2)
    with pytest.raises(ValueError, match="does not record"):
        cache.activate_past_recording()
    with pytest.raises(ValueError, match=r"row indices \[0, 5\]"):
        cache.reorder_cache(torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="positive integer"):
        cache.batch_repeat_interleave(0)
    for bad in (2.5, "10", 0):
        with pytest.raises(ValueError, match="max_cache_len"):
            KDAMoECache(model.config, max_cache_len=bad)


def test_cache_length_is_the_mla_layers_count_under_every_transformers_version():
    """The cached length comes from an MLA layer (transformers 5.25's ``Cache.get_seq_length()`` reads layer 0, a KDA
    layer here, whose own count is not the tokens): the default, an MLA index and the model's own reading agree with
    the tokens fed; a KDA index is refused by name; an index past the last layer answers 0, as transformers' does."""
    kinds = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    model = _model(layer_types=kinds)
    mla = kinds.index("full_attention")
    with torch.no_grad():
        cache = model(_ids(27, 2, 9), use_cache=True).cache
        cache = model(_ids(28, 2, 3), cache=cache, use_cache=True).cache
    assert cache.get_seq_length() == cache.get_seq_length(mla) == attention_seq_length(cache) == 12
    later_kda = kinds.index("linear_attention", mla + 1)
    with pytest.raises(ValueError, match=f"layer {later_kda} is a KDA layer"):
        cache.get_seq_length(later_kda)
    assert cache.get_seq_length(len(kinds)) == 0


def test_decode_graph_validity_follows_moved_and_replaced_parameters_and_the_model():
    """A captured graph reads parameters by address: moving one (``.data =``), replacing one (a new ``Parameter`` in
    the slot) or calling another model must invalidate it; an unchanged model must not (no needless re-capture)."""
    model, other = _model(seed=0), _model(seed=0)
    graph = DecodeGraph.__new__(DecodeGraph)  # the validity bookkeeping alone: capturing needs CUDA
    graph.watch_parameters(model)
    assert graph.valid_for(model)
    assert not graph.valid_for(other)
    weight = model.lm_head.weight
    weight.data = weight.data.clone()
    assert not graph.valid_for(model)
    graph.watch_parameters(model)
    layer = model.model.layers[1].mlp.gate
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
    assert not graph.valid_for(model)


@pytest.mark.parametrize("bad", [-1, 0, 2.5, "8", True])
def test_generate_refuses_a_prefill_chunk_size_it_cannot_split_by(bad):
    """transformers' own chunked prefill (``generate(prefill_chunk_size=...)``) splits the prompt before our forward
    runs: a bad value must be a ValueError naming it, not a crash inside ``torch.split``."""
    model = _model(seed=0)
    ids = _ids(0, 1, 12)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        model.generate(ids, max_new_tokens=2, do_sample=False, prefill_chunk_size=bad)
