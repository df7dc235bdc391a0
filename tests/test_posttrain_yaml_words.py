"""``--set trainer.save_strategy=no``: YAML 1.1 reads ``no`` as ``false``, so TRL's config class sees ``False`` and
says "False is not a valid SaveStrategy"; the error says why and how to quote the word."""

import pytest
from trl import SFTConfig

from kdamoe.posttraining import load_posttrain_config
from kdamoe.posttraining.recipes.common import trainer_args


def test_a_yaml_boolean_word_given_to_a_string_field_gets_a_hint(tmp_path):
    cfg = load_posttrain_config("sft", [f"output_dir={tmp_path}", "trainer.save_strategy=no"])
    assert cfg.trainer["save_strategy"] is False
    with pytest.raises(ValueError, match=r"not a valid SaveStrategy.*trainer\.save_strategy is False: YAML reads no"):
        trainer_args(cfg, SFTConfig)
    cfg = load_posttrain_config("sft", [f"output_dir={tmp_path}", "trainer.save_strategy='no'"])
    assert trainer_args(cfg, SFTConfig).save_strategy == "no"
