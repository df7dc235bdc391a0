"""Key hunt: a multi-turn environment where only the tools reveal the way (no network, no data files).

A task is a hidden chain of rooms ``start → r1 → … → rh`` whose last room holds a key. The agent is told
the start room and must call ``open_door(room)`` on each room in turn: the tool answers ``"room N"`` (the
door leads to room N) or ``"key K"`` (the key is here), and the agent then calls ``submit(key)``. A task
with ``h`` hops needs ``h + 1`` ``open_door`` calls before the ``submit``; nothing in the prompt tells how
many, so an agent that stops early can only submit a wrong number.

This is the environment of the post-training demo (``make posttrain``, docs/post-training.md): each step
copies a number from the last tool result into the next call (what a model of a few hundred thousand
parameters learns in minutes), and the one decision that matters — open the next door or submit — is
read off the tool result. The same contract as :class:`~kdamoe.posttraining.environment.ArithmeticEnvironment`
(TRL's ``environment_factory``: ``reset(task=json)``, tools as public methods with type hints and
Google-style docstrings, ``get_reward()`` from the episode's state).

Reward (``[0, 1]``): ``1.0`` when the submitted value is the key; otherwise ``0.5 × (rooms of the chain
opened in order, from the start) / (h + 1)``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from .environment import _as_int, _maybe_int

ROOMS = (1, 9)    # room numbers: one token each, so reading a room off the last tool result is a one-token copy
KEYS = (10, 99)   # key numbers: never a room number, so a submitted room is always wrong


@dataclass(frozen=True)
class KeyHuntTask:
    """One key-hunt task.

    Attributes:
        rooms: the chain, ``rooms[0]`` the start; distinct numbers in :data:`ROOMS`.
        key: the key in ``rooms[-1]``, in :data:`KEYS`.
    """

    rooms: tuple[int, ...]
    key: int

    def __post_init__(self):
        if not self.rooms:
            raise ValueError("KeyHuntTask.rooms must hold at least the start room")
        if len(set(self.rooms)) != len(self.rooms):
            raise ValueError(f"KeyHuntTask.rooms={self.rooms}: rooms must be distinct")
        for r in self.rooms:
            if not (isinstance(r, int) and not isinstance(r, bool) and ROOMS[0] <= r <= ROOMS[1]):
                raise ValueError(f"KeyHuntTask: room {r!r} is not an int in {list(ROOMS)}")
        if not (isinstance(self.key, int) and not isinstance(self.key, bool) and KEYS[0] <= self.key <= KEYS[1]):
            raise ValueError(f"KeyHuntTask.key={self.key!r} is not an int in {list(KEYS)}")

    @property
    def hops(self) -> int:
        return len(self.rooms) - 1

    @property
    def calls_needed(self) -> int:
        """``open_door`` calls before ``submit``: one per room of the chain."""
        return len(self.rooms)

    @property
    def answer(self) -> int:
        return self.key

    def door(self, room: int) -> str:
        """What ``open_door(room)`` answers: ``"room N"``, ``"key K"``, or ``"locked"`` off the chain."""
        if room not in self.rooms:
            return "locked"
        i = self.rooms.index(room)
        return f"key {self.key}" if i == len(self.rooms) - 1 else f"room {self.rooms[i + 1]}"

    def prompt(self) -> str:
        """The user message stating the task."""
        return f"Find the key. Start in room {self.rooms[0]}."

    def to_json(self) -> str:
        return json.dumps({"rooms": list(self.rooms), "key": self.key})

    @classmethod
    def from_json(cls, text: str) -> "KeyHuntTask":
        """Inverse of :meth:`to_json`. Raises ``ValueError`` on malformed text."""
        try:
            data = json.loads(text)
            return cls(rooms=tuple(data["rooms"]), key=data["key"])
        except (TypeError, KeyError, json.JSONDecodeError) as err:
            raise ValueError(f"task {text!r} is not a KeyHuntTask JSON string: {err}") from None

    def episode_messages(self, steps: int | None = None) -> list[dict]:
        """Assistant / tool turns of an agent that opens the first ``steps`` rooms (default: all) and then
        submits the last number it read (the key when it opened every room; a room number — wrong — when it
        stopped early; the start room when ``steps == 0``). Arguments are JSON text (see
        :func:`kdamoe.posttraining.data.tool_call_message`)."""
        from .data import tool_call_message, tool_result_message

        steps = self.calls_needed if steps is None else steps
        if not 0 <= steps <= self.calls_needed:
            raise ValueError(f"steps={steps} outside [0, {self.calls_needed}]")
        out, last = [], self.rooms[0]
        for room in self.rooms[:steps]:
            result = self.door(room)
            out += [tool_call_message("open_door", {"room": room}), tool_result_message("open_door", result)]
            last = int(result.split()[1])
        out += [tool_call_message("submit", {"key": last}), tool_result_message("submit", "submitted"),
                {"role": "assistant", "content": "Done."}]
        return out


def make_keyhunt_tasks(n: int, seed: int, *, min_hops: int = 0, max_hops: int = 3,
                       exclude: set[KeyHuntTask] | None = None) -> list[KeyHuntTask]:
    """``n`` distinct random tasks (fixed by ``seed``), hops drawn uniformly from ``[min_hops, max_hops]``.

    Raises:
        ValueError: a bad hop range (``0 <= min_hops <= max_hops <= 10``) or ``n < 0``.
    """
    if not 0 <= min_hops <= max_hops <= 10:
        raise ValueError(f"need 0 <= min_hops <= max_hops <= 10, got min_hops={min_hops}, max_hops={max_hops}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    out, seen = [], set(exclude or ())
    while len(out) < n:
        rooms = tuple(rng.sample(range(ROOMS[0], ROOMS[1] + 1), rng.randint(min_hops, max_hops) + 1))
        task = KeyHuntTask(rooms, rng.randint(*KEYS))
        if task not in seen:
            seen.add(task)
            out.append(task)
    return out


class KeyHuntEnvironment:
    """Key-hunt environment for TRL's ``environment_factory`` and :mod:`kdamoe.posttraining.agent`.

    Tools: :meth:`open_door`, :meth:`submit`. Calls after ``submit`` are refused (the episode is over).

    Attributes:
        task: the current :class:`KeyHuntTask` (``None`` before the first reset).
        calls: every tool call of the episode, ``(name, arguments dict)`` in order.
        submitted: the value passed to ``submit`` (``None`` until then).
    """

    def __init__(self):
        self.task: KeyHuntTask | None = None
        self.calls: list[tuple[str, dict]] = []
        self.submitted: int | None = None

    def reset(self, task: str | KeyHuntTask | None = None, **row) -> str | None:
        """Start an episode from the row's ``task`` column (JSON text) or a :class:`KeyHuntTask`.

        Returns ``None``: the task is already the dataset's user message. Raises ``ValueError`` when ``task``
        is missing or malformed.
        """
        if task is None:
            raise ValueError("KeyHuntEnvironment.reset needs the row's `task` column (KeyHuntTask.to_json())")
        self.task = task if isinstance(task, KeyHuntTask) else KeyHuntTask.from_json(task)
        self.calls, self.submitted = [], None
        return None

    def _check_open(self) -> None:
        if self.task is None:
            raise ValueError("no episode: call reset(task=...) first")
        if self.submitted is not None:
            raise ValueError("the key was already submitted; the episode is over")

    def open_door(self, room: int) -> str:
        """Open the door of a room.

        Args:
            room: The room number.

        Returns:
            Where the door leads ("room N") or the key found there ("key K").
        """
        self._check_open()
        self.calls.append(("open_door", {"room": room}))
        return self.task.door(_as_int(room, "room"))

    def submit(self, key: int) -> str:
        """Submit the key. This ends the task.

        Args:
            key: The key number.

        Returns:
            A confirmation.
        """
        self._check_open()
        self.calls.append(("submit", {"key": key}))
        self.submitted = _as_int(key, "key")
        return "submitted"

    def _rooms_opened_in_order(self) -> int:
        done = 0
        opened = [args.get("room") for name, args in self.calls if name == "open_door"]
        for got, want in zip(opened, self.task.rooms):
            if _maybe_int(got) != want:
                break
            done += 1
        return done

    def get_reward(self) -> float:
        """1.0 for the right key, else ``0.5 × rooms opened in order / (hops + 1)``; 0.0 before any reset."""
        if self.task is None:
            return 0.0
        if self.submitted is not None and self.submitted == self.task.key:
            return 1.0
        return 0.5 * self._rooms_opened_in_order() / self.task.calls_needed

    @property
    def tool_calls_before_submit(self) -> int:
        """``open_door`` calls in this episode."""
        return sum(name == "open_door" for name, _ in self.calls)
