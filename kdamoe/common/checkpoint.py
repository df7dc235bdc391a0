"""Training checkpoints: written atomically, verified by a manifest, resumed from the newest intact one.

A checkpoint is the folder ``checkpoints/stage<i>-step<n>/``:

* ``accelerator.save_state`` files — ``model.safetensors``, ``optimizer.bin``, ``random_states_<rank>.pkl``
  (and whatever accelerate writes for sharded set-ups);
* ``progress.json`` — our own state (:class:`~kdamoe.training.trainer.TrainProgress`) as JSON, and
  ``monitor.safetensors`` — the expert-load totals; both written by us, so resuming never unpickles
  them (no ``accelerator.register_for_checkpointing``, whose ``custom_checkpoint_*.pkl`` files accelerate
  loads with ``torch.load(weights_only=False)``);
* ``manifest.json`` — size and SHA-256 of every other file, written last.

Under ``train.parallelism: fsdp2_ep`` accelerate does not hold the model (transformers' engine sharded it), so its
files are only the RNG states; the model and the optimizer are sharded folders written by every process
(:func:`save_expert_parallel_state`): ``model/`` (``save_pretrained(..., distributed_checkpoint=True)``:
torch.distributed.checkpoint shards as safetensors, plus ``config.json``) and ``optimizer/`` (transformers'
``save_optimizer_distributed``: ``__<rank>_0.distcp`` files and ``.metadata``).

Everything is written into a hidden sibling ``.tmp-<name>``, each file and the folder are fsynced, and
only then is the folder renamed into place (POSIX ``rename`` is atomic), so a killed run leaves either a
whole checkpoint or none. On resume :func:`find_checkpoint` walks the checkpoints newest first and takes
the first whose files match the manifest, printing one line for each one it skips and why.

What is still unpickled on resume: accelerate loads ``optimizer.bin`` and ``random_states_*.pkl`` with
``torch.load(weights_only=True)`` (restricted unpickler, tensors and plain containers only; see
:func:`load_state`). Checkpoint folders must still come from a trusted source (docs/pretraining.md).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.distributed.checkpoint import load_optimizer_distributed, save_optimizer_distributed

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
MONITOR = "monitor.safetensors"
EP_MODEL, EP_OPTIMIZER = "model", "optimizer"  # the sharded folders of an fsdp2_ep checkpoint
_NAME = re.compile(r"^stage(\d+)-step(\d+)$")


def checkpoint_name(stage: int, step: int) -> str:
    """``stage<stage>-step<step:06d>``."""
    return f"stage{stage}-step{step:06d}"


def parse_checkpoint_name(name: str) -> tuple[int, int] | None:
    """``(stage, step)`` of a checkpoint folder name, or None if ``name`` is not one."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def list_checkpoints(root: Path) -> list[tuple[int, int, Path]]:
    """``(stage, step, folder)`` of every checkpoint-named folder in ``root``, oldest first (by stage, then step)."""
    if not root.is_dir():
        return []
    found = [(*parsed, p) for p in root.iterdir() if p.is_dir() and (parsed := parse_checkpoint_name(p.name))]
    return sorted(found)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path) -> None:
    """fsync every file under ``folder``, then write ``manifest.json`` (``{relative path: {"size", "sha256"}}``)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {}
    for p in files:
        _fsync(p)
        manifest[p.relative_to(folder).as_posix()] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    with open(folder / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for d in {p.parent for p in files} | {folder}:
        _fsync(d)


def verify_checkpoint(folder: Path, required: tuple[str, ...] = (PROGRESS,)) -> str | None:
    """Why ``folder`` is not an intact checkpoint (a short reason naming the file), or None if it is.

    Intact: no ``custom_checkpoint_*.pkl`` file (kdamoe never writes one, and accelerate's ``load_state``
    would unpickle it with ``weights_only=False``), ``manifest.json`` parses and lists every name of ``required``
    (pretraining: ``progress.json``; a glob pattern such as ``rng_state*.pth`` needs one match), and every listed
    file exists with the listed size and SHA-256. Other unlisted files are never loaded.
    """
    planted = sorted(p.name for p in folder.glob("custom_checkpoint_*.pkl"))
    if planted:
        return (f"holds {planted[0]}, which kdamoe never writes (accelerate would unpickle it with "
                "weights_only=False)")
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST} (its write did not finish)"
    except (OSError, ValueError) as err:
        return f"{MANIFEST} unreadable ({err})"
    if not isinstance(manifest, dict):
        return f"{MANIFEST} is not a mapping of files"
    for name in required:
        if not any(fnmatch.fnmatch(listed, name) for listed in manifest):
            return f"{MANIFEST} does not list {name} (the checkpoint was saved without it)"
    for name, entry in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry.get("size"):
            return f"{name} is {size} bytes, the manifest says {entry.get('size')}"
        if _sha256(path) != entry.get("sha256"):
            return f"{name} does not match its SHA-256 in the manifest"
    return None


def find_checkpoint(root: Path, say: Callable[[str], None] = print) -> Path | None:
    """The newest intact checkpoint folder in ``root`` (see :func:`verify_checkpoint`), or None.

    Calls ``say`` once for every newer checkpoint it skips, naming it and the reason.
    """
    for _, _, folder in reversed(list_checkpoints(root)):
        reason = verify_checkpoint(folder)
        if reason is None:
            return folder
        say(f"skipping checkpoint {folder.name}: {reason}")
    return None


def save_checkpoint_atomically(accelerator, folder: Path, write_own_state: Callable[[Path], None],
                               write_sharded_state: Callable[[Path], None] | None = None) -> Path:
    """``accelerator.save_state``, ``write_sharded_state(tmp)`` (every process) and ``write_own_state(tmp)`` (main
    process) into ``.tmp-<name>``, then the manifest, fsync and an atomic rename to ``folder`` (replacing an older
    folder of that name).

    Call on every process (each writes its own RNG state). Returns ``folder``.
    """
    tmp = folder.parent / f".tmp-{folder.name}"
    old = folder.parent / f".old-{folder.name}"
    if accelerator.is_main_process:
        folder.parent.mkdir(parents=True, exist_ok=True)
        for stale in (tmp, old):
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if write_sharded_state is not None:
        write_sharded_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_own_state(tmp)
        write_manifest(tmp)
        if folder.exists():  # e.g. a corrupt one the resumed run has now redone
            os.replace(folder, old)
        os.replace(tmp, folder)
        _fsync(folder.parent)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return folder


def load_state(accelerator, folder: Path) -> None:
    """``accelerator.load_state`` with ``weights_only=True`` for every ``torch.load`` it passes ``load_kwargs`` to.

    accelerate 1.15's own ``load`` already defaults to ``weights_only=True`` (with numpy's RNG-state types
    allowed); passing it explicitly keeps the optimizer and scheduler loads restricted if that default changes.
    """
    accelerator.load_state(str(folder), load_kwargs={"weights_only": True})


def save_expert_parallel_state(model, optimizer, folder: Path) -> None:
    """Write an ``fsdp2_ep`` model's shards to ``folder/model`` and its AdamW state to ``folder/optimizer``.

    Call on every process: each writes its own shards (torch.distributed.checkpoint through transformers 5.24's
    ``save_pretrained(distributed_checkpoint=True)`` and ``transformers.distributed.checkpoint.
    save_optimizer_distributed``). The router biases are persistent buffers, so they are in the model's shards.
    """
    # Tied embeddings (tie_word_embeddings, as in the CPU preset): transformers 5.24 hands both keys to safetensors.
    # That passes while a shard is a view into a larger buffer (a model sharded from a full load) and fails with
    # "Some tensors share memory" once each shard owns its storage (a model loaded from these shards, i.e. after
    # a resume). A clone stands in for the LM head during the save; loading ties the two again.
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    shared = head.weight if head is not None and head.weight is embeddings.weight else None
    if shared is not None:
        head.weight = torch.nn.Parameter(shared.detach().clone(), requires_grad=False)
    try:
        model.save_pretrained(folder / EP_MODEL, distributed_checkpoint=True)
    finally:
        if shared is not None:
            head.weight = shared
    save_optimizer_distributed(model, optimizer, str(folder / EP_OPTIMIZER))


def load_expert_parallel_optimizer(model, optimizer, folder: Path) -> None:
    """Load ``folder/optimizer`` (:func:`save_expert_parallel_state`) into ``optimizer`` of the sharded ``model``.

    Call on every process. The model's own shards are loaded when it is built (``from_pretrained(folder/model,
    distributed_config=...)``, :func:`kdamoe.common.parallel.expert_parallel_model`). As for ``fsdp2``
    checkpoints, torch.distributed.checkpoint unpickles the folder's ``.metadata``: trusted folders only.
    """
    load_optimizer_distributed(model, optimizer, str(folder / EP_OPTIMIZER))
