"""The pretraining job's configuration: one dataclass tree, loaded from YAML.

``load_config(path, overrides)`` reads a YAML file (a path, or the name of a file shipped in
``kdamoe/configs/``), applies ``dotted.key=value`` overrides (values parsed as YAML; list items by
index, e.g. ``train.stages.0.steps=10``) and validates every field. Any problem raises
``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.config import apply_override, build_dataclass, read_yaml
from ..common.parallel import PARALLELISMS, check_expert_parallel, launched_processes
from ..model import KDAMoEConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = "cpu_default.yaml"


@dataclass
class StageConfig:
    """One context-length stage: its own row length, batch, step count and warmup + cosine LR schedule.

    ``batch_size`` is PER PROCESS: one optimizer step consumes ``batch_size × processes × train.grad_accum_steps``
    rows, and N processes with ``batch_size = B / N`` train what one process with ``B`` trains, up to float32
    summation order (docs/pretraining.md, "Data-parallel runs").
    """

    name: str
    seq_len: int  # tokens per row
    batch_size: int  # rows per micro-batch per process (the global micro-batch is batch_size × processes)
    steps: int  # optimizer steps
    lr: float  # peak learning rate
    warmup_steps: int = 0


@dataclass
class DataConfig:
    """Where documents come from and how validation is held out."""

    source: str = "shakespeare"  # shakespeare | files | hf
    path: str = "data/shakespeare"  # shakespeare: folder written by scripts/fetch_corpus.py
    files: list[str] = field(default_factory=list)  # files: .txt/.md/.jsonl files or folders
    hf_name: str | None = None  # hf: dataset name on the Hub, or a local dataset path
    hf_config: str | None = None
    hf_split: str = "train"
    text_field: str = "text"
    max_documents: int | None = None
    val_documents: list[str] = field(default_factory=list)  # names held out; empty → val_fraction
    val_fraction: float = 0.05


@dataclass
class TokenizerConfig:
    """Byte-level BPE trained on the training split, unless ``path`` names a saved tokenizer."""

    vocab_size: int = 4096
    min_frequency: int = 2
    path: str | None = None


@dataclass
class TrainConfig:
    """Optimizer, schedule and loop settings shared by all stages."""

    stages: list[StageConfig] = field(default_factory=list)
    grad_accum_steps: int = 1
    weight_decay: float = 0.1
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    mixed_precision: str = "auto"  # auto (bf16 on a GPU that has it, else fp32) | no | bf16
    checkpoint_every: int = 0  # optimizer steps; 0: only at the end of each stage
    keep_checkpoints: int = 2  # newest checkpoints kept per run (stage ends are always kept)
    log_every: int = 10  # optimizer steps between TensorBoard scalar writes
    num_threads: int | None = None  # torch CPU threads; None leaves torch's default
    # ddp: every process holds the whole model (DistributedDataParallel); fsdp2: parameters, gradients and AdamW
    # state sharded over the processes (accelerate's FullyShardedDataParallelPlugin(fsdp_version=2), one shard
    # group per KDAMoEDecoderLayer; docs/pretraining.md, "Data-parallel runs"). fsdp2_ep: FSDP2 plus expert
    # parallelism by transformers' own engine (DistributedConfig(fsdp_size=N, ep_size=N)): every process holds
    # num_experts / N whole experts and the routed tokens travel to them. fsdp2 and fsdp2_ep need >= 2 processes.
    # All three are set up by kdamoe.common.parallel.
    parallelism: str = "ddp"


@dataclass
class EvalConfig:
    """Validation: rows of ``seq_len`` tokens from the held-out documents, at most ``max_rows`` of them."""

    seq_len: int = 512
    max_rows: int = 64
    batch_size: int = 8
    bigram_discount: float = 0.75


@dataclass
class MonitorConfig:
    """Expert-load monitoring."""

    load_imbalance_threshold: float = 4.0  # warn when max/mean tokens per expert passes this
    histogram_every: int = 25  # optimizer steps between expert-load histograms


@dataclass
class GenerateConfig:
    """Samples printed at the end of the run."""

    prompts: list[str] = field(default_factory=lambda: ["ROMEO.\n"])
    max_new_tokens: int = 60
    do_sample: bool = True
    temperature: float = 0.8
    top_k: int = 40


@dataclass
class RunConfig:
    """Everything one ``kdamoe-train`` run needs. ``model`` holds ``KDAMoEConfig`` keyword arguments;
    ``vocab_size`` and the special token ids are filled in from the tokenizer."""

    output_dir: str = "outputs/run"
    seed: int = 0
    model: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)

    def validate(self) -> "RunConfig":
        """Check value ranges; raises ``ValueError`` naming the first bad field. Returns ``self``."""
        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ValueError(f"config field {name}: {why}")

        need(self.data.source in {"shakespeare", "files", "hf"}, "data.source", "must be shakespeare, files or hf")
        need(self.data.source != "files" or bool(self.data.files), "data.files", "must list files when source is files")
        need(self.data.source != "hf" or bool(self.data.hf_name), "data.hf_name", "must be set when source is hf")
        need(0.0 < self.data.val_fraction < 1.0, "data.val_fraction", "must lie in (0, 1)")
        need(self.tokenizer.vocab_size >= 266, "tokenizer.vocab_size", "must be at least 266")
        t = self.train
        need(len(t.stages) > 0, "train.stages", "needs at least one stage")
        for i, s in enumerate(t.stages):
            p = f"train.stages[{i}]"
            need(s.seq_len >= 2, f"{p}.seq_len", "must be at least 2")
            need(s.batch_size >= 1, f"{p}.batch_size", "must be at least 1")
            need(s.steps >= 1, f"{p}.steps", "must be at least 1")
            need(s.lr > 0, f"{p}.lr", "must be positive")
            need(0 <= s.warmup_steps <= s.steps, f"{p}.warmup_steps", "must lie in [0, steps]")
        need(len({s.name for s in t.stages}) == len(t.stages), "train.stages", "stage names must be unique")
        need(t.grad_accum_steps >= 1, "train.grad_accum_steps", "must be at least 1")
        need(len(t.adam_betas) == 2 and all(0 <= b < 1 for b in t.adam_betas), "train.adam_betas",
             "two values in [0, 1)")
        need(t.max_grad_norm > 0, "train.max_grad_norm", "must be positive")
        need(t.mixed_precision in {"auto", "no", "bf16"}, "train.mixed_precision", "must be auto, no or bf16")
        need(t.parallelism in PARALLELISMS, "train.parallelism",
             f"must be one of {', '.join(PARALLELISMS)}, got {t.parallelism!r}")
        need(t.checkpoint_every >= 0, "train.checkpoint_every", "must be >= 0")
        need(t.keep_checkpoints >= 1, "train.keep_checkpoints", "must be at least 1")
        need(t.log_every >= 1, "train.log_every", "must be at least 1")
        need(self.eval.seq_len >= 2, "eval.seq_len", "must be at least 2")
        need(self.eval.max_rows >= 1, "eval.max_rows", "must be at least 1")
        need(self.eval.batch_size >= 1, "eval.batch_size", "must be at least 1")
        need(0 < self.eval.bigram_discount < 1, "eval.bigram_discount", "must lie in (0, 1)")
        need(self.monitor.load_imbalance_threshold > 1, "monitor.load_imbalance_threshold", "must exceed 1")
        need(self.monitor.histogram_every >= 1, "monitor.histogram_every", "must be at least 1")
        need(self.generate.max_new_tokens >= 1, "generate.max_new_tokens", "must be at least 1")
        # The model section is KDAMoEConfig's own: check it now, not after the corpus and tokenizer work.
        check_model_section(self.model, self.tokenizer.vocab_size)
        if t.parallelism == "fsdp2_ep" and "WORLD_SIZE" in os.environ:  # under torchrun; else make_accelerator checks
            check_expert_parallel(self.model, launched_processes())
        return self


# Filled in by the run from the tokenizer (``trainer.build_model``); a value under ``model:`` would be ignored.
FROM_TOKENIZER = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


def model_config_fields() -> list[str]:
    """The keyword arguments ``KDAMoEConfig.__init__`` documents (its signature, ``**kwargs`` excluded)."""
    params = inspect.signature(KDAMoEConfig.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]


def check_model_section(model: dict[str, Any], vocab_size: int) -> None:
    """Validate the ``model:`` section: every key a documented ``KDAMoEConfig`` field, and the config they make valid.

    ``KDAMoEConfig`` takes ``**kwargs`` (as every ``PretrainedConfig``), so a misspelt key would otherwise be
    stored as an unused attribute and the model silently built with the default.

    Raises:
        ValueError: ``config field model.<key>: unknown KDAMoEConfig field`` (with the closest field name,
            ``difflib``), a key filled in from the tokenizer, or ``config field model: <KDAMoEConfig's message>``.
    """
    fields = model_config_fields()
    for key, value in model.items():
        # YAML 1.1 reads 1e-6 (no dot) as a string; the other sections convert such values by their type.
        if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()):
            model[key] = float(value)
    for key in model:
        if key in FROM_TOKENIZER:
            raise ValueError(f"config field model.{key}: set from the tokenizer, not in the model section")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; known fields: {', '.join(fields)}"
            raise ValueError(f"config field model.{key}: unknown KDAMoEConfig field{hint}")
    try:
        KDAMoEConfig(**{**model, "vocab_size": vocab_size})
    except (TypeError, ValueError) as err:
        raise ValueError(f"config field model: {err}") from err


def resolve_config_path(path: str | Path | None) -> Path:
    """A config path as given, else the file of that name shipped in ``kdamoe/configs/``; ``None`` → the CPU default.

    Raises:
        ValueError: neither exists.
    """
    if path is None:
        return CONFIG_DIR / DEFAULT_CONFIG
    p = Path(path)
    for candidate in (p, CONFIG_DIR / p, CONFIG_DIR / f"{p}.yaml"):
        if candidate.is_file():
            return candidate
    shipped = sorted(f.name for f in CONFIG_DIR.glob("*.yaml"))
    raise ValueError(f"config {path}: no such file (shipped configs: {shipped})")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read, override and validate a run configuration (see module docstring)."""
    data = read_yaml(resolve_config_path(path))
    for assignment in overrides or []:
        apply_override(data, assignment)
    return build_dataclass(RunConfig, data, "").validate()


def config_to_dict(cfg: RunConfig) -> dict:
    """Plain-data form of a config (for YAML dumps and TensorBoard)."""
    return dataclasses.asdict(cfg)


def with_defaults(data: dict) -> dict:
    """A saved plain-data config (``config_to_dict`` of an older run) with every field it lacks at its default,
    so a field added since (e.g. ``train.parallelism``) compares as the value that run used."""
    return config_to_dict(build_dataclass(RunConfig, data, ""))
