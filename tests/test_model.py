"""KDAMoEForCausalLM end to end on CPU: cache, generation, packing, padding, checkpointing, remote code."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, DynamicCache
from transformers.utils import is_kernels_available

from kdamoe import KDAMoECache, KDAMoEForCausalLM, KDAMoEForSequenceClassification
from kdamoe.model.modeling_kdamoe import fused_linear
from tests.helpers import tiny_config


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = KDAMoEForCausalLM(tiny_config(**overrides))
    with torch.no_grad():  # non-trivial balancing biases, so they matter in every comparison
        for router in model._routers():
            router.e_score_correction_bias.copy_(0.05 * torch.randn(router.num_experts))
    return model.eval()


def _ids(seed, B, T, vocab=97):
    return torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attnres_num_blocks", [0, 2])
def test_incremental_decode_equals_full_forward(attnres_num_blocks):
    model = _model(attnres_num_blocks=attnres_num_blocks)
    ids = _ids(1, B=2, T=40)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :23], use_cache=True)  # the full forward spans two torch chunks (32)
        cache, pieces = out.cache, [out.logits]
        assert isinstance(cache, DynamicCache)
        for t in range(23, 33):  # single-token decode steps
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            cache, pieces = out.cache, pieces + [out.logits]
        out = model(ids[:, 33:], cache=cache, use_cache=True)  # multi-token continuation
        pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-4)


def test_packed_sequences_equal_sequences_run_alone():
    model = _model()
    docs = [_ids(s, 1, n) for s, n in ((2, 13), (3, 20), (4, 7))]
    ids = torch.cat(docs, 1)
    position_ids = torch.cat([torch.arange(d.shape[1]) for d in docs]).unsqueeze(0)
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, use_cache=False).logits
        alone = torch.cat([model(d, use_cache=False).logits for d in docs], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


def test_left_padding_gives_the_unpadded_logits():
    model = _model()
    short, long = _ids(5, 1, 9), _ids(6, 1, 15)
    pad = torch.zeros(1, 6, dtype=torch.long)
    ids = torch.cat([torch.cat([pad, short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 6), torch.ones(1, 9)], 1), torch.ones(1, 15)]).long()
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, use_cache=False).logits
        alone_short = model(short, use_cache=False).logits
        alone_long = model(long, use_cache=False).logits
    torch.testing.assert_close(batched[0, 6:], alone_short[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batched[1], alone_long[0], rtol=1e-4, atol=1e-4)


def test_batched_left_padded_generation_matches_single_prompts():
    model = _model()
    prompts = [_ids(7, 1, 5), _ids(8, 1, 11)]
    ids = torch.cat([torch.cat([torch.zeros(1, 6, dtype=torch.long), prompts[0]], 1), prompts[1]])
    mask = (torch.arange(11) >= torch.tensor([[6], [0]])).long()
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for row, prompt in enumerate(prompts):
        single = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(batched[row, -8:], single[0, -8:])
    torch.manual_seed(0)
    sampled = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)
    assert sampled.shape == (2, 19)


def test_training_step_counts_real_tokens_once_even_with_gradient_checkpointing():
    ids = _ids(9, B=2, T=24)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    grads, loads = [], []
    for checkpointing in (False, True):
        model = _model(seed=1).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        out = model(ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        loads.append(model.expert_load())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    n_sparse = tiny_config().num_sparse_layers
    real = int(mask.sum())
    assert loads[1].shape == (n_sparse, 8)
    assert torch.equal(loads[0], loads[1])
    assert torch.all(loads[1].sum(-1) == real * 2)


def test_eval_and_generation_never_move_router_biases():
    model = _model()
    before = [r.e_score_correction_bias.clone() for r in model._routers()]
    model.generate(_ids(10, 1, 6), max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.update_router_biases()
    after = [r.e_score_correction_bias for r in model._routers()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert model.expert_load().sum() == 0


def test_router_logits_logits_to_keep_and_aux_loss():
    model = _model(router_aux_loss_coef=0.01)
    ids = _ids(11, B=2, T=10)
    out = model(ids, output_router_logits=True, logits_to_keep=3, use_cache=False)
    assert out.logits.shape == (2, 3, 97)
    assert isinstance(out.router_logits, tuple) and len(out.router_logits) == tiny_config().num_sparse_layers
    assert out.router_logits[0].shape == (20, 8)
    assert out.aux_loss is not None and out.aux_loss.item() > 0
    with_aux = model(ids, labels=ids, output_router_logits=True, use_cache=False)
    without = model(ids, labels=ids, output_router_logits=False, use_cache=False)
    torch.testing.assert_close(with_aux.loss, without.loss + 0.01 * with_aux.aux_loss)
    full = model(ids, use_cache=False).logits
    torch.testing.assert_close(out.logits, full[:, -3:])


def test_backbone_contract_for_trl_fused_head():
    model = _model()
    backbone = getattr(model, model.base_model_prefix)
    out = backbone(input_ids=_ids(12, 1, 6), use_cache=False, output_router_logits=True)
    assert out.last_hidden_state.shape == (1, 6, 32)
    assert isinstance(out.router_logits, tuple)
    assert model.get_output_embeddings() is model.lm_head


def test_sequence_classification_reads_last_real_token():
    torch.manual_seed(0)
    model = KDAMoEForSequenceClassification(tiny_config(num_labels=1)).eval()
    ids = _ids(13, 1, 8)
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 8), torch.zeros(1, 3)], 1).long()
    with torch.no_grad():
        score = model(ids).logits
        score_padded = model(padded, attention_mask=mask).logits
    assert score.shape == (1, 1)
    torch.testing.assert_close(score, score_padded, rtol=1e-5, atol=1e-5)
    out = model(ids, labels=torch.tensor([0.5]))
    assert out.loss is not None and out.loss.requires_grad


REMOTE_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)  # as the parent computes the expected logits: equal bits need one reduction order
    sys.path = [p for p in sys.path if p not in ("", ".", {repo!r})]
    sys.modules["kdamoe"] = None  # block the package even where it is pip-installed (editable or not)
    try:
        import kdamoe
        raise SystemExit("kdamoe must not be importable here")
    except ImportError:
        pass
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True).eval()
    ids = torch.load({ids!r})
    with torch.no_grad():
        torch.save(model(ids, use_cache=False).logits, {out!r})
    print(type(model).__module__)
    from transformers import AutoModel, AutoModelForSequenceClassification
    backbone = AutoModel.from_pretrained({folder!r}, trust_remote_code=True)
    scorer = AutoModelForSequenceClassification.from_pretrained({folder!r}, trust_remote_code=True, num_labels=1)
    print(type(backbone).__name__, type(scorer).__name__)
    print("use_kernels", model.use_kernels, backbone.use_kernels, scorer.use_kernels)
    """
)


