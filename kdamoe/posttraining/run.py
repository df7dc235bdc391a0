"""Run one post-training recipe end to end: load the base, build TRL's trainer, train (resuming), save.

:func:`run_recipe` writes into ``cfg.output_dir``:

* ``checkpoint-N/`` — the Trainer's own checkpoints (model with its router-bias buffers in
  ``model.safetensors``, optimizer, scheduler, RNG, ``trainer_state.json``); a rerun resumes from the newest
  complete one (it has ``trainer_state.json``, written last); none under ``distributed_config`` (transformers'
  Trainer cannot checkpoint the optimizer of a model sharded while it loads);
* ``final/`` — the trained model, reloadable with ``AutoModelForCausalLM.from_pretrained(final,
  trust_remote_code=True)`` (:func:`kdamoe.hub.write_model_folder`), with a model card naming the recipe, the
  base model, the data and, for RL recipes, the reward curve (a table and ``reward_curve.png``). Under PEFT
  it is the merged model, and ``adapter/`` holds the LoRA adapter for the base;
* ``summary.json`` — the config, the paths, the log history and the reward curve.

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

logger = logging.getLogger(__name__)

RL_RECIPES = ("grpo", "rloo", "ppo")
TRL_TRAINERS = {"sft": "SFTTrainer", "grpo": "GRPOTrainer", "dpo": "DPOTrainer", "rloo": "RLOOTrainer",
                "ppo": "PPOTrainer"}
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def newest_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete Trainer checkpoint (``checkpoint-N`` holding ``trainer_state.json``) or ``None``."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _CHECKPOINT.match(p.name)) and (p / "trainer_state.json").is_file()]
    return str(max(found)[1]) if found else None


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


def _plot_reward_curve(curve: list[tuple[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([s for s, _ in curve], [r for _, r in curve], marker="o")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _is_local(path: str) -> bool:
    return Path(path).expanduser().exists()


def _card(cfg, model, curve, image: str | None):
    from ..model_card import count_parameters, render_model_card

    d = cfg.data
    mode = f" ({cfg.grpo.mode})" if cfg.recipe == "grpo" else ""
    recipe = f"`{cfg.recipe}`{mode} with TRL's `{TRL_TRAINERS[cfg.recipe]}`"
    if cfg.peft is not None:
        recipe += " and a LoRA adapter (merged into these weights)"
    biases = ("frozen" if cfg.peft is not None or cfg.router_biases == "freeze"
              else "updated by Quantile Balancing once per optimizer step")
    family = ("key-hunt tasks (walk through hidden rooms with `open_door` until the key, then `take_key`)"
              if d.environment == "keyhunt" else
              f"chained-arithmetic tasks (operands 2-{d.max_operand}, calculator tools)")
    description = (
        f"Data: {d.num_tasks} generated {family}, seed {d.seed}, {d.min_calls}-{d.max_calls} tool calls before the "
        "final one"
        + (f", {d.hasty_fraction:.0%} of the demonstrations by a hasty agent" if cfg.recipe == "sft" else "")
        + f"; nothing downloaded. Router biases {biases}.")
    total, active = count_parameters(model)
    local = _is_local(cfg.model)
    return render_model_card(
        model.config, repo_id=f"kdamoe/{Path(cfg.output_dir).name}", total=total, active=active,
        base_model=None if local else cfg.model, base_model_path=cfg.model if local else None,
        training_description=description, recipe=recipe, reward_curve=curve or None, reward_curve_image=image,
        extra_tags=["trl", cfg.recipe], chat_template=True)


def trained_model(cfg, trainer):
    """The trained model, whole, on the main process (``None`` on the others when the model is sharded).

    Call on every process. Under DDP every process holds the whole model: its unwrapped module is returned as it
    is. Under FSDP2 (``trainer.fsdp``) and under transformers' engine (``distributed_config``: FSDP2, with expert
    parallelism) every process holds a shard: the full state dict is all-gathered (persistent buffers included, so
    the router biases travel with the weights; accelerate's ``get_state_dict`` for the first, transformers'
    ``gather_full_state_dict`` for the second, which the Trainer never wrapped) and the main process loads it into
    a fresh, unsharded copy of the base (:func:`load_base`), as the pretraining job does.
    """
    accelerator = trainer.accelerator
    model = accelerator.unwrap_model(trainer.model)
    if getattr(model, "is_distributed_loading_by_transformers", False):
        from transformers.distributed.utils import gather_full_state_dict

        state = gather_full_state_dict(model)  # collective: every rank takes part, rank 0 gets the tensors
    elif accelerator.is_fsdp2:
        state = accelerator.get_state_dict(trainer.model)
    else:
        return getattr(model, "policy", model)  # TRL's PPO trains a wrapper of policy and value model
    if not accelerator.is_main_process:
        return None
    model, _ = load_base(cfg, sharded=False)
    model.load_state_dict(state, strict=True)
    return model


def _save(cfg, model, tokenizer, padding_side: str, curve) -> tuple[Path, Path | None, object]:
    """Write ``final/`` (and ``adapter/`` under PEFT) of the whole trained ``model``; return their paths and the
    saved model (merged under PEFT)."""
    from ..hub import write_model_folder

    out = Path(cfg.output_dir)
    tokenizer.padding_side = padding_side  # GRPO / RLOO pad on the left; the shipped tokenizer keeps its own
    adapter_dir = None
    if cfg.peft is not None:
        adapter_dir = out / "adapter"
        with _atomic_folder(adapter_dir) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        model = model.merge_and_unload()
    final = out / "final"
    with _atomic_folder(final) as tmp:
        image = None
        if curve:
            _plot_reward_curve(curve, tmp / "reward_curve.png")
            image = "reward_curve.png"
        write_model_folder(model, tokenizer, tmp, _card(cfg, model, curve, image))
    return final, adapter_dir, model


def load_base(cfg, sharded: bool = True):
    """``(model, tokenizer)`` of ``cfg.model``: ``KDAMoEForCausalLM.from_pretrained`` (float32) and ``AutoTokenizer``.

    With ``cfg.distributed_config`` (and ``sharded``) the model is sharded while it loads, by transformers'
    engine: ``from_pretrained(..., distributed_config=DistributedConfig(**cfg.distributed_config))`` applies the
    model's ``base_model_fsdp_plan`` / ``_fsdp_plan`` (FSDP2) and, with ``ep_size``, its ``base_model_ep_plan``
    (docs/distributed.md, "transformers DistributedConfig"); every process must call it. ``sharded=False`` loads
    the whole model (the copy :func:`trained_model` fills with the gathered weights).

    Raises:
        ValueError: ``cfg.model`` looks like a local folder without ``config.json``, or ``distributed_config``
            does not fit the model (:func:`kdamoe.posttraining.config.check_distributed_config`).
    """
    import torch
    from transformers import AutoTokenizer

    from .. import KDAMoEConfig, KDAMoEForCausalLM
    from .config import check_distributed_config

    folder = Path(cfg.model).expanduser()
    looks_local = folder.exists() or cfg.model.startswith(("/", ".", "~", "outputs")) or cfg.model.count("/") > 1
    if looks_local and not (folder / "config.json").is_file():
        raise ValueError(f"model={cfg.model}: no model folder there (no config.json). The shipped grpo / dpo / rloo "
                         "configs start from outputs/posttrain/sft/final: run `kdamoe-posttrain --config sft` first, "
                         "or pass --set model=FOLDER")
    kwargs = {}
    if sharded and cfg.distributed_config is not None:
        from transformers.distributed import DistributedConfig

        check_distributed_config(cfg.distributed_config, KDAMoEConfig.from_pretrained(cfg.model))
        kwargs["distributed_config"] = DistributedConfig(**cfg.distributed_config)
    model = KDAMoEForCausalLM.from_pretrained(cfg.model, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    return model, tokenizer


def check_world_size(trainer) -> None:
    """Refuse a launch whose ``WORLD_SIZE`` (set by ``torchrun``) differs from the processes the Trainer set up.

    Without this, N processes that each built a one-process Trainer would train N unrelated copies and race on
    ``output_dir`` (docs/post-training.md, "Several processes").

    Raises:
        ValueError: ``WORLD_SIZE`` != ``trainer.accelerator.num_processes``, naming both.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != trainer.accelerator.num_processes:
        raise ValueError(f"WORLD_SIZE={launched} processes were launched but the Trainer set up "
                         f"{trainer.accelerator.num_processes} ({trainer.accelerator.distributed_type}); on CPUs "
                         "the recipes need use_cpu=True (their default without CUDA) for a gloo DDP run")


