"""An agentic environment that needs no network: chained arithmetic with calculator tools.

A task is a chain of ``n_ops`` operations on integers, e.g. *"Start with 7, add 5, then multiply by
3. Submit the result."* The agent must call ``add`` / ``multiply`` once per operation, feeding each
tool result into the next call (it cannot do the arithmetic itself: a result is only known from the
tool), then call ``submit`` with the final value. The environment keeps what happened in its state
(the calls, their operands, the submitted value), and :meth:`ArithmeticEnvironment.get_reward` scores
the episode from that state, so the reward cannot be earned by text that merely looks right.

The class follows TRL's ``environment_factory`` contract (``GRPOTrainer(environment_factory=...)``,
TRL >= 1.14): ``reset(**row)`` starts an episode from a dataset row (the row's ``task`` column, a
JSON string written by :meth:`ArithmeticTask.to_json`), its public methods are the tools (type
hints + Google-style docstrings, which transformers turns into the JSON schema the chat template
renders), and ``get_reward()`` returns the episode's reward. The same class drives our own
evaluation loop (:mod:`kdamoe.posttraining.agent`) so training and evaluation score episodes
identically.

Reward (one number in ``[0, 1]``): ``1.0`` when the submitted value equals the chain's result and every
operation was carried out with the tools, in order, with the right operands (a right number typed without
the tools earns no more than partial credit); otherwise ``0.5 × (operations carried out correctly, in order) / n_ops``,
a partial credit that separates an agent that did some of the work from one that did none (GRPO needs differences
within a group to learn anything).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from .messages import tool_call_message, tool_result_message

OPERATIONS = ("add", "multiply")
_PHRASES = {"add": "add {}", "multiply": "multiply by {}"}


@dataclass(frozen=True)
class ArithmeticTask:
    """One chained-arithmetic task.

    Attributes:
        start: the starting integer.
        ops: the operations in order, each ``(name, operand)`` with ``name`` in :data:`OPERATIONS`.
    """

    start: int
    ops: tuple[tuple[str, int], ...]

    def __post_init__(self):
        if not self.ops:
            raise ValueError("ArithmeticTask.ops must hold at least one operation")
        for name, operand in self.ops:
            if name not in OPERATIONS:
                raise ValueError(f"ArithmeticTask: operation {name!r} is not one of {OPERATIONS}")
            if not isinstance(operand, int) or isinstance(operand, bool):
                raise ValueError(f"ArithmeticTask: operand {operand!r} of {name} is not an int")
        if not isinstance(self.start, int) or isinstance(self.start, bool):
            raise ValueError(f"ArithmeticTask.start={self.start!r} is not an int")

    @property
    def n_ops(self) -> int:
        """Calculator calls the task needs (``submit`` not counted)."""
        return len(self.ops)

    @property
    def calls_needed(self) -> int:
        """Tool calls before ``submit`` (the common name across task families)."""
        return len(self.ops)

    def values(self) -> list[int]:
        """``[start, after op 1, ..., after op n]``: the chain's intermediate results."""
        out = [self.start]
        for name, operand in self.ops:
            out.append(apply_operation(name, out[-1], operand))
        return out

    @property
    def answer(self) -> int:
        return self.values()[-1]

    def prompt(self) -> str:
        """The user message stating the task."""
        steps = [_PHRASES[name].format(operand) for name, operand in self.ops]
        chain = steps[0] if len(steps) == 1 else ", ".join(steps[:-1]) + ", then " + steps[-1]
        return f"Start with {self.start}, {chain}. Submit the result."

    def to_json(self) -> str:
        return json.dumps({"start": self.start, "ops": [list(op) for op in self.ops]})

    def episode_messages(self, steps: int | None = None) -> list[dict]:
        """Assistant / tool turns of an agent that carries out the first ``steps`` operations (default: all)
        and then submits the value reached (``steps < n_ops``: the hasty agent, a wrong answer)."""
        steps = self.n_ops if steps is None else steps
        if not 0 <= steps <= self.n_ops:
            raise ValueError(f"steps={steps} outside [0, {self.n_ops}]")
        values, out = self.values(), []
        # values holds n_ops + 1 entries (the start first) and steps may stop short of n_ops: zip stops at steps
        for (name, operand), current, result in zip(self.ops[:steps], values, values[1:], strict=False):
            out += [tool_call_message(name, {"a": current, "b": operand}), tool_result_message(name, result)]
        out += [tool_call_message("submit", {"answer": values[steps]}), tool_result_message("submit", "submitted"),
                {"role": "assistant", "content": "Done."}]
        return out

    @classmethod
    def from_json(cls, text: str) -> "ArithmeticTask":
        """Inverse of :meth:`to_json`. Raises ``ValueError`` on malformed text."""
        try:
            data = json.loads(text)
            return cls(start=data["start"], ops=tuple((str(n), o) for n, o in data["ops"]))
        except (TypeError, KeyError, json.JSONDecodeError) as err:
            raise ValueError(f"task {text!r} is not an ArithmeticTask JSON string: {err}") from None


