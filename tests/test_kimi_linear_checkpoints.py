"""Kimi Linear checkpoints in kdamoe: loading, exporting and converting, checked against transformers' own
``KimiLinearForCausalLM`` (CPU, float32).

The reference is transformers' implementation, built from tiny ``KimiLinearConfig``s with MLA and KDA layers in
several orders and dense / sparse MLPs in several orders; every parameter and buffer is moved by seeded noise (a norm
left at 1, a bias left at 0 or an ``A_log`` at its init would hide a wrong mapping), saved with transformers'
``save_pretrained`` (the released on-disk layout), then loaded by kdamoe. The fixture
``fixtures/kimi_linear_48b_config.json`` holds the released 48B ``config.json``: its keys and values as a public
re-upload of the Instruct release shows them (less the re-upload's own ``quantization_config``), the keys cut off there
as other projects record the released architecture; they agree with the model page's facts (27 layers, hidden 2304,
MLA layers 4, 8, ..., 24, 27, 32 KDA heads of 128, 256 experts top-8 plus 1 shared, first layer dense, vocab 163840,
``routed_scaling_factor`` 2.446). ``use_cache`` and ``transformers_version`` were not found and are left out.
"""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors import safe_open
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from kdamoe import KDAMoEConfig, KDAMoEForCausalLM
from kdamoe.cli import convert_main
from kdamoe.common.folders import check_model_folder
from kdamoe.conversion import convert_checkpoint
from kdamoe.model.kimi_linear_format import (
    kdamoe_to_kimi_linear_config,
    kdamoe_to_kimi_linear_tensors,
    kimi_linear_to_kdamoe_config,
    kimi_linear_to_kdamoe_tensors,
)

FIXTURE = Path(__file__).parent / "fixtures" / "kimi_linear_48b_config.json"
TOLERANCE = 1e-5  # max |Δlogit| / max |logit|

# Release-style config.json dicts (the key names of the public config.json, which KimiLinearConfig reads).
BASE = dict(model_type="kimi_linear", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8,
            num_experts=6, num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=2.446,
            moe_renormalize=True, num_expert_group=1, topk_group=1, mla_use_nope=True, model_max_length=512,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, tie_word_embeddings=False)
CONFIGS = {
    # MLA first and last; dense / sparse alternating (explicit mlp_layer_types); shared key part; no q LoRA
    "mla-ends": dict(BASE, num_hidden_layers=4, q_lora_rank=None, qk_rope_head_dim=4,
                     linear_attn_config=dict(full_attn_layers=[1, 4], kda_layers=[2, 3], num_heads=2, head_dim=16,
                                             short_conv_kernel_size=4),
                     mlp_layer_types=["dense", "sparse", "dense", "sparse"]),
    # KDA first and last; first_k_dense_replace=1; q LoRA; conv width 3
    "kda-ends": dict(BASE, num_hidden_layers=3, q_lora_rank=12, qk_rope_head_dim=6, first_k_dense_replace=1,
                     linear_attn_config=dict(full_attn_layers=[2], kda_layers=[1, 3], num_heads=2, head_dim=16,
                                             short_conv_kernel_size=3)),
}


def _perturbed_reference(raw: dict, seed: int) -> KimiLinearForCausalLM:
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig.from_dict(raw)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_floating_point():
                tensor.add_(0.05 * torch.randn(tensor.shape, generator=gen) + 0.01)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    """(name, reference model, its save_pretrained folder, kdamoe model loaded from it)."""
    name = request.param
    folder = tmp_path_factory.mktemp(f"kimi-{name}")
    reference = _perturbed_reference(CONFIGS[name], seed=len(name))
    reference.save_pretrained(folder)
    model = KDAMoEForCausalLM.from_pretrained(folder).eval()
    return name, reference, folder, model


def _ids(batch, length, seed=0):
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def _relative(a, b) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


def test_logits_match_transformers(case):
    name, reference, _, model = case
    ids = _ids(2, 40)  # longer than kdamoe's PyTorch KDA chunk (32): the chunked path crosses a boundary
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    err = _relative(want, got)
    print(f"{name}: max|dlogit|/max|logit| = {err:.2e}")
    assert err <= TOLERANCE
    assert model.config.router_bias_update == "none"  # a loaded release keeps its biases frozen


