"""KDAMoEConfig: defaults, round trip, and a clear ValueError naming each bad field."""

import json
import logging

import pytest

from kdamoe import KDAMoEConfig


def test_defaults_are_a_3_to_1_hybrid_and_round_trip(tmp_path):
    config = KDAMoEConfig(num_hidden_layers=8)
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert config.qk_head_dim == config.hidden_size // config.num_attention_heads
    config.save_pretrained(tmp_path)
    again = KDAMoEConfig.from_pretrained(tmp_path)
    assert again.to_dict() == config.to_dict()


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3), "layer_types"),
        (dict(num_hidden_layers=2, layer_types=["linear_attention", "sliding_attention"]), "layer_types[1]"),
        (dict(num_experts=8, num_experts_per_tok=8), "num_experts_per_tok"),
        (dict(num_experts=8, num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(kda_lower_bound=-6.0), "kda_lower_bound"),
        (dict(kda_lower_bound=0.0), "kda_lower_bound"),
        (dict(situ_beta=0.0), "situ_beta"),
        (dict(situ_linear_beta=-1.0), "situ_linear_beta"),
        (dict(num_hidden_layers=4, attnres_num_blocks=5), "attnres_num_blocks"),
        (dict(hidden_size=100, num_attention_heads=3), "num_attention_heads"),
        (dict(hidden_size=100, kda_num_heads=3, num_attention_heads=4), "kda_num_heads"),
        (dict(router_bias_update="aux"), "router_bias_update"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(kernel_backend="cuda"), "kernel_backend"),
        (dict(first_k_dense_replace=9, num_hidden_layers=4), "first_k_dense_replace"),
        (dict(moe_latent_size=0), "moe_latent_size"),
    ],
)
def test_bad_field_raises_naming_it(fields, name):
    with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
        KDAMoEConfig(**fields)


def test_lower_bound_edges_are_accepted():
    assert KDAMoEConfig(kda_lower_bound=-5.0).kda_lower_bound == -5.0
    assert KDAMoEConfig(kda_lower_bound=-0.5).kda_lower_bound == -0.5


def test_a_misspelt_config_json_key_warns_with_the_close_match(tmp_path, caplog):
    """transformers keeps unknown config.json keys as attributes no layer reads; a near-miss of a field must warn."""
    KDAMoEConfig(num_hidden_layers=2).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["kda_lower_bund"] = -3.0  # typo of kda_lower_bound
    data["my_dataset_note"] = "kept silently: no field is close"
    (tmp_path / "config.json").write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        config = KDAMoEConfig.from_pretrained(tmp_path)
    warned = [r.getMessage() for r in caplog.records if "is not a KDAMoEConfig field" in r.getMessage()]
    assert warned == ["config field 'kda_lower_bund' is not a KDAMoEConfig field (did you mean 'kda_lower_bound'?); "
                      "it is kept as an attribute that the model ignores"]
    assert config.kda_lower_bound == KDAMoEConfig().kda_lower_bound  # the typo did not reach the field
