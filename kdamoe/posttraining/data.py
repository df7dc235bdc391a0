"""Generated post-training data for the arithmetic environment: SFT conversations, RL prompts, preference pairs.

Everything here is produced from :func:`kdamoe.posttraining.environment.make_tasks` with a seed; nothing
is downloaded. Columns follow TRL's dataset formats (https://huggingface.co/docs/trl/dataset_formats):

* SFT (conversational, with tools): ``messages`` (a full episode: user task, assistant tool calls, tool
  results, final assistant turn) and ``tools`` (JSON text of the tool schemas, as ``SFTTrainer`` reads it).
* GRPO / RLOO (prompt-only, conversational): ``prompt`` (the user message) and ``task`` (JSON, read by
  :meth:`ArithmeticEnvironment.reset` and by the reward functions), ``answer`` (int).
* DPO (preference, conversational): ``prompt``, ``chosen``, ``rejected`` (assistant / tool turns only) and
  ``tools``.

The demonstrations come from two scripted agents. The *careful* agent calls one calculator tool per
operation, feeding each result into the next call, then submits the last result. The *hasty* agent stops
after a random number of steps (possibly none) and submits the value it has so far. An SFT set mixes them
(``hasty_fraction``): imitation learns both behaviours in proportion, the environment's reward tells them
apart — which is what the post-training demo shows GRPO learning (docs/post-training.md).
"""

from __future__ import annotations

import json
import random

from datasets import Dataset

from .environment import ArithmeticEnvironment, ArithmeticTask

SYSTEM_PROMPT = None  # the chat template's tool preamble already says how to call tools


def tool_schemas() -> list[dict]:
    """JSON schemas of the environment's tools, exactly as TRL renders them for ``environment_factory``
    (public methods in ``inspect.getmembers`` order — alphabetical — through transformers' ``get_json_schema``)."""
    import inspect

    from transformers.utils import get_json_schema

    env = ArithmeticEnvironment()
    names = [n for n, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
             if n not in ("reset", "get_reward") and not n.startswith("_")]
    return [get_json_schema(getattr(env, n)) for n in names]


def _call(name: str, arguments: dict) -> dict:
    # Arguments as JSON text: the chat template writes a string as-is, so the rendered call is
    # byte-identical to a dict rendered by `tojson` (json.dumps defaults) and Arrow needs no union schema.
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _result(name: str, value) -> dict:
    return {"role": "tool", "name": name, "content": str(value)}


def episode_messages(task: ArithmeticTask, steps: int | None = None) -> list[dict]:
    """The assistant / tool turns of an episode that carries out the first ``steps`` operations
    (default: all of them) and then submits the value reached. ``steps < task.n_ops`` is the hasty agent."""
    steps = task.n_ops if steps is None else steps
    if not 0 <= steps <= task.n_ops:
        raise ValueError(f"steps={steps} outside [0, {task.n_ops}]")
    values, out = task.values(), []
    for (name, operand), current, result in zip(task.ops[:steps], values, values[1:]):
        out += [_call(name, {"a": current, "b": operand}), _result(name, result)]
    out += [_call("submit", {"answer": values[steps]}), _result("submit", "submitted"),
            {"role": "assistant", "content": "Done."}]
    return out


def user_message(task: ArithmeticTask) -> dict:
    return {"role": "user", "content": task.prompt()}


def sft_dataset(tasks: list[ArithmeticTask], *, hasty_fraction: float = 0.0, seed: int = 0) -> Dataset:
    """SFT conversations, one per task; a ``hasty_fraction`` share (random, fixed by ``seed``) by the hasty agent.

    Raises:
        ValueError: ``hasty_fraction`` outside ``[0, 1]`` or no tasks.
    """
    if not 0.0 <= hasty_fraction <= 1.0:
        raise ValueError(f"hasty_fraction must be in [0, 1], got {hasty_fraction}")
    if not tasks:
        raise ValueError("sft_dataset needs at least one task")
    rng = random.Random(seed)
    tools = json.dumps(tool_schemas())
    rows = []
    for task in tasks:
        steps = rng.randrange(task.n_ops) if rng.random() < hasty_fraction else task.n_ops
        rows.append({"messages": [user_message(task), *episode_messages(task, steps)], "tools": tools})
    return Dataset.from_list(rows)


def prompt_dataset(tasks: list[ArithmeticTask]) -> Dataset:
    """GRPO / RLOO prompts: ``prompt`` (conversational), ``task`` (JSON) and ``answer``."""
    if not tasks:
        raise ValueError("prompt_dataset needs at least one task")
    return Dataset.from_list([{"prompt": [user_message(t)], "task": t.to_json(), "answer": t.answer} for t in tasks])


def preference_dataset(tasks: list[ArithmeticTask], seed: int = 0) -> Dataset:
    """DPO pairs: ``chosen`` = the careful agent's episode, ``rejected`` = a hasty one (random early stop)."""
    if not tasks:
        raise ValueError("preference_dataset needs at least one task")
    rng = random.Random(seed)
    tools = json.dumps(tool_schemas())
    return Dataset.from_list([
        {"prompt": [user_message(t)], "chosen": episode_messages(t),
         "rejected": episode_messages(t, rng.randrange(t.n_ops)), "tools": tools}
        for t in tasks])
