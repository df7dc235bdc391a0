"""Model folders shared by the jobs: writing a Hub-ready ``save_pretrained`` folder, and rebuilding the model of a
pretraining checkpoint from its run's files.

A pretraining run folder (``kdamoe-train``) holds ``config.yaml`` (the resolved run configuration), ``tokenizer/``,
``checkpoints/stage<i>-step<n>/`` (:mod:`kdamoe.common.checkpoint`) and ``final/``; the functions here read those
files as plain data, so the publishing job needs no pretraining code.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer

from ..model import KDAMoEConfig, KDAMoEForCausalLM
from .checkpoint import verify_checkpoint


def write_model_folder(model, tokenizer, out_dir: str | Path, card) -> Path:
    """``save_pretrained`` the model (``kernel_backend="auto"``, safetensors, ``auto_map`` for every head, the
    modeling files) and the tokenizer (``model_max_length`` = the model's ``max_position_embeddings``) into
    ``out_dir``, and ``card.save(out_dir / "README.md")``. Returns ``out_dir``."""
    out_dir = Path(out_dir)
    # The run may have forced a backend (e.g. torch on a CPU); the shipped model picks its own.
    trained_backend, model.config.kernel_backend = model.config.kernel_backend, "auto"
    try:
        model.save_pretrained(out_dir)
    finally:
        model.config.kernel_backend = trained_backend
    # The tokenizer's context limit is the model's (a pretraining tokenizer is trained before the model exists).
    saved_max, tokenizer.model_max_length = tokenizer.model_max_length, model.config.max_position_embeddings
    try:
        tokenizer.save_pretrained(out_dir)
    finally:
        tokenizer.model_max_length = saved_max
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
