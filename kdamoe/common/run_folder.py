"""A run owns its output folder: one writer at a time, nothing of anyone else's removed or overwritten.

Every job that writes an output folder (``kdamoe-train``, ``kdamoe-posttrain``) goes through :func:`claim_run_folder`
before it writes anything:

* **A lock** (:class:`RunFolderLock`, file :data:`LOCK_NAME`) admits one writer. It records the writer's host and pid;
  a lock left by a process that no longer runs on this host (a crash, ``kill -9``) is stale and taken over with a
  message, while a lock held by a live process, or by another host (whose pids cannot be checked from here), makes
  the second run stop with a :class:`RunFolderError` naming the holder. The lock is released on exit, also on an
  exception.
* **A marker** (:data:`RUN_MARKER`, ``{"job": ..., "created": ...}``) says which job's run the folder holds. A folder
  marked for another job — for post-training, in particular the pretraining run whose ``final/`` is its base — is
  refused. Folders written before markers existed are recognised by the files each job writes
  (:func:`detect_job`).
* **A fresh start** (nothing to resume) refuses a folder that holds anything but the marker and lock, naming what it
  found. ``overwrite=True`` (``--overwrite``) removes only what the job writes (its :data:`JOB_OUTPUTS` names) and
  leaves every other file where it is.

Errors are :class:`RunFolderError`, a ``ValueError``: the command-line tools print its one line and exit 2.
"""

from __future__ import annotations

import fnmatch
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

RUN_MARKER = "kdamoe_run.json"
LOCK_NAME = ".kdamoe.lock"
JOBS = ("pretraining", "posttraining")
# The top-level names each job writes into its output folder (glob patterns); `--overwrite` removes only these.
JOB_OUTPUTS = {
    "pretraining": ("config.yaml", "tokenizer", "checkpoints", "final", "initial", "summary.json", "baselines.json",
                    "tensorboard", "expert_load.png", ".tmp-*"),
    "posttraining": ("checkpoint-*", "final", "adapter", "summary.json", "runs", "reward_curve.png", "tensorboard",
                     "reward_model", "reward_training", "README.md", "training_args.bin",
                     ".tmp-*", "*.tmp", "results.json", "heldout_curve.png"),
}


# Inside a folder a run owns (``final/``, ``tokenizer/``, ``checkpoints/``, ...): the names of the files kdamoe and
# the libraries it drives write there (weights, configs, remote code, tokenizer, card, trainer and accelerate states,
# TensorBoard events, plots). ``--overwrite`` removes only these; anything else (a user's notes) stays.
WRITTEN_FILES = ("*.safetensors", "*.json", "*.py", "README.md", "*.jinja", "merges.txt", "vocab.txt", "*.pt",
                 "*.pth", "*.bin", "*.pkl", "events.out.tfevents.*", "*.png", "*.distcp", ".metadata", "*.tmp",
                 "*.yaml")


def _remove_written_files(folder: Path) -> list[Path]:
    """Delete the files of ``folder`` (recursively) that match :data:`WRITTEN_FILES`, then the folders left empty;
    return the files kept."""
    kept = []
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        elif any(fnmatch.fnmatch(path.name, pattern) for pattern in WRITTEN_FILES):
            path.unlink()
        else:
            kept.append(path)
    if not any(folder.iterdir()):
        folder.rmdir()
    return sorted(kept)


class RunFolderError(ValueError):
    """A run cannot use its output folder (another writer, another job's run, files it did not write)."""


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (``kill(pid, 0)``; a live process of another user counts).
    Used to tell a stale lock or partial folder, left by a killed process, from one still being written."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a live process of another user
        return True
    return True


