"""End to end on a tiny model: staged training, bitwise resume on CPU, the exported folder, monitoring output."""

import json
import random
import shutil

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoTokenizer

from kdamoe.cli import generate_main, train_main
from kdamoe.common.checkpoint import MANIFEST, verify_checkpoint, write_manifest
from kdamoe.posttraining import load_posttrain_config, run_recipe
from kdamoe.training import load_config, run
from kdamoe.training.export import reload_model
from kdamoe.training.trainer import check_same_run

WORDS = ("to be or not that is the question whether tis nobler in mind suffer slings and arrows of outrageous "
         "fortune take arms against a sea troubles by opposing end them die sleep no more").split()


def _write_corpus(folder):
    rng = random.Random(0)
    folder.mkdir()
    for i in range(6):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 12))) for _ in range(40)]
        (folder / f"doc{i}.txt").write_text("\n".join(lines))


def _config(tmp_path, out, **train):
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        _write_corpus(corpus)
    data = {
        "output_dir": str(tmp_path / out),
        "seed": 1,
        "model": dict(hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                      num_attention_heads=2, kv_lora_rank=16, kda_num_heads=2, kda_chunk_size=16, num_experts=4,
                      num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=32, moe_latent_size=16,
                      first_k_dense_replace=0, intermediate_size=64, attnres_num_blocks=2, kernel_backend="torch"),
        "data": {"source": "files", "files": [str(corpus)], "val_documents": ["doc5"]},
        "tokenizer": {"vocab_size": 300},
        "train": {"stages": [
            {"name": "short", "seq_len": 16, "batch_size": 2, "steps": 3, "lr": 3e-3, "warmup_steps": 1},
            {"name": "long", "seq_len": 32, "batch_size": 2, "steps": 4, "lr": 2e-3, "warmup_steps": 1}],
            "grad_accum_steps": 2, "checkpoint_every": 2, "log_every": 1, **train},
        "eval": {"seq_len": 32, "max_rows": 2, "batch_size": 2},
        "monitor": {"histogram_every": 1},
        "generate": {"prompts": ["to be"], "max_new_tokens": 4},
    }
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("run")
    summary = run(_config(tmp_path, "full"), resume=False)
    return tmp_path, summary


# at a stage boundary; mid-stage, two steps to go (LR schedule state matters)
@pytest.mark.parametrize("stop_after", [3, 5])
def test_resume_reproduces_losses_bitwise(uninterrupted, stop_after):
    tmp_path, full = uninterrupted
    assert full["finished"] and [s for s, _ in full["losses"]] == list(range(1, 8))

    cfg = _config(tmp_path, f"killed{stop_after}")
    first = run(cfg, resume=False, stop_after_steps=stop_after)
    assert not first["finished"] and len(first["losses"]) == stop_after
    resumed = run(_config(tmp_path, f"killed{stop_after}"), resume=True)  # fresh objects, from disk
    assert resumed["finished"]
    assert resumed["losses"] == full["losses"]  # exact float equality, every step
    assert resumed["after"] == full["after"]


