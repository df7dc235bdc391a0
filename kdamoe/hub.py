"""Hub publishing: build a Hub folder from any folder kdamoe writes, validate it without kdamoe, push it.

A **Hub folder** holds only what a user of the repository needs, and nothing that is unpickled:

* a full model: ``model.safetensors`` (or safetensors shards + index), ``config.json`` whose ``auto_map``
  names every head, the modeling files (remote code, docs/architecture.md §7), ``generation_config.json``,
  the tokenizer with its chat template, and ``README.md`` (:mod:`kdamoe.common.cards`);
* a PEFT adapter repository: ``adapter_config.json``, ``adapter_model.safetensors``, the tokenizer and a card
  naming ``base_model`` with ``base_model_relation: adapter``.

Sources (:func:`detect_source`): a pretraining ``final/`` folder (its run's ``config.yaml`` and
``summary.json`` next to it give datasets, stages and validation numbers), a pretraining checkpoint
``checkpoints/stage<i>-step<n>/`` (an accelerate ``save_state`` folder, rebuilt with the run's
``config.yaml`` and ``tokenizer/``; only its ``model.safetensors`` is read), a post-training ``final/`` (its run's
``summary.json`` records the card's values: recipe, base, data, logged curves, usage; its plots are copied), any
``save_pretrained`` / transformers or TRL trainer ``output_dir`` (``training_args.bin``, optimizer states and
``checkpoint-*`` folders are never copied; metadata of a trainer-written card is kept), and a PEFT adapter folder,
merged into its base or published as an adapter.

**Validation** (:func:`validate_hub_folder`) runs before every upload: the required files are present, no
file is a pickle, and a fresh Python process in which ``import kdamoe`` fails loads the folder with
``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`` (plus ``PeftModel`` for an adapter),
loads the tokenizer (and renders the chat template), generates, and returns logits that must match the
source model's.

**Push** (:func:`push_to_hub`): ``HfApi.create_repo`` + ``HfApi.upload_folder``; ``dry_run`` prints the
files and the card metadata and touches no network. The token is huggingface_hub's usual one
(``hf auth login`` or ``HF_TOKEN``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from huggingface_hub import HfApi, ModelCard
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers.dynamic_module_utils import get_relative_imports

from .common.cards import check_repo_id, count_parameters, pretraining_card_metadata, render_model_card
from .common.checkpoint import PROGRESS, parse_checkpoint_name
from .common.folders import (
    check_stored_weights,
    load_model_strictly,
    load_pretraining_checkpoint,
    load_run_tokenizer,
    write_model_folder,
)
from .common.run_folder import detect_job

# Files that are (or may be) pickles: never in a Hub folder, never read from a source.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
VALIDATION_ATOL = 1e-4  # float32 logits; the same weights through the same PyTorch path agree far closer
VALIDATION_RTOL = 1e-4
PROMPT_LENGTH = 12
_NETWORK_MODULES = ("huggingface_hub", "httpx", "httpx2", "httpcore", "requests", "urllib3")
GENERATE_TOKENS = 4


@dataclass
class Source:
    """What :func:`detect_source` found: the kind of folder and where its run / base lives."""

    kind: str  # "pretraining-final" | "pretraining-checkpoint" | "model" | "peft-adapter"
    path: Path
    run_dir: Path | None = None  # pretraining kinds: the run's output_dir
    base_path: str | None = None  # peft-adapter: the base model's folder or Hub id
    metadata: dict = field(default_factory=dict)  # card values found in the source


def detect_source(src: str | Path) -> Source:
    """Classify ``src`` (see the module docstring).

    Raises:
        ValueError: naming ``src`` when it is not a folder, or not one kdamoe writes (with a hint for a run
            folder, a trainer ``output_dir`` holding only ``checkpoint-*`` folders, or pickled weights).
    """
    path = Path(src).expanduser()
    if not path.is_dir():
        raise ValueError(f"SRC {src}: not a folder")
    if (path / "adapter_config.json").is_file():
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{path / 'adapter_config.json'}: no base_model_name_or_path")
        return Source("peft-adapter", path, base_path=base)
    if parse_checkpoint_name(path.name) and (path / PROGRESS).is_file():
        return Source("pretraining-checkpoint", path, run_dir=path.parent.parent)
    if (path / "config.json").is_file():
        if path.name == "final" and (path.parent / "config.yaml").is_file():
            return Source("pretraining-final", path, run_dir=path.parent)
        return Source("model", path)
    if (path / "final" / "config.json").is_file():
        kind = detect_job(path) or "training"  # a post-training run folder holds final/ too
        raise ValueError(f"SRC {src}: a {kind} run folder; pass its model, {path / 'final'}")
    trainer_checkpoints = sorted((p for p in path.glob("checkpoint-*") if (p / "config.json").is_file()),
                                 key=lambda p: int(p.name.split("-")[-1]) if p.name.split("-")[-1].isdigit() else -1)
    if trainer_checkpoints:
        raise ValueError(f"SRC {src}: no config.json at the top (the trainer did not save a final model); "
                         f"pass a checkpoint, e.g. {trainer_checkpoints[-1]}")
    raise ValueError(f"SRC {src}: not a folder kdamoe writes (no config.json, adapter_config.json or "
                     f"pretraining checkpoint {PROGRESS})")


# --------------------------------------------------------------------------------------------- loading sources


def _refuse_pickled_weights(folder: Path, safetensors_name: str) -> None:
    if not (folder / safetensors_name).is_file() and not (folder / f"{safetensors_name}.index.json").is_file():
        pickled = sorted(p.name for p in folder.iterdir()
                         if p.suffix in PICKLE_SUFFIXES and "training_args" not in p.name)
        hint = (f" (found {pickled[0]}: pickled weights are not read; re-save with safe_serialization)"
                if pickled else "")
        raise ValueError(f"{folder / safetensors_name}: missing{hint}")


def _load_kdamoe_model(folder: str | Path):
    """A ``KDAMoEForCausalLM`` from a local ``save_pretrained`` folder, with kdamoe's own classes, in the stored
    dtype."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "kda_moe":
        raise ValueError(f"{folder / 'config.json'}: model_type {config.get('model_type')!r}, not 'kda_moe'")
    arch = (config.get("architectures") or ["KDAMoEForCausalLM"])[0]
    if arch not in ("KDAMoEForCausalLM", "KDAMoEModel"):
        raise ValueError(f"{folder / 'config.json'}: architectures {arch!r}; only causal LMs are published")
    _refuse_pickled_weights(folder, "model.safetensors")
    try:
        return load_model_strictly(folder, dtype="auto").eval()
    except ValueError:
        raise
    except Exception as err:  # a truncated or foreign weights file: name it instead of a loader traceback
        raise ValueError(f"{folder / 'model.safetensors'}: the model does not load "
                         f"({type(err).__name__}: {err})") from err


