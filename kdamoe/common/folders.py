"""Model folders shared by the jobs: writing a Hub-ready ``save_pretrained`` folder, and rebuilding the model of a
pretraining checkpoint from its run's files.

A pretraining run folder (``kdamoe-train``) holds ``config.yaml`` (the resolved run configuration), ``tokenizer/``,
``checkpoints/stage<i>-step<n>/`` (:mod:`kdamoe.common.checkpoint`) and ``final/``; the functions here read those
files as plain data, so the publishing job needs no pretraining code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoTokenizer

from ..model import KDAMoEConfig, KDAMoEForCausalLM
from ..model.kimi_k3_format import check_kimi_k3_folder, is_kimi_k3_config
from ..model.kimi_linear_format import check_kimi_linear_folder, is_kimi_linear_config
from .checkpoint import verify_checkpoint

LOADING_ARGUMENTS = ("is_local", "local_files_only")


def write_model_folder(model, tokenizer, out_dir: str | Path, card) -> Path:
    """``save_pretrained`` the model (``kernel_backend="auto"``, safetensors, ``auto_map`` for every head, the
    modeling files) and the tokenizer (``model_max_length`` = the model's ``max_position_embeddings``) into
    ``out_dir``, and ``card.save(out_dir / "README.md")``. Returns ``out_dir``."""
    out_dir = Path(out_dir)
    # The saved config describes the model for inference: the run may have forced a backend (e.g. torch on a CPU;
    # the shipped model picks its own), and trainers set use_cache=False for training (activation checkpointing),
    # which would make a plain forward of the published model return no cache.
    trained = model.config.kernel_backend, model.config.use_cache
    model.config.kernel_backend, model.config.use_cache = "auto", True
    try:
        model.save_pretrained(out_dir)
    finally:
        model.config.kernel_backend, model.config.use_cache = trained
    # The tokenizer's context limit is the model's (a pretraining tokenizer is trained before the model exists).
    saved_max, tokenizer.model_max_length = tokenizer.model_max_length, model.config.max_position_embeddings
    try:
        tokenizer.save_pretrained(out_dir)
    finally:
        tokenizer.model_max_length = saved_max
    # transformers 5.25 writes two of from_pretrained's loading arguments into a re-saved tokenizer's config (a
    # tokenizer loaded from disk); they describe how this copy was loaded, not the tokenizer, so the folder drops them.
    tokenizer_config = out_dir / "tokenizer_config.json"
    if tokenizer_config.is_file():
        data = json.loads(tokenizer_config.read_text())
        if any(key in data for key in LOADING_ARGUMENTS):
            tokenizer_config.write_text(json.dumps({k: v for k, v in data.items() if k not in LOADING_ARGUMENTS},
                                                   indent=2, ensure_ascii=False) + "\n")
    card.save(out_dir / "README.md")
    return out_dir


def model_from_run_config(run_cfg: dict, tokenizer) -> KDAMoEForCausalLM:
    """A freshly initialised ``KDAMoEForCausalLM`` of a pretraining run.

    Args:
        run_cfg: the run's configuration as plain data (``config.yaml``, ``kdamoe.training.config.config_to_dict``):
            its ``model`` section (``KDAMoEConfig`` fields), the stages' and the evaluation's ``seq_len`` (the longest
            is ``max_position_embeddings`` unless the model section sets it).
        tokenizer: gives ``vocab_size`` and the bos / eos / pad ids.
    """
    lengths = [s["seq_len"] for s in run_cfg["train"]["stages"]] + [run_cfg["eval"]["seq_len"]]
    kwargs = {"max_position_embeddings": max(lengths), **run_cfg.get("model", {})}
    kwargs.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return KDAMoEForCausalLM(KDAMoEConfig(**kwargs))


def load_run_tokenizer(folder: str | Path):
    """The tokenizer saved in ``folder``.

    Raises:
        ValueError: naming the file when ``tokenizer_config.json`` or ``tokenizer.json`` is missing.
    """
    folder = Path(folder)
    if not (folder / "tokenizer_config.json").is_file():
        raise ValueError(f"{folder / 'tokenizer_config.json'}: missing (no tokenizer in {folder})")
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"{folder / 'tokenizer.json'}: missing (tokenizer_config.json is there)")
    return AutoTokenizer.from_pretrained(str(folder))


def load_pretraining_checkpoint(checkpoint: str | Path, run_dir: str | Path):
    """Rebuild the model of a pretraining checkpoint from the run's ``config.yaml`` and ``tokenizer/``; read only the
    checkpoint's ``model.safetensors`` (after checking the folder against its manifest).

    Returns:
        ``(model in eval mode, tokenizer, run_cfg as plain data)``.

    Raises:
        ValueError: naming the file: a checkpoint that fails its manifest, a missing ``config.yaml`` / ``tokenizer``,
            weights that do not match the run's model.
    """
    checkpoint, run_dir = Path(checkpoint), Path(run_dir)
    reason = verify_checkpoint(checkpoint)
    if reason is not None:
        raise ValueError(f"checkpoint {checkpoint}: {reason}")
    for needed in ("config.yaml", "tokenizer"):
        if not (run_dir / needed).exists():
            raise ValueError(f"{run_dir / needed}: missing "
                             "(a checkpoint is rebuilt with its run's config and tokenizer)")
    run_cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    tokenizer = load_run_tokenizer(run_dir / "tokenizer")
    model = model_from_run_config(run_cfg, tokenizer)
    state = load_file(str(checkpoint / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(model.all_tied_weights_keys)
    if unexpected or set(missing) - tied:
        raise ValueError(f"{checkpoint / 'model.safetensors'}: does not match the run's model "
                         f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.tie_weights()
    return model.eval(), tokenizer, run_cfg


def _stored_tensors(folder: Path, name: str) -> dict[str, tuple[Path, str]]:
    """``{tensor name: (file, name)}`` of the safetensors weights ``name`` (single file or sharded with an index)."""
    index = folder / f"{name}.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return {key: (folder / file, key) for key, file in weight_map.items()}
    path = folder / name
    if not path.is_file():
        raise ValueError(f"{path}: missing (no {name} or {name}.index.json in {folder})")
    with safe_open(str(path), framework="pt") as f:
        return {key: (path, key) for key in f.keys()}


def check_stored_weights(expected: dict[str, torch.Tensor], folder: str | Path, name: str = "model.safetensors",
                         optional: set[str] = frozenset(), what: str = "the model") -> None:
    """Compare the tensors stored in ``folder/name`` with the ones ``expected`` (a state dict) before they are
    trusted: transformers and PEFT would initialise a missing tensor freshly (and only log it), cast an integer
    tensor into a float parameter, and load NaN / inf as they are.

    Args:
        expected: ``{name: tensor}`` the loaded module needs (its ``state_dict()``; values give shapes and dtypes).
        folder, name: where the safetensors file (or its ``.index.json``) lies.
        optional: names that may be absent (tied weights, stored once).
        what: names the module in the errors.

    Raises:
        ValueError: naming the first few offending tensors with their shapes / dtypes: a tensor ``expected`` holds
            that is not stored, a stored tensor ``expected`` lacks, a shape that differs, an integer or bool tensor
            stored where a float one is expected, a tensor holding NaN or inf; or a missing / unreadable file.
    """
    folder = Path(folder)
    stored = _stored_tensors(folder, name)
    missing = sorted(set(expected) - set(stored) - set(optional))
    unexpected = sorted(set(stored) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing {', '.join(f'{k} {list(expected[k].shape)}' for k in missing[:4])}"
                        + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected[:4])}" + (f" and {len(unexpected) - 4} more"
                                                                     if len(unexpected) > 4 else ""))
    by_file: dict[Path, list[str]] = {}
    for key in sorted(set(stored) & set(expected)):
        by_file.setdefault(stored[key][0], []).append(key)
    for path, keys in by_file.items():
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as err:  # a truncated or foreign file: name it instead of a loader traceback
            raise ValueError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err})") from err
        with handle as f:
            for key in keys:
                tensor, want = f.get_tensor(key), expected[key]
                if tuple(tensor.shape) != tuple(want.shape):
                    problems.append(f"{key} stored as {list(tensor.shape)}, expected {list(want.shape)}")
                elif want.is_floating_point() and not tensor.is_floating_point():
                    problems.append(f"{key} stored as {tensor.dtype}, expected a float tensor ({want.dtype})")
                elif tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    problems.append(f"{key} holds NaN or inf")
    if problems:
        raise ValueError(f"{folder / name}: does not match {what}: " + "; ".join(problems[:6]))


def check_model_folder(folder: str | Path, cls=KDAMoEForCausalLM) -> None:
    """:func:`check_stored_weights` of a ``save_pretrained`` folder against the model its ``config.json`` describes
    (built on the ``meta`` device: nothing is allocated). A Kimi Linear folder (``model_type: kimi_linear``) is checked
    through the Kimi Linear tensor map instead (names and shapes, from the safetensors headers), a Kimi K3 folder
    (``model_type: kimi_k3``) through the K3 map.

    Raises:
        ValueError: naming the file and tensor (see :func:`check_stored_weights`), or a missing ``config.json``.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder / 'config.json'}: missing")
    raw = json.loads((folder / "config.json").read_text())
    if is_kimi_linear_config(raw):
        # A Kimi Linear release: its tensors map onto the model (names and shapes from the headers; docs/checkpoints.md)
        check_kimi_linear_folder(folder, cls)
        return
    if is_kimi_k3_config(raw):  # a Kimi K3 release, the same way (its MXFP4 experts by their shapes)
        check_kimi_k3_folder(folder, cls)
        return
    config = KDAMoEConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        skeleton = cls(config)
    optional = set(getattr(skeleton, "all_tied_weights_keys", None) or ())
    check_stored_weights(skeleton.state_dict(), folder, optional=optional,
                         what=f"the {cls.__name__} of its config.json")


def load_model_strictly(folder: str | Path, cls=KDAMoEForCausalLM, **kwargs):
    """``cls.from_pretrained(folder, **kwargs)`` after :func:`check_model_folder`.

    Raises:
        ValueError: see :func:`check_model_folder`.
    """
    check_model_folder(folder, cls)
    return cls.from_pretrained(str(folder), **kwargs)
