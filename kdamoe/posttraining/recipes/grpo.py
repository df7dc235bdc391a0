"""GRPO recipe: TRL's ``GRPOTrainer`` (Shao et al. 2024, arXiv:2402.03300) on the generated tasks, in three modes.

* ``environment`` — ``environment_factory=`` the data's environment class (``KeyHuntEnvironment`` or
  ``ArithmeticEnvironment``): one environment per rollout, reset from
  the row's ``task`` column; its public methods are the tools and its ``get_reward()`` (computed from what the
  tools saw, not from the text) is the reward.
* ``tools`` — ``tools=[add, multiply, submit]`` (arithmetic tasks only): stateless calculator functions (the
  same signatures and docstrings as the environment's, so the prompt is the one SFT trained on); reward
  :func:`submitted_answer_reward`: 1.0 when the last ``submit`` call of the completion passes the row's
  ``answer``.
* ``single_turn`` — no tools; reward :func:`stated_answer_reward`: 1.0 when the last integer in the
  completion's text is the answer.

Rollouts (``grpo.rollout``): ``trl`` builds TRL's ``GRPOTrainer`` (its own tool loop); ``cached`` builds
:class:`~kdamoe.posttraining.rollout.CachedRolloutGRPOTrainer`, whose rollouts continue each conversation's cache
turn by turn (the same tokens as TRL's loop under greedy decoding; :mod:`kdamoe.posttraining.rollout`).

Budget: TRL counts the whole multi-turn completion (tool results included) in ``max_completion_length`` and
stops a rollout at ``model.config.max_position_embeddings``; the default budget and its check are
:func:`kdamoe.posttraining.recipes.common.completion_budget`. ``max_tool_calling_iterations`` defaults to
``data.max_calls + 2`` (the calls a task needs, ``submit``, and one spare).

``grpo.long_context: true`` (:func:`long_context_defaults`): the memory-bounded update of long trajectories, with
:class:`~kdamoe.posttraining.long_update.LongContextGRPOTrainer` (each row scored without its padding).
"""

from __future__ import annotations

import re

from trl import GRPOConfig, GRPOTrainer

from ..chat_formats import attach_response_template
from ..data import prompt_dataset
from ..environments import ENVIRONMENTS
from ..environments.arithmetic import _as_int
from ..long_update import LongContextGRPOTrainer
from ..rollout import CachedRolloutGRPOTrainer
from .common import completion_budget, peft_config, trainer_args, training_tasks

CONFIG_CLASS = GRPOConfig
_INTEGER = re.compile(r"-?\d+")


# --------------------------------------------------------------------------------- tools of mode "tools"
# Their schemas (transformers' get_json_schema of the signature + docstring) equal the environment's, which
# `kdamoe.posttraining.data.tool_schemas` renders into the SFT data: a test checks it.


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum a + b.
    """
    return _as_int(a, "a") + _as_int(b, "b")


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The product a * b.
    """
    return _as_int(a, "a") * _as_int(b, "b")


def submit(answer: int) -> str:
    """Submit the final result. This ends the task.

    Args:
        answer: The final number.

    Returns:
        A confirmation.
    """
    _as_int(answer, "answer")
    return "submitted"


TOOLS = [add, multiply, submit]


# --------------------------------------------------------------------------------------------- rewards


def _submitted_value(completion: list[dict]):
    """The argument of the last ``submit`` tool call in a conversational completion, or ``None``."""
    value = None
    for message in completion:
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            if function.get("name") == "submit" and isinstance(function.get("arguments"), dict):
                value = function["arguments"].get("answer")
    return value


def submitted_answer_reward(completions: list[list[dict]], answer: list[int], **kwargs) -> list[float]:
    """Mode ``tools``: 1.0 when the completion's last ``submit`` call passes the row's ``answer`` (an int, or
    text of one), else 0.0. ``completions``: TRL's conversational completions (assistant and tool messages)."""
    out = []
    for completion, want in zip(completions, answer, strict=True):
        value = _submitted_value(completion)
        try:
            out.append(float(value is not None and _as_int(value, "answer") == want))
        except ValueError:
            out.append(0.0)
    return out


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if isinstance(m.get("content"), str))


def stated_answer_reward(completions, answer: list[int], **kwargs) -> list[float]:
    """Mode ``single_turn`` (and RLOO): 1.0 when the last integer written in the completion equals ``answer``.

    ``completions``: conversational (a list of messages; their ``content`` is read) or plain text.
    """
    out = []
    for completion, want in zip(completions, answer, strict=True):
        numbers = _INTEGER.findall(_text(completion))
        out.append(float(bool(numbers) and int(numbers[-1]) == want))
    return out


# --------------------------------------------------------------------------------------------- trainer