def _load_tokenizer(*folders: str | Path):
    """The tokenizer of the first of ``folders`` that holds one (:func:`~kdamoe.common.folders.load_run_tokenizer`)."""
    for folder in folders:
        if folder is not None and (Path(folder) / "tokenizer_config.json").is_file():
            return load_run_tokenizer(folder)
    raise ValueError(f"no tokenizer (tokenizer_config.json) in {', '.join(str(f) for f in folders if f)}")


def _card_metadata(folder: Path) -> dict:
    """``base_model``, ``datasets`` and trainer tags of a card a trainer (e.g. TRL) wrote into ``folder``."""
    readme = folder / "README.md"
    if not readme.is_file():
        return {}
    data = ModelCard.load(readme).data
    base = data.base_model[0] if isinstance(data.base_model, list) else data.base_model
    if _is_local(base):  # e.g. PEFT's card names the local base folder; the Hub needs an id
        base = None
    out = {"base_model": base, "datasets": data.datasets,
           "extra_tags": [t for t in (data.tags or [])
                          if t in ("trl", "sft", "dpo", "grpo", "orpo", "kto", "reward-trainer")]}
    return {k: v for k, v in out.items() if v}


# ------------------------------------------------------------------------------------------------ writing


def _is_local(path: str | None) -> bool:
    return path is not None and Path(path).expanduser().exists()


