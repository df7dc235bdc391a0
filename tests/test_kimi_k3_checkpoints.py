"""Kimi K3 checkpoints: load the released layout (MXFP4 experts), export it back, convert, and compare with an
independent K3.

The reference is ``tests/fixtures/k3_tiny``: a tiny K3-shaped checkpoint (every parameter perturbed, experts MXFP4) and
the float32 logits NeMo AutoModel 0.7.0's own K3 computed for its input ids on the CPU
(``benchmarks/k3_reference/k3_reference.py``; ``tests/test_k3_reference.py`` reruns it). The released-size parameter
count is the one NeMo's model gives on the meta device (docs/checkpoints.md, section Kimi K3).
"""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kdamoe import KDAMoEConfig, KDAMoEForCausalLM
from kdamoe.common.folders import check_model_folder
from kdamoe.conversion import convert_checkpoint
from kdamoe.model.kimi_k3_format import (
    kdamoe_to_kimi_k3_config,
    kdamoe_to_kimi_k3_tensors,
    kimi_k3_to_kdamoe_config,
    kimi_k3_to_kdamoe_tensors,
)
from kdamoe.model.mxfp4 import mxfp4_decode
from tests.helpers import tiny_config

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "k3_tiny"
RELEASED_CONFIG = FIXTURES / "kimi_k3_config.json"
# NeMo's meta-device KimiK3ForCausalLM of the released text config (docs/checkpoints.md, "Parameter count").
K3_TEXT_PARAMETERS = 2_779_484_393_568
# The bar is 1e-4 of the largest |logit|; kdamoe reaches ~1e-6 (float32, different summation orders). The
# tighter bar tells NeMo's MLA norm eps (1e-6) from sglang's (1e-5), which moves the logits by ~4e-5 of the largest.
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return load_file(str(FIXTURE / "reference.safetensors"))


@pytest.fixture(scope="module")
def fixture_tensors():
    return load_file(str(FIXTURE / "model.safetensors"))


@pytest.fixture(scope="module")
def model():
    return KDAMoEForCausalLM.from_pretrained(str(FIXTURE))


def _relative_error(model, reference) -> float:
    with torch.no_grad():
        logits = model(reference["input_ids"], use_cache=False).logits
    return ((logits - reference["logits"]).abs().max() / reference["logits"].abs().max()).item()


def test_loaded_k3_matches_nemo_k3_logits(model, reference):
    assert model.config.kda_full_rank_output_gate and model.config.mla_output_gate
    assert model.config.latent_moe_routed_scaling and model.config.routed_scaling_factor == 2.5
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"] * 2
    assert model.config.attnres_block_size == 2 and model.config.mla_rms_norm_eps == 1e-6
    assert model.model.layers[0].self_attn.A_log.shape == (4,)
    assert _relative_error(model, reference) < REL_TOL


