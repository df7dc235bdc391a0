"""Kimi K3 checkpoints a user may hand to the loader that are wrong in ways the strict name / shape map does not see:
MXFP4 scale bytes that decode to NaN or infinity, config values of the wrong type, a ``quantization_config`` of
another scheme, a folder of another model type. Each is refused with a ``ValueError`` naming the bad value, before a
model with NaN weights (and NaN logits) or a traceback from deep inside torch / transformers comes out.

The checkpoint is ``tests/fixtures/k3_tiny`` (``tests/test_kimi_k3_checkpoints.py`` says what it is), altered here
in a temporary copy.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kdamoe import KDAMoEForCausalLM
from kdamoe.conversion import convert_checkpoint
from kdamoe.model.kimi_k3_format import kimi_k3_to_kdamoe_config

FIXTURE = Path(__file__).parent / "fixtures" / "k3_tiny"
EXPERT = "language_model.model.layers.2.block_sparse_moe.experts.5.w3"


@pytest.fixture(scope="module")
def fixture_tensors():
    return load_file(str(FIXTURE / "model.safetensors"))


@pytest.fixture(scope="module")
def fixture_config():
    return json.loads((FIXTURE / "config.json").read_text())


def _folder(tmp_path: Path, tensors: dict, config: dict | None = None) -> Path:
    folder = tmp_path / "k3"
    shutil.copytree(FIXTURE, folder)
    save_file(tensors, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def _with_byte(tensors: dict, name: str, row: int, col: int, value: int) -> dict:
    changed = tensors[name].clone()
    changed[row, col] = value
    return {**tensors, name: changed}


def test_an_e8m0_nan_scale_byte_is_refused_naming_the_block(tmp_path, fixture_tensors):
    """Scale byte 255 is E8M0's NaN (OCP MX v1.0 §5.4): decoded, its 32 weights are NaN and so is every logit of a
    token routed to the expert. Loading and converting refuse it, naming the tensor and the block."""
    folder = _folder(tmp_path, _with_byte(fixture_tensors, EXPERT + ".weight_scale", 7, 0, 255))
    match = rf"{EXPERT}\.weight_scale\[7, 0\] is 255"
    with pytest.raises(ValueError, match=match):
        KDAMoEForCausalLM.from_pretrained(str(folder))
    with pytest.raises(ValueError, match=match):
        convert_checkpoint(folder, tmp_path / "out", to="kda_moe")
    assert not (tmp_path / "out").exists()


def test_a_block_beyond_the_dtypes_range_is_refused(tmp_path, fixture_tensors):
    """Scale byte 254 is 2^127; an element of magnitude 6 there is 6 · 2^127 ≈ 1.0e39, above float32's and
    bfloat16's largest finite value (≈ 3.4e38): it decodes to inf. The byte 0x77 holds two such elements."""
    tensors = _with_byte(fixture_tensors, EXPERT + ".weight_scale", 3, 0, 254)
    tensors = _with_byte(tensors, EXPERT + ".weight_packed", 3, 0, 0x77)
    folder = _folder(tmp_path, tensors)
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match=rf"{EXPERT}: decodes to inf at \[3, 0\]"):
            KDAMoEForCausalLM.from_pretrained(str(folder), dtype=dtype)
    # in float64 the block is finite (6 · 2^127 < 1.8e308), so the model loads
    loaded = KDAMoEForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
    assert loaded.model.layers[2].mlp.experts.gate_up_proj[5, 32 + 3, 0].item() == 6.0 * 2.0**127


@pytest.mark.parametrize(("field", "value", "match"), [
    ("num_hidden_layers", "5", r"text_config\.num_hidden_layers is '5'"),
    ("num_hidden_layers", True, r"text_config\.num_hidden_layers is True"),
    ("first_k_dense_replace", "1", r"text_config\.first_k_dense_replace is '1'"),
    ("qk_rope_head_dim", "8", r"text_config\.qk_rope_head_dim is '8'"),
    ("qk_nope_head_dim", 16.0, r"text_config\.qk_nope_head_dim is 16\.0"),
    ("dtype", "bf16", r"text_config\.dtype is 'bf16'"),
    ("dtype", "int8", r"text_config\.dtype is 'int8'"),
])
def test_text_config_values_of_the_wrong_type_are_refused_naming_the_field(fixture_config, field, value, match):
    bad = {**fixture_config, "text_config": {**fixture_config["text_config"], field: value}}
    with pytest.raises(ValueError, match=match):
        kimi_k3_to_kdamoe_config(bad)