def test_outputs_of_a_finished_run(uninterrupted):

    tmp_path, full = uninterrupted
    out = tmp_path / "full"
    final = out / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["kernel_backend"] == "auto"  # trained with torch forced, shipped to pick its own
    assert config["model_type"] == "kda_moe" and "AutoModelForCausalLM" in config["auto_map"]
    for name in ["model.safetensors", "generation_config.json", "modeling_kdamoe.py", "tokenizer.json",
                 "tokenizer_config.json", "README.md"]:
        assert (final / name).exists(), name
    card = (final / "README.md").read_text()
    assert "custom_code" in card and f"{full['after']['ppl']:.2f}" in card
    assert (out / "expert_load.png").stat().st_size > 1000

    # the reloaded folder scores what the trained model scored, and the stage-end checkpoints are kept
    assert full["reloaded"] == full["after"]
    assert {p.name for p in (out / "checkpoints").iterdir()} >= {"stage0-step000003", "stage1-step000004"}
    model = reload_model(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.model_max_length == config["max_position_embeddings"] == 32  # the longest stage / eval row
    assert tok("to be")["input_ids"][0] == tok.bos_token_id == config["bos_token_id"]
    biases = [v for k, v in model.state_dict().items() if k.endswith("e_score_correction_bias")]
    assert len(biases) == 2 and all(torch.count_nonzero(b) > 0 for b in biases)  # QB biases moved and were saved

    acc = EventAccumulator(str(out / "tensorboard")).Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
            "expert_load/max_over_mean/layer0", "expert_load/max_over_mean/layer1"} <= tags
    assert "expert_load/tokens_per_expert/layer1" in acc.Tags()["histograms"]
    lr = {e.step: e.value for e in acc.Scalars("train/lr")}
    # each stage: one warmup step from 0, then its own peak and cosine decay
    assert [lr[1], lr[2], lr[3]] == pytest.approx([0.0, 3e-3, 1.5e-3])
    assert [lr[4], lr[5]] == pytest.approx([0.0, 2e-3])


