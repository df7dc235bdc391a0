"""Run one post-training recipe end to end: load the base, build TRL's trainer, train (resuming), save.

:func:`run_recipe` writes into ``cfg.output_dir``:

* ``checkpoint-N/`` — the Trainer's own checkpoints (model with its router-bias buffers in
  ``model.safetensors``, optimizer, scheduler, RNG, ``trainer_state.json``); a rerun resumes from the newest
  complete one (it has ``trainer_state.json``, written last); none under ``distributed_config`` (transformers'
  Trainer cannot checkpoint the optimizer of a model sharded while it loads);
* ``final/`` — the trained model, reloadable with ``AutoModelForCausalLM.from_pretrained(final,
  trust_remote_code=True)`` (:func:`kdamoe.common.folders.write_model_folder`), with a model card naming the recipe, the
  base model, the data and the curve the trainer logged: the training loss for SFT / DPO (a table and
  ``loss_curve.png``), the mean reward for RL recipes (``reward_curve.png``). Under PEFT it is the merged model,
  and ``adapter/`` holds the LoRA adapter for the base, with its own card;
* ``summary.json`` — the config, the paths, the log history, the reward curve and ``card``: the card's values
  (:func:`card_values`), from which ``kdamoe-push`` of ``final/`` renders the same Training section.

``final/``, ``adapter/`` and ``summary.json`` are written to a temporary name and renamed into place, so a
crash leaves either the previous complete version or none — never a half-written folder.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import PartialState
from matplotlib.figure import Figure
from transformers import AutoTokenizer, TrainerCallback, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..callbacks import RouterBiasUpdateCallback, add_router_bias_callback
from ..common.cards import count_parameters, curve_is_constant, render_model_card
from ..common.checkpoint import verify_checkpoint, write_manifest
from ..common.folders import check_model_folder, write_model_folder
from ..common.parallel import check_world_size, consolidated_model, enable_fsdp2_on_cpu, load_sharded
from ..common.run_folder import check_no_other_job, owned_run_folder
from ..model import KDAMoEForCausalLM
from .config import posttrain_config_to_dict
from .environments import ENVIRONMENTS, make_family_tasks, tool_schemas
from .recipes import build_trainer
from .recipes.common import check_aux_loss

logger = logging.getLogger(__name__)

RL_RECIPES = ("grpo", "rloo", "ppo")
TRL_TRAINERS = {"sft": "SFTTrainer", "grpo": "GRPOTrainer", "dpo": "DPOTrainer", "rloo": "RLOOTrainer",
                "ppo": "PPOTrainer"}
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


# What a Trainer checkpoint must hold to resume the same run (transformers' Trainer._save_checkpoint writes them):
# weights (full or adapter), optimizer, scheduler, RNG state(s) and the trainer state. Listed by the manifest that
# CheckpointManifestCallback writes after the Trainer finished the folder.
TRAINER_CHECKPOINT_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state*.pth")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")


def verify_trainer_checkpoint(folder: Path) -> str | None:
    """Why the Trainer checkpoint ``folder`` cannot be resumed (a reason naming the file), or None when it can: its
    manifest (written last) checks out (:func:`kdamoe.common.checkpoint.verify_checkpoint`) and lists
    :data:`TRAINER_CHECKPOINT_FILES` and the weights."""
    reason = verify_checkpoint(folder, required=TRAINER_CHECKPOINT_FILES)
    if reason is None and not any((folder / name).is_file() for name in WEIGHT_FILES):
        reason = f"no weights ({' / '.join(WEIGHT_FILES)})"
    return reason


def newest_checkpoint(output_dir: str | Path, say=logger.warning) -> str | None:
    """The newest intact Trainer checkpoint ``checkpoint-N`` in ``output_dir`` (:func:`verify_trainer_checkpoint`), or
    None when there is none at all; ``say`` gets one line per newer checkpoint skipped, naming the file and why.

    Raises:
        ValueError: there are checkpoints but none is intact (a silent fresh start would lose the run).
    """
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    found = sorted(((int(m.group(1)), p) for p in folder.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()),
                   reverse=True)
    for _, path in found:
        reason = verify_trainer_checkpoint(path)
        if reason is None:
            return str(path)
        say(f"skipping {path}: {reason}")
    if found:
        raise ValueError(f"no intact checkpoint in {folder} (reasons above); pass --no-resume --overwrite to start "
                         "over (which deletes them) or another --output-dir")
    return None


class CheckpointManifestCallback(TrainerCallback):
    """Writes ``manifest.json`` into each ``checkpoint-N`` once the Trainer has saved everything in it (``on_save``
    runs after ``Trainer._save_checkpoint``): the manifest is the last file, so a checkpoint cut short by a crash has
    none and is skipped on resume (:func:`newest_checkpoint`)."""

    def on_save(self, args, state, control, **kwargs):
        PartialState().wait_for_everyone()  # every rank's shards are on disk
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if folder.is_dir():
                write_manifest(folder)
        return control


# The mean reward per step as each TRL trainer logs it: GRPO / RLOO `reward`, PPO (TRL 1.12) `objective/scores`.
REWARD_KEYS = ("reward", "objective/scores")


def reward_curve(log_history: list[dict]) -> list[tuple[int, float]]:
    """``(step, mean reward)`` of every training log row with a reward metric (:data:`REWARD_KEYS`), in step order."""
    out = []
    for row in log_history:
        key = next((k for k in REWARD_KEYS if k in row), None)
        if key is not None and "step" in row:
            out.append((int(row["step"]), float(row[key])))
    return out


@contextmanager
def _atomic_folder(dest: Path):
    """Yield a temporary sibling of ``dest`` to fill; on success it replaces ``dest`` by renames."""
    tmp, old = dest.with_name(f".{dest.name}.tmp"), dest.with_name(f".{dest.name}.old")
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    tmp.mkdir(parents=True)
    yield tmp
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    if old.exists():
        shutil.rmtree(old)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


# The training loss per logged step as SFTTrainer and DPOTrainer log it (the run's last row has `train_loss`, the mean).
LOSS_RECIPES = ("sft", "dpo")


def loss_curve(log_history: list[dict]) -> list[tuple[int, float]]:
    """``(step, training loss)`` of every training log row with a ``loss`` metric, in step order."""
    return [(int(row["step"]), float(row["loss"])) for row in log_history if "loss" in row and "step" in row]


def plot_curve(curve: list[tuple[int, float]], path: Path, ylabel: str) -> tuple[float, float]:
    """Draw ``(step, value)`` rows into ``path`` (PNG); return the plot's y-range ``(bottom, top)``. A constant curve
    (:func:`kdamoe.common.cards.curve_is_constant`) gets a y-range of ±0.5 around its value, so float rounding noise
    is not magnified into a slope (matplotlib's autoscale would span the noise)."""
    fig = Figure(figsize=(5, 3))  # a bare Figure draws on the Agg canvas; pyplot's global backend is left alone
    ax = fig.subplots()
    values = [v for _, v in curve]
    ax.plot([s for s, _ in curve], values, marker="o")
    if curve_is_constant(values):
        ax.set_ylim(values[0] - 0.5, values[0] + 0.5)
        ax.set_title(f"constant at {values[0]:.4f}", fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    bottom, top = ax.get_ylim()
    return float(bottom), float(top)


def _is_local(path: str) -> bool:
    return Path(path).expanduser().exists()


# Recipes and GRPO modes whose model works with tools (the data's tool schemas), as opposed to single-turn answers.
def _uses_tools(cfg) -> bool:
    if cfg.recipe == "grpo":
        return cfg.grpo.mode in ("tools", "environment")
    return cfg.recipe in ("sft", "dpo")


def card_values(cfg, history: list[dict]) -> dict:
    """What the card of a post-training run says, as plain JSON data (:func:`kdamoe.common.cards.render_model_card`
    keywords): recipe and mode as they ran, base (a Hub id, or the absolute path of a local folder), data, the
    curve the trainer logged (loss for SFT / DPO, mean reward for RL), tags and the usage example. ``final/``'s card
    is rendered from it, and it is stored in ``summary.json`` under ``card`` so that ``kdamoe-push`` renders the same
    Training section."""
    d = cfg.data
    tools = _uses_tools(cfg)
    mode = ""
    if cfg.recipe == "grpo":
        mode = f" ({cfg.grpo.mode}"
        if cfg.grpo.rollout == "cached":
            mode += ", cached rollouts: each turn continues the rollout's cache and prefills only its new tokens"
        elif cfg.grpo.rollout == "batched":
            mode += (", batched rollouts: the episodes decoded together on per-episode cache slots, each turn "
                     "prefilling only its new tokens")
        if cfg.grpo.long_context:
            mode += ", memory-bounded update: activation checkpointing per layer, chunked LM head"
        mode += ")"
    elif cfg.recipe in ("rloo", "ppo"):
        mode = " (single turn, no tools)"
    recipe = f"`{cfg.recipe}`{mode} with TRL's `{TRL_TRAINERS[cfg.recipe]}`"
    if cfg.peft is not None:
        recipe += " and a LoRA adapter (merged into these weights)"
    biases = ("frozen" if cfg.peft is not None or cfg.router_biases == "freeze"
              else "updated by Quantile Balancing once per optimizer step")
    span = str(d.min_calls) if d.min_calls == d.max_calls else f"{d.min_calls}-{d.max_calls}"
    plural = "" if d.max_calls == 1 else "s"
    if d.environment == "keyhunt":
        family = "key-hunt tasks (walk through hidden rooms with `open_door` until the key, then `take_key`)"
        calls = f", {span} door{plural} before the key"
    elif tools:
        family = f"chained-arithmetic tasks (operands 2-{d.max_operand}, calculator tools)"
        calls = f", {span} tool call{plural} before `submit`"
    else:
        family = (f"chained-arithmetic tasks (operands 2-{d.max_operand}), answered in one turn without tools "
                  "(reward: the completion states the result)")
        calls = f", {span} operation{plural} each"
    description = (
        f"Data: {d.num_tasks} generated {family}, seed {d.seed}{calls}"
        + (f", {d.hasty_fraction:.0%} of the demonstrations by a hasty agent" if cfg.recipe == "sft" else "")
        + f"; nothing downloaded. Router biases {biases}.")
    losses = loss_curve(history) if cfg.recipe in LOSS_RECIPES else None
    mean = next((row["train_loss"] for row in reversed(history) if "train_loss" in row), None)
    if cfg.recipe in LOSS_RECIPES and not losses and mean is not None:  # logging_steps past the run's last step
        description += (f" Mean training loss over the run {float(mean):.4f} (no per-step loss was logged: "
                        "trainer.logging_steps exceeds the steps).")
    local = _is_local(cfg.model)
    env_cls = ENVIRONMENTS[d.environment][1]
    example = make_family_tasks(d.environment, 1, d.seed, min_calls=d.min_calls, max_calls=d.max_calls,
                                max_operand=d.max_operand)[0]
    return dict(
        recipe=recipe, training_description=description,
        base_model=None if local else cfg.model,
        base_model_path=str(Path(cfg.model).expanduser().resolve()) if local else None,
        reward_curve=reward_curve(history) if cfg.recipe in RL_RECIPES else None,
        loss_curve=losses,
        extra_tags=["trl", cfg.recipe], chat_template=True,
        usage={"prompt": example.prompt(), "tools": tool_schemas(env_cls) if tools else None})


def render_run_card(model_config, values: dict, *, total: int, active: int, repo_id: str | None = None,
                    local_path: str | None = None, images: tuple[str, ...] = (), **overrides):
    """The card of a post-trained model from :func:`card_values` (``final/``'s, or a pushed folder's with its
    ``repo_id``); ``images``: the curve plots present next to it (``loss_curve.png``, ``reward_curve.png``)."""
    values = {**values, **{k: v for k, v in overrides.items() if v is not None}}
    return render_model_card(
        model_config, repo_id=repo_id, local_path=local_path, total=total, active=active,
        reward_curve_image="reward_curve.png" if "reward_curve.png" in images else None,
        loss_curve_image="loss_curve.png" if "loss_curve.png" in images else None, **values)


def trained_model(cfg, trainer):
    """The trained model, whole, on the main process (``None`` on the others when the model is sharded).

    Call on every process. Under DDP every process holds the whole model: its unwrapped module is returned as it
    is. Under FSDP2 (``trainer.fsdp``) and under transformers' engine (``distributed_config``: FSDP2, with expert
    parallelism) every process holds a shard: :func:`kdamoe.common.parallel.consolidated_model` gathers the full
    state dict and the main process loads it into a fresh, unsharded copy of the base (:func:`load_base`), as the
    pretraining job does.
    """
    model = consolidated_model(trainer.accelerator, trainer.model, lambda: load_base(cfg, sharded=False)[0])
    return getattr(model, "policy", model)  # TRL's PPO trains a wrapper of policy and value model


def _adapter_card(cfg, model, values: dict, folder: Path):
    """The adapter folder's card (replacing PEFT's empty template): the base by its Hub id, or its absolute local
    path with a note."""
    total, active = count_parameters(model.get_base_model())
    peft_config = next(iter(model.peft_config.values()))
    targets = sorted(set(peft_config.target_modules or [])) + sorted(set(getattr(peft_config, "target_parameters",
                                                                                 None) or []))
    adapter_values = {**values, "recipe": values["recipe"].replace(" (merged into these weights)", ""),
                      "training_description": values["training_description"]
                      + f" LoRA rank {peft_config.r}, alpha {peft_config.lora_alpha}, on {', '.join(targets)}."}
    return render_model_card(model.get_base_model().config, repo_id=None, local_path=str(folder), total=total,
                             active=active, adapter=True, **adapter_values)


def _save(cfg, model, tokenizer, padding_side: str, values: dict) -> tuple[Path, Path | None, object]:
    """Write ``final/`` (and ``adapter/`` under PEFT) of the whole trained ``model`` with their cards (from
    :func:`card_values`); return their paths and the saved model (merged under PEFT)."""
    out = Path(cfg.output_dir)
    tokenizer.padding_side = padding_side  # GRPO / RLOO pad on the left; the shipped tokenizer keeps its own
    adapter_dir = None
    if cfg.peft is not None:
        adapter_dir = out / "adapter"
        if _is_local(cfg.model):  # a relative base path would resolve only from the folder the run started in
            for peft_config in model.peft_config.values():
                peft_config.base_model_name_or_path = str(Path(cfg.model).expanduser().resolve())
        with _atomic_folder(adapter_dir) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            _adapter_card(cfg, model, values, adapter_dir.expanduser().resolve()).save(tmp / "README.md")
        model = model.merge_and_unload()
    final = out / "final"
    with _atomic_folder(final) as tmp:
        images = []
        for name, key, label in (("loss_curve.png", "loss_curve", "training loss"),
                                 ("reward_curve.png", "reward_curve", "mean reward")):
            if values.get(key):
                plot_curve(values[key], tmp / name, label)
                images.append(name)
        total, active = count_parameters(model)
        card = render_run_card(model.config, values, total=total, active=active,
                               local_path=str(final.expanduser().resolve()), images=tuple(images))
        write_model_folder(model, tokenizer, tmp, card)
    return final, adapter_dir, model


def check_base(cfg) -> None:
    """Check ``cfg.model`` before anything is built or written: a local folder (anything that exists, or a path-like
    name: ``/``, ``.``, ``~``, ``outputs`` at the start, or more than one ``/``) must hold ``config.json``, the
    tokenizer (``tokenizer_config.json`` + ``tokenizer.json``) and intact weights
    (:func:`kdamoe.common.folders.check_model_folder`); any other name is taken for a Hub id.

    Raises:
        ValueError: naming ``model=`` and what is missing or damaged.
    """
    folder = Path(cfg.model).expanduser()
    looks_local = folder.exists() or cfg.model.startswith(("/", ".", "~", "outputs")) or cfg.model.count("/") > 1
    if looks_local and not (folder / "config.json").is_file():
        hint = ("The shipped grpo / dpo / rloo configs start from outputs/posttrain/sft/final: run `kdamoe-posttrain "
                "--config sft` first, or pass --set model=FOLDER" if cfg.recipe != "sft" else
                "Pass --set model=FOLDER (make train writes outputs/cpu_default/final)")
        raise ValueError(f"model={cfg.model}: no model folder there (no config.json). {hint}")
    if folder.is_dir():
        for name in ("tokenizer_config.json", "tokenizer.json"):
            if not (folder / name).is_file():
                raise ValueError(f"model={cfg.model}: no {name} there; the recipes need the model's tokenizer in its "
                                 "folder (tokenizer.save_pretrained(folder))")
        check_model_folder(folder)  # a missing, foreign, misshapen or non-finite tensor would otherwise load silently


def load_base(cfg, sharded: bool = True):
    """``(model, tokenizer)`` of ``cfg.model``: ``KDAMoEForCausalLM.from_pretrained`` (float32) and ``AutoTokenizer``.

    With ``cfg.distributed_config`` (and ``sharded``) the model is sharded while it loads, by transformers'
    engine (:func:`kdamoe.common.parallel.load_sharded`: the model's FSDP2 plan and, with ``ep_size``, its
    expert-parallel plan); every process must call it. ``sharded=False`` loads the whole model (the copy
    :func:`trained_model` fills with the gathered weights).

    Raises:
        ValueError: see :func:`check_base`, or ``distributed_config`` does not fit the model
            (:func:`kdamoe.common.parallel.check_distributed_config`), or the tokenizer has more tokens than the
            model's ``vocab_size``.
    """
    check_base(cfg)
    if sharded and cfg.distributed_config is not None:
        model = load_sharded(KDAMoEForCausalLM, cfg.model, cfg.distributed_config, dtype=torch.float32)
    else:
        model = KDAMoEForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    if len(tokenizer) > model.config.vocab_size:
        # else the first training step stops on an id past the embedding, after the data is built, naming neither
        raise ValueError(f"model={cfg.model}: its tokenizer has {len(tokenizer)} tokens, more than the model's "
                         f"vocab_size {model.config.vocab_size}; save the model's own tokenizer in the folder, or "
                         "resize the model (model.resize_token_embeddings(len(tokenizer)), then save_pretrained)")
    return model, tokenizer


def run_identity(cfg) -> dict:
    """What a resumed run must share with the run that wrote its output folder: the base model (a local folder as
    its absolute path), the recipe and the data section."""

    model = str(Path(cfg.model).expanduser().resolve()) if _is_local(cfg.model) else cfg.model
    return {"model": model, "recipe": cfg.recipe, "data": posttrain_config_to_dict(cfg)["data"]}


def run_recipe(cfg, resume: bool = True, overwrite: bool = False, callbacks=()) -> dict:
    """Train ``cfg.recipe`` from ``cfg.model`` and save it (module docstring).

    The run owns ``cfg.output_dir`` while it runs (:func:`kdamoe.common.run_folder.owned_run_folder`): a second run
    into it stops; a folder holding a pretraining run (such as the base's own run) or the base model itself is
    refused; a fresh start refuses a non-empty folder unless ``overwrite``; a resume needs the same base, recipe and
    data as the run recorded, and the newest intact checkpoint (:func:`newest_checkpoint`).

    Args:
        cfg: a validated :class:`~kdamoe.posttraining.config.PostTrainConfig`.
        resume: continue from the newest intact ``checkpoint-N`` in ``cfg.output_dir`` when there is one.
        overwrite: on a fresh start, remove what an earlier post-training run wrote there (only that).
        callbacks: extra ``TrainerCallback`` instances, placed right after the router-bias callback and before the
            ``report_to`` integrations, so metrics they add in ``on_log`` reach TensorBoard too.
    Returns:
        ``{"final": str, "adapter": str | None, "summary": str, "log_history": list[dict], "train_runtime":
        float (seconds), "global_step": int, "reward_curve": [(step, mean reward)], "resumed_from": str | None,
        "model": the saved model (merged under PEFT; ``None`` on the other processes when the model is sharded: FSDP2,
        ``distributed_config``), "trainer": the TRL trainer}``.
    Raises:
        ValueError: a config value that does not fit the model (aux loss next to Quantile Balancing, a completion
            budget past the context, ``distributed_config``'s ``ep_size`` against ``num_experts``), naming it; or a
            checkpoint to resume under ``distributed_config``; checkpoints of which none is intact.
        kdamoe.common.run_folder.RunFolderError: the folder is busy, holds a pretraining run, is
            not empty on a fresh start, or was written by a run with another base / recipe / data (named).
    """
    check_base(cfg)  # before anything is loaded or written: a typo leaves nothing behind
    out = Path(cfg.output_dir).expanduser().resolve()
    if _is_local(cfg.model) and Path(cfg.model).expanduser().resolve().is_relative_to(out):
        raise ValueError(f"model={cfg.model} lies inside output_dir={cfg.output_dir}: the run would overwrite its own "
                         "base; pick another output_dir")
    check_no_other_job(cfg.output_dir, "posttraining")  # read-only: refused before the base loads
    if resume and cfg.distributed_config is not None and any(Path(cfg.output_dir).glob("checkpoint-*")):
        # refused before the base loads: a sharded load waits for every process, a refusal on one would hang the rest
        raise ValueError(f"distributed_config: output_dir {cfg.output_dir} holds checkpoint-* folders, and "
                         "transformers' Trainer cannot resume a model sharded while it loads; pass --no-resume "
                         "--overwrite or another output_dir")

    # Claimed before anything is written to it (the PPO recipe trains its reward model into it while it builds).
    with owned_run_folder(cfg.output_dir, "posttraining", lambda: newest_checkpoint(cfg.output_dir) if resume else None,
                          overwrite=overwrite, identity=run_identity(cfg), say=logger.warning) as checkpoint:
        set_seed(cfg.seed)
        model, tokenizer = load_base(cfg)
        check_aux_loss(cfg, model.config)
        padding_side = tokenizer.padding_side
        eos = model.config.eos_token_id
        trainer = build_trainer(cfg, model, tokenizer)
        check_world_size(trainer.accelerator, "the Trainer", "on CPUs the recipes need use_cpu=True (their default "
                         "without CUDA) for a gloo DDP run")  # else N lone processes would race on output_dir
        enable_fsdp2_on_cpu(trainer)
        add_router_bias_callback(trainer, RouterBiasUpdateCallback(freeze_biases=cfg.router_biases == "freeze"))
        trainer.add_callback(CheckpointManifestCallback())
        for position, callback in enumerate(callbacks, start=1):
            trainer.callback_handler.callbacks.insert(position, callback)
        return _train_and_save(cfg, trainer, tokenizer, padding_side, checkpoint, eos)


def _train_and_save(cfg, trainer, tokenizer, padding_side: str, checkpoint: str | None, eos=None) -> dict:
    """:func:`run_recipe`'s training and saving, with the output folder owned and the checkpoint to resume (or None)
    decided; ``eos``: the base config's ``eos_token_id``, which the saved config keeps."""

    if checkpoint:
        logger.warning(f"resuming from {checkpoint}")
    result = trainer.train(resume_from_checkpoint=checkpoint)
    history = list(trainer.state.log_history)
    curve = reward_curve(history) if cfg.recipe in RL_RECIPES else []
    card = card_values(cfg, history)
    trained = trained_model(cfg, trainer)  # on every process: under FSDP2 it gathers the shards
    if trained is not None and eos is not None:
        # transformers' Trainer.train sets config.eos_token_id to the tokenizer's eos (align_special_tokens) and adds
        # it to the generation config's; a base whose turns end with another token (Kimi's <|im_end|>, its
        # tokenizer's eos being [EOS]) keeps its own in final/config.json, the generation config stopping at both
        trained.config.eos_token_id = eos
    if trainer.is_world_process_zero():  # one writer: every rank holds the same weights and biases
        final, adapter, saved = _save(cfg, trained, tokenizer, padding_side, card)
    else:
        final = Path(cfg.output_dir) / "final"
        adapter = Path(cfg.output_dir) / "adapter" if cfg.peft is not None else None
        saved = trained
    summary = {
        "recipe": cfg.recipe, "config": posttrain_config_to_dict(cfg), "final": str(final),
        "adapter": None if adapter is None else str(adapter), "resumed_from": checkpoint,
        "global_step": trainer.state.global_step, "train_runtime": float(result.metrics.get("train_runtime", 0.0)),
        "reward_curve": curve, "card": card, "log_history": history,
    }
    summary_path = Path(cfg.output_dir) / "summary.json"
    if trainer.is_world_process_zero():
        _write_json(summary_path, summary)
    trainer.accelerator.wait_for_everyone()  # no rank returns before final/ and summary.json exist
    return {**summary, "summary": str(summary_path), "model": saved, "trainer": trainer}