def test_greedy_generation_left_padding_and_continued_cache(case):
    _, reference, _, model = case
    ids = _ids(2, 9, seed=1)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding (pad id 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want = reference.generate(ids, **kwargs)
        got = model.generate(ids, **kwargs)
        assert torch.equal(want, got)
        # the padded batch's logits at real tokens
        err = _relative(reference(ids, attention_mask=mask).logits[mask.bool()],
                        model(ids, attention_mask=mask).logits[mask.bool()])
        assert err <= TOLERANCE
        # a prefix, then a 5-token continuation on each model's own cache
        full = _ids(1, 14, seed=2)
        ref_out = reference(full[:, :9], use_cache=True)
        own_out = model(full[:, :9], use_cache=True)
        ref_next = reference(full[:, 9:], cache=ref_out.cache, use_cache=True).logits
        own_next = model(full[:, 9:], cache=own_out.cache, use_cache=True).logits
        assert _relative(ref_next, own_next) <= TOLERANCE
        assert _relative(reference(full).logits[:, 9:], own_next) <= TOLERANCE


def test_export_back_to_kimi_linear(case, tmp_path):
    """kdamoe folder → ``kdamoe-convert --to kimi_linear`` → transformers' class: the same tensors, the same logits."""
    _, reference, _, model = case
    model.save_pretrained(tmp_path / "kdamoe")
    out = convert_checkpoint(tmp_path / "kdamoe", tmp_path / "kimi", to="kimi_linear")
    assert not list(out.glob("*.py"))  # kdamoe's model code stays behind
    back, info = KimiLinearForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    want = reference.state_dict()
    got = back.state_dict()
    assert sorted(want) == sorted(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key
    ids = _ids(1, 12, seed=3)
    with torch.no_grad():
        assert torch.equal(reference(ids).logits, back.eval()(ids).logits)


def test_streaming_converter_on_sharded_folder(case, tmp_path):
    """A reference folder in small shards (one layer's experts straddle shards) → ``--to kda_moe`` in small shards:
    the same tensors as ``from_pretrained`` of the original folder, and the folder loads as a kdamoe folder."""
    _, reference, _, model = case
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="20KB")
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    layer = next(i for i, t in enumerate(reference.config.mlp_layer_types) if t == "sparse")
    expert_files = {f for k, f in weight_map.items() if k.startswith(f"model.layers.{layer}.block_sparse_moe.experts.")}
    assert len(expert_files) >= 2
    # the release's side files: the tokenizer and its code are carried over, the release's model code is not
    config = json.loads((sharded / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"}
    (sharded / "config.json").write_text(json.dumps(config))
    for name in ("tiktoken.model", "tokenization_kimi.py", "modeling_kimi.py"):
        (sharded / name).write_text(name)
    out = convert_checkpoint(sharded, tmp_path / "kdamoe", to="kda_moe", max_shard_size="30KB")
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 2
    assert (out / "tiktoken.model").read_text() == "tiktoken.model" and (out / "tokenization_kimi.py").is_file()
    assert not (out / "modeling_kimi.py").exists() and (out / "modeling_kdamoe.py").is_file()
    converted = KDAMoEForCausalLM.from_pretrained(out)
    assert converted.config.router_bias_update == "none"
    want, got = model.state_dict(), converted.state_dict()
    assert sorted(want) == sorted(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key


REMOTE_SCRIPT = """
import sys, torch
sys.path = [p for p in sys.path if p not in ("", ".", {repo!r})]
sys.modules["kdamoe"] = None  # the converted folder must run on its own remote code
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True).eval()
with torch.no_grad():
    torch.save(model(torch.load({ids!r})).logits, {out!r})
print(type(model).__module__, model.config.router_bias_update)
"""


def test_converted_folder_runs_without_kdamoe(case, tmp_path):
    """``--to kda_moe`` writes a folder that loads with transformers alone (``trust_remote_code``), as a kdamoe
    ``save_pretrained`` folder does, and gives the reference's logits."""
    name, reference, folder, _ = case
    if name != "mla-ends":
        pytest.skip("one configuration is enough for the folder's code (a fresh process costs seconds)")
    out = convert_checkpoint(folder, tmp_path / "kdamoe", to="kda_moe")
    ids = _ids(1, 12, seed=6)
    torch.save(ids, tmp_path / "ids.pt")
    script = REMOTE_SCRIPT.format(repo=str(Path(__file__).resolve().parent.parent), folder=str(out),
                                  ids=str(tmp_path / "ids.pt"), out=str(tmp_path / "out.pt"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "transformers_modules" in result.stdout and result.stdout.strip().endswith("none"), result.stdout
    with torch.no_grad():
        assert _relative(reference(ids).logits, torch.load(tmp_path / "out.pt")) <= TOLERANCE


def test_tensor_map_takes_pieces_in_any_order(case):
    """The streaming map gives the same tensors whatever order (and shard) the per-expert pieces come in."""
    _, _, folder, model = case
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        pairs = [(k, f.get_tensor(k)) for k in f.keys()]
    random.Random(0).shuffle(pairs)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    got = dict(kimi_linear_to_kdamoe_tensors(pairs, model.config, expected))
    for key, value in model.state_dict().items():
        assert torch.equal(value, got[key]), key


def _pairs(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_strict_load_names_the_bad_tensor(case, tmp_path):
    _, _, folder, model = case
    expected = {k: v.shape for k, v in model.state_dict().items()}
    tensors = _pairs(folder)
    layer = next(i for i, t in enumerate(model.config.mlp_layer_types) if t == "sparse")
    piece = f"model.layers.{layer}.block_sparse_moe.experts.3.w3.weight"

    missing = {k: v for k, v in tensors.items() if k != piece}
    with pytest.raises(ValueError, match=rf"{piece.replace('.', '[.]')}"):
        list(kimi_linear_to_kdamoe_tensors(missing.items(), model.config, expected))
    missing = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing model[.]norm[.]weight"):
        list(kimi_linear_to_kdamoe_tensors(missing.items(), model.config, expected))
    extra = dict(tensors, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    with pytest.raises(ValueError, match=r"unexpected tensor model[.]layers[.]0[.]self_attn[.]rotary_emb[.]inv_freq"):
        list(kimi_linear_to_kdamoe_tensors(extra.items(), model.config, expected))
    wrong = dict(tensors)
    wrong[piece] = torch.zeros(wrong[piece].shape[0] + 1, wrong[piece].shape[1])
    with pytest.raises(ValueError, match=rf"{piece.replace('.', '[.]')}: shape \[25, 32\], expected \[24, 32\]"):
        list(kimi_linear_to_kdamoe_tensors(wrong.items(), model.config, expected))
    twice = dict(tensors)
    dense = next(i for i, t in enumerate(model.config.mlp_layer_types) if t == "dense")
    stored = next(k for k in tensors if k.startswith(f"model.layers.{dense}.") and k.endswith("up_proj.weight"))
    other = (stored.replace(".block_sparse_moe.", ".mlp.") if ".block_sparse_moe." in stored
             else stored.replace(".mlp.", ".block_sparse_moe."))
    twice[other] = tensors[stored]  # the dense MLP's tensor under both of its names
    with pytest.raises(ValueError, match="stored twice"):
        list(kimi_linear_to_kdamoe_tensors(twice.items(), model.config, expected))
    wrong = dict(tensors, **{"lm_head.weight": torch.zeros(96, 32)})
    with pytest.raises(ValueError, match=r"lm_head[.]weight: shape \[96, 32\], expected \[97, 32\]"):
        list(kimi_linear_to_kdamoe_tensors(wrong.items(), model.config, expected))
    # the same through from_pretrained of a folder
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    from safetensors.torch import save_file  # noqa: PLC0415

    save_file({k: v for k, v in tensors.items() if k != piece}, str(bad / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{piece.replace('.', '[.]')}"):
        KDAMoEForCausalLM.from_pretrained(bad)
    # the jobs' folder check (kdamoe.common.folders) reads the headers only, through the same map
    check_model_folder(folder)
    with pytest.raises(ValueError, match=rf"{piece.replace('.', '[.]')}"):
        check_model_folder(bad)


def test_loading_options(case):
    _, reference, folder, _ = case
    model = KDAMoEForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, router_bias_update="quantile")
    assert model.config.router_bias_update == "quantile"
    dtypes = {name: p.dtype for name, p in model.state_dict().items()}
    kept = [n for n in dtypes if n.endswith(("dt_bias", "A_log", "e_score_correction_bias", ".mlp.gate.weight"))]
    assert kept and all(dtypes[n] == torch.float32 for n in kept)
    assert all(dtypes[n] == torch.bfloat16 for n in dtypes if n not in kept)
    with pytest.raises(ValueError, match="device_map='auto'"):
        KDAMoEForCausalLM.from_pretrained(folder, device_map="auto")
    with pytest.raises(ValueError, match="output_hidden_state"):
        KDAMoEForCausalLM.from_pretrained(folder, output_hidden_state=True)


def test_a_loaded_release_trains_with_frozen_router_biases(case):
    """One training step on a loaded release: the routers' biases stay as released under the default rule
    (``router_bias_update="none"``) and move only when a rule is asked for."""
    _, reference, folder, _ = case
    # (transformers' KimiLinearForCausalLM names its modules as kdamoe does: `mlp.gate.e_score_correction_bias`)
    released = {k: v.clone() for k, v in reference.state_dict().items() if k.endswith("e_score_correction_bias")}
    assert released
    for rule, moves in (("none", False), ("quantile", True)):
        model = KDAMoEForCausalLM.from_pretrained(folder, router_bias_update=rule).train()
        ids = _ids(2, 16, seed=4)
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.optim.SGD(model.parameters(), lr=1e-3).step()
        model.update_router_biases()
        biases = {k: v for k, v in model.state_dict().items() if k.endswith("e_score_correction_bias")}
        assert sorted(biases) == sorted(released)
        changed = any(not torch.equal(biases[k], released[k]) for k in released)
        assert changed == moves, rule


@pytest.mark.parametrize("field, value, message", [
    ("num_expert_group", 2, "num_expert_group"),
    ("moe_renormalize", False, "moe_renormalize"),
    ("attention_bias", True, "attention_bias"),
    ("num_key_value_heads", 1, "num_key_value_heads"),
    ("mla_use_nope", False, "mla_use_nope"),
    ("num_nextn_predict_layers", 1, "num_nextn_predict_layers"),
])
def test_refuses_kimi_configs_kdamoe_cannot_represent(field, value, message):
    raw = dict(CONFIGS["kda-ends"], **{field: value})
    with pytest.raises(ValueError, match=message):
        kimi_linear_to_kdamoe_config(raw)


def test_refuses_to_export_kdamoe_options_kimi_linear_lacks(tmp_path):
    config = KDAMoEConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16,
                          kda_num_heads=2, kda_head_dim=16, num_experts=4, moe_intermediate_size=16,
                          moe_latent_size=8, intermediate_size=32, kernel_backend="torch", rms_norm_eps=1e-5)
    with pytest.raises(ValueError) as err:
        kdamoe_to_kimi_linear_config(config)
    for field in ("moe_latent_size", "attnres_num_blocks", "hidden_act", "kda_lower_bound", "kda_output_gate_bias",
                  "mla_rms_norm_eps"):
        assert field in str(err.value)
    KDAMoEForCausalLM(config).save_pretrained(tmp_path / "src")
    with pytest.raises(SystemExit) as exit_:
        convert_main([str(tmp_path / "src"), str(tmp_path / "out"), "--to", "kimi_linear"])
    assert exit_.value.code == 2
    assert not (tmp_path / "out").exists()


def test_export_without_A_log_writes_zeros():
    """``kda_use_A_log=False`` is Kimi Linear's gate with ``A_log = 0`` (``exp(0) = 1``)."""
    config = KDAMoEConfig(**kimi_linear_to_kdamoe_config(dict(CONFIGS["kda-ends"])))
    config.kda_use_A_log = False
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(config)
    out = dict(kdamoe_to_kimi_linear_tensors(model.state_dict().items(), config))
    assert torch.equal(out["model.layers.0.self_attn.A_log"], torch.zeros(1, 1, 2, 1))


def test_export_of_a_tied_head_writes_it_out(tmp_path):
    """transformers' Kimi Linear class never ties its head: a tied kdamoe model is exported with the head as its own
    tensor (and ``tie_word_embeddings: false``), and gives the same logits there."""
    config = KDAMoEConfig(**dict(kimi_linear_to_kdamoe_config(dict(CONFIGS["kda-ends"])), tie_word_embeddings=True))
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "tied")
    out = convert_checkpoint(tmp_path / "tied", tmp_path / "kimi", to="kimi_linear")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    back = KimiLinearForCausalLM.from_pretrained(out).eval()
    assert torch.equal(back.lm_head.weight, model.model.embed_tokens.weight)
    ids = _ids(1, 10, seed=5)
    with torch.no_grad():
        assert _relative(back(ids).logits, model(ids).logits) <= TOLERANCE


def test_converter_refuses_non_empty_destination(case, tmp_path):
    _, _, folder, _ = case
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exit_:
        convert_main([str(folder), str(dst), "--to", "kda_moe"])
    assert exit_.value.code == 2
    assert (dst / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="converts from 'kda_moe'"):
        convert_checkpoint(folder, tmp_path / "other", to="kimi_linear")


def _released_parameter_count(c: dict) -> int:
    """The parameter count of the released architecture, from its config alone (the layer formulas)."""
    d, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    lin = c["linear_attn_config"]
    H, K, W = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    HK = H * K
    kda = 3 * d * HK + 3 * HK * W + d * K + K * HK + HK + H + d * H + d * K + K * HK + K + HK * d
    heads, nope, rope, v, R = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                               c["v_head_dim"], c["kv_lora_rank"])
    mla = d * heads * (nope + rope) + d * (R + rope) + R + R * heads * (nope + v) + heads * v * d
    E, inter = c["num_experts"], c["moe_intermediate_size"]
    moe = E * d + E * 3 * inter * d + c["num_shared_experts"] * 3 * inter * d
    dense = 3 * d * c["intermediate_size"]
    k = c["first_k_dense_replace"]
    mixers = len(lin["kda_layers"]) * kda + len(lin["full_attn_layers"]) * mla
    return 2 * V * d + d + L * 2 * d + mixers + k * dense + (L - k) * moe


def test_released_config_translates_with_the_released_parameter_count():
    raw = json.loads(FIXTURE.read_text())
    kwargs = kimi_linear_to_kdamoe_config(raw)
    assert kwargs["router_bias_update"] == "none" and kwargs["kda_lower_bound"] is None
    config = KDAMoEConfig(**kwargs)
    assert config.layer_types.count("full_attention") == 7 and config.layer_types[26] == "full_attention"
    assert config.qk_head_dim == 192 and config.qk_rope_head_dim == 64 and config.num_experts == 256
    with torch.device("meta"):
        ours = KDAMoEForCausalLM(config)
        theirs = KimiLinearForCausalLM(KimiLinearConfig.from_dict(raw))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == _released_parameter_count(raw)
    assert count == 49_122_675_072
    # the exported config describes the same model again
    back = kdamoe_to_kimi_linear_config(config)
    assert KDAMoEConfig(**kimi_linear_to_kdamoe_config(back)).to_diff_dict() == config.to_diff_dict()


def test_converted_card_names_its_format_and_keeps_the_source_facts(case, tmp_path):
    """A card copied by a conversion keeps its license and other tags, swaps its format tags for the target's and
    says it was converted (a kdamoe card exported to Kimi Linear would otherwise advertise kdamoe's remote code)."""
    _, _, folder, model = case
    src = tmp_path / "kimi"
    shutil.copytree(folder, src)
    (src / "README.md").write_text("---\nlicense: mit\ntags:\n- custom_code\n- chat\n---\n\n# A release\n\nUse it.\n")
    kd = convert_checkpoint(src, tmp_path / "kd", to="kda_moe")
    card = ModelCard.load(kd / "README.md")
    assert card.data.license == "mit"
    assert sorted(card.data.tags) == ["chat", "custom_code", "kda_moe"]
    assert card.text.startswith("> Converted from the `kimi_linear` checkpoint format to `kda_moe`")
    assert "# A release" in card.text
    back = convert_checkpoint(kd, tmp_path / "back", to="kimi_linear")
    card = ModelCard.load(back / "README.md")
    assert sorted(card.data.tags) == ["chat", "kimi_linear"]
    assert card.text.startswith("> Converted from the `kda_moe` checkpoint format to `kimi_linear`")