def test_loaded_k3_decodes_and_chunks_as_its_full_forward(model, reference):
    ids = reference["input_ids"]
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :18], use_cache=True)
        steps = [out.logits]
        for t in range(18, ids.shape[1]):
            out = model(ids[:, t:t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
        chunked = model(ids, use_cache=True, prefill_chunk_size=5).logits
    scale = reference["logits"].abs().max()
    assert ((torch.cat(steps, 1) - full).abs().max() / scale) < REL_TOL
    assert ((chunked - full).abs().max() / scale) < REL_TOL


def test_export_gives_back_the_fixture_bytes(model, fixture_tensors):
    """Decoding the MXFP4 experts and encoding them again is exact: every tensor, packed bytes and scales included,
    equals the fixture's."""
    exported = dict(kdamoe_to_kimi_k3_tensors(model.state_dict().items(), model.config,
                                              {k: v.shape for k, v in model.state_dict().items()}))
    assert sorted(exported) == sorted(fixture_tensors)
    for name, want in fixture_tensors.items():
        got = exported[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name
    assert any(name.endswith("w2.weight_packed") for name in exported)


def test_export_config_round_trips_the_fixture_text_config(model):
    fixture = json.loads((FIXTURE / "config.json").read_text())
    written = kdamoe_to_kimi_k3_config(model.config)
    assert written["model_type"] == "kimi_k3" and written["routed_experts_format"] == "mxfp4"
    for key, value in written["text_config"].items():
        if key in fixture["text_config"] and key != "architectures":
            assert value == fixture["text_config"][key], key
    assert kimi_k3_to_kdamoe_config(written) == {**kimi_k3_to_kdamoe_config(fixture), "dtype": "float32"}


def test_convert_to_kdamoe_and_back_to_k3_mxfp4_and_bf16(tmp_path, fixture_tensors, reference):
    ours = convert_checkpoint(FIXTURE, tmp_path / "kdamoe", to="kda_moe")
    assert json.loads((ours / "config.json").read_text())["model_type"] == "kda_moe"
    loaded = KDAMoEForCausalLM.from_pretrained(str(ours))
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}  # experts decoded to the config's dtype
    assert _relative_error(loaded, reference) < REL_TOL
    back = convert_checkpoint(ours, tmp_path / "k3", to="kimi_k3")
    tensors = load_file(str(back / "model.safetensors"))
    assert sorted(tensors) == sorted(fixture_tensors)
    for name, want in fixture_tensors.items():
        assert tensors[name].dtype == want.dtype and torch.equal(tensors[name], want), name

    bf16 = convert_checkpoint(ours, tmp_path / "k3-bf16", to="kimi_k3", experts_format="bf16")
    config = json.loads((bf16 / "config.json").read_text())
    assert config["routed_experts_format"] == "bf16"
    tensors = load_file(str(bf16 / "model.safetensors"))
    name = "language_model.model.layers.2.block_sparse_moe.experts.5.w3"
    assert tensors[name + ".weight"].dtype == torch.bfloat16 and name + ".weight_packed" not in tensors
    want = mxfp4_decode(fixture_tensors[name + ".weight_packed"], fixture_tensors[name + ".weight_scale"])
    assert torch.equal(tensors[name + ".weight"].float(), want)
    assert _relative_error(KDAMoEForCausalLM.from_pretrained(str(bf16)), reference) < REL_TOL


def test_shards_that_split_an_experts_packed_bytes_from_its_scales_load_the_same(tmp_path, fixture_tensors,
                                                                                 reference):
    """Three shards with an index, named in an order that puts every ``weight_scale`` in a later shard than its
    ``weight_packed``: the pairs and the fused tensors are assembled across shards."""
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(FIXTURE / "config.json", folder / "config.json")
    names = sorted(fixture_tensors, key=lambda n: (n.endswith("weight_scale"), n))
    shards = [names[: len(names) // 3], names[len(names) // 3: 2 * len(names) // 3], names[2 * len(names) // 3:]]
    weight_map = {}
    for i, part in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-00003.safetensors"
        save_file({n: fixture_tensors[n] for n in part}, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    expert = "language_model.model.layers.4.block_sparse_moe.experts.7.w2"
    assert weight_map[expert + ".weight_packed"] != weight_map[expert + ".weight_scale"]
    assert _relative_error(KDAMoEForCausalLM.from_pretrained(str(folder)), reference) < REL_TOL


def test_vision_tensors_are_skipped_and_counted(tmp_path, fixture_tensors, reference, caplog):
    folder = tmp_path / "with-vision"
    shutil.copytree(FIXTURE, folder)
    vision = {"vision_tower.patch_embed.proj.weight": torch.ones(4, 3, 2, 2),
              "vision_tower.encoder.blocks.0.wqkv.weight": torch.ones(6, 4),
              "mm_projector.proj.0.weight": torch.ones(8, 8)}
    save_file({**fixture_tensors, **vision}, str(folder / "model.safetensors"))
    with caplog.at_level(logging.WARNING):
        loaded = KDAMoEForCausalLM.from_pretrained(str(folder))
    lines = [r.getMessage() for r in caplog.records if "vision tensors" in r.getMessage()]
    assert len(lines) == 1 and "skipped 3 vision tensors" in lines[0]
    assert _relative_error(loaded, reference) < REL_TOL


def test_check_model_folder_reads_a_k3_folder_by_its_headers(tmp_path, fixture_tensors):
    check_model_folder(FIXTURE)
    folder = tmp_path / "bad"
    shutil.copytree(FIXTURE, folder)
    name = "language_model.model.layers.2.block_sparse_moe.experts.1.w2"
    bad = {**fixture_tensors, name + ".weight_packed": torch.zeros(32, 32, dtype=torch.uint8),
           name + ".weight_scale": torch.zeros(32, 2, dtype=torch.uint8)}  # a valid pair, twice too wide
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}\.weight_(packed|scale): shape \[32, 64\], expected \[32, 32\]"):
        check_model_folder(folder)


def _mapped(tensors, config, model):
    expected = {k: v.shape for k, v in model.state_dict().items()}
    return dict(kimi_k3_to_kdamoe_tensors(tensors.items(), config, expected))


def test_strict_loading_names_the_tensor(fixture_tensors, model):
    config = model.config
    expert = "language_model.model.layers.1.block_sparse_moe.experts.3.w1"
    missing = {k: v for k, v in fixture_tensors.items() if k != "language_model.model.layers.3.self_attn.g_proj.weight"}
    with pytest.raises(ValueError, match=r"missing language_model\.model\.layers\.3\.self_attn\.g_proj\.weight"):
        _mapped(missing, config, model)
    lone = {k: v for k, v in fixture_tensors.items() if k != expert + ".weight_scale"}
    with pytest.raises(ValueError, match=rf"{expert}\.weight_packed has no weight_scale"):
        _mapped(lone, config, model)
    extra = {**fixture_tensors, "language_model.model.layers.0.self_attn.g_b_proj.weight": torch.ones(2, 2)}
    with pytest.raises(ValueError, match=r"unexpected tensor language_model\.model\.layers\.0\.self_attn\.g_b_proj"):
        _mapped(extra, config, model)
    wrong = {**fixture_tensors, "language_model.model.norm.weight": torch.ones(63)}
    with pytest.raises(ValueError, match=r"language_model\.model\.norm\.weight: shape \[63\]"):
        _mapped(wrong, config, model)
    outside = {**fixture_tensors, "lm_head.weight": torch.ones(2)}
    with pytest.raises(ValueError, match=r"unexpected tensor lm_head\.weight"):
        _mapped(outside, config, model)


def test_released_config_translates_to_k3s_parameter_count_and_back():
    released = json.loads(RELEASED_CONFIG.read_text())
    config = KDAMoEConfig(**kimi_k3_to_kdamoe_config(released))
    written = kdamoe_to_kimi_k3_config(config)["text_config"]  # the released keys, plus token ids and the init std
    assert {k: written[k] for k in released["text_config"]} == released["text_config"]
    assert config.attnres_block_size == 12 and config.num_hidden_layers == 93
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [*range(3, 92, 4), 92]
    with torch.device("meta"):
        model = KDAMoEForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == K3_TEXT_PARAMETERS


def test_configs_k3_cannot_represent_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="kda_full_rank_output_gate=False") as err:
        kdamoe_to_kimi_k3_config(tiny_config())
    assert "q_lora_rank=None" in str(err.value)
    with pytest.raises(ValueError, match="mla_rms_norm_eps=1e-05"):
        kdamoe_to_kimi_k3_config(KDAMoEConfig(**{**kimi_k3_to_kdamoe_config(json.loads(RELEASED_CONFIG.read_text())),
                                                 "mla_rms_norm_eps": 1e-5}))
    released = json.loads(RELEASED_CONFIG.read_text())
    for change, match in (({"attn_res_block_size": 13}, "attn_res_block_size is 13"),
                          ({"hidden_act": "silu"}, "hidden_act"),
                          ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
                          ({"linear_attn_config": {**released["text_config"]["linear_attn_config"],
                                                   "kda_layers": [1, 2]}}, "layer 3 .* neither")):
        bad = {**released, "text_config": {**released["text_config"], **change}}
        with pytest.raises(ValueError, match=match):
            kimi_k3_to_kdamoe_config(bad)
