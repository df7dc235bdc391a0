"""The post-training environments and their registry: a task family is a task class (``prompt()``, ``to_json()`` /
``from_json``, ``answer``, ``calls_needed``, ``episode_messages(steps)``) and an environment class in TRL's
``environment_factory`` shape (``reset(**row)``, public tool methods, ``get_reward()``), one module each:

* ``arithmetic`` — :class:`~.arithmetic.ArithmeticTask` / :class:`~.arithmetic.ArithmeticEnvironment`: a chain of
  calculator operations, one tool call per operation, then ``submit``;
* ``keyhunt`` — :class:`~.keyhunt.KeyHuntTask` / :class:`~.keyhunt.KeyHuntEnvironment`: open doors until the room
  with the key, then ``take_key`` (the post-training demo's environment).

:data:`ENVIRONMENTS` maps the config's ``data.environment`` names to ``(task class, environment class)``.
"""

from __future__ import annotations

import inspect

from transformers.utils import get_json_schema

from .arithmetic import ArithmeticEnvironment, ArithmeticTask, make_tasks
from .keyhunt import KeyHuntEnvironment, KeyHuntTask, make_keyhunt_tasks

ENVIRONMENTS = {"keyhunt": (KeyHuntTask, KeyHuntEnvironment), "arithmetic": (ArithmeticTask, ArithmeticEnvironment)}


def make_family_tasks(environment: str, n: int, seed: int, *, min_calls: int = 1, max_calls: int = 3,
                      max_operand: int = 9, exclude: set | None = None) -> list:
    """``n`` distinct tasks of one family that need ``min_calls``–``max_calls`` tool calls before ``submit``.

    ``environment="keyhunt"``: :func:`~.keyhunt.make_keyhunt_tasks` with rooms = calls;
    ``"arithmetic"``: :func:`~.arithmetic.make_tasks` with operations = calls and operands in
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
