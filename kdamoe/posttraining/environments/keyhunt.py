"""Key hunt: a multi-turn environment where only the tools tell how far to go (no network, no data files).

A task is a hidden row of rooms in a building; the key lies in the last one. The agent calls
``open_door()`` to walk into the next room — the tool describes the room and says whether it holds
``another door`` or ``the key`` — and ends the task with ``take_key()``. A task with ``n`` rooms needs
``n`` ``open_door`` calls before ``take_key``; nothing in the prompt tells ``n``, so an agent that takes the
key early fails. The reward is read from the environment's state (the rooms entered, whether the key had
been found when ``take_key`` was called), never from the text.

This is the environment of the post-training demo (``make posttrain``, docs/post-training.md). Its tools
take no arguments on purpose: the CPU demo's model (0.7 M parameters, a few minutes of SFT) does not learn
to copy numbers from a tool result into the next call — measured: after 120 SFT steps on numbered rooms
it wrote the same room number whatever the tool had said — while the decision this task is about, open the
next door or stop, is read off the last tool result. :mod:`kdamoe.posttraining.environments.arithmetic` (chained
arithmetic) is the environment whose tools take arguments.

The same contract as :class:`~kdamoe.posttraining.environments.arithmetic.ArithmeticEnvironment` (TRL's
``environment_factory``: ``reset(task=json)``, tools as public methods with type hints and Google-style
docstrings, ``get_reward()``).

Reward: ``1.0`` when ``take_key`` came after the key was found, else ``0.0`` — the task's success, nothing
else, so a policy cannot raise its reward without solving more tasks. Partial credit was tried and gamed,
twice. With credit for rooms entered alone, GRPO learned to open every door and never take the key. With
``0.2 + 0.3 × rooms entered / n`` for a key taken too early, GRPO learned to take it at once: measured on the
demo's seed 0 (200 held-out hunts of 2–3 rooms, episodes sampled at temperature 1), immediate ``take_key``
went from 51 episodes (SFT) to 104 (GRPO) and episodes that never called ``take_key`` (reward 0, mostly a
malformed call) from 99 to 40, so the mean reward rose from 0.175 to 0.221 while success fell from 6.0 % to
3.5 %. A zero for every failure needs a starting policy that succeeds often enough for a group of rollouts to
disagree: the demo's SFT stage is trained until it does (docs/post-training.md).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from .messages import tool_call_message, tool_result_message

PLACES = ("old mill", "castle", "tower", "manor", "abbey", "farmhouse", "palace", "inn", "chapel", "fort",
          "library", "harbour house")
ROOMS = ("hall", "cellar", "kitchen", "study", "gallery", "pantry", "stable", "attic", "parlour", "armoury",
         "chamber", "vault")


@dataclass(frozen=True)
class KeyHuntTask:
    """One key-hunt task.

    Attributes:
        place: the building, named in the prompt (one of :data:`PLACES`).
        rooms: the rooms behind the doors, in order (each one of :data:`ROOMS`); the key is in the last.
    """

    place: str
    rooms: tuple[str, ...]

    def __post_init__(self):
        if self.place not in PLACES:
            raise ValueError(f"KeyHuntTask.place={self.place!r} is not one of {PLACES}")
        if not self.rooms:
            raise ValueError("KeyHuntTask.rooms must hold at least one room")
        for room in self.rooms:
            if room not in ROOMS:
                raise ValueError(f"KeyHuntTask: room {room!r} is not one of {ROOMS}")

    @property
    def calls_needed(self) -> int:
        """``open_door`` calls before ``take_key``: one per room."""
        return len(self.rooms)

    def door(self, entered: int) -> str:
        """What the ``entered``-th ``open_door`` call (1-based) answers. Raises ``ValueError`` for ``entered < 1``."""
        if entered < 1:
            raise ValueError(f"entered={entered}: doors are counted from 1")
        if entered > len(self.rooms):
            return "no more doors"
        room = self.rooms[entered - 1]
        room = ("An " if room[0] in "aeiou" else "A ") + room
        # The two endings share no word with each other, the prompt or the tool lines, so whether the key was
        # found is one token's presence in the context, which attention reads without positions (NoPE).
        return f"{room}. The key lies here!" if entered == len(self.rooms) else f"{room}. Another door leads on."

    def prompt(self) -> str:
        """The user message stating the task."""
        return f"Find the key hidden in the {self.place}."

    def to_json(self) -> str:
        return json.dumps({"place": self.place, "rooms": list(self.rooms)})

    @classmethod
    def from_json(cls, text: str) -> "KeyHuntTask":
        """Inverse of :meth:`to_json`. Raises ``ValueError`` on malformed text."""
        try:
            data = json.loads(text)
            return cls(place=data["place"], rooms=tuple(data["rooms"]))
        except (TypeError, KeyError, json.JSONDecodeError) as err:
            raise ValueError(f"task {text!r} is not a KeyHuntTask JSON string: {err}") from None

    def episode_messages(self, steps: int | None = None) -> list[dict]:
        """Assistant / tool turns of an agent that opens ``steps`` doors (default: all; fewer is the hasty
        agent, who then takes a key that is not there) and calls ``take_key``, then says ``Done.``"""
        steps = self.calls_needed if steps is None else steps
        if not 0 <= steps <= self.calls_needed:
            raise ValueError(f"steps={steps} outside [0, {self.calls_needed}]")
        out = []
        for entered in range(1, steps + 1):
            out += [tool_call_message("open_door", {}), tool_result_message("open_door", self.door(entered))]
        found = steps == self.calls_needed
        out += [tool_call_message("take_key", {}), tool_result_message("take_key", _take_result(found)),
                {"role": "assistant", "content": "Done."}]
        return out


def _take_result(found: bool) -> str:
    return "you have the key" if found else "there is no key here"  # the episode is over either way


def make_keyhunt_tasks(n: int, seed: int, *, min_rooms: int = 1, max_rooms: int = 3,
                       exclude: set[KeyHuntTask] | None = None) -> list[KeyHuntTask]:
    """``n`` distinct random tasks (fixed by ``seed``), room counts drawn uniformly from ``[min_rooms, max_rooms]``.

    Raises:
        ValueError: a bad range (``1 <= min_rooms <= max_rooms <= 8``), ``n < 0``, or fewer than ``n`` distinct
            tasks left after ``exclude``.
    """
    if not 1 <= min_rooms <= max_rooms <= 8:
        raise ValueError(f"need 1 <= min_rooms <= max_rooms <= 8, got min_rooms={min_rooms}, max_rooms={max_rooms}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    exclude = set(exclude or ())
    possible = sum(len(PLACES) * len(ROOMS) ** k for k in range(min_rooms, max_rooms + 1))
    # only excluded tasks this range could draw shrink the pool (a training set may have other room counts)
    excluded = sum(isinstance(t, KeyHuntTask) and min_rooms <= t.calls_needed <= max_rooms for t in exclude)
    if n > possible - excluded:
        raise ValueError(f"asked for {n} distinct tasks but only {possible} exist with {min_rooms}-{max_rooms} rooms "
                         f"({excluded} of them excluded)")
    rng = random.Random(seed)
    out, seen = [], exclude
    while len(out) < n:
        place = rng.choice(PLACES)
        task = KeyHuntTask(place, tuple(rng.choice(ROOMS) for _ in range(rng.randint(min_rooms, max_rooms))))
        if task not in seen:
            seen.add(task)
            out.append(task)
    return out


class KeyHuntEnvironment:
    """Key-hunt environment for TRL's ``environment_factory`` and :mod:`kdamoe.posttraining.agent`.

    Tools: :meth:`open_door`, :meth:`take_key`. Calls after ``take_key`` are refused (the episode is over).

    Attributes:
        task: the current :class:`KeyHuntTask` (``None`` before the first reset).
        calls: every tool call of the episode, ``(name, arguments dict)`` in order.
        entered: rooms entered so far.
        done: ``take_key`` was called.
    """

    def __init__(self):
        self.task: KeyHuntTask | None = None
        self.calls: list[tuple[str, dict]] = []
        self.entered = 0
        self.done = False
        self.found_when_taken = False

    def reset(self, task: str | KeyHuntTask | None = None, **row) -> str | None:
        """Start an episode from the row's ``task`` column (JSON text) or a :class:`KeyHuntTask`.

        Returns ``None``: the task is already the dataset's user message. Raises ``ValueError`` when ``task``
        is missing or malformed.
        """
        if task is None:
            raise ValueError("KeyHuntEnvironment.reset needs the row's `task` column (KeyHuntTask.to_json())")
        self.task = task if isinstance(task, KeyHuntTask) else KeyHuntTask.from_json(task)
        self.calls, self.entered, self.done, self.found_when_taken = [], 0, False, False
        return None

    def _check_open(self) -> None:
        if self.task is None:
            raise ValueError("no episode: call reset(task=...) first")
        if self.done:
            raise ValueError("the key was already taken; the episode is over")

    def open_door(self) -> str:
        """Open the next door and walk through it.

        Returns:
            The room behind it, and whether it holds another door or the key.
        """
        self._check_open()
        self.calls.append(("open_door", {}))
        if self.entered < self.task.calls_needed:
            self.entered += 1
            return self.task.door(self.entered)
        return self.task.door(self.entered + 1)

    def take_key(self) -> str:
        """Take the key from the room you are in. This ends the task.

        Returns:
            Whether you got the key.
        """
        self._check_open()
        self.calls.append(("take_key", {}))
        self.done = True
        self.found_when_taken = self.entered == self.task.calls_needed
        return _take_result(self.found_when_taken)

    def get_reward(self) -> float:
        """1.0 when the key was taken after it was found (the task solved), else 0.0: taken too early, never
        taken, or before a reset (module docstring: why no partial credit)."""
        return float(self.task is not None and self.done and self.found_when_taken)

    @property
    def tool_calls_before_submit(self) -> int:
        """``open_door`` calls in this episode (the final ``take_key`` not counted)."""
        return sum(name == "open_door" for name, _ in self.calls)