class RunFolderLock:
    """An exclusive, crash-safe lock on ``folder`` (module docstring). Use as a context manager.

    Args:
        folder: the output folder (created if missing).
        say: prints a line (e.g. about a stale lock taken over); default ``print``.

    Raises:
        RunFolderError: on entering, when a live process (or a process on another host) holds the lock.
    """

    def __init__(self, folder: str | Path, say: Callable[[str], None] = print):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.say = say
        self.held = False

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None

    def acquire(self) -> None:
        if self.folder.exists() and not self.folder.is_dir():
            raise RunFolderError(f"output folder {self.folder}: exists and is not a folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:  # being written this instant, or truncated by a crash mid-write
                    time.sleep(0.2)
                    if self._holder() is None and self.path.exists():
                        self.say(f"{self.path}: unreadable lock (a crash while it was written); taking it over")
                        self.path.unlink(missing_ok=True)
                    continue
                if holder.get("host") == me["host"] and not pid_alive(int(holder.get("pid", -1))):
                    self.say(f"{self.path}: stale lock of pid {holder.get('pid')} (no longer running); taking it over")
                    self.path.unlink(missing_ok=True)
                    continue
                where = "this host" if holder.get("host") == me["host"] else f"host {holder.get('host')}"
                raise RunFolderError(
                    f"{self.folder}: another run is writing here (pid {holder.get('pid')} on {where}, since "
                    f"{holder.get('since')}); wait for it or use another output folder (delete {self.path} only if "
                    "you are sure that run is gone)") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise RunFolderError(f"{self.path}: could not take the lock (another run keeps taking it)")

    def release(self) -> None:
        if self.held:
            holder = self._holder()
            if holder is not None and holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunFolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def read_marker(folder: str | Path) -> dict | None:
    """The folder's :data:`RUN_MARKER` as a dict, or None when it has none.

    Raises:
        RunFolderError: the marker exists but is not a JSON object naming a job.
    """
    path = Path(folder) / RUN_MARKER
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunFolderError(f"{path}: not valid JSON ({err}); it marks a kdamoe run folder") from err
    if not isinstance(data, dict) or data.get("job") not in JOBS:
        raise RunFolderError(f"{path}: expected {{\"job\": one of {JOBS}}}, got {data!r}")
    return data


def detect_job(folder: str | Path) -> str | None:
    """Which job's run ``folder`` holds: its marker's job, else (folders written before markers) ``"pretraining"`` for
    a ``config.yaml`` beside ``checkpoints/`` or ``tokenizer/``, ``"posttraining"`` for a trainer ``checkpoint-N/`` or a
    ``summary.json`` recording a ``recipe``; None otherwise."""
    folder = Path(folder)
    marker = read_marker(folder)
    if marker is not None:
        return marker["job"]
    if (folder / "config.yaml").is_file() and ((folder / "checkpoints").is_dir() or (folder / "tokenizer").is_dir()):
        return "pretraining"
    if any(p.is_dir() and (p / "trainer_state.json").is_file() for p in folder.glob("checkpoint-*")):
        return "posttraining"
    summary = folder / "summary.json"
    if summary.is_file():
        try:
            data = json.loads(summary.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if isinstance(data, dict) and ("recipe" in data or "recipe" in (data.get("config") or {})):
            return "posttraining"
    return None


def check_no_other_job(folder: str | Path, job: str) -> None:
    """Refuse ``folder`` when it holds another job's run (:func:`detect_job`); read-only, so every process of a launch
    can run it before anything is loaded.

    Raises:
        RunFolderError: naming the folder and the job whose run it holds.
    """
    folder = Path(folder)
    found = detect_job(folder) if folder.is_dir() else None
    if found is not None and found != job:
        how = RUN_MARKER if read_marker(folder) else "its files"
        raise RunFolderError(f"output folder {folder}: holds a {found} run ({how}); "
                             f"a {job} run must not write into it (its final/ may be your base model): use another "
                             "output folder")


def _owned(name: str, job: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in JOB_OUTPUTS[job])


def claim_run_folder(folder: str | Path, job: str, *, resuming: bool, overwrite: bool = False,
                     identity: dict | None = None, say: Callable[[str], None] = print) -> None:
    """Check that ``job`` may write into ``folder`` and mark it as that job's run (module docstring). Call it while
    holding :class:`RunFolderLock`.

    Args:
        folder: the run's output folder (created if missing).
        job: one of :data:`JOBS`.
        resuming: the run continues a checkpoint found in ``folder`` (its earlier outputs are its own).
        overwrite: on a fresh start, remove what ``job`` writes (:data:`JOB_OUTPUTS`; inside those folders only the
            files :data:`WRITTEN_FILES` names) instead of refusing.
        identity: what a resumed run must share with the run that wrote ``folder`` (e.g. the base model, the recipe,
            the data), recorded in the marker by a fresh start and compared on a resume.
        say: prints a line per removed entry.

    Raises:
        ValueError: ``job`` is not one of :data:`JOBS`.
        RunFolderError: ``folder`` is a file, holds another job's run, or (fresh start without ``overwrite``) holds
            anything; with ``overwrite``, the entries it keeps are named in a line, not refused. On a resume, a field
            of ``identity`` that differs from the one the marker recorded (named with both values).
    """
    if job not in JOBS:
        raise ValueError(f"job {job!r} is not one of {JOBS}")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"output folder {folder}: exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    check_no_other_job(folder, job)
    marker = read_marker(folder)
    if resuming and marker is not None and identity:
        recorded = marker.get("identity") or {}
        for key, value in identity.items():
            if key in recorded and recorded[key] != value:
                raise RunFolderError(
                    f"output folder {folder}: its run used {key}={recorded[key]!r}, this one has {key}={value!r}; a "
                    "resumed run must continue the same run: use another output folder, or pass --overwrite (with "
                    "--no-resume) to start over there")
    entries = sorted(p.name for p in folder.iterdir() if p.name not in (RUN_MARKER, LOCK_NAME))
    if not resuming and entries:
        owned = [name for name in entries if _owned(name, job)]
        foreign = [name for name in entries if name not in owned]
        if not overwrite:
            shown = ", ".join(entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "")
            raise RunFolderError(
                f"output folder {folder}: not empty and nothing to resume from (it holds {shown}); use a new folder, "
                f"or pass --overwrite to remove what a {job} run writes"
                + (f" ({', '.join(owned[:6])}); {', '.join(foreign[:6])} would stay" if foreign else ""))
        for name in owned:
            path = folder / name
            say(f"--overwrite: removing {path}")
            if path.is_dir() and not path.is_symlink():
                kept = _remove_written_files(path)
                if kept:
                    say(f"--overwrite: keeping {', '.join(str(p) for p in kept[:6])} (not files a {job} run writes)")
            else:
                path.unlink()
        if foreign:
            say(f"--overwrite: keeping {', '.join(foreign)} in {folder} (not written by a {job} run)")
    if not resuming or marker is None:
        record = {"job": job, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if identity:
            record["identity"] = identity
        (folder / RUN_MARKER).write_text(json.dumps(record, indent=1) + "\n")


def _process_group() -> tuple[bool, bool]:
    """``(is the main process, is there a process group to talk through)``: torch.distributed's rank when a process
    group is up (the pretraining job's accelerator), else torchrun's ``RANK`` (a post-training launch before its
    Trainer exists: if the main process then stops with an error, torchrun stops the other ranks within seconds)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0, torch.distributed.get_world_size() > 1
    return int(os.environ.get("RANK", "0")) == 0, False


def _on_main_process(is_main: bool, grouped: bool, action: Callable[[], None]) -> None:
    """Run ``action`` on the main process only; with a process group, a :class:`RunFolderError` it raises is raised
    on every process (broadcast), so no process is left waiting at a barrier the main process never reaches."""
    error = None
    if is_main:
        try:
            action()
        except RunFolderError as err:
            error = str(err)
    if grouped:
        box = [error]
        torch.distributed.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RunFolderError(error)


@contextmanager
def owned_run_folder(folder: str | Path, job: str, find_resume: Callable[[], object | None], *,
                     overwrite: bool = False, identity: dict | None = None,
                     say: Callable[[str], None] = print) -> Iterator[object | None]:
    """The whole life of a run in ``folder``: lock it (the main process), find what to resume, claim the folder
    (:func:`claim_run_folder`), yield the resume point, release the lock on exit (also on an exception). Call it on
    every process of a launch, before anything is written to ``folder``; only the main process touches the folder.

    Args:
        find_resume: returns the checkpoint to resume from, or None for a fresh start; runs on every process with
            the lock held.
        overwrite, identity, say: as :func:`claim_run_folder`.

    Raises:
        RunFolderError: on the main process, and on every process when they share a process group (see
            :class:`RunFolderLock`, :func:`claim_run_folder`).
    """
    is_main, grouped = _process_group()
    lock = RunFolderLock(folder, say) if is_main else None
    _on_main_process(is_main, grouped, lock.acquire if lock is not None else (lambda: None))
    try:
        resume_from = find_resume()

        def claim() -> None:
            claim_run_folder(folder, job, resuming=resume_from is not None, overwrite=overwrite, identity=identity,
                             say=say)

        _on_main_process(is_main, grouped, claim)
        if grouped:
            torch.distributed.barrier()
        yield resume_from
    finally:
        if lock is not None:
            lock.release()
