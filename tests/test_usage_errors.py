"""User mistakes in the command-line tools: exit 2 with one line naming the field or path, nothing written."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from kdamoe import KDAMoEForCausalLM
from kdamoe.cli import posttrain_main, train_main
from tests.helpers import tiny_config


def _usage_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--set", "data.path=nowhere/shakespeare"], "data.path: no texts in nowhere/shakespeare; run `python "
                                                 "scripts/fetch_corpus.py"),
    (["--set", "data.source=files", "--set", "data.files=[missing.txt]"], "data.files: missing.txt does not exist"),
    (["--set", "seed=[1"], "override 'seed=[1': its value is not valid YAML at line 1, column 3"),
    (["--stop-after", "0"], "--stop-after must be >= 1"),
])
def test_train_mistakes_exit_2_before_writing(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    line = _usage_error(train_main, ["--output-dir", str(out), *argv], capsys)
    assert message in line
    assert not out.exists()  # nothing claimed, so the corrected command runs into the same folder


def test_train_refuses_a_stop_after_past_the_run_and_a_broken_config_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "play.txt").write_text("to be or not to be\n" * 50)
    monkeypatch.chdir(tmp_path)
    line = _usage_error(train_main, ["--set", "data.path=data", "--output-dir", "out", "--stop-after", "100000"],
                        capsys)
    assert "--stop-after 100000 never stops the run: it has" in line
    (tmp_path / "bad.yaml").write_text("seed: [1, 2\n")
    line = _usage_error(train_main, ["--config", "bad.yaml"], capsys)
    assert "config bad.yaml is not valid YAML at line 2, column 1" in line


def test_posttrain_refuses_a_base_without_tokenizer_before_writing(tmp_path, capsys):
    base = tmp_path / "base"
    KDAMoEForCausalLM(tiny_config()).save_pretrained(base)  # no tokenizer saved next to it
    out = tmp_path / "sft"
    line = _usage_error(posttrain_main, ["--config", "sft", "--output-dir", str(out), "--set", f"model={base}"], capsys)
    assert f"model={base}: no tokenizer_config.json there" in line
    assert not out.exists()


def test_posttrain_refuses_a_base_with_a_damaged_tensor(tmp_path, capsys):
    base = tmp_path / "base"
    KDAMoEForCausalLM(tiny_config()).save_pretrained(base)
    tensors = load_file(str(base / "model.safetensors"))
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("inf"))
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(base)
    line = _usage_error(posttrain_main, ["--config", "sft", "--output-dir", str(tmp_path / "sft"),
                                         "--set", f"model={base}"], capsys)
    assert "model.norm.weight holds NaN or inf" in line


@pytest.mark.parametrize("setting", ["trainer.per_device_train_batch_size=0", "trainer.learning_rate=-1",
                                     "trainer.learning_rate=.nan"])
def test_posttrain_trainer_values_torch_refuses_late_are_refused_when_the_config_loads(tmp_path, capsys, setting):
    """Before: these passed TRL's config and failed with a traceback from torch's optimizer / data loader."""
    line = _usage_error(posttrain_main, ["--config", "sft", "--output-dir", str(tmp_path / "sft"), "--set", setting],
                        capsys)
    assert f"config field {setting.split('=')[0]}: must be a finite number >=" in line
