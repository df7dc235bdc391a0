"""Run configuration: shipped files load, overrides apply, bad values name their field."""

import inspect

import pytest

from kdamoe import KDAMoEConfig
from kdamoe.training.config import CONFIG_DIR, load_config, resolve_config_path


@pytest.mark.parametrize("name", ["cpu_default.yaml", "gpu_h200.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(name)
    assert cfg.train.stages and cfg.model
    lengths = [s.seq_len for s in cfg.train.stages]
    assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)  # a growing context schedule


def test_default_and_overrides():
    assert resolve_config_path(None) == CONFIG_DIR / "cpu_default.yaml"
    cfg = load_config(None, ["train.stages.1.steps=17", "model.hidden_size=64", "seed=3", "train.stages.0.lr=1e-4"])
    assert cfg.train.stages[1].steps == 17 and cfg.model["hidden_size"] == 64 and cfg.seed == 3
    assert cfg.train.stages[0].lr == pytest.approx(1e-4)


@pytest.mark.parametrize("override, field", [
    ("train.stages.0.seq_len=1", "train.stages[0].seq_len"),
    ("train.stages.0.warmup_steps=100000", "train.stages[0].warmup_steps"),
    ("train.grad_accum_steps=0", "train.grad_accum_steps"),
    ("data.source=web", "data.source"),
    ("train.mixed_precision=fp8", "train.mixed_precision"),
    ("train.bogus=1", "train.bogus"),
    ("eval.seq_len=abc", "eval.seq_len"),
    ("monitor.load_imbalance_threshold=0.5", "monitor.load_imbalance_threshold"),
    ("train.stages=[]", "train.stages"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [override])


def test_missing_file_and_bad_override():
    with pytest.raises(ValueError, match="no such file"):
        load_config("nope.yaml")
    with pytest.raises(ValueError, match="key=value"):
        load_config(None, ["train.stages"])
    with pytest.raises(ValueError, match="no list item"):
        load_config(None, ["train.stages.9.steps=1"])


@pytest.mark.parametrize("name", ["cpu_default.yaml", "gpu_h200.yaml"])
def test_shipped_model_sections_are_valid_kdamoe_configs(name):
    cfg = load_config(name)
    model_cfg = KDAMoEConfig(**cfg.model, vocab_size=cfg.tokenizer.vocab_size)
    assert model_cfg.num_experts_per_tok < model_cfg.num_experts
    for key, value in cfg.model.items():
        assert getattr(model_cfg, key) == value, key


def test_bad_model_section_fails_at_config_time():
    with pytest.raises(ValueError, match="config field model: `kda_lower_bound`"):
        load_config(None, ["model.kda_lower_bound=-7"])


@pytest.mark.parametrize("override, message", [
    ("model.num_expert=4", r"model\.num_expert: unknown KDAMoEConfig field; did you mean num_experts\?"),
    ("model.hiden_size=64", r"model\.hiden_size: unknown KDAMoEConfig field; did you mean hidden_size\?"),
    ("model.zzzz=1", r"model\.zzzz: unknown KDAMoEConfig field; known fields: vocab_size, hidden_size"),
    ("model.vocab_size=100", r"model\.vocab_size: set from the tokenizer"),
])
def test_unknown_model_key_is_rejected_at_config_time(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_every_shipped_model_key_is_a_kdamoe_config_argument():

    documented = set(inspect.signature(KDAMoEConfig.__init__).parameters) - {"self", "kwargs"}
    for name in ("cpu_default.yaml", "gpu_h200.yaml"):
        assert set(load_config(name).model) <= documented, name


def test_model_section_reads_yaml_exponent_floats():
    # YAML 1.1 reads 1e-5 (no dot) as the string "1e-5"; a shipped YAML or an override may write it so
    cfg = load_config(None, ["model.rms_norm_eps=1e-5"])
    assert cfg.model["rms_norm_eps"] == 1e-5
