"""The shipped recipes on a converted Kimi K3 checkpoint with Kimi's tokenizer and chat format: one SFT step and one
GRPO step (environment mode, Kimi tool calls), through :func:`run_recipe`.

The base folder: a tiny random K3-shaped kdamoe model (every K3 option on) exported to K3's released layout with
``kdamoe.conversion.convert_checkpoint(..., to="kimi_k3")`` (MXFP4 experts), the Kimi tokenizer saved beside it, and
that K3 folder converted back with ``to="kda_moe"``, which decodes the experts and carries the tokenizer over. The
steps and their checks are those of ``tests/test_posttrain_kimi.py`` (run here on this folder): the step ran, the
weights moved, Kimi's tool calls were parsed and executed, ``final/`` keeps the tokenizer and ends turns at
``<|im_end|>``.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kdamoe import KDAMoEForCausalLM
from kdamoe.conversion import convert_checkpoint
from kdamoe.posttraining import load_posttrain_config, run_recipe
from tests.helpers import tiny_config
from tests.test_posttrain_kimi import FAST, TOKENIZER_FILES, _ids, kimi_tokenizer  # noqa: F401 (a fixture)
from tests.test_posttrain_kimi import test_grpo_step_parses_kimi_tool_calls as _grpo_step
from tests.test_posttrain_kimi import test_sft_step_on_the_folders_own_kimi_tokenizer as _sft_step

K3_TINY = dict(kda_full_rank_output_gate=True, mla_output_gate=True, latent_moe_routed_scaling=True,
               routed_scaling_factor=2.5, kda_use_A_log=True, kda_head_dim=16, q_lora_rank=16, qk_head_dim=24,
               qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-5, mla_rms_norm_eps=1e-6, num_shared_experts=2,
               moe_intermediate_size=32, moe_latent_size=32, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def k3_folder(tmp_path_factory, kimi_tokenizer):  # noqa: F811 (the imported fixture)
    """A tiny K3-shaped model in K3's released layout (MXFP4 experts) with the Kimi tokenizer."""
    root = tmp_path_factory.mktemp("k3_folder")
    torch.manual_seed(0)
    KDAMoEForCausalLM(tiny_config(**_ids(kimi_tokenizer), **K3_TINY)).save_pretrained(root / "trained")
    k3 = convert_checkpoint(root / "trained", root / "k3", to="kimi_k3")
    kimi_tokenizer.save_pretrained(k3)
    with safe_open(str(k3 / "model.safetensors"), "pt") as f:
        assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in f.keys()
    assert json.loads((k3 / "config.json").read_text())["model_type"] == "kimi_k3"
    return k3


@pytest.fixture(scope="module")
def k3_base(tmp_path_factory, k3_folder):
    """That K3 folder converted to a kdamoe folder."""
    k3 = k3_folder
    base = convert_checkpoint(k3, tmp_path_factory.mktemp("k3_base") / "base", to="kda_moe")
    for name in TOKENIZER_FILES:
        assert (base / name).read_bytes() == (k3 / name).read_bytes(), name
    return base


def test_sft_step_on_a_converted_k3_and_its_export_to_k3(k3_base, tmp_path, kimi_tokenizer):  # noqa: F811
    _sft_step(k3_base, tmp_path, kimi_tokenizer)
    # the fine-tuned folder goes back to K3's layout, its tokenizer with it
    k3 = convert_checkpoint(tmp_path / "sft" / "final", tmp_path / "sft-k3", to="kimi_k3")
    assert (k3 / "tokenizer.json").read_bytes() == (k3_base / "tokenizer.json").read_bytes()
    with safe_open(str(k3 / "model.safetensors"), "pt") as f:
        assert f.get_tensor("language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_scale").dtype == \
            torch.uint8


def test_grpo_step_on_a_converted_k3_parses_kimi_tool_calls(k3_base, tmp_path, kimi_tokenizer,  # noqa: F811
                                                            monkeypatch):
    _grpo_step(k3_base, tmp_path, kimi_tokenizer, monkeypatch)


def test_sft_step_straight_from_the_k3_folder(k3_folder, tmp_path):
    """``model=`` a K3 folder: checked through the K3 map (``check_model_folder``), loaded by ``from_pretrained``'s K3
    path, trained one step, saved as a kdamoe folder."""
    cfg = load_posttrain_config("sft", [f"model={k3_folder}", f"output_dir={tmp_path / 'sft'}", *FAST])
    result = run_recipe(cfg)
    assert result["global_step"] == 1
    before = KDAMoEForCausalLM.from_pretrained(str(k3_folder)).state_dict()
    after = load_file(str(Path(result["final"]) / "model.safetensors"))
    assert json.loads((Path(result["final"]) / "config.json").read_text())["model_type"] == "kda_moe"
    assert max((after[n] - before[n].float()).abs().max().item() for n in after) > 0