def test_resume_refuses_a_changed_config_and_a_fresh_start_refuses_a_used_folder(uninterrupted, tmp_path, capsys):
    tmp, _ = uninterrupted
    changed = _config(tmp, "full")
    changed.train.stages[1].lr = 1e-3
    with pytest.raises(ValueError, match="train.stages differs"):
        check_same_run(tmp / "full", changed)
    check_same_run(tmp / "full", _config(tmp, "full"))  # same config: fine

    # Before: a fresh start deleted final/, summary.json and tokenizer/ (a user's file inside included) unasked.
    used = tmp_path / "used"
    (used / "tokenizer").mkdir(parents=True)
    (used / "tokenizer" / "my_vocab_notes.txt").write_text("kept")
    (used / "final").mkdir()
    (used / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--config", str(tmp / "full.yaml"), "--output-dir", str(used), "--no-resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "not empty and nothing to resume from" in err and "--overwrite" in err and "Traceback" not in err
    assert (used / "tokenizer" / "my_vocab_notes.txt").read_text() == "kept" and (used / "final").is_dir()
    # the pretraining run's own folder is no place for a post-training run (its final/ is the base)
    cfg = load_posttrain_config("sft", [f"model={tmp / 'full' / 'final'}", f"output_dir={tmp / 'full'}"])
    with pytest.raises(ValueError, match="lies inside output_dir"):
        run_recipe(cfg)
    other = tmp_path / "other_pretraining_run"
    other.mkdir()
    (other / "kdamoe_run.json").write_text('{"job": "pretraining"}')
    cfg = load_posttrain_config("sft", [f"model={tmp / 'full' / 'final'}", f"output_dir={other}"])
    with pytest.raises(ValueError, match="holds a pretraining run"):
        run_recipe(cfg)


def test_cli_entry_points(uninterrupted, capsys):
    tmp_path, _ = uninterrupted
    cfg_path = tmp_path / "full.yaml"
    assert train_main(["--config", str(cfg_path), "--output-dir", str(tmp_path / "cli"), "--no-resume",
                       "--stop-after", "1", "--set", "train.checkpoint_every=1"]) == 0
    assert (tmp_path / "cli" / "checkpoints" / "stage0-step000001" / "progress.json").exists()
    capsys.readouterr()

    assert generate_main(["--model", str(tmp_path / "full" / "final"), "--prompt", "to be", "--greedy",
                          "--max-new-tokens", "5", "--device", "cpu"]) == 0
    streamed = capsys.readouterr().out
    assert streamed.startswith("to be") and len(streamed) > len("to be")

    final = str(tmp_path / "full" / "final")
    bad = [(["--model", final, "--temperature", "0"], "--temperature must be"),
           (["--model", final, "--temperature", "inf"], "--temperature must be"),
           (["--model", final, "--top-k", "0"], "--top-k must be"),
           (["--model", final, "--max-new-tokens", "0"], "--max-new-tokens must be"),
           (["--model", final, "--device", "bogus"], "'bogus' is not a torch device"),
           (["--model", str(tmp_path / "missing")], "no config.json there"),
           (["--model", str(tmp_path / "full")], "the exported model is " + final)]
    for extra, message in bad:
        with pytest.raises(SystemExit):  # rejected before the model loads, naming the flag and the value
            generate_main(["--prompt", "x", *extra])
        assert message in capsys.readouterr().err, extra

    with pytest.raises(SystemExit):  # a bad field is a usage error naming it
        train_main(["--config", str(cfg_path), "--set", "train.stages.0.lr=-1"])
    assert "train.stages[0].lr" in capsys.readouterr().err


@pytest.fixture(scope="module")
def killed(uninterrupted):
    """A run killed after 5 steps: checkpoints stage0-step2 (mid), stage0-step3 (stage end), stage1-step2 (newest)."""
    tmp_path, _ = uninterrupted
    run(_config(tmp_path, "killed"), resume=False, stop_after_steps=5)
    names = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert names == ["stage0-step000002", "stage0-step000003", "stage1-step000002"]
    return tmp_path / "killed"


def _copy_run(killed, tmp_path, name):
    shutil.copytree(killed, tmp_path / name)
    return tmp_path / name / "checkpoints" / "stage1-step000002"


@pytest.mark.parametrize("damaged", ["progress.json", "model.safetensors", "optimizer.bin"])
def test_resume_skips_a_truncated_newest_checkpoint(uninterrupted, killed, capsys, damaged):
    tmp_path, full = uninterrupted
    newest = _copy_run(killed, tmp_path, f"truncated_{damaged}")
    path = newest / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    capsys.readouterr()
    resumed = run(_config(tmp_path, f"truncated_{damaged}"), resume=True)
    out = capsys.readouterr().out
    skips = [line for line in out.splitlines() if line.startswith("skipping checkpoint")]
    assert len(skips) == 1 and "stage1-step000002" in skips[0] and damaged in skips[0], out
    assert "stage0-step000003" in out  # fell back to the older, intact stage end
    assert resumed["finished"] and resumed["losses"] == full["losses"] and resumed["after"] == full["after"]


def test_resume_never_unpickles_a_planted_custom_checkpoint(uninterrupted, killed):
    tmp_path, full = uninterrupted
    newest = _copy_run(killed, tmp_path, "planted")
    marker = tmp_path / "planted_payload_ran"

    class Payload:
        def __reduce__(self):  # unpickling calls open(marker, "w"): creates the file
            return open, (str(marker), "w")

    for index in range(2):  # the files accelerate would load for registered objects
        torch.save(Payload(), newest / f"custom_checkpoint_{index}.pkl")
    write_manifest(newest)  # an attacker who can write the folder can also rewrite the manifest
    assert "custom_checkpoint_0.pkl" in verify_checkpoint(newest)
    resumed = run(_config(tmp_path, "planted"), resume=True)  # skips it, resumes from stage0-step000003
    assert not marker.exists()
    assert resumed["finished"] and resumed["losses"] == full["losses"]


def test_resume_with_no_intact_checkpoint_refuses_instead_of_starting_over(killed, tmp_path):
    shutil.copytree(killed, tmp_path / "broken")
    for folder in (tmp_path / "broken" / "checkpoints").iterdir():
        (folder / "progress.json").write_text("{")
    with pytest.raises(ValueError, match="no intact checkpoint"):
        run(_config(tmp_path, "broken"), resume=True)
    assert len(list((tmp_path / "broken" / "checkpoints").iterdir())) == 3  # nothing deleted


def test_checkpoint_writes_are_atomic(killed):
    root = killed / "checkpoints"
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    for folder in root.iterdir():
        assert verify_checkpoint(folder) is None
        manifest = json.loads((folder / MANIFEST).read_text())
        assert {"progress.json", "model.safetensors", "optimizer.bin", "random_states_0.pkl"} <= set(manifest)
        assert not any(name.startswith("custom_checkpoint") for name in manifest)
