"""Block Attention Residuals against a loop-over-sources reference built from the layers' own sublayers."""

import pytest
import torch

from kdamoe import KDAMoEForCausalLM
from kdamoe.modeling_kdamoe import KDAMoEBlockAttnRes
from tests.helpers import tiny_config


def _mix_reference(res, sources):
    """h = Σ_i softmax_i(w · RMSNorm(v_i)) v_i, one source at a time."""
    logits = torch.stack([(res.key_norm(v) * res.query).sum(-1) for v in sources])
    weights = torch.softmax(logits, dim=0)
    out = torch.zeros_like(sources[0])
    for i, v in enumerate(sources):
        out = out + weights[i].unsqueeze(-1) * v
    return out


def _sublayers(layer, h):
    mixed = layer.self_attn(layer.input_layernorm(h))
    return mixed[0] if isinstance(mixed, tuple) else mixed  # MLA returns (output, attention weights)


def _mlp(layer, h):
    out = layer.mlp(layer.post_attention_layernorm(h))
    return out[0] if isinstance(out, tuple) else out


def _reference_logits(model, ids):
    """Block AttnRes wiring written out: block b holds layers [b·s, (b+1)·s), s = ceil(L / N)."""
    config, backbone = model.config, model.model
    L, N = config.num_hidden_layers, config.attnres_num_blocks
    size = -(-L // N)
    blocks, partial = [backbone.embed_tokens(ids)], None
    for i, layer in enumerate(backbone.layers):
        h = _mix_reference(layer.attn_res, blocks + ([partial] if partial is not None else []))
        mixed = _sublayers(layer, h)
        partial = mixed if partial is None else partial + mixed
        h = _mix_reference(layer.mlp_res, blocks + [partial])
        partial = partial + _mlp(layer, h)
        if i // size != (i + 1) // size or i == L - 1:  # the block ends after this layer
            blocks.append(partial)
            partial = None
    assert len(blocks) == N + 1
    return model.lm_head(backbone.norm(_mix_reference(backbone.final_res, blocks)))


def _standard_logits(model, ids, streams=None):
    backbone = model.model
    h = backbone.embed_tokens(ids)
    for layer in backbone.layers:
        if streams is not None:
            streams.append(h)
        h = h + _sublayers(layer, h)
        h = h + _mlp(layer, h)
    return model.lm_head(backbone.norm(h))


def test_zero_query_is_the_uniform_average():
    res = KDAMoEBlockAttnRes(tiny_config())
    sources = torch.randn(5, 2, 3, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(res(list(sources)), sources.mean(0))


@pytest.mark.parametrize("layers, blocks", [(5, 2), (4, 4), (3, 1)])
@pytest.mark.parametrize("random_queries", [False, True])
def test_model_matches_loop_reference(layers, blocks, random_queries):
    torch.manual_seed(layers * 10 + blocks)
    model = KDAMoEForCausalLM(tiny_config(num_hidden_layers=layers, attnres_num_blocks=blocks)).eval()
    if random_queries:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, KDAMoEBlockAttnRes):
                    module.query.normal_(0, 1.0)
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, _reference_logits(model, ids), rtol=1e-5, atol=1e-5)


def test_zero_blocks_is_the_standard_residual_stream():
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(attnres_num_blocks=0)).eval()
    assert not any(isinstance(m, KDAMoEBlockAttnRes) for m in model.modules())
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    streams = []
    with torch.no_grad():
        out = model(ids, use_cache=False, output_hidden_states=True)
        torch.testing.assert_close(out.logits, _standard_logits(model, ids, streams), rtol=1e-5, atol=1e-5)
    # hidden_states: embeddings, the stream after each layer, and (last) the final normed state.
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    for got, want in zip(out.hidden_states[:-1], streams):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.hidden_states[-1], model.model(ids, use_cache=False).last_hidden_state)


def test_hidden_states_with_block_attnres_are_the_summed_stream():
    torch.manual_seed(1)
    model = KDAMoEForCausalLM(tiny_config(num_hidden_layers=3, attnres_num_blocks=3)).eval()
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(4))
    backbone, total, expected = model.model, None, []
    with torch.no_grad():
        out = model(ids, use_cache=False, output_hidden_states=True)
        # With one layer per block the sources before layer i are [emb, out_0, ..., out_{i-1}].
        sources = [backbone.embed_tokens(ids)]
        for layer in backbone.layers:
            expected.append(sum(sources))
            h = _mix_reference(layer.attn_res, sources)
            partial = _sublayers(layer, h)
            partial = partial + _mlp(layer, _mix_reference(layer.mlp_res, sources + [partial]))
            sources.append(partial)
    assert len(out.hidden_states) == 4
    for got, want in zip(out.hidden_states[:-1], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_pseudo_query_receives_gradient():
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(num_hidden_layers=4, attnres_num_blocks=2)).train()
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).loss.backward()
    queries = {name: m.query for name, m in model.named_modules() if isinstance(m, KDAMoEBlockAttnRes)}
    assert len(queries) == 2 * 4 + 1
    # The very first sublayer mixes a single source (the embeddings): softmax over one item is constant.
    assert float(queries.pop("model.layers.0.attn_res").grad.abs().max()) == 0
    for name, q in queries.items():
        assert q.grad is not None and float(q.grad.abs().max()) > 0, name