def enable_fsdp2_on_cpu(trainer) -> None:
    """Make a Trainer configured for FSDP (``trainer.fsdp=full_shard``; transformers 5.24 defaults to FSDP2) shard
    on CPU processes too; a no-op without ``fsdp`` and on accelerator devices.

    On CPU, accelerate 1.15 drops the FSDP plugin the Trainer passes: ``AcceleratorState`` switches to
    ``DistributedType.FSDP`` only on accelerator devices (MULTI_GPU, ...), not MULTI_CPU, so the model would be
    wrapped in DDP. gloo supports what FSDP2 needs, so before anything is prepared this makes the switch accelerate
    makes on GPUs (distributed type, the plugin, its mixed-precision policy) and sets the Trainer's
    ``is_fsdp_enabled`` flag as ``create_accelerator_and_postprocess`` would have; from then on it is
    accelerate's own FSDP2 path, the one CUDA runs (the same switch as ``kdamoe.training.trainer.make_accelerator``).

    FSDP on one process, FSDP version 1 and FSDP with a PEFT adapter (``final/`` merges the adapter on the main
    process, which needs the whole model there) never get here: the config refuses them when it loads
    (:meth:`kdamoe.posttraining.config.PostTrainConfig.validate`), before transformers would fail on them itself.

    Raises:
        RuntimeError: the accelerator did not end up in FSDP2 mode (an accelerate version whose gating differs).
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin_args = trainer.args.fsdp_plugin_args
    if plugin_args is None:
        return
    accelerator = trainer.accelerator
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        plugin = FullyShardedDataParallelPlugin(**plugin_args)
        if accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.mixed_precision)
        state = accelerator.state
        state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        state.fsdp_plugin = plugin
        trainer.is_fsdp_enabled = True
    if not accelerator.is_fsdp2:
        raise RuntimeError(f"trainer.fsdp is set but accelerate set up {accelerator.distributed_type}")


def run_recipe(cfg, resume: bool = True, callbacks=()) -> dict:
    """Train ``cfg.recipe`` from ``cfg.model`` and save it (module docstring).

    Args:
        cfg: a validated :class:`~kdamoe.posttraining.config.PostTrainConfig`.
        resume: continue from the newest complete ``checkpoint-N`` in ``cfg.output_dir`` when there is one.
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
            checkpoint to resume under ``distributed_config``.
    """
    from transformers import set_seed

    from ..callbacks import RouterBiasUpdateCallback, add_router_bias_callback
    from .config import posttrain_config_to_dict
    from .recipes import build_trainer
    from .recipes.common import check_aux_loss

    checkpoint = newest_checkpoint(cfg.output_dir) if resume else None
    if checkpoint and cfg.distributed_config is not None:
        raise ValueError(f"distributed_config: output_dir holds {checkpoint}, and transformers' Trainer cannot resume "
                         "a model sharded while it loads; pass --no-resume (resume=False) or another output_dir")
    set_seed(cfg.seed)
    model, tokenizer = load_base(cfg)
    check_aux_loss(cfg, model.config)
    padding_side = tokenizer.padding_side
    trainer = build_trainer(cfg, model, tokenizer)
    check_world_size(trainer)
    enable_fsdp2_on_cpu(trainer)
    add_router_bias_callback(trainer, RouterBiasUpdateCallback(freeze_biases=cfg.router_biases == "freeze"))
    for position, callback in enumerate(callbacks, start=1):
        trainer.callback_handler.callbacks.insert(position, callback)
    if checkpoint:
        logger.warning(f"resuming from {checkpoint}")
    result = trainer.train(resume_from_checkpoint=checkpoint)
    history = list(trainer.state.log_history)
    curve = reward_curve(history) if cfg.recipe in RL_RECIPES else []
    trained = trained_model(cfg, trainer)  # on every process: under FSDP2 it gathers the shards
    if trainer.is_world_process_zero():  # one writer: every rank holds the same weights and biases
        final, adapter, saved = _save(cfg, trained, tokenizer, padding_side, curve)
    else:
        final = Path(cfg.output_dir) / "final"
        adapter = Path(cfg.output_dir) / "adapter" if cfg.peft is not None else None
        saved = trained
    summary = {
        "recipe": cfg.recipe, "config": posttrain_config_to_dict(cfg), "final": str(final),
        "adapter": None if adapter is None else str(adapter), "resumed_from": checkpoint,
        "global_step": trainer.state.global_step, "train_runtime": float(result.metrics.get("train_runtime", 0.0)),
        "reward_curve": curve, "log_history": history,
    }
    summary_path = Path(cfg.output_dir) / "summary.json"
    if trainer.is_world_process_zero():
        _write_json(summary_path, summary)
    trainer.accelerator.wait_for_everyone()  # no rank returns before final/ and summary.json exist
    return {**summary, "summary": str(summary_path), "model": saved, "trainer": trainer}