def test_remote_code_round_trip_in_a_fresh_process(tmp_path):
    model = _model()
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    files = sorted(os.listdir(folder))
    assert "model.safetensors" in files and not any(f.endswith(".bin") for f in files)
    for code in ("configuration_kdamoe.py", "modeling_kdamoe.py", "kda_torch.py", "moe_torch.py",
                 "quantile_balancing.py", "kernel_dispatch.py", "cache_kdamoe.py", "decode_graph.py", "mla_torch.py",
                 "norm_torch.py", "attnres_torch.py"):
        assert code in files, files
    ids = _ids(14, 2, 12)
    torch.save(ids, tmp_path / "ids.pt")
    script = REMOTE_SCRIPT.format(repo=os.getcwd(), folder=str(folder), ids=str(tmp_path / "ids.pt"),
                                  out=str(tmp_path / "out.pt"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "transformers_modules" in result.stdout
    assert "KDAMoEModel KDAMoEForSequenceClassification" in result.stdout  # auto_map names every head
    # No Hub kernels unless asked (transformers 5.25 turned them on by default: a kernelize on every load)
    assert "use_kernels False False False" in result.stdout, result.stdout
    assert "kernel mapping" not in result.stderr, result.stderr[-2000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU matmuls reduce in an order that depends on the thread count (seen: 1e-5 apart)
    try:
        with torch.no_grad():
            expected = model(ids, use_cache=False).logits
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)
    # In-process Auto classes (registered by `import kdamoe`) load it too, biases included.
    again = AutoModelForCausalLM.from_pretrained(folder)
    for a, b in zip(model._routers(), again._routers(), strict=True):
        assert torch.equal(a.e_score_correction_bias, b.e_score_correction_bias)
    assert isinstance(AutoModelForSequenceClassification.from_config(model.config), KDAMoEForSequenceClassification)


def test_hub_kernels_are_off_by_default_on_every_transformers_version(tmp_path):
    # transformers 5.25's from_pretrained kernelizes every load unless told otherwise (use_kernels defaults to on);
    # kdamoe keeps 5.24's opt-in (KDAMoEPreTrainedModel.from_pretrained), so its own kernels run after a plain load
    _model().save_pretrained(tmp_path)
    for cls in (AutoModelForCausalLM, KDAMoEForCausalLM, AutoModelForSequenceClassification):
        assert cls.from_pretrained(tmp_path).use_kernels is False, cls
    assert KDAMoEForCausalLM.from_pretrained(tmp_path, use_kernels=None).use_kernels is False  # 5.25's "default"


@pytest.mark.skipif(not is_kernels_available(), reason="the `kernels` package (a dependency of transformers >= 5.25)")
def test_hub_kernels_still_load_when_asked_for(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    opted = AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True).eval()
    assert opted.use_kernels is True
    assert AutoModelForCausalLM.from_pretrained(tmp_path, kernels_mode=opted.kernels_mode).use_kernels is True
    ids = _ids(15, 1, 9)
    with torch.no_grad():  # on the CPU the Hub mapping has nothing for these ops: kdamoe's own code still runs
        assert torch.equal(opted(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


def test_eager_and_sdpa_attention_agree():
    ids = _ids(15, 2, 14)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    logits = {}
    for impl in ("eager", "sdpa"):
        model = _model(attn_implementation=impl)
        assert model.config._attn_implementation == impl
        with torch.no_grad():
            logits[impl] = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(logits["eager"][0], logits["sdpa"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits["eager"][1, 4:], logits["sdpa"][1, 4:], rtol=1e-5, atol=1e-5)


def test_fused_linear_equals_each_projection_and_leaves_wrapped_modules_to_themselves():
    """One GEMM over concatenated weights == each ``nn.Linear`` on its own (float64); a module that is not a plain
    bias-free Linear (here one with a bias, as a stand-in for a wrapper) makes every module run itself."""
    gen = torch.Generator().manual_seed(3)
    mods = tuple(torch.nn.Linear(24, n, bias=False).double() for n in (16, 5, 1, 9))
    x = torch.randn(2, 7, 24, generator=gen, dtype=torch.float64)
    for out, m in zip(fused_linear(x, mods), mods, strict=True):
        torch.testing.assert_close(out, x @ m.weight.T, rtol=1e-12, atol=1e-12)
    biased = mods[:2] + (torch.nn.Linear(24, 3, bias=True).double(),)
    for out, m in zip(fused_linear(x, biased), biased, strict=True):
        torch.testing.assert_close(out, m(x), rtol=0, atol=0)


def test_fused_linear_group_is_one_view_of_its_modules_side_by_side():
    """A tuple entry (the KDA layer's q|k|v) gives one output, its modules' outputs side by side: in the fused case a
    single column view of the one GEMM (row stride Σ out), so its gradient reaches autograd as one piece; with a
    module that is not plain, the modules' own outputs concatenated. Values as each ``nn.Linear`` (float64)."""
    gen = torch.Generator().manual_seed(5)
    mods = tuple(torch.nn.Linear(24, n, bias=False).double() for n in (6, 6, 6, 3))
    x = torch.randn(2, 7, 24, generator=gen, dtype=torch.float64)
    group, rest = fused_linear(x, (mods[:3], mods[3]))
    assert group.shape == (2, 7, 18) and group.stride(1) == 21 and rest.data_ptr() == group.data_ptr() + 18 * 8
    torch.testing.assert_close(group, torch.cat([x @ m.weight.T for m in mods[:3]], -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rest, x @ mods[3].weight.T, rtol=1e-12, atol=1e-12)
    biased = torch.nn.Linear(24, 6, bias=True).double()
    group, rest = fused_linear(x, ((mods[0], biased), mods[3]))
    torch.testing.assert_close(group, torch.cat([mods[0](x), biased(x)], -1), rtol=0, atol=0)
    torch.testing.assert_close(rest, mods[3](x), rtol=0, atol=0)


def test_fused_linear_first_and_second_derivatives_equal_each_projection_on_its_own():
    """Gradients of the input and of every weight through the fused GEMM against separate ``nn.Linear`` modules in
    float64, and the same for a gradient penalty (double backward, ``create_graph=True``)."""
    gen = torch.Generator().manual_seed(4)
    mods = tuple(torch.nn.Linear(24, n, bias=False).double() for n in (16, 5, 1, 9))
    x = torch.randn(2, 7, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    upstream = [torch.randn(2, 7, m.out_features, generator=gen, dtype=torch.float64) for m in mods]
    params = [x, *(m.weight for m in mods)]

    def derivatives(outs):
        loss = sum((o.tanh() * u).sum() for o, u in zip(outs, upstream, strict=True))
        grads = torch.autograd.grad(loss, params, create_graph=True)
        return grads + torch.autograd.grad(sum(g.square().sum() for g in grads), params)

    fused = derivatives(fused_linear(x, mods))
    separate = derivatives(tuple(F.linear(x, m.weight) for m in mods))
    for got, want in zip(fused, separate, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_fused_linear_with_mismatched_dtypes_raises_like_the_modules():
    """float32 input, float64 weights: the same error as the modules give, not a silent cast."""
    mods = tuple(torch.nn.Linear(6, n, bias=False).double() for n in (4, 3))
    x = torch.randn(5, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="dtype"):
        fused_linear(x, mods)


def test_fused_linear_under_autocast_runs_in_bfloat16_and_returns_float32_gradients():
    """float32 master weights under CPU bfloat16 autocast: the outputs are bfloat16 like ``F.linear``'s under
    autocast, and the gradients float32 and equal to autocast's separate projections."""
    gen = torch.Generator().manual_seed(6)
    mods = tuple(torch.nn.Linear(32, n, bias=False) for n in (16, 8))
    x = torch.randn(3, 5, 32, generator=gen, requires_grad=True)
    results = []
    for run in (lambda: fused_linear(x, mods), lambda: tuple(m(x) for m in mods)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = run()
        assert all(o.dtype == torch.bfloat16 for o in outs)
        loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
        results.append(torch.autograd.grad(loss, [x, *(m.weight for m in mods)]))
    for got, want in zip(*results, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_hooks_on_a_fused_projection_still_run_and_change_the_output():
    """A forward hook on one of the projections ``fused_linear`` groups must fire and be applied (the fused GEMM
    would bypass it): zeroing ``q_proj``'s output through a hook equals zeroing its weight."""
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config()).eval()
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    proj = model.model.layers[0].self_attn.q_proj
    calls = []
    handle = proj.register_forward_hook(lambda m, args, out: calls.append(1) or torch.zeros_like(out))
    with torch.no_grad():
        hooked = model(ids, use_cache=False).logits
    handle.remove()
    with torch.no_grad():
        proj.weight.zero_()
        zeroed = model(ids, use_cache=False).logits
    assert calls, "the hook never ran"
    torch.testing.assert_close(hooked, zeroed, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("value", [2, 0.5, -1])
def test_an_attention_mask_with_values_other_than_0_and_1_is_refused(value):
    """A mask of 2, 0.5 or -1 is neither padding nor token: it would silently act as "keep" (a wrong result)."""
    model = KDAMoEForCausalLM(tiny_config()).eval()
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 6)
    mask[1, 0] = value
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=mask)
    model(ids, attention_mask=torch.ones(2, 6, dtype=torch.bool))  # bool and 0/1 masks stay fine


def test_packed_position_ids_with_a_padding_mask():
    """Before: restarting position_ids next to an attention_mask silently turned document separation off. With a mask
    of ones the documents stay separated (equal to the mask-free packed forward); with padding it is a ValueError;
    left padding's own position_ids (a 0 at the first real token) are not a restart."""
    torch.manual_seed(3)
    model = KDAMoEForCausalLM(tiny_config()).eval()
    ids = torch.randint(3, 97, (1, 12))
    restart = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        packed = model(ids, position_ids=restart).logits
        with_ones = model(ids, position_ids=restart, attention_mask=torch.ones(1, 12, dtype=torch.long)).logits
        second_alone = model(ids[:, 5:]).logits
    torch.testing.assert_close(with_ones, packed)
    torch.testing.assert_close(packed[:, 5:], second_alone, rtol=1e-4, atol=1e-4)  # nothing crossed the boundary
    padded = torch.ones(2, 12, dtype=torch.long)
    padded[1, :3] = 0
    with pytest.raises(ValueError, match="restart at 0 between real tokens"):
        model(ids.expand(2, 12), position_ids=restart.expand(2, 12), attention_mask=padded)
    left = torch.tensor([[0, 0, 0] + [1] * 9])  # left padding; positions as generate builds them
    positions = (left.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(ids, position_ids=positions, attention_mask=left)  # accepted


@pytest.mark.parametrize("kwargs", [{"assistant_model": "self"}, {"prompt_lookup_num_tokens": 3},
                                    {"assistant_early_exit": 2}])
def test_assisted_generation_and_prompt_lookup_are_refused_with_our_message(kwargs):
    """Before: transformers 5.25 failed with a TypeError inside its past recording, 5.24 with its own message."""
    model = KDAMoEForCausalLM(tiny_config()).eval()
    kwargs = {k: (model if v == "self" else v) for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))}: assisted generation and prompt lookup are not "
                                         "supported by KDAMoE models"):
        model.generate(torch.randint(3, 97, (1, 6)), max_new_tokens=3, do_sample=False, **kwargs)
    # as another model's assistant, transformers 5.25 asks our cache to record its past (a TypeError before)
    with pytest.raises(ValueError, match="recurrent state cannot be rewound"):
        KDAMoECache(model.config).activate_past_recording(recurrent_states_to_keep=3)
