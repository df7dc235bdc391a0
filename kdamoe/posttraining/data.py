"""Generated post-training data for the task families: SFT conversations, RL prompts, preference pairs.

Everything here is produced from generated tasks (:func:`kdamoe.posttraining.keyhunt.make_keyhunt_tasks`,
:func:`kdamoe.posttraining.environment.make_tasks`) with a seed; nothing is downloaded. A task family is a
task class with ``prompt()``, ``to_json()``, ``answer``, ``calls_needed`` and ``episode_messages(steps)`` and
its environment class (:func:`environment_class`). Columns follow TRL's dataset formats (https://huggingface.co/docs/trl/dataset_formats):

* SFT (conversational, with tools): ``messages`` (a full episode: user task, assistant tool calls, tool
  results, final assistant turn) and ``tools`` (JSON text of the tool schemas, as ``SFTTrainer`` reads it).
* GRPO / RLOO (prompt-only, conversational): ``prompt`` (the user message) and ``task`` (JSON, read by
  the environment's ``reset`` and by the reward functions), ``answer`` (int).
* DPO (preference, conversational): ``prompt``, ``chosen``, ``rejected`` (assistant / tool turns only) and
  ``tools``.

The demonstrations come from two scripted agents. The *careful* agent makes every tool call the task
needs, feeding each result into the next call, then submits. The *hasty* agent stops after a random number
of calls (possibly none) and submits the value it has so far — always a wrong answer. An SFT set mixes them
(``hasty_fraction``): imitation learns both behaviours in proportion, the environment's reward tells them
apart — which is what the post-training demo shows GRPO learning (docs/post-training.md).
"""

from __future__ import annotations

import inspect
import json
import random

from datasets import Dataset
from transformers.utils import get_json_schema

from .environment import ArithmeticEnvironment, ArithmeticTask, make_tasks
from .keyhunt import KeyHuntEnvironment, KeyHuntTask, make_keyhunt_tasks

ENVIRONMENTS = {"keyhunt": (KeyHuntTask, KeyHuntEnvironment), "arithmetic": (ArithmeticTask, ArithmeticEnvironment)}


def make_family_tasks(environment: str, n: int, seed: int, *, min_calls: int = 1, max_calls: int = 3,
                      max_operand: int = 9, exclude: set | None = None) -> list:
    """``n`` distinct tasks of one family that need ``min_calls``–``max_calls`` tool calls before ``submit``.

    ``environment="keyhunt"``: :func:`~kdamoe.posttraining.keyhunt.make_keyhunt_tasks` with rooms = calls;
    ``"arithmetic"``: :func:`~kdamoe.posttraining.environment.make_tasks` with operations = calls and operands in
    ``[2, max_operand]``.

    Raises:
        ValueError: an unknown ``environment`` or a range the family's generator refuses.
    """
    if environment == "keyhunt":
        return make_keyhunt_tasks(n, seed, min_rooms=min_calls, max_rooms=max_calls, exclude=exclude)
    if environment == "arithmetic":
        return make_tasks(n, seed, min_ops=min_calls, max_ops=max_calls, max_operand=max_operand, exclude=exclude)
    raise ValueError(f"environment={environment!r} is not one of {list(ENVIRONMENTS)}")


def environment_class(task) -> type:
    """The environment class of a task (by its type). Raises ``ValueError`` for an unknown task type."""
    for task_cls, env_cls in ENVIRONMENTS.values():
        if isinstance(task, task_cls):
            return env_cls
    raise ValueError(f"no environment for task type {type(task).__name__}; known: {list(ENVIRONMENTS)}")


def environment_tools(env) -> list:
    """The bound tool methods of an environment instance, in TRL's order: public functions of its class
    other than ``reset`` / ``get_reward``, as ``inspect.getmembers`` lists them (alphabetical)."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def tool_schemas(env_cls: type) -> list[dict]:
    """JSON schemas of an environment's tools, exactly as TRL renders them for ``environment_factory``
    (:func:`environment_tools` through transformers' ``get_json_schema``)."""
    return [get_json_schema(tool) for tool in environment_tools(env_cls())]


def task_tool_schemas(tasks: list) -> list[dict]:
    """:func:`tool_schemas` of the one environment the ``tasks`` belong to.

    Raises:
        ValueError: the tasks belong to two environments.
    """
    classes = {environment_class(t) for t in tasks}
    if len(classes) != 1:
        raise ValueError(f"tasks mix environments {sorted(c.__name__ for c in classes)}; use one family per dataset")
    return tool_schemas(classes.pop())


def tool_call_message(name: str, arguments: dict) -> dict:
    """An assistant turn with one tool call. The arguments are JSON text: the chat template writes a string
    as-is, so the rendered call is byte-identical to a dict rendered by ``tojson`` (``json.dumps`` defaults)
    — what the model sees at training time equals what TRL renders from a parsed call — and Arrow needs no
    union schema across tools with different arguments."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def tool_result_message(name: str, value) -> dict:
    return {"role": "tool", "name": name, "content": str(value)}


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