def _prepare_out_dir(out_dir: str | Path, overwrite: bool) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise ValueError(f"out_dir {out_dir}: exists and is not empty (pass another --out-dir, or empty it; "
                             "the Python API takes overwrite=True)")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def _validation_ids(vocab_size: int) -> torch.Tensor:
    """``[1, PROMPT_LENGTH]`` int64 token ids, fixed seed, away from the lowest (special) ids."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(min(8, vocab_size - 1), vocab_size, (1, PROMPT_LENGTH), generator=gen)


@torch.no_grad()
def _reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits ``[1, T, vocab]`` of the source model (a float32 copy when stored in another dtype)."""
    ref = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    return ref(input_ids=ids, use_cache=False).logits.float()


def build_hub_folder(src: str | Path, out_dir: str | Path, *, repo_id: str | None = None, merge_adapter: bool = True,
                     base_model: str | None = None, base_model_path: str | Path | None = None,
                     datasets: list[str] | None = None, training_description: str | None = None,
                     stages: list[dict] | None = None, evaluation: dict | None = None, tags: list[str] | None = None,
                     license: str = "apache-2.0", language: str | list[str] | None = "en", overwrite: bool = False,
                     validate: bool = True) -> Path:
    """Write the Hub folder of ``src`` into ``out_dir`` and (by default) validate it.

    Args:
        src: a folder kdamoe writes (:func:`detect_source`).
        out_dir: where to write; must be empty or absent unless ``overwrite``.
        repo_id: the target Hub id, for the card's title and usage code (default: none; the card's usage code then
            loads ``out_dir`` and says to replace it with the repository id).
        merge_adapter: for a PEFT adapter: merge it into its base (a full model) or publish the adapter.
        base_model: Hub id of the model ``src`` was trained from (card ``base_model``; for an adapter repo also
            written into ``adapter_config.json``). Defaults: a trainer card's ``base_model``, an adapter's
            ``base_model_name_or_path`` when that is not a local path.
        base_model_path: local folder of an adapter's base (default: ``base_model_name_or_path``).
        datasets, training_description, stages, evaluation, tags: card values (see
            :func:`kdamoe.common.cards.render_model_card`); given values replace what the source provides.
        validate: run :func:`validate_hub_folder` against the source model's logits.
    Returns:
        ``out_dir``.
    Raises:
        ValueError: naming the file or value: an unusable source, a missing base / tokenizer, a failed validation.
    """
    if repo_id is not None:
        check_repo_id(repo_id)
    if base_model is not None:
        check_repo_id(base_model, "base_model")
    source = detect_source(src)
    meta = _source_metadata(source)
    given = dict(base_model=base_model, datasets=datasets, training_description=training_description, stages=stages,
                 evaluation=evaluation)
    meta.update({k: v for k, v in given.items() if v is not None})
    meta["extra_tags"] = [*meta.get("extra_tags", []), *(tags or [])]
    # Without a repo id the card's usage code loads the built folder itself (with a note), never a guessed id.
    card_kwargs = dict(license=license, language=language, local_path=str(Path(out_dir).resolve()))
    images = [name for name in CURVE_IMAGES if (source.path / name).is_file()]
    for name in images:
        meta[f"{name.removesuffix('.png')}_image"] = name

    adapter_base = None
    if source.kind == "peft-adapter":
        base_path = str(base_model_path or source.base_path)
        if not _is_local(base_path):
            raise ValueError(f"adapter base {base_path!r} (base_model_name_or_path in "
                             f"{source.path / 'adapter_config.json'}): not a local folder; pass base_model_path "
                             "(--base-model-path) with the base model's folder")
        if meta.get("base_model") is None and not _is_local(source.base_path):
            meta["base_model"] = source.base_path
        base = _load_kdamoe_model(base_path)
        tokenizer = _load_tokenizer(source.path, base_path)
        _refuse_pickled_weights(source.path, "adapter_model.safetensors")
        model = PeftModel.from_pretrained(base, str(source.path)).eval()
        check_stored_weights(get_peft_model_state_dict(model), source.path, "adapter_model.safetensors",
                             what="the adapter its adapter_config.json describes")
        peft_config = model.peft_config["default"]
        lora = _adapter_description(peft_config, model)
        if training_description is None and meta.get("recipe") and meta.get("training_description"):
            meta["training_description"] += " " + lora  # a post-training run's adapter/: its run's text, plus LoRA's
        else:
            meta.setdefault("training_description", lora)
        ids = _validation_ids(base.config.vocab_size)
        reference = _reference_logits(model, ids)
        total, active = count_parameters(base)
        if merge_adapter:
            model = model.merge_and_unload()
        else:
            if not meta.get("base_model"):
                raise ValueError(f"adapter repo of {source.path}: its base {base_path} is a local folder; pass "
                                 "base_model (--base-model) with the base's Hub id (written into adapter_config.json)")
            adapter_base = base_path
            if meta.get("recipe"):  # published as the adapter itself, not merged
                meta["recipe"] = meta["recipe"].replace(" (merged into these weights)", "")
    else:
        if source.kind == "pretraining-checkpoint":
            model, tokenizer, _ = load_pretraining_checkpoint(source.path, source.run_dir)
        else:
            model = _load_kdamoe_model(source.path)
            tokenizer = _load_tokenizer(source.path, source.run_dir and source.run_dir / "tokenizer")
        ids = _validation_ids(model.config.vocab_size)
        reference = _reference_logits(model, ids)
        total, active = count_parameters(model)

    card = render_model_card(
        model.config if adapter_base is None else base.config, repo_id=repo_id, total=total, active=active,
        adapter=adapter_base is not None, chat_template=bool(getattr(tokenizer, "chat_template", None)),
        **card_kwargs, **{k: v for k, v in meta.items() if k in _CARD_KEYS})
    out_dir = _prepare_out_dir(out_dir, overwrite)
    for name in images:  # the plots the card shows
        shutil.copyfile(source.path / name, out_dir / name)
    if adapter_base is None:
        write_model_folder(model, tokenizer, out_dir, card)
    else:
        model.save_pretrained(str(out_dir))  # adapter_config.json + adapter_model.safetensors
        adapter_config = json.loads((out_dir / "adapter_config.json").read_text())
        adapter_config["base_model_name_or_path"] = meta["base_model"]  # the Hub id, not a local path
        (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(str(out_dir))
        card.save(out_dir / "README.md")
    if validate:
        validate_hub_folder(out_dir, reference=reference, input_ids=ids, adapter_base=adapter_base)
    return out_dir


_CARD_KEYS = ("base_model", "base_model_relation", "datasets", "data_note", "training_description", "stages", "tokens",
              "trained_context", "evaluation", "extra_tags", "recipe", "base_model_path", "reward_curve",
              "reward_curve_image", "loss_curve", "loss_curve_image", "usage")
# Plots a source's card shows next to it (a post-training final/): copied into the Hub folder with the card.
CURVE_IMAGES = ("loss_curve.png", "reward_curve.png")


def _source_metadata(source: Source) -> dict:
    """Card values the source itself records (a pretraining run's config / summary / progress; a trainer's card)."""
    if source.kind in ("pretraining-final", "pretraining-checkpoint"):
        run_cfg = yaml.safe_load((source.run_dir / "config.yaml").read_text())
        summary_path = source.run_dir / "summary.json"
        summary = (json.loads(summary_path.read_text())
                   if source.kind == "pretraining-final" and summary_path.is_file() else None)
        progress = (json.loads((source.path / "progress.json").read_text())
                    if source.kind == "pretraining-checkpoint" else None)
        return pretraining_card_metadata(run_cfg, summary, progress)
    run_card = _posttraining_card_values(source.path)
    if run_card is not None:
        return run_card
    return _card_metadata(source.path)


def _posttraining_card_values(folder: Path) -> dict | None:
    """The card values a post-training run recorded for its ``final/`` and ``adapter/`` (``summary.json``'s ``card``,
    written by :func:`kdamoe.posttraining.run.card_values`): recipe and mode, base, data, the logged curve, the usage
    example; ``None`` when ``folder`` is not such a folder."""
    summary_path = folder.parent / "summary.json"
    if folder.name not in ("final", "adapter") or not summary_path.is_file():
        return None
    summary = json.loads(summary_path.read_text())
    if not isinstance(summary, dict) or not isinstance(summary.get("card"), dict):
        return None
    return {k: v for k, v in summary["card"].items() if k in _CARD_KEYS and v is not None}


def _adapter_description(peft_config, model) -> str:
    trainable = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    targets = (sorted(set(peft_config.target_modules or []))
               + sorted(set(getattr(peft_config, "target_parameters", None) or [])))
    return (f"LoRA (PEFT) with rank {peft_config.r}, alpha {peft_config.lora_alpha}, on {', '.join(targets)}: "
            f"{trainable / 1e6:.3f} M adapter parameters.")


# --------------------------------------------------------------------------------------------- validation

# Runs in a fresh interpreter: kdamoe is made unimportable before anything else, so the folder must load
# with its own copied code (and kernel_dispatch's absolute `import kdamoe.kernels` must fall back).
_VALIDATE_SCRIPT = r"""
import importlib.abc, json, sys

class _BlockKdamoe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "kdamoe" or name.startswith("kdamoe."):
            raise ImportError(f"kdamoe is blocked during Hub-folder validation ({name})")
        return None

sys.meta_path.insert(0, _BlockKdamoe())
args = json.loads(sys.argv[1])
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

if args["adapter_base"]:
    from peft import PeftModel
    base = AutoModelForCausalLM.from_pretrained(args["adapter_base"], trust_remote_code=True, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, args["folder"])
else:
    model = AutoModelForCausalLM.from_pretrained(args["folder"], trust_remote_code=True, dtype=torch.float32)
model.eval()
tokenizer = AutoTokenizer.from_pretrained(args["folder"], trust_remote_code=True)
ids = torch.tensor(args["input_ids"], dtype=torch.long)
with torch.no_grad():
    logits = model(input_ids=ids, use_cache=False).logits.float()
    prompt = tokenizer("ROMEO.", return_tensors="pt").input_ids
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args["new_tokens"],
                         min_new_tokens=args["new_tokens"], do_sample=False)
chat = None
if tokenizer.chat_template:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
save_file({"logits": logits.contiguous()}, args["logits_path"])
print("KDAMOE-VALIDATION " + json.dumps({"generated": out.shape[1] - prompt.shape[1], "chat": chat,
                  "kdamoe_loaded": any(m == "kdamoe" or m.startswith("kdamoe.") for m in sys.modules),
                  "model_module": type(model.get_base_model() if args["adapter_base"] else model).__module__}))
"""


def check_hub_files(folder: str | Path, adapter: bool = False) -> None:
    """Refuse (``ValueError`` naming the file) a folder with a pickle file, or without a file a Hub folder needs:
    ``README.md``, the tokenizer files, and ``config.json`` + safetensors weights + ``generation_config.json`` + every
    modeling file named in ``auto_map`` (a model), or ``adapter_config.json`` + ``adapter_model.safetensors``
    (an adapter)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder")
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in PICKLE_SUFFIXES:
            raise ValueError(f"{path}: a pickle file ({path.suffix}); a Hub folder holds safetensors and JSON only")
    needed = ["README.md", *TOKENIZER_FILES]
    if adapter:
        needed += ["adapter_config.json", "adapter_model.safetensors"]
    else:
        needed += ["config.json", "generation_config.json"]
        if not (folder / "model.safetensors").is_file():
            sharded = any(folder.glob("model-*.safetensors"))
            needed.append("model.safetensors.index.json" if sharded else "model.safetensors")
        if (folder / "config.json").is_file():
            auto_map = json.loads((folder / "config.json").read_text()).get("auto_map") or {}
            if "AutoModelForCausalLM" not in auto_map:
                raise ValueError(f"{folder / 'config.json'}: auto_map has no AutoModelForCausalLM entry")
            needed += sorted({ref.split(".")[0] + ".py" for ref in auto_map.values()})
    for name in needed:
        if not (folder / name).is_file():
            raise ValueError(f"{folder / name}: missing (a Hub folder needs it)")
    # the modules the code files import with single-dot imports: what transformers copies and loads (§7)

    todo, seen = [n for n in needed if n.endswith(".py")], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for module in get_relative_imports(str(folder / name)):
            if not (folder / f"{module}.py").is_file():
                raise ValueError(f"{folder / (module + '.py')}: missing (imported by {name})")
            todo.append(f"{module}.py")
    if (folder / "model.safetensors.index.json").is_file():
        shards = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
        for shard in sorted(shards):
            if not (folder / shard).is_file():
                raise ValueError(f"{folder / shard}: missing (listed in model.safetensors.index.json)")


def validate_hub_folder(folder: str | Path, reference: torch.Tensor | None = None,
                        input_ids: torch.Tensor | None = None, adapter_base: str | Path | None = None,
                        timeout: float = 600.0) -> dict:
    """Check ``folder`` (:func:`check_hub_files`), then load it in a fresh process where ``import kdamoe`` fails,
    generate, and compare its float32 logits on ``input_ids`` with ``reference``.

    Args:
        folder: a Hub folder.
        reference: ``[1, T, vocab]`` float32 logits of the source model on ``input_ids`` ``[1, T]`` int64.
        adapter_base: for an adapter folder, the local folder of its base model (loaded with remote code).
    Returns:
        ``{"generated": int, "chat": str | None, "max_abs_diff": float | None}``.
    Raises:
        ValueError: naming the file for a missing / pickled file; with the child's last error lines when the
        folder fails to load or generate; with the difference when the logits disagree beyond
        ``VALIDATION_ATOL`` / ``VALIDATION_RTOL``.
    """
    folder = Path(folder).resolve()
    check_hub_files(folder, adapter=adapter_base is not None)
    if input_ids is None:
        vocab = json.loads((Path(adapter_base or folder) / "config.json").read_text())["vocab_size"]
        input_ids = _validation_ids(vocab)
    with tempfile.TemporaryDirectory(prefix="kdamoe-validate-") as tmp:
        args = dict(folder=str(folder), adapter_base=str(Path(adapter_base).resolve()) if adapter_base else None,
                    input_ids=input_ids.tolist(), new_tokens=GENERATE_TOKENS,
                    logits_path=str(Path(tmp) / "logits.safetensors"))
        # Offline, and a private modules cache: the copied code is the folder's, never a stale cached copy.
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(Path(tmp) / "modules")}
        result = subprocess.run([sys.executable, "-c", _VALIDATE_SCRIPT, json.dumps(args)], capture_output=True,
                                text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-6:])
            raise ValueError(f"{folder}: does not load and generate without kdamoe (trust_remote_code):\n{tail}")
        marker = "KDAMOE-VALIDATION "
        report = json.loads(result.stdout[result.stdout.rindex(marker) + len(marker):].splitlines()[0])
        logits = load_file(args["logits_path"])["logits"]
    if report["kdamoe_loaded"] or report["model_module"].startswith("kdamoe"):
        raise ValueError(f"{folder}: the validation process imported kdamoe ({report['model_module']})")
    if report["generated"] != GENERATE_TOKENS:
        raise ValueError(f"{folder}: generated {report['generated']} tokens, asked for {GENERATE_TOKENS}")
    diff = None
    if reference is not None:
        if logits.shape != reference.shape:
            raise ValueError(f"{folder}: logits of shape {tuple(logits.shape)}, "
                             f"the source model's {tuple(reference.shape)}")
        diff = float((logits - reference).abs().max())
        if not torch.allclose(logits, reference, atol=VALIDATION_ATOL, rtol=VALIDATION_RTOL):
            raise ValueError(f"{folder}: logits differ from the source model's by up to {diff:.3g} "
                             f"(allowed {VALIDATION_ATOL} + {VALIDATION_RTOL}·|ref|)")
    return {"generated": report["generated"], "chat": report["chat"], "max_abs_diff": diff}


# ------------------------------------------------------------------------------------------------- push


def hub_files(folder: str | Path) -> list[str]:
    """Every file under ``folder`` as ``upload_folder`` sends it (relative POSIX paths, sorted)."""
    folder = Path(folder)
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def upload_hub_folder(folder: str | Path, repo_id: str, *, private: bool | None = None, revision: str | None = None,
                      create_pr: bool = False, commit_message: str | None = None, commit_description: str | None = None,
                      token: str | None = None):
    """``HfApi.create_repo(exist_ok=True)``, ``create_branch`` for a new ``revision`` (unless ``create_pr``), then
    ``HfApi.upload_folder`` of ``folder``. Returns ``upload_folder``'s ``CommitInfo``."""
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True).repo_id
    if revision is not None and not create_pr:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
                             create_pr=create_pr, commit_message=commit_message or "Upload KDAMoE model",
                             commit_description=commit_description)


