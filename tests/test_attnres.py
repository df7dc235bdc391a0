"""Block Attention Residuals against a loop-over-sources reference built from the layers' own sublayers."""

import os

import pytest
import torch

import kdamoe.model.modeling_kdamoe as modeling
from kdamoe import KDAMoEForCausalLM
from kdamoe.model.modeling_kdamoe import KDAMoEBlockAttnRes
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
        torch.testing.assert_close(model(ids, use_cache=False).logits, _reference_logits(model, ids),
                                   rtol=1e-5, atol=1e-5)


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
    for got, want in zip(out.hidden_states[:-1], streams, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.hidden_states[-1], model.model(ids, use_cache=False).last_hidden_state)


def test_hidden_states_with_block_attnres_are_the_summed_stream():
    torch.manual_seed(1)
    model = KDAMoEForCausalLM(tiny_config(num_hidden_layers=3, attnres_num_blocks=3)).eval()
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(4))
    backbone, expected = model.model, []
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
    for got, want in zip(out.hidden_states[:-1], expected, strict=True):
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


def _mix_on_the_kernel(monkeypatch, record):
    """Run every AttnRes mix of the model on the Triton kernel (CPU interpreter) while the rest of the model stays
    on its torch ops; ``record`` gets, per mix, the sources' data pointers (to check they are not copies)."""
    real = modeling.block_attnres

    def on_kernel(sources, query, key_weight, eps, backend):
        record.append([v.data_ptr() for v in sources])
        return real(sources, query, key_weight, eps, backend="triton")

    monkeypatch.setattr(modeling, "block_attnres", on_kernel)


@pytest.mark.skipif(bool(os.environ.get("KDAMOE_TEST_ON_GPU")), reason="CPU-interpreter test")
def test_training_step_with_the_kernel_mix_matches_the_torch_mix(monkeypatch):
    """Loss and every parameter's gradient agree with the AttnRes mix on the kernel and on the torch op; the kernel
    sees each sublayer's sources in the Block AttnRes schedule, the embeddings and block sums read in place."""
    torch.manual_seed(3)
    model = KDAMoEForCausalLM(tiny_config(num_hidden_layers=4, attnres_num_blocks=2)).train()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, KDAMoEBlockAttnRes):
                module.query.normal_(0, 1.0)
    ids = torch.randint(3, 97, (2, 13), generator=torch.Generator().manual_seed(5))
    results, record = [], []
    embeddings = []
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: embeddings.append(o.data_ptr()))
    for on_kernel in (False, True):
        if on_kernel:
            _mix_on_the_kernel(monkeypatch, record)
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}))
    # Blocks of 2 layers: [attn, mlp] sources per layer are [1, 2], [2, 2], [2, 3], [3, 3]; then the final mix of
    # the embeddings and both block sums.
    assert [len(r) for r in record] == [1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert all(r[0] == embeddings[-1] for r in record)  # the embeddings themselves, not a stacked copy
    assert record[5][:2] == record[-1][:2] and record[4][1] == record[5][1] == record[-1][1]  # block 1's sum
    (loss, grads), (kernel_loss, kernel_grads) = results
    torch.testing.assert_close(kernel_loss, loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == kernel_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(kernel_grads[name], g, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(bool(os.environ.get("KDAMOE_TEST_ON_GPU")), reason="CPU-interpreter test")
def test_incremental_decode_with_the_kernel_mix_matches_the_full_forward(monkeypatch):
    torch.manual_seed(4)
    model = KDAMoEForCausalLM(tiny_config(num_hidden_layers=3, attnres_num_blocks=2)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, KDAMoEBlockAttnRes):
                module.query.normal_(0, 1.0)
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        _mix_on_the_kernel(monkeypatch, [])
        out = model(ids[:, :7], use_cache=True)
        pieces, cache = [out.logits], out.cache
        for t in range(7, 10):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            pieces.append(out.logits)
            cache = out.cache
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_keeps_the_gradients_through_the_block_sums(reentrant):
    """The finished block sums reach each layer as positional tensors, which both kinds of checkpoint
    differentiate through: the gradients equal those without checkpointing."""
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(7))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(5)
        model = KDAMoEForCausalLM(tiny_config(num_hidden_layers=4, attnres_num_blocks=4)).train()
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": reentrant})
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.skipif(bool(os.environ.get("KDAMOE_TEST_ON_GPU")), reason="CPU-interpreter test")
def test_autocast_training_step_with_the_kernel_mix_matches_the_torch_mix(monkeypatch):
    """Under autocast the sources differ in dtype (float32 embeddings, half-precision sublayer outputs): the kernel
    mixes them like the torch op, which stacks them into the promoted dtype."""
    torch.manual_seed(6)
    model = KDAMoEForCausalLM(tiny_config(num_hidden_layers=2, attnres_num_blocks=2)).train()
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(8))
    dtypes, results = set(), []
    for on_kernel in (False, True):
        if on_kernel:
            _mix_on_the_kernel(monkeypatch, [])
        model.zero_grad(set_to_none=True)
        hook = model.model.layers[1].attn_res.register_forward_pre_hook(
            lambda m, args: dtypes.update(v.dtype for v in args[0]))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(ids, labels=ids).loss
        hook.remove()
        loss.backward()
        results.append((loss.detach(), model.model.layers[1].mlp_res.query.grad.clone()))
    assert dtypes == {torch.float32, torch.float16}
    (loss, grad), (kernel_loss, kernel_grad) = results
    torch.testing.assert_close(kernel_loss, loss, rtol=2e-3, atol=2e-3)
    assert float(grad.abs().max()) > 0
    torch.testing.assert_close(kernel_grad, grad, rtol=2e-2, atol=2e-3)
