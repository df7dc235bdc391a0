"""User mistakes in the command-line tools: exit 2 with one line naming the field or path, nothing written."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kdamoe import KDAMoEForCausalLM, hub
from kdamoe.cli import generate_main, posttrain_main, push_main, train_main
from kdamoe.common.cards import render_model_card
from kdamoe.common.folders import write_model_folder
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


def test_generate_refuses_a_folder_without_tokenizer_files(tmp_path, capsys):
    """Before: a 30-line traceback from transformers ("install sentencepiece or tiktoken")."""
    folder = tmp_path / "model"
    KDAMoEForCausalLM(tiny_config()).save_pretrained(folder)
    line = _usage_error(generate_main, ["--model", str(folder), "--prompt", "x", "--device", "cpu"], capsys)
    assert f"--model {folder}: no tokenizer_config.json there" in line


def test_a_failed_upload_is_one_line(tmp_path, capsys, monkeypatch):
    """Before: kdamoe-push offline (or without a token) ended in the HTTP client's traceback."""
    def offline(*args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    base = tmp_path / "base"
    KDAMoEForCausalLM(tiny_config()).save_pretrained(base)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(base)
    monkeypatch.setattr(hub, "upload_hub_folder", offline)
    monkeypatch.setattr(hub, "validate_hub_folder", lambda *a, **k: None)  # the kdamoe-free reload: test_hub's
    line = _usage_error(push_main, [str(base), "me/kdamoe-x"], capsys)
    assert "upload to me/kdamoe-x failed (OSError: [Errno -2] Name or service not known); check `hf auth login`" in line


def test_a_published_tokenizer_config_holds_no_loading_arguments(tmp_path):
    """transformers 5.25 wrote is_local / local_files_only into a re-saved tokenizer's config (seen in a re-exported
    final/)."""
    source = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)  # loaded from disk, as kdamoe-train's export does
    model = KDAMoEForCausalLM(tiny_config())
    write_model_folder(model, tokenizer, tmp_path / "out", render_model_card(model.config, repo_id="me/x", total=1,
                                                                            active=1))
    saved = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert "is_local" not in saved and "local_files_only" not in saved
    assert saved["model_max_length"] == model.config.max_position_embeddings
