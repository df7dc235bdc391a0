"""Generated post-training data for the task families: SFT conversations, RL prompts, preference pairs.

Everything here is produced from generated tasks
(:func:`kdamoe.posttraining.environments.keyhunt.make_keyhunt_tasks`,
:func:`kdamoe.posttraining.environments.arithmetic.make_tasks`) with a seed; nothing is downloaded. A task family is
a task class with ``prompt()``, ``to_json()``, ``answer``, ``calls_needed`` and ``episode_messages(steps)`` and its
environment class (:func:`kdamoe.posttraining.environments.environment_class`). Columns follow TRL's dataset formats
(https://huggingface.co/docs/trl/dataset_formats):

* SFT (conversational, with tools): ``messages`` (a full episode: user task, assistant tool calls, tool
  results, final assistant turn) and ``tools`` (JSON text of the tool schemas, as ``SFTTrainer`` reads it).
* GRPO / RLOO (prompt-only, conversational): ``prompt`` (the user message) and ``task`` (JSON, read by
  the environment's ``reset`` and by the reward functions), ``answer`` (int).
* DPO (preference, conversational): ``prompt``, ``chosen``, ``rejected`` (assistant / tool turns only) and
  ``tools``.

The demonstrations come from two scripted agents. The *careful* agent makes every tool call the task needs, feeding
each result into the next call, then submits. The *hasty* agent stops after a random number of calls (possibly none)
and submits the value it has so far — always a wrong answer. An SFT set mixes them (``hasty_fraction``): imitation
learns both behaviours in proportion, the environment's reward tells them apart — which is what the post-training
demo shows GRPO learning (docs/post-training.md).
"""

from __future__ import annotations

import json
import random

from datasets import Dataset

from .environments import task_tool_schemas


def user_message(task) -> dict:
    return {"role": "user", "content": task.prompt()}


def episode_messages(task, steps: int | None = None) -> list[dict]:
    """The assistant / tool turns of ``task``'s scripted episode (``task.episode_messages``): all the calls it
    needs (the careful agent), or only the first ``steps`` before submitting (the hasty agent)."""
    return task.episode_messages(steps)


def _tools_json(tasks) -> str:
    return json.dumps(task_tool_schemas(tasks))


def sft_dataset(tasks: list, *, hasty_fraction: float = 0.0, seed: int = 0) -> Dataset:
    """SFT conversations, one per task; a ``hasty_fraction`` share (random, fixed by ``seed``) by the hasty agent.

    Raises:
        ValueError: ``hasty_fraction`` outside ``[0, 1]``, no tasks, or tasks of two families.
    """
    if not 0.0 <= hasty_fraction <= 1.0:
        raise ValueError(f"hasty_fraction must be in [0, 1], got {hasty_fraction}")
    if not tasks:
        raise ValueError("sft_dataset needs at least one task")
    tools = _tools_json(tasks)
    rng = random.Random(seed)
    rows = []
    for task in tasks:
        steps = rng.randrange(task.calls_needed) if rng.random() < hasty_fraction else task.calls_needed
        rows.append({"messages": [user_message(task), *task.episode_messages(steps)], "tools": tools})
    return Dataset.from_list(rows)


def prompt_dataset(tasks: list) -> Dataset:
    """GRPO / RLOO prompts: ``prompt`` (conversational), ``task`` (JSON) and ``answer`` (the arithmetic result;
    ``None`` for a key hunt, whose reward comes from its environment alone)."""
    if not tasks:
        raise ValueError("prompt_dataset needs at least one task")
    _tools_json(tasks)
    return Dataset.from_list([{"prompt": [user_message(t)], "task": t.to_json(), "answer": getattr(t, "answer", None)}
                               for t in tasks])


def preference_dataset(tasks: list, seed: int = 0) -> Dataset:
    """DPO pairs: ``chosen`` = the careful agent's episode, ``rejected`` = a hasty one (random early stop)."""
    if not tasks:
        raise ValueError("preference_dataset needs at least one task")
    tools = _tools_json(tasks)
    rng = random.Random(seed)
    return Dataset.from_list([
        {"prompt": [user_message(t)], "chosen": t.episode_messages(),
         "rejected": t.episode_messages(rng.randrange(t.calls_needed)), "tools": tools}
        for t in tasks])