def long_context_defaults(model_config) -> dict:
    """Trainer defaults of ``grpo.long_context: true``, after checking that the model's no-grad passes chunk.

    What bounds the memory of a long trajectory's update (docs/post-training.md, "Long-horizon agentic RL"):

    * the log-probs and entropies: TRL's ``add_fused_lm_head``, which ``GRPOTrainer`` installs on the policy and the
      reference model whatever this setting; ``trl.kernels.ChunkedLogProbFunction`` projects through the LM head in
      tiles of 4,096 tokens x 32,768 vocabulary columns and recomputes each tile in its backward, so no
      ``[T, vocab]`` logits exist, forward or backward;
    * the training forward: activation checkpointing per decoder layer (``GradientCheckpointingLayer``), which
      keeps only each layer's input; TRL turns it on by default, but :func:`.common.device_defaults` turns it off
      on a CPU, so it is set here again;
    * the reference-model and old-policy log-probs: no-grad forwards, which our backbone runs in chunks of
      ``config.prefill_chunk_size`` tokens (docs/long-context.md);
    * the padding: :class:`~kdamoe.posttraining.long_update.LongContextGRPOTrainer` scores each row without it, so
      no ``[T, T]`` attention mask is built.

    Args:
        model_config: the policy's :class:`~kdamoe.KDAMoEConfig`.
    Returns:
        ``{"activation_checkpointing": True}`` (the recipe's default; ``trainer:`` may still override it, which
        :func:`check_long_context_args` then refuses).
    Raises:
        ValueError: ``model_config.prefill_chunk_size`` is 0 or None (the no-grad passes would keep every layer's
            activations of the whole trajectory at once), or ``model_config.output_router_logits`` is true (TRL's
            fused head then asks every forward for router logits, which a chunked forward refuses).
    """
    chunk = getattr(model_config, "prefill_chunk_size", None)
    if not chunk:
        raise ValueError(f"grpo.long_context: the model's prefill_chunk_size={chunk} runs the reference and "
                         "old-policy passes in one pass; set it to a positive number of tokens (default 32768)")
    if getattr(model_config, "output_router_logits", False):
        raise ValueError("grpo.long_context: the model's output_router_logits=True makes TRL's fused head request "
                         "router logits, which a chunked no-grad forward refuses; set it to False (Quantile "
                         "Balancing needs no aux loss)")
    return {"activation_checkpointing": True}


def check_long_context_args(args) -> None:
    """Refuse a ``grpo.long_context: true`` run whose ``trainer:`` section turned activation checkpointing off.

    Raises:
        ValueError: ``args.activation_checkpointing`` is false.
    """
    if not args.activation_checkpointing:
        raise ValueError("grpo.long_context: true needs activation checkpointing per layer; the trainer section "
                         "sets activation_checkpointing=False (or gradient_checkpointing=False)")



def build_trainer(cfg, model, tokenizer) -> GRPOTrainer:
    """The GRPO trainer for ``cfg.grpo.mode`` (module docstring); the tokenizer pads on the left (TRL requires it).
    In the tool modes the tokenizer gets the ``response_template`` TRL parses tool calls with, when it has none
    (:func:`~kdamoe.posttraining.chat_formats.attach_response_template`: Kimi's format, or one TRL knows).
    Its class is :func:`trainer_class`'s: ``GRPOTrainer``, with the cached rollout for ``cfg.grpo.rollout ==
    "cached"`` (:class:`~kdamoe.posttraining.rollout.CachedRolloutGRPOTrainer`), with the memory-bounded update for
    ``cfg.grpo.long_context`` (:class:`~kdamoe.posttraining.long_update.LongContextGRPOTrainer`), or both.

    Raises:
        ValueError: the completion budget does not fit the model's context (``common.completion_budget``), or
            ``grpo.long_context`` is set for a model or trainer section it cannot bound
            (:func:`long_context_defaults`, :func:`check_long_context_args`); a tool mode with a tokenizer whose
            chat format is unknown (no tool call could be parsed).
    """
    mode = cfg.grpo.mode
    if mode != "single_turn":  # before TRL's trainer, whose own fallback knows no Kimi template
        attach_response_template(tokenizer, needs_tool_calls=True)
    tasks = training_tasks(cfg)
    budget = completion_budget(cfg, tokenizer, model.config, tasks, with_tools=mode != "single_turn")
    defaults = dict(max_completion_length=budget)
    if mode != "single_turn":
        defaults["max_tool_calling_iterations"] = cfg.data.max_calls + 2
    if cfg.grpo.long_context:
        defaults.update(long_context_defaults(model.config))
    args = trainer_args(cfg, GRPOConfig, **defaults)
    if cfg.grpo.long_context:
        check_long_context_args(args)
    tokenizer.padding_side = "left"
    kwargs = dict(model=model, args=args, train_dataset=prompt_dataset(tasks), processing_class=tokenizer,
                  peft_config=peft_config(cfg))
    if mode == "environment":
        kwargs["environment_factory"] = ENVIRONMENTS[cfg.data.environment][1]
    elif mode == "tools":
        kwargs.update(tools=TOOLS, reward_funcs=[submitted_answer_reward])
    else:
        kwargs["reward_funcs"] = [stated_answer_reward]
    return trainer_class(cfg.grpo)(**kwargs)


class CachedRolloutLongContextGRPOTrainer(CachedRolloutGRPOTrainer, LongContextGRPOTrainer):
    """``grpo.rollout: cached`` with ``grpo.long_context: true``: the cached rollouts' ``_tool_call_loop`` and the
    memory-bounded update's ``_get_per_token_logps_and_entropies`` (they override different methods)."""


def trainer_class(section) -> type:
    """The TRL trainer class for a :class:`~kdamoe.posttraining.config.GRPOSection`: ``GRPOTrainer``, or the
    subclass that adds the cached rollout (``rollout: cached``), the memory-bounded update (``long_context: true``)
    or both."""
    classes = {(False, False): GRPOTrainer, (True, False): CachedRolloutGRPOTrainer,
               (False, True): LongContextGRPOTrainer, (True, True): CachedRolloutLongContextGRPOTrainer}
    return classes[(section.rollout == "cached", bool(section.long_context))]
