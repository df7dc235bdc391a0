"""``kdamoe-convert``: rewrite a checkpoint folder between Moonshot's Kimi Linear format and kdamoe's, shard by shard.

A Kimi Linear 48B checkpoint is ~96 GB in bfloat16, so the converter never holds the model: it reads one tensor at a
time from the source shards (``safetensors.safe_open``), maps it (:mod:`kdamoe.model.kimi_linear_format`, the same
map ``KDAMoEForCausalLM.from_pretrained`` uses), and writes output shards of at most ``max_shard_size`` bytes. Held at
any time: the output shard being filled plus the fused tensors still waiting for a piece (for Kimi Linear → kdamoe,
one MoE layer's ``gate_up_proj`` / ``down_proj``: ~3.6 GB for the 48B release in bf16).

``--to kda_moe`` writes a folder like kdamoe's ``save_pretrained``: ``config.json`` with ``auto_map`` for every head,
the model code, the weights, and the source's tokenizer / generation / card files. ``--to kimi_linear`` writes the
released layout, which transformers' ``KimiLinearForCausalLM.from_pretrained`` (and the release's own remote code,
and servers that read it) load. Tensors keep their stored dtype.

Kimi K3 (:mod:`kdamoe.model.kimi_k3_format`): ``--to kda_moe`` also reads a ``model_type: kimi_k3`` folder (its text
model; the vision tower's tensors are skipped), decoding the MXFP4 routed experts exactly into the dtype its config
names (bfloat16 when it names none);
``--to kimi_k3`` writes K3's released layout with the experts re-quantised to MXFP4 (``--experts-dtype mxfp4``, the
default) or kept in bfloat16 (``--experts-dtype bf16``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from huggingface_hub import ModelCard
from safetensors.torch import save_file
from transformers.dynamic_module_utils import custom_object_save
from transformers.utils.hub import convert_file_size_to_int

from .common.run_folder import pid_alive
from .model import KDAMoEConfig, KDAMoEForCausalLM
from .model.checkpoint_formats import checkpoint_files, iter_safetensors, read_config_dict
from .model.kimi_k3_format import (
    EXPERTS_FORMATS,
    KIMI_K3_MODEL_TYPE,
    kdamoe_to_kimi_k3_config,
    kdamoe_to_kimi_k3_tensors,
    kimi_k3_to_kdamoe_config,
    kimi_k3_to_kdamoe_tensors,
)
from .model.kimi_linear_format import (
    KIMI_LINEAR_MODEL_TYPE,
    kdamoe_to_kimi_linear_config,
    kdamoe_to_kimi_linear_tensors,
    kimi_linear_to_kdamoe_config,
    kimi_linear_to_kdamoe_tensors,
)
from .model.modeling_kdamoe import AUTO_MAP

logger = logging.getLogger(__name__)

FORMATS = ("kimi_linear", "kimi_k3", "kda_moe")
DEFAULT_MAX_SHARD_SIZE = "5GB"
# Files of a source folder that are not carried over: its weights and config (rewritten) and caches.
_NOT_COPIED = ("*.safetensors", "model.safetensors.index.json", "config.json", "*.bin", "*.pt", "*.pth", "*.gguf")


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, to: str, overwrite: bool = False,
                       max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, experts_format: str = "mxfp4") -> Path:
    """Convert the checkpoint ``src`` (a folder or Hub id) into ``dst`` in the format ``to``, streaming.

    Args:
        src: a Kimi Linear or Kimi K3 folder / Hub id (``model_type: kimi_linear`` / ``kimi_k3``; K3's text model,
            its vision tensors skipped) for ``to="kda_moe"``, or a kdamoe folder (``model_type: kda_moe``) for
            ``to="kimi_linear"`` / ``"kimi_k3"``; weights as safetensors (one file or shards + index).
        dst: the output folder; it must not exist or be empty, unless ``overwrite``. A symbolic link is followed:
            the folder it points to is the one written (or replaced).
        to: ``"kda_moe"``, ``"kimi_linear"`` or ``"kimi_k3"``.
        overwrite: replace a non-empty ``dst`` that holds only checkpoint files (weights, index, model code, configs,
            and names the source's other files have; anything else is refused up front), its whole content removed
            once the conversion has succeeded (the new folder is written beside it first, as a hidden
            ``.DST.converting-PID`` folder; such folders left by an interrupted conversion whose process is gone are
            removed when the next conversion to ``dst`` starts).
        max_shard_size: largest output shard, bytes or a size string (``"5GB"``, ``"500MB"``); a single tensor larger
            than it gets a shard of its own. One shard → ``model.safetensors``; more → ``model-0000i-of-0000N`` and
            ``model.safetensors.index.json``.
        experts_format: for ``to="kimi_k3"``: ``"mxfp4"`` (the released storage: each routed expert projection
            re-quantised by ``kdamoe.model.mxfp4.mxfp4_encode``, round to nearest E2M1 per block of 32 with an E8M0
            scale; a relative RMS error of about 0.11 on weights that were not MXFP4 before, none on weights decoded
            from MXFP4 and not changed since) or ``"bf16"`` (bfloat16 experts, the config saying
            ``routed_experts_format: bf16``). Not read for the other targets.

    Returns:
        ``dst`` as a ``Path``.

    Raises:
        ValueError: ``to`` not in :data:`FORMATS`; ``src`` without a ``config.json`` (or one that is not a JSON
            object), of a format other than the one
            ``to`` converts from; ``dst`` non-empty without ``overwrite``, or with ``overwrite`` holding files a
            conversion does not write; ``dst`` holding ``src`` or inside it; a
            config the target format cannot represent (naming the field); a missing, extra or wrongly shaped tensor
            (naming it and its shapes); a bad ``max_shard_size``; files put into an empty ``dst`` during the
            conversion (the result is then kept as ``DST.converted-PID``); a bad ``experts_format``.
    """
    if to not in FORMATS:
        raise ValueError(f"to={to!r}: expected one of {FORMATS}")
    if experts_format not in EXPERTS_FORMATS:
        raise ValueError(f"experts_format={experts_format!r}: expected one of {EXPERTS_FORMATS}")
    limit = _shard_limit(max_shard_size)
    if Path(src).expanduser().exists():
        src = Path(src).expanduser()
    elif Path(src).is_absolute() or str(src).startswith((".", "~")) or str(src).count("/") != 1:
        raise ValueError(f"src {src}: no such folder (and not a Hub id, namespace/name)")
    source_config = read_config_dict(str(src))
    if source_config is None:
        where = "the folder has none" if Path(src).is_dir() else (
            "not a local folder, and as a Hub id its config.json could not be fetched: check the id, the network, "
            "HF_HUB_OFFLINE and the token")
        raise ValueError(f"{src}: no config.json ({where})")
    if not isinstance(source_config, dict):
        raise ValueError(f"{src}: config.json holds {type(source_config).__name__} {str(source_config)[:40]!r}, not a "
                         "JSON object")
    src_type = source_config.get("model_type")
    wants = (KIMI_LINEAR_MODEL_TYPE, KIMI_K3_MODEL_TYPE) if to == "kda_moe" else (KDAMoEConfig.model_type,)
    if src_type not in wants:
        raise ValueError(f"{src}: model_type is {src_type!r}; --to {to} converts from {' or '.join(map(repr, wants))}")
    dst = Path(dst).expanduser()
    if dst.is_symlink():
        # a link (e.g. to a folder on a larger disk) is written through: the new folder is built beside its target
        # and replaces it, so the link keeps pointing at the result (shutil.rmtree refuses to remove a link itself)
        dst = dst.resolve()
    _check_destination(Path(src), dst, overwrite)
    if overwrite and dst.is_dir() and any(dst.iterdir()):
        _refuse_foreign_entries(dst, _side_folder(src))

    if to == "kda_moe" and src_type == KIMI_K3_MODEL_TYPE:
        config = KDAMoEConfig(**kimi_k3_to_kdamoe_config(source_config))

        # The experts are decoded to the checkpoint's dtype (its config's `dtype`), so the folder has one dtype, or to
        # bfloat16 when it names none: MXFP4 values (two significant bits times a power of two) are exact in each.
        stored = getattr(config, "dtype", None)
        stored = getattr(torch, stored.removeprefix("torch."), None) if isinstance(stored, str) else stored
        experts_dtype = stored if stored in (torch.float32, torch.bfloat16, torch.float64) else torch.bfloat16

        def mapping(tensors, config, expected, optional):
            return kimi_k3_to_kdamoe_tensors(tensors, config, expected, optional, experts_dtype=experts_dtype)
    elif to == "kda_moe":
        config = KDAMoEConfig(**kimi_linear_to_kdamoe_config(source_config))
        mapping = kimi_linear_to_kdamoe_tensors
    elif to == "kimi_k3":
        config = KDAMoEConfig.from_dict({k: v for k, v in source_config.items() if k != "model_type"})
        target_config = kdamoe_to_kimi_k3_config(config, experts_format)  # refuses, naming the option, first

        def mapping(tensors, config, expected, optional):
            return kdamoe_to_kimi_k3_tensors(tensors, config, expected, optional, experts_format=experts_format)
    else:
        config = KDAMoEConfig.from_dict({k: v for k, v in source_config.items() if k != "model_type"})
        target_config = kdamoe_to_kimi_linear_config(config)  # refuses, naming the option, before anything is written
        mapping = kdamoe_to_kimi_linear_tensors
    with torch.device("meta"):
        skeleton = KDAMoEForCausalLM(config)
    expected = {k: v.shape for k, v in skeleton.state_dict().items()}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()

    _remove_stale_partial_folders(dst)
    tmp = dst.with_name(f"{_PARTIAL_PREFIX.format(name=dst.name)}{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        files = checkpoint_files(str(src))
        _write_shards(mapping(iter_safetensors(files), config, expected, optional), tmp, limit)
        _copy_side_files(_side_folder(src), tmp, source_config)
        _mark_converted_card(tmp / "README.md", src_type, to)
        if to == "kda_moe":
            _write_kdamoe_config(skeleton, tmp)
        else:
            (tmp / "config.json").write_text(json.dumps(target_config, indent=2) + "\n")
        _move_into_place(tmp, dst, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


# The folder a conversion writes before renaming it to dst: hidden, beside dst, named after the writing process.
_PARTIAL_PREFIX = ".{name}.converting-"


def _remove_stale_partial_folders(dst: Path) -> None:
    """Remove the partial folders that conversions to ``dst`` killed before they could clean up (``kill -9``, a lost
    machine) left beside it: hidden, and as large as the shards written so far. A folder whose process still runs
    (another conversion to the same ``dst``) is left alone."""
    prefix = _PARTIAL_PREFIX.format(name=dst.name)
    if not dst.parent.is_dir():
        return
    for path in dst.parent.glob(f"{prefix}*"):
        pid = path.name[len(prefix):]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        logger.warning("removing %s, the partial output of an interrupted conversion (process %s)", path, pid)
        shutil.rmtree(path, ignore_errors=True)


def _move_into_place(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``dst``. Without ``overwrite``, ``dst`` was absent or empty when the conversion
    started; files put there since (a conversion of the 48B model takes hours) are not the converter's to delete, so
    the result then stays beside ``dst`` under a visible name and the conversion ends with a ``ValueError``."""
    if dst.exists():
        if overwrite:
            shutil.rmtree(dst)
        else:
            try:
                dst.rmdir()  # still empty, as checked at the start
            except OSError:
                kept = dst.with_name(f"{dst.name}.converted-{os.getpid()}")
                tmp.rename(kept)
                raise ValueError(f"dst {dst}: files were added to it during the conversion; it is left as it is, and "
                                 f"the converted folder is {kept}") from None
    tmp.rename(dst)


def _shard_limit(max_shard_size) -> int:
    if isinstance(max_shard_size, str) and max_shard_size.strip().isdigit():
        max_shard_size = int(max_shard_size)  # a plain number of bytes, as the command line passes it
    try:
        limit = convert_file_size_to_int(max_shard_size)
    except (ValueError, TypeError) as err:
        raise ValueError(f"max_shard_size={max_shard_size!r}: expected bytes or a size such as '5GB' ({err})") from err
    if not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r}: must be a positive size")
    return limit


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse a ``dst`` that holds anything unless ``overwrite``, and always one that is ``src``, contains it (the
    project's "nothing lost" rule, as the run folders of the other jobs) or lies inside it."""
    if src.exists() and dst.exists() and (dst.resolve() == src.resolve() or dst.resolve() in src.resolve().parents):
        raise ValueError(f"dst {dst}: is (or contains) the source folder {src}; pick another folder")
    if src.is_dir() and src.resolve() in dst.resolve().parents:
        # inside SRC, the output becomes one of SRC's "other files": the next conversion of SRC copies it along
        # (weights excepted), and a push or copy of SRC carries a second model with it
        raise ValueError(f"dst {dst}: is inside the source folder {src}; pick a folder outside it")
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"dst {dst}: exists and is not a folder")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        found = sorted(p.name for p in dst.iterdir())
        raise ValueError(f"dst {dst}: exists and is not empty ({', '.join(found[:3])}"
                         f"{', ...' if len(found) > 3 else ''}); pass --overwrite (overwrite=True) to replace it, or "
                         "another folder")