def apply_operation(name: str, a: int, b: int) -> int:
    """``a + b`` or ``a * b``. Raises ``ValueError`` for an unknown ``name``."""
    if name == "add":
        return a + b
    if name == "multiply":
        return a * b
    raise ValueError(f"unknown operation {name!r}; expected one of {OPERATIONS}")


def make_tasks(n: int, seed: int, *, min_ops: int = 1, max_ops: int = 3, max_operand: int = 9,
               exclude: set[ArithmeticTask] | None = None) -> list[ArithmeticTask]:
    """``n`` distinct random tasks (fixed by ``seed``).

    Args:
        n: number of tasks.
        seed: the random seed; the same arguments always give the same tasks.
        min_ops, max_ops: chain length range (inclusive), drawn uniformly.
        max_operand: start and operands are drawn from ``[2, max_operand]``.
        exclude: tasks that must not be drawn (a held-out set kept disjoint from training).
    Raises:
        ValueError: a bad range, or fewer than ``n`` distinct tasks exist.
    """
    if not 1 <= min_ops <= max_ops:
        raise ValueError(f"need 1 <= min_ops <= max_ops, got min_ops={min_ops}, max_ops={max_ops}")
    if max_operand < 2:
        raise ValueError(f"max_operand must be >= 2, got {max_operand}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    values = max_operand - 1
    possible = sum(values * (len(OPERATIONS) * values) ** k for k in range(min_ops, max_ops + 1))
    exclude = exclude or set()
    # only excluded tasks these ranges could draw shrink the pool (a training set may have other chain lengths)
    excluded = sum(isinstance(t, ArithmeticTask) and min_ops <= t.n_ops <= max_ops
                   and all(2 <= v <= max_operand for v in (t.start, *(o for _, o in t.ops))) for t in exclude)
    if n > possible - excluded:
        raise ValueError(f"asked for {n} distinct tasks but only {possible} exist with ops in [{min_ops}, {max_ops}] "
                         f"and operands in [2, {max_operand}] ({excluded} of them excluded)")
    rng = random.Random(seed)
    out, seen = [], set(exclude)
    while len(out) < n:
        k = rng.randint(min_ops, max_ops)
        task = ArithmeticTask(rng.randint(2, max_operand),
                              tuple((rng.choice(OPERATIONS), rng.randint(2, max_operand)) for _ in range(k)))
        if task not in seen:
            seen.add(task)
            out.append(task)
    return out


class ArithmeticEnvironment:
    """Calculator environment for TRL's ``environment_factory`` and :mod:`kdamoe.posttraining.agent`.

    One instance runs one episode at a time; :meth:`reset` starts the next. Tools: :meth:`add`,
    :meth:`multiply`, :meth:`submit`. Calls after ``submit`` are refused (the episode is over).

    Attributes:
        task: the current :class:`ArithmeticTask` (``None`` before the first reset).
        calls: every tool call of the episode, ``(name, arguments dict)`` in order.
        submitted: the value passed to ``submit`` (``None`` until then).
    """

    def __init__(self):
        self.task: ArithmeticTask | None = None
        self.calls: list[tuple[str, dict]] = []
        self.submitted: int | None = None

    def reset(self, task: str | ArithmeticTask | None = None, **row) -> str | None:
        """Start an episode. ``task``: the row's ``task`` column (JSON text) or an :class:`ArithmeticTask`.

        Returns ``None``: the task is already in the prompt (the dataset's user message), so TRL appends
        nothing. Raises ``ValueError`` when ``task`` is missing or malformed.
        """
        if task is None:
            raise ValueError("ArithmeticEnvironment.reset needs the row's `task` column (ArithmeticTask.to_json())")
        self.task = task if isinstance(task, ArithmeticTask) else ArithmeticTask.from_json(task)
        self.calls, self.submitted = [], None
        return None

    def _check_open(self) -> None:
        if self.task is None:
            raise ValueError("no episode: call reset(task=...) first")
        if self.submitted is not None:
            raise ValueError("the result was already submitted; the episode is over")

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.

        Returns:
            The sum a + b.
        """
        self._check_open()
        self.calls.append(("add", {"a": a, "b": b}))
        return _as_int(a, "a") + _as_int(b, "b")

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first number.
            b: The second number.

        Returns:
            The product a * b.
        """
        self._check_open()
        self.calls.append(("multiply", {"a": a, "b": b}))
        return _as_int(a, "a") * _as_int(b, "b")

    def submit(self, answer: int) -> str:
        """Submit the final result. This ends the task.

        Args:
            answer: The final number.

        Returns:
            A confirmation.
        """
        self._check_open()
        self.calls.append(("submit", {"answer": answer}))
        self.submitted = _as_int(answer, "answer")
        return "submitted"

    # Not a tool (TRL exposes public methods other than reset/get_reward as tools): leading underscore.
    def _correct_steps(self) -> int:
        """Operations of the task carried out in order with the right operands, counted from the first."""
        values, done = self.task.values(), 0
        calc = [(name, args) for name, args in self.calls if name != "submit"]
        # the agent may have made fewer (or more) calls than the task has operations: count the common prefix
        for (name, args), (want, operand), current in zip(calc, self.task.ops, values, strict=False):
            if name == want and sorted(_maybe_int(v) for v in args.values()) == sorted([current, operand]):
                done += 1
            else:
                break
        return done

    def get_reward(self) -> float:
        """The episode's reward from the environment's state (module docstring): 1.0 for the right submitted
        value reached through the tools (every operation called in order with the right operands), else
        ``0.5 × correct steps / n_ops``; 0.0 before any reset."""
        if self.task is None:
            return 0.0
        steps = self._correct_steps()
        if self.submitted is not None and self.submitted == self.task.answer and steps == self.task.n_ops:
            return 1.0
        return 0.5 * steps / self.task.n_ops

    @property
    def done(self) -> bool:
        """``submit`` was called: the episode is over."""
        return self.submitted is not None

    @property
    def tool_calls_before_submit(self) -> int:
        """Calls to ``add`` / ``multiply`` in this episode (``submit`` not counted)."""
        return sum(name != "submit" for name, _ in self.calls)


def _as_int(value, name: str) -> int:
    """Tool arguments come from parsed model output: accept ints and integral strings/floats, else ValueError
    (TRL reports a raised exception to the model as the tool's error result)."""
    out = _maybe_int(value)
    if not isinstance(out, int):
        raise ValueError(f"{name}={value!r} is not an integer")
    return out


def _maybe_int(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return value
    return value