def describe_hub_folder(folder: str | Path) -> str:
    """The dry-run report: each file with its size, then the card's YAML metadata."""
    folder = Path(folder)
    lines = ["files:"] + [f"  {name}  ({(folder / name).stat().st_size} bytes)" for name in hub_files(folder)]
    metadata = ModelCard.load(folder / "README.md").data.to_yaml()
    lines += ["card metadata:"] + ["  " + line for line in metadata.splitlines()]
    return "\n".join(lines)


def push_to_hub(src: str | Path, repo_id: str, *, private: bool | None = None, revision: str | None = None,
                create_pr: bool = False, commit_message: str | None = None, commit_description: str | None = None,
                dry_run: bool = False,
                token: str | None = None, out_dir: str | Path | None = None, say=print, **build_kwargs):
    """Build the Hub folder of ``src`` (:func:`build_hub_folder`, validated), then upload it to ``repo_id``.

    Args:
        src: a folder kdamoe writes.
        repo_id: ``namespace/name`` on the Hub.
        private, revision, create_pr, commit_message: as ``HfApi.upload_folder`` / ``create_repo``.
        dry_run: print (``say``) exactly the files and the card metadata that would be sent; no network.
        out_dir: keep the built folder there (default: a temporary folder, removed afterwards).
        build_kwargs: card and source options of :func:`build_hub_folder`.
    Returns:
        The ``CommitInfo`` of the upload, or the dry-run report (str).
    Raises:
        ValueError: ``repo_id`` that the Hub refuses (:func:`kdamoe.common.cards.check_repo_id`); anything
            :func:`build_hub_folder` refuses.
    """
    check_repo_id(repo_id)
    with tempfile.TemporaryDirectory(prefix="kdamoe-hub-") as tmp:
        folder = build_hub_folder(src, out_dir or Path(tmp) / "hub", repo_id=repo_id, **build_kwargs)
        if dry_run:
            kept = "" if out_dir else " (a temporary folder, removed now; --out-dir keeps it)"
            report = (f"dry run: would upload {folder}{kept} to {repo_id} (revision {revision or 'main'}"
                      f"{', as a pull request' if create_pr else ''}{', private' if private else ''})\n"
                      + describe_hub_folder(folder))
            say(report)
            return report
        try:
            return upload_hub_folder(folder, repo_id, private=private, revision=revision, create_pr=create_pr,
                                     commit_message=commit_message, commit_description=commit_description, token=token)
        except Exception as err:
            # The Hub's refusals (no token, no write access) and the network's (offline) come from huggingface_hub and
            # its HTTP client: a one-line error for the user; anything else is ours and keeps its traceback.
            if not (isinstance(err, OSError) or type(err).__module__.split(".")[0] in _NETWORK_MODULES):
                raise
            raise ValueError(f"upload to {repo_id} failed ({type(err).__name__}: {err}); check `hf auth login` (or "
                             "HF_TOKEN), the repository's write access and the network; --dry-run builds without "
                             "uploading") from err


def push_model_to_hub(model, repo_id: str, *, tokenizer=None, max_shard_size: int | str | None = "50GB", **kwargs):
    """``model.push_to_hub`` for a KDAMoE model: save it (and its tokenizer) to a temporary folder, then
    :func:`push_to_hub` from there, so the repository gets our card, the tokenizer and the validation.

    The tokenizer defaults to the one saved with the model (``model.name_or_path``). ``kwargs`` are
    :func:`push_to_hub`'s (``private``, ``revision``, ``create_pr``, ``commit_message``, ``commit_description``,
    ``token``, ``tags``, ``dry_run``, card options), which covers transformers' ``push_to_hub`` arguments.
    Raises:
        ValueError: when no tokenizer is given and none sits next to the model.
    """
    if tokenizer is None:
        source = getattr(model, "name_or_path", None)
        if not (source and (Path(source) / "tokenizer_config.json").is_file()):
            raise ValueError("model.push_to_hub: pass tokenizer=... (none is saved next to the model "
                             f"{source!r}); a Hub folder needs the tokenizer")
        tokenizer = _load_tokenizer(source)
    with tempfile.TemporaryDirectory(prefix="kdamoe-src-") as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        return push_to_hub(tmp, repo_id, **kwargs)
