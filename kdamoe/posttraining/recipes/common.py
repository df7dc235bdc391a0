"""What every recipe shares: the TRL config with safe defaults, device defaults, the aux-loss check, the LoRA
config, the generated tasks and the completion budget of the RL recipes.

Safe defaults (:func:`trainer_args`), overridden by the recipe's own and then by the YAML's ``trainer:``:

* precision by device (:func:`device_defaults`): TRL configs default to ``bf16=True`` even on a CPU, where it
  would train in an autocast the CPU run never asked for; CPU → float32 with ``use_cpu=True``, a CUDA device
  with bfloat16 → ``bf16=True``;
* ``router_aux_loss_coef=0.0`` where the config has the field: Quantile Balancing moves the router biases, and
  the softmax aux loss would fight it (docs/architecture.md §4);
* ``report_to="none"``, ``save_strategy="steps"`` (the Trainer also saves at the last step, so a run is
  resumable from ``output_dir/checkpoint-N``), ``save_total_limit=2``, ``logging_steps=1``, ``seed=cfg.seed``;
  with ``distributed_config`` ``save_strategy="no"``: transformers' Trainer refuses to checkpoint a model sharded
  while it loads (its optimizer state cannot be saved), and ``final/`` is written at the end.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..data import episode_messages, user_message
from ..environments import make_family_tasks, task_tool_schemas

logger = logging.getLogger(__name__)

# Tokens on top of the longest careful episode: a policy that phrases a call a little differently still fits.
COMPLETION_MARGIN = 32


def device_defaults() -> dict:
    """Precision keywords of a TRL / ``TrainingArguments`` config for this machine's device.

    Returns ``{"use_cpu": True, "bf16": False, "fp16": False, "activation_checkpointing": False}`` without CUDA,
    ``{"bf16": True, "fp16": False}`` on a CUDA device that supports bfloat16, else ``{"bf16": False, "fp16": False}``
    (float32).
    """
    if not torch.cuda.is_available():
        # TRL turns activation checkpointing on by default; the small CPU models have no activation memory to
        # save and would pay a second forward per step.
        return {"use_cpu": True, "bf16": False, "fp16": False, "activation_checkpointing": False}
    return {"bf16": bool(torch.cuda.is_bf16_supported()), "fp16": False}


# transformers 5.24 renamed these (the old names still work, with a FutureWarning); given both, the new one wins
# silently, so a user's old-name setting would lose to a recipe default under the new name
_CHECKPOINTING_NAMES = {"activation_checkpointing": "gradient_checkpointing",
                        "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs"}


def _checkpointing_names(user: dict, fields: set) -> dict:
    """The user's ``trainer`` keys with the deprecated checkpointing names renamed to the current ones (when the
    config class has them).

    Raises:
        ValueError: both names of one setting are given.
    """
    if "activation_checkpointing" not in fields:
        return user
    for new, old in _CHECKPOINTING_NAMES.items():
        if old in user:
            if new in user:
                raise ValueError(f"config field trainer.{old}: give one of {old} (deprecated) and {new}, not both")
            user[new] = user.pop(old)
    return user


def trainer_args(cfg, config_class: type, trainer: dict | None = None, **recipe_defaults):
    """The recipe's TRL config: safe defaults (module docstring) < ``recipe_defaults`` < ``trainer``.

    Args:
        cfg: the :class:`~kdamoe.posttraining.config.PostTrainConfig`.
        config_class: a ``TrainingArguments`` subclass (``trl.SFTConfig``, ``trl.GRPOConfig``, ...).
        trainer: the user's keyword arguments (default ``cfg.trainer``; PPO passes ``{}`` for its reward model's
            ``RewardConfig``, which ``cfg.trainer`` does not describe).
        recipe_defaults: the recipe's own defaults (e.g. ``assistant_only_loss=True``); ``output_dir`` may be
            among them (PPO's reward model trains in a sub-folder).
    Returns:
        An instance of ``config_class`` with ``output_dir=cfg.output_dir`` and ``seed=cfg.seed``.
    Raises:
        ValueError: naming the ``trainer`` section when the class rejects a key or a value.
    """
    fields = {f.name for f in dataclasses.fields(config_class)}
    kwargs = dict(report_to="none", save_strategy="steps" if cfg.distributed_config is None else "no",
                  save_total_limit=2, logging_steps=1)
    kwargs.update(device_defaults())
    if "router_aux_loss_coef" in fields:
        kwargs["router_aux_loss_coef"] = 0.0
    kwargs.update(output_dir=cfg.output_dir)
    kwargs.update(recipe_defaults)
    kwargs.update(_checkpointing_names(dict(cfg.trainer if trainer is None else trainer), fields))
    kwargs.update(seed=cfg.seed)
    if "activation_checkpointing" not in fields:  # an older transformers (the PPO venv): only the old names
        for new, old in _CHECKPOINTING_NAMES.items():
            if new in kwargs:
                kwargs[old] = kwargs.pop(new)
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(f"config field trainer.{unknown[0]}: not a field of {config_class.__name__}")
    try:
        return config_class(**kwargs)
    except (TypeError, ValueError) as err:
        user = cfg.trainer if trainer is None else trainer
        raise ValueError(f"config field trainer ({config_class.__name__}): {err}"
                         f"{_yaml_bool_hint(config_class, user, str(err))}") from err


def _yaml_bool_hint(config_class: type, user: dict, message: str) -> str:
    """A hint for a ``true`` / ``false`` the user gave to a field that is not a plain bool, when the class's message
    names that value: YAML 1.1 reads the words no, off, yes and on as booleans, so ``--set trainer.save_strategy=no``
    passes ``False``, not the strategy "no"."""
    types = {f.name: f.type for f in dataclasses.fields(config_class)}
    for key, value in user.items():
        if isinstance(value, bool) and types.get(key) not in (bool, "bool") and str(value) in message:
            return (f" (trainer.{key} is {value}: YAML reads no / off / yes / on as false / true; quote the word, "
                    f"e.g. --set \"trainer.{key}='no'\")")
    return ""


def check_aux_loss(cfg, model_config) -> None:
    """Refuse a softmax load-balancing aux loss next to router-bias balancing.

    The coefficient is ``cfg.trainer["router_aux_loss_coef"]`` when set, else the model config's own.

    Raises:
        ValueError: the coefficient is nonzero while ``model_config.router_bias_update != "none"``.
    """
    coef = cfg.trainer.get("router_aux_loss_coef")
    source = "trainer.router_aux_loss_coef"
    if coef is None:
        coef, source = getattr(model_config, "router_aux_loss_coef", 0.0), "the model's router_aux_loss_coef"
    mode = getattr(model_config, "router_bias_update", "none")
    if coef and mode != "none":
        raise ValueError(f"{source}={coef}: the model balances experts with router_bias_update={mode!r} "
                         "(Quantile Balancing replaces the aux loss); set it to 0.0")


def peft_config(cfg):
    """``peft.LoraConfig`` of the ``peft`` section, or ``None`` for full fine-tuning (see ``config.lora_config``)."""
    return None if cfg.peft is None else lora_config(cfg.peft)


def training_tasks(cfg) -> list:
    """The recipe's tasks, from ``cfg.data`` (:func:`~kdamoe.posttraining.data.make_family_tasks`)."""
    d = cfg.data
    return make_family_tasks(d.environment, d.num_tasks, d.seed, min_calls=d.min_calls, max_calls=d.max_calls,
                             max_operand=d.max_operand)


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def episode_token_lengths(tokenizer, tasks: list, with_tools: bool) -> list[tuple[int, int]]:
    """``(prompt tokens, completion tokens)`` of each task's careful episode, rendered with the chat template.

    The prompt is the user turn plus the generation prompt (and the tool preamble when ``with_tools``); the
    completion is everything after it — assistant calls *and* tool results, which TRL's tool loop counts in
    ``max_completion_length``.
    """
    tools = task_tool_schemas(tasks) if with_tools else None
    out = []
    for task in tasks:
        prompt = [user_message(task)]
        p = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(prompt + episode_messages(task), tools=tools, tokenize=False)
        n_prompt = _n_tokens(tokenizer, p)
        out.append((n_prompt, _n_tokens(tokenizer, full) - n_prompt))
    return out


def check_episodes_fit(cfg, tokenizer, model_config, tasks: list, what: str) -> int:
    """The longest careful episode of ``tasks`` in tokens (prompt with tools + completion); SFT and DPO train on
    whole episodes, and a cut one would teach calls without their end.

    Raises:
        ValueError: it is longer than ``model_config.max_position_embeddings`` (``what`` names the data in the
            message, e.g. "SFT episode").
    """
    limit = model_config.max_position_embeddings
    longest = max(p + c for p, c in episode_token_lengths(tokenizer, tasks, with_tools=True))
    if longest > limit:
        raise ValueError(f"data.max_calls={cfg.data.max_calls}: the longest {what} has {longest} tokens, more than "
                         f"the model's max_position_embeddings={limit}")
    return longest


def completion_budget(cfg, tokenizer, model_config, tasks: list, with_tools: bool) -> int:
    """``max_completion_length`` of a GRPO / RLOO run, checked against the context.

    Default (``cfg.trainer`` sets none): the longest careful episode's completion over ``tasks`` (tool results
    included) + :data:`COMPLETION_MARGIN`. A budget shorter than that longest completion is allowed (with a
    warning: long episodes get cut).

    Raises:
        ValueError: the longest prompt + the budget reaches ``model_config.max_position_embeddings``: TRL's tool
            loop then drops tool results silently (it stops a rollout whose sequence reaches that length).
    """
    lengths = episode_token_lengths(tokenizer, tasks, with_tools)
    longest_prompt = max(p for p, _ in lengths)
    longest_completion = max(c for _, c in lengths)
    budget = cfg.trainer.get("max_completion_length")
    budget = longest_completion + COMPLETION_MARGIN if budget is None else int(budget)
    limit = model_config.max_position_embeddings
    if longest_prompt + budget >= limit:
        raise ValueError(
            f"max_completion_length={budget}: the longest prompt ({longest_prompt} tokens) plus it reaches the "
            f"model's max_position_embeddings={limit}; TRL's tool loop would drop tool results past that. Lower "
            f"data.max_calls (now {cfg.data.max_calls}) or trainer.max_completion_length")
    if budget < longest_completion:
        logger.warning(f"max_completion_length={budget} is shorter than the longest careful episode "
                       f"({longest_completion} tokens): such episodes are cut before they submit")
    return budget


def lora_config(section: dict[str, Any]):
    """``peft.LoraConfig(**section)`` with ``task_type="CAUSAL_LM"`` by default.

    Raises:
        ValueError: naming the section when LoraConfig rejects a key or a value.
    """
    from peft import LoraConfig  # noqa: PLC0415 (peft is absent from the PPO venv, requirements-ppo.txt, whose recipe imports this module)

    try:
        return LoraConfig(**{"task_type": "CAUSAL_LM", **section})
    except (TypeError, ValueError) as err:
        raise ValueError(f"config field peft: {err}") from err
