"""GRPO recipe: TRL's ``GRPOTrainer`` (Shao et al. 2024, arXiv:2402.03300) on the generated tasks, in three modes.

* ``environment`` — ``environment_factory=`` the data's environment class (``KeyHuntEnvironment`` or
  ``ArithmeticEnvironment``): one environment per rollout, reset from
  the row's ``task`` column; its public methods are the tools and its ``get_reward()`` (computed from what the
  tools saw, not from the text) is the reward.
* ``tools`` — ``tools=[add, multiply, submit]`` (arithmetic tasks only): stateless calculator functions (the same signatures and
  docstrings as the environment's, so the prompt is the one SFT trained on); reward
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
"""

from __future__ import annotations

import re

from trl import GRPOConfig, GRPOTrainer

from ..data import prompt_dataset
from ..data import ENVIRONMENTS
from ..environment import _as_int
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
    for completion, want in zip(completions, answer):
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
    for completion, want in zip(completions, answer):
        numbers = _INTEGER.findall(_text(completion))
        out.append(float(bool(numbers) and int(numbers[-1]) == want))
    return out


# --------------------------------------------------------------------------------------------- trainer


def build_trainer(cfg, model, tokenizer) -> GRPOTrainer:
    """``GRPOTrainer`` (or, for ``cfg.grpo.rollout == "cached"``, ``CachedRolloutGRPOTrainer``) for
    ``cfg.grpo.mode`` (module docstring); the tokenizer pads on the left (TRL requires it).

    Raises:
        ValueError: the completion budget does not fit the model's context (``common.completion_budget``).
    """
    mode = cfg.grpo.mode
    tasks = training_tasks(cfg)
    budget = completion_budget(cfg, tokenizer, model.config, tasks, with_tools=mode != "single_turn")
    defaults = dict(max_completion_length=budget)
    if mode != "single_turn":
        defaults["max_tool_calling_iterations"] = cfg.data.max_calls + 2
    args = trainer_args(cfg, GRPOConfig, **defaults)
    tokenizer.padding_side = "left"
    kwargs = dict(model=model, args=args, train_dataset=prompt_dataset(tasks), processing_class=tokenizer,
                  peft_config=peft_config(cfg))
    if mode == "environment":
        kwargs["environment_factory"] = ENVIRONMENTS[cfg.data.environment][1]
    elif mode == "tools":
        kwargs.update(tools=TOOLS, reward_funcs=[submitted_answer_reward])
    else:
        kwargs["reward_funcs"] = [stated_answer_reward]
    trainer_class = CachedRolloutGRPOTrainer if cfg.grpo.rollout == "cached" else GRPOTrainer
    return trainer_class(**kwargs)