@pytest.mark.parametrize("value", ["4,5", [4.0, 5], ["4", "5"], 4])
def test_layer_lists_that_are_not_lists_of_layer_numbers_are_refused(fixture_config, value):
    text = fixture_config["text_config"]
    bad = {**fixture_config, "text_config": {
        **text, "linear_attn_config": {**text["linear_attn_config"], "full_attn_layers": value}}}
    with pytest.raises(ValueError, match=r"text_config\.linear_attn_config\.full_attn_layers is "):
        kimi_k3_to_kdamoe_config(bad)


def test_a_quantization_config_of_another_scheme_is_refused(fixture_config):
    """The loader decodes MXFP4 (compressed-tensors' naming) only; a config naming another scheme (its tensors
    would be read as something they are not, had they the same names) is refused naming the scheme."""
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method is 'fp8'"):
        kimi_k3_to_kdamoe_config({**fixture_config, "quantization_config": fp8})
    awq = {"quant_method": "awq", "bits": 4}
    with pytest.raises(ValueError, match=r"text_config\.quantization_config\.quant_method is 'awq'"):
        kimi_k3_to_kdamoe_config({**fixture_config, "text_config": {**fixture_config["text_config"],
                                                                    "quantization_config": awq}})
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"format": "pack-quantized", "targets": ["Linear"]}}}
    with pytest.raises(ValueError, match=r"quantization_config\.format is 'pack-quantized'"):
        kimi_k3_to_kdamoe_config({**fixture_config, "quantization_config": int4})
    with pytest.raises(ValueError, match=r"quantization_config is 'mxfp4'"):
        kimi_k3_to_kdamoe_config({**fixture_config, "quantization_config": "mxfp4"})
    # compressed-tensors' MXFP4, at the top or in a group (a mixed-precision config names it per group), is read
    plain = kimi_k3_to_kdamoe_config(fixture_config)
    for mxfp4 in ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
                  {"quant_method": "compressed-tensors", "format": "mixed-precision",
                   "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"]}}}):
        assert kimi_k3_to_kdamoe_config({**fixture_config, "quantization_config": mxfp4}) == plain


@pytest.mark.parametrize("model_type", ["kimi_vl", "Kimi_K3", None])
def test_from_pretrained_of_a_folder_of_another_model_type_names_it(tmp_path, fixture_tensors, fixture_config,
                                                                   model_type):
    """A multimodal Kimi folder of another type (or a typo) used to fail inside transformers' config code with an
    AttributeError; it is a ValueError naming the model type the folder's config.json gives."""
    config = {k: v for k, v in fixture_config.items() if k != "model_type"}
    if model_type is not None:
        config["model_type"] = model_type
    folder = _folder(tmp_path, fixture_tensors, config)
    with pytest.raises(ValueError, match=rf"model_type is {model_type!r}"):
        KDAMoEForCausalLM.from_pretrained(str(folder))


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_training(tmp_path):
    """The fixture's vocabulary has 256 ids; a Kimi-style tokenizer saved beside it has 300 + 256. The recipe used
    to build its data and stop at the first step on an id past the embedding (``input_ids contains 417``)."""
    from kdamoe.posttraining.config import load_posttrain_config  # noqa: PLC0415 (only this test needs TRL)
    from kdamoe.posttraining.run import load_base  # noqa: PLC0415
    from tests.kimi_tokenizer import build_kimi_tokenizer  # noqa: PLC0415

    folder = tmp_path / "k3"
    shutil.copytree(FIXTURE, folder)
    tokenizer = build_kimi_tokenizer(["the key is under the mat", "add 3 and 4"], base_vocab_size=300)
    tokenizer.save_pretrained(folder)
    assert len(tokenizer) > 256
    cfg = load_posttrain_config("sft", [f"model={folder}", f"output_dir={tmp_path / 'sft'}"])
    match = rf"tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size 256"
    with pytest.raises(ValueError, match=match):
        load_base(cfg)


def test_a_config_json_that_is_not_an_object_is_refused(tmp_path, fixture_tensors):
    """Valid JSON that is not an object (a string here) used to give an AttributeError in the converter ('str' object
    has no attribute 'get') and a TypeError inside transformers in ``from_pretrained``."""
    folder = _folder(tmp_path, fixture_tensors)
    (folder / "config.json").write_text('"kimi_k3"')
    with pytest.raises(ValueError, match=r"config\.json holds str 'kimi_k3', not a JSON object"):
        KDAMoEForCausalLM.from_pretrained(str(folder))
    with pytest.raises(ValueError, match=r"config\.json holds str 'kimi_k3', not a JSON object"):
        convert_checkpoint(folder, tmp_path / "out", to="kda_moe")