# What --overwrite may delete in DST besides the names the conversion writes: any checkpoint's weights, index, model
# code and configs (an earlier conversion or save_pretrained folder, possibly of another shard count).
_REPLACEABLE = ("*.safetensors", "model.safetensors.index.json", "*.bin", "*.pt", "*.pth", "*.gguf", "*.py",
                "config.json", "generation_config.json")


def _refuse_foreign_entries(dst: Path, side_folder: Path) -> None:
    """With ``overwrite``, refuse (before converting anything) a ``dst`` holding an entry that neither the conversion
    writes (the source's other files, which it copies, and the patterns of :data:`_REPLACEABLE`) nor a checkpoint
    has: someone's notes or data, which replacing the folder would delete. The other jobs' ``--overwrite`` likewise
    removes only what their runs write."""
    written = {path.relative_to(side_folder).parts[0] for path in _iter_files(side_folder)}
    foreign = sorted(p.name for p in dst.iterdir()
                     if p.name not in written and not any(Path(p.name).match(pattern) for pattern in _REPLACEABLE))
    if foreign:
        raise ValueError(f"dst {dst}: --overwrite would delete {', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}, which a conversion does not write; move "
                         f"{'it' if len(foreign) == 1 else 'them'} away or pick another folder")


class _ShardWriter:
    """Fills safetensors shards of at most ``limit`` bytes; at :meth:`finish`, names them as transformers does and
    writes the index."""

    def __init__(self, folder: Path, limit: int):
        self.folder, self.limit = folder, limit
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total_bytes = self.total_parameters = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.limit:
            self._flush()
        self.current[name] = tensor.contiguous()
        self.current_bytes += size
        self.total_bytes += size
        self.total_parameters += tensor.numel()

    def _flush(self) -> None:
        path = self.folder / f".part-{len(self.parts):05d}.safetensors"
        save_file(self.current, str(path), metadata={"format": "pt"})
        self.parts.append((path, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def finish(self) -> None:
        if self.current or not self.parts:
            self._flush()
        if len(self.parts) == 1:
            self.parts[0][0].rename(self.folder / "model.safetensors")
            return
        weight_map = {}
        n = len(self.parts)
        for i, (path, names) in enumerate(self.parts, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_parameters": self.total_parameters, "total_size": self.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_shards(tensors: Iterable[tuple[str, torch.Tensor]], folder: Path, limit: int) -> None:
    writer = _ShardWriter(folder, limit)
    seen = set()
    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"{name}: produced twice (stored twice in the source?)")
        seen.add(name)
        writer.add(name, tensor)
    writer.finish()


def _side_folder(src) -> Path:
    """The local folder holding the source's other files: ``src`` itself, or for a Hub id a snapshot of the repository
    without its weights (tokenizer, its code, chat template, generation config, card, license)."""
    if Path(src).is_dir():
        return Path(src)
    from huggingface_hub import snapshot_download  # noqa: PLC0415 (only a Hub source needs it)

    return Path(snapshot_download(str(src), ignore_patterns=list(_NOT_COPIED)))


def _copy_side_files(folder: Path, out: Path, source_config: dict) -> None:
    """Copy the source's tokenizer, generation config, card and other files; not its weights, config or model code
    (the ``.py`` files its ``auto_map`` names, and kdamoe's model files)."""
    model_code = {ref.split(".")[0] + ".py" for ref in _auto_map_refs(source_config)}
    model_code |= {p.name for p in Path(__file__).with_name("model").glob("*.py")}
    for path in sorted(_iter_files(folder)):
        rel = path.relative_to(folder)
        if rel.parts[0].startswith(".") or any(rel.match(p) for p in _NOT_COPIED) or (
                len(rel.parts) == 1 and rel.name in model_code):
            continue
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


# Hub tags that name a checkpoint format (the rest of a card's tags, its license, language, datasets, base model, are
# facts about the model and stay): what a converted folder's card says instead.
_FORMAT_TAGS = {"kda_moe": ["custom_code", "kda_moe"], "kimi_linear": ["kimi_linear"], "kimi_k3": ["kimi_k3"]}


def _mark_converted_card(card_path: Path, source_type: str, to: str) -> None:
    """Say on the copied model card (``README.md``, when the source had one) that the folder was converted.

    The card is the source's: its license, language, datasets and description still hold, but its usage text is
    written for the source format (a kdamoe card shows ``trust_remote_code=True`` and kdamoe's remote code; a Kimi
    release's card shows its own loaders). So the format tags of the card's YAML header are swapped for the target's
    (:data:`_FORMAT_TAGS`) and a note naming both formats and the command opens the text, rather than a card that
    silently describes another format (a push of the folder would publish it as it is).
    """
    if not card_path.is_file():
        return
    card = ModelCard.load(card_path)
    tags = [t for t in (card.data.tags or []) if t not in {tag for tags in _FORMAT_TAGS.values() for tag in tags}]
    card.data.tags = tags + [t for t in _FORMAT_TAGS[to] if t not in tags]
    note = (f"> Converted from the `{source_type}` checkpoint format to `{to}` by `kdamoe-convert SRC DST --to {to}`. "
            f"The card below is the source's: its usage instructions are written for the `{source_type}` format.\n\n")
    card.text = note + card.text.lstrip("\n")
    card.save(card_path)


def _auto_map_refs(config: dict) -> Iterator[str]:
    for value in (config.get("auto_map") or {}).values():
        for ref in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(ref, str):
                yield ref.split("--")[-1]


def _iter_files(folder: Path) -> Iterator[Path]:
    for path in folder.rglob("*"):
        if path.is_file():
            yield path


def _write_kdamoe_config(skeleton: KDAMoEForCausalLM, out: Path) -> None:
    """``config.json`` (with ``auto_map`` for every head) and the model code, as ``save_pretrained`` writes them; the
    config describes the model for inference (``kernel_backend="auto"``, ``use_cache=True``)."""
    config = skeleton.config
    config.kernel_backend, config.use_cache = "auto", True
    config.auto_map = dict(AUTO_MAP)
    config.architectures = ["KDAMoEForCausalLM"]
    custom_object_save(skeleton, out, config=config)
    config.save_pretrained(out)
    if not (out / "generation_config.json").exists() and skeleton.generation_config is not None:
        skeleton.generation_config.save_pretrained(out)


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "FORMATS", "convert_checkpoint"]
