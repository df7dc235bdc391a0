"""The pretraining job: data → tokenizer → model → staged training → export → reload → samples.

``run(cfg)`` is the whole job; ``train_stage`` is the loop of one context-length stage. Each stage
builds its own packed rows, data loader and warmup + cosine schedule; the model and the AdamW state
carry over from the stage before. Checkpoints (:mod:`kdamoe.common.checkpoint`) are folders under
``<output_dir>/checkpoints/`` holding everything a resumed run needs: ``accelerator.save_state`` files
(model with its router biases, optimizer, RNG, gradient-accumulation step) and our own
:class:`TrainProgress` (stage, step, data position, the stage's LR scheduler state, losses) as JSON and
the expert-load totals as safetensors. They are written atomically and resumed from the newest intact one.

``train.parallelism`` picks the data-parallel engine, set up by :mod:`kdamoe.common.parallel`
(:func:`~kdamoe.common.parallel.make_accelerator`): ``ddp`` (a whole model per process), ``fsdp2`` (accelerate's
FSDP2 plugin; sharded checkpoints, and :func:`~kdamoe.common.parallel.consolidated_model` gathers the full weights
for the export) or ``fsdp2_ep`` (FSDP2 plus expert parallelism by transformers' own engine,
:func:`~kdamoe.common.parallel.expert_parallel_model`; accelerate then keeps the data loader sharding, gradient
accumulation, mixed precision, RNG states and collectives, but never wraps the model).
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, get_cosine_schedule_with_warmup

from ..common.checkpoint import (
    EP_MODEL,
    MONITOR,
    PROGRESS,
    checkpoint_name,
    find_checkpoint,
    list_checkpoints,
    load_expert_parallel_optimizer,
    load_state,
    save_checkpoint_atomically,
    save_expert_parallel_state,
)
from ..common.folders import model_from_run_config
from ..common.parallel import (
    check_world_size,
    consolidated_model,
    deferred_reduction,
    expert_parallel_model,
    make_accelerator,
)
from ..common.run_folder import owned_run_folder
from .config import RunConfig, StageConfig, config_to_dict, with_defaults
from .corpus import check_corpus_source, load_corpus
from .data import IGNORE_INDEX, pack_documents, stage_loader, tokenize_documents
from .evaluate import BigramBaseline, evaluate_lm
from .export import export_model, print_samples, reload_model
from .monitoring import TrainingMonitor
from .tokenizer import token_byte_lengths, train_tokenizer

logger = logging.getLogger(__name__)
# accelerate warns on every save_state that the tied LM head is stored once; that is intended here.
logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)


@dataclass
class TrainProgress:
    """Where the run stands; saved in every checkpoint as ``progress.json`` (plain JSON, never unpickled).

    JSON keeps every float exactly (``repr`` round-trips), which the bitwise resume relies on.
    """

    stage: int = 0  # index of the stage in progress
    step: int = 0  # optimizer steps done in that stage; micro-batches consumed = step · grad_accum_steps
    global_step: int = 0  # optimizer steps over all stages
    tokens: int = 0  # training tokens consumed over all stages (all processes)
    scheduler: dict | None = None  # state of the stage's LR scheduler
    losses: list = field(default_factory=list)  # [global_step, loss] of every optimizer step so far
    # processes of the run that wrote the checkpoint (None in checkpoints written before it was recorded): a resume
    # on another count would change the global batch (batch_size is per process) and lack RNG states
    num_processes: int | None = None

    def save(self, folder: Path) -> None:
        (folder / PROGRESS).write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, folder: Path) -> "TrainProgress":
        return cls(**json.loads((folder / PROGRESS).read_text()))


@dataclass
class PreparedData:
    """Tokenizer, tokenized training documents and packed validation rows."""

    tokenizer: object
    train_docs: list[list[int]]
    val_rows: dict[str, torch.Tensor]
    byte_lengths: list[int]


def prepare_data(cfg: RunConfig, out_dir: Path) -> PreparedData:
    """Load the corpus, split it, get the tokenizer (trained on the training split, saved to
    ``out_dir/tokenizer`` and reused from there on resume) and tokenize both splits."""
    train_docs, val_docs = load_corpus(cfg.data, cfg.seed)
    tok_dir = out_dir / "tokenizer"
    if cfg.tokenizer.path:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer.path)
    elif (tok_dir / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    else:
        tokenizer = train_tokenizer((d.text for d in train_docs), cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency)
        tokenizer.save_pretrained(tok_dir)  # reused on resume: the token ids must not change
    ids = dict(bos_id=tokenizer.bos_token_id, eos_id=tokenizer.eos_token_id)
    train_tokens = tokenize_documents(tokenizer, [d.text for d in train_docs], **ids)
    val_tokens = tokenize_documents(tokenizer, [d.text for d in val_docs], **ids)
    val_rows = pack_documents(val_tokens, cfg.eval.seq_len, tokenizer.pad_token_id)
    val_rows = {k: v[: cfg.eval.max_rows] for k, v in val_rows.items()}
    return PreparedData(tokenizer, train_tokens, val_rows, token_byte_lengths(tokenizer))


def build_model(cfg: RunConfig, tokenizer):
    """A freshly initialised ``KDAMoEForCausalLM`` from ``cfg.model`` plus the tokenizer's vocabulary and ids
    (:func:`kdamoe.common.folders.model_from_run_config`, which also rebuilds a checkpoint's model for publishing)."""
    return model_from_run_config(config_to_dict(cfg), tokenizer)


def make_optimizer(model, cfg: RunConfig) -> torch.optim.AdamW:
    """AdamW; matrices (dim ≥ 2) decay, norms, biases, gates and AttnRes queries do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    t = cfg.train
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.stages[0].lr, betas=tuple(t.adam_betas), eps=t.adam_eps)


def make_scheduler(optimizer, stage: StageConfig):
    """Warmup + cosine from the stage's own peak LR (the optimizer's moments carry over)."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = stage.lr
    return get_cosine_schedule_with_warmup(optimizer, stage.warmup_steps, stage.steps)


def checkpoint_dir(out_dir: Path, progress: TrainProgress) -> Path:
    return out_dir / "checkpoints" / checkpoint_name(progress.stage, progress.step)


# Fields that decide what a resumed run computes; the rest (logging, output) may change between runs.
RESUME_KEYS = ["seed", "model", "data", "tokenizer", "train.stages", "train.grad_accum_steps", "train.weight_decay",
               "train.adam_betas", "train.adam_eps", "train.max_grad_norm", "train.mixed_precision",
               "train.parallelism"]  # a DDP checkpoint holds model.safetensors, the FSDP2 ones sharded folders


def check_same_run(out_dir: Path, cfg: RunConfig) -> None:
    """Raise ``ValueError`` naming the first field in :data:`RESUME_KEYS` where ``cfg`` differs from the
    configuration the checkpoints in ``out_dir`` were made with."""
    saved_path = out_dir / "config.yaml"
    if not saved_path.exists():
        return
    saved, current = with_defaults(yaml.safe_load(saved_path.read_text())), config_to_dict(cfg)
    for key in RESUME_KEYS:
        a, b = saved, current
        for part in key.split("."):
            a, b = (a or {}).get(part), (b or {}).get(part)
        if a != b:
            raise ValueError(f"config field {key} differs from the run whose checkpoints are in {out_dir} "
                             f"({a!r} there, {b!r} now): pass --no-resume or another --output-dir")


def check_same_processes(checkpoint: Path, num_processes: int) -> None:
    """Raise ``ValueError`` when ``checkpoint`` was written by a run on another number of processes.

    ``train.stages[*].batch_size`` is per process, so another count changes the global batch and the rows each
    process reads, and the checkpoint holds RNG states for its own processes only: the resumed run would silently
    compute something else. Checkpoints that do not record the count (written before it was) are not checked."""
    saved = TrainProgress.load(checkpoint).num_processes
    if saved is not None and saved != num_processes:
        raise ValueError(f"checkpoint {checkpoint} was written by a run on {saved} processes and this run has "
                         f"{num_processes}: resume with --nproc_per_node {saved} (train.stages.*.batch_size is per "
                         "process, so the global batch would change), or pass --no-resume / another --output-dir")


def save_checkpoint(accelerator, progress: TrainProgress, scheduler, monitor: TrainingMonitor, out_dir: Path,
                    cfg: RunConfig, model=None, optimizer=None) -> Path:
    """Write ``checkpoints/stage<i>-step<n>`` atomically (:func:`kdamoe.common.checkpoint.save_checkpoint_atomically`):
    accelerate's state, under ``fsdp2_ep`` the sharded ``model`` and ``optimizer``
    (:func:`kdamoe.common.checkpoint.save_expert_parallel_state`), ``progress.json``, ``monitor.safetensors``, the
    manifest. Then delete mid-stage checkpoints beyond the newest ``train.keep_checkpoints``; stage ends are kept."""
    progress.scheduler = scheduler.state_dict()
    progress.num_processes = accelerator.num_processes

    def write_own_state(folder: Path) -> None:
        progress.save(folder)
        if monitor.total_load is not None:
            save_file({"total_load": monitor.total_load.contiguous()}, str(folder / MONITOR))

    sharded = None
    if cfg.train.parallelism == "fsdp2_ep":
        sharded = functools.partial(save_expert_parallel_state, model, optimizer)  # called with the folder
    path = save_checkpoint_atomically(accelerator, checkpoint_dir(out_dir, progress), write_own_state, sharded)
    if accelerator.is_main_process:  # stage end or not is read from the name: no file of a folder is trusted here
        stages = cfg.train.stages
        mids = [p for stage, step, p in list_checkpoints(path.parent)
                if not (stage < len(stages) and step == stages[stage].steps)]
        for old in mids[: max(0, len(mids) - cfg.train.keep_checkpoints)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(folder: Path, monitor: TrainingMonitor) -> TrainProgress:
    """Our own state from a checkpoint folder: the :class:`TrainProgress` and the monitor's expert-load totals
    (accelerate's part is loaded by :func:`kdamoe.common.checkpoint.load_state` in :func:`train_stage`)."""
    if (folder / MONITOR).exists():
        monitor.load_state_dict(load_file(str(folder / MONITOR)))
    return TrainProgress.load(folder)


def micro_batch_loss(accelerator, model, batch: dict, aux_coef: float) -> torch.Tensor:
    """This process's training loss of one micro-batch: the forward of ``model`` on ``batch`` (its rows) under
    accelerate's autocast, normalised so that the processes' gradients, averaged by DDP / FSDP2, are those of the
    token mean over the GLOBAL micro-batch (every process's rows).

    Each process divides its token-loss sum by (global count G / processes N), i.e. returns N · sum / G. The count
    is passed to the model as ``num_items_in_batch`` (the divisor of transformers' loss functions) as the integer G
    itself, an int64 tensor, and the result is multiplied by N here. Not as the float G / N: FSDP2's mixed precision
    casts every floating-point forward argument to ``param_dtype`` (``MixedPrecisionPolicy.cast_forward_inputs``),
    so under bf16 the count was rounded to 8 significant bits (507 -> 508, 16380 -> 16384: loss and gradients off by
    up to 0.2 %, differently every step). An integer tensor is not cast; the loss divides its float32 sum by it in
    float32 (exact for G < 2^24). One process: N = 1, nothing is multiplied, the plain token mean.

    With the load-balancing aux loss on (``output_router_logits`` and ``router_aux_loss_coef = aux_coef > 0``) the
    model adds ``aux_coef · aux`` of this process's tokens to its loss; only the token part is multiplied by N, so
    the aux term stays this process's own (averaged over the processes, as before).
    """
    targets = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()  # the model shifts the labels by one
    count = accelerator.reduce(targets, "sum")  # int64: see above
    with accelerator.autocast():
        output = model(**batch, use_cache=False, num_items_in_batch=count)
    n = accelerator.num_processes
    if n == 1:
        return output.loss
    if output.aux_loss is not None and aux_coef > 0:
        return n * output.loss - (n - 1) * aux_coef * output.aux_loss
    return n * output.loss


def train_stage(accelerator, model, optimizer, index: int, stage: StageConfig, data: PreparedData,
                progress: TrainProgress, monitor: TrainingMonitor, cfg: RunConfig, out_dir: Path,
                resume_from: Path | None, stop_at: int | None) -> bool:
    """Run one stage to its last step (or until ``progress.global_step == stop_at``). Returns False if stopped early."""
    t = cfg.train
    # the model is transformers' (expert_parallel_model), not accelerate's
    expert_parallel = t.parallelism == "fsdp2_ep"
    rows = pack_documents(data.train_docs, stage.seq_len, data.tokenizer.pad_token_id, drop_last=True)
    loader = accelerator.prepare(stage_loader(rows, stage.batch_size, stage.steps * t.grad_accum_steps,
                                              cfg.seed + index, accelerator.num_processes))
    scheduler = make_scheduler(optimizer, stage)
    if resume_from is not None:
        load_state(accelerator, resume_from)
        if expert_parallel:
            load_expert_parallel_optimizer(model, optimizer, resume_from)
        scheduler.load_state_dict(progress.scheduler)
    raw_model = accelerator.unwrap_model(model)
    aux_coef = raw_model.config.router_aux_loss_coef
    monitor.start_stage(stage.name, stage.steps, progress.step)
    batches = accelerator.skip_first_batches(loader, progress.step * t.grad_accum_steps)
    step_loss, step_tokens, t0 = 0.0, 0, time.perf_counter()
    model.train()
    for batch in batches:
        if progress.global_step == stop_at:
            return False
        with accelerator.accumulate(model):
            # fsdp2_ep: the model was never prepared, so accelerate's autocast and no_sync are applied here, and the
            # optimizer (not accelerate's either) is stepped only on the last micro-batch. For ddp / fsdp2 the
            # prepared model's forward already runs under that autocast and accelerate's optimizer skips the others.
            defer = deferred_reduction(model, not accelerator.sync_gradients) if expert_parallel else nullcontext()
            with defer:
                # the token mean over the GLOBAL micro-batch; the count goes in as an integer, as FSDP2's bf16
                # rounds every floating-point forward argument (micro_batch_loss)
                loss = micro_batch_loss(accelerator, model, batch, aux_coef)
                accelerator.backward(loss)
            if accelerator.sync_gradients:
                # under fsdp2_ep the experts' gradients live on another device mesh than the rest; accelerate's
                # clip then takes one norm per mesh
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm)
            if accelerator.sync_gradients or not expert_parallel:
                optimizer.step()
                optimizer.zero_grad()
        # the global micro-batch's loss: the mean over processes of their (rescaled) losses
        step_loss += accelerator.reduce(loss.detach(), "mean").item() / t.grad_accum_steps
        step_tokens += batch["input_ids"].numel() * accelerator.num_processes
        if not accelerator.sync_gradients:
            continue
        lr = scheduler.get_last_lr()[0]  # the rate this step used
        scheduler.step()
        # all processes' tokens; before the update resets them
        load = accelerator.reduce(raw_model.expert_load(), "sum")
        raw_model.update_router_biases()
        progress.step, progress.global_step = progress.step + 1, progress.global_step + 1
        progress.tokens += step_tokens
        progress.losses.append([progress.global_step, step_loss])
        write = progress.global_step % t.log_every == 0 or progress.step == stage.steps
        elapsed = time.perf_counter() - t0
        monitor.log_step(progress.global_step, {"loss": step_loss, "lr": lr,
                                                "grad_norm": float(grad_norm), "tokens_per_s": step_tokens / elapsed,
                                                "seq_len": stage.seq_len}, write)
        monitor.log_expert_load(progress.global_step, load, write)
        if progress.step == stage.steps or (t.checkpoint_every and progress.step % t.checkpoint_every == 0):
            save_checkpoint(accelerator, progress, scheduler, monitor, out_dir, cfg, model, optimizer)
        step_loss, step_tokens, t0 = 0.0, 0, time.perf_counter()
    return True


def _say(accelerator, text: str) -> None:
    accelerator.print(text)
    logger.info(text)


def _metrics_line(name: str, m: dict) -> str:
    return f"  {name:<28} loss {m['loss']:.4f}  ppl {m['ppl']:10.2f}  bpb {m['bpb']:.4f}  ({m['tokens']} tokens)"


def run(cfg: RunConfig, resume: bool = True, stop_after_steps: int | None = None, overwrite: bool = False) -> dict:
    """Run the whole job (see module docstring) and return a summary dict.

    The run owns ``cfg.output_dir`` while it runs (:func:`kdamoe.common.run_folder.owned_run_folder`): a second run
    into it stops, and a fresh start refuses a folder that holds anything unless ``overwrite``.

    Args:
        cfg: validated run configuration.
        resume: continue from the newest checkpoint in ``cfg.output_dir`` if there is one.
        stop_after_steps: stop once this many optimizer steps (over all stages) are done, as if the
            run were killed there (no export); a later call with ``resume=True`` continues.
        overwrite: on a fresh start, remove what an earlier pretraining run wrote there (only that).
    Returns:
        ``{"losses": [[global_step, loss], ...] of all steps so far, "finished": bool, "before"/"after"/
        "reloaded"/"bigram": metric dicts (when finished), "final_dir", "seconds"}``.
    Raises:
        kdamoe.common.run_folder.RunFolderError: the folder is busy, holds another job's run, or (fresh start) is not
            empty.
        ValueError: no intact checkpoint among the folder's checkpoints, or a resumed run with another config.
    """
    start = time.perf_counter()
    out_dir = Path(cfg.output_dir)
    check_corpus_source(cfg.data)  # before the folder is claimed: a typo leaves nothing behind
    if cfg.tokenizer.path and not (Path(cfg.tokenizer.path) / "tokenizer_config.json").is_file():
        raise ValueError(f"tokenizer.path: no tokenizer_config.json in {cfg.tokenizer.path} (a folder written by "
                         "save_pretrained), or leave tokenizer.path unset to train one")
    if stop_after_steps is not None:
        total = sum(stage.steps for stage in cfg.train.stages)
        if not 1 <= stop_after_steps <= total:
            raise ValueError(f"--stop-after {stop_after_steps} never stops the run: it has {total} optimizer steps "
                             f"(train.stages); give 1 <= N <= {total}")
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    use_bf16 = cfg.train.mixed_precision == "bf16" or (
        cfg.train.mixed_precision == "auto" and torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    accelerator = make_accelerator(cfg.train.parallelism, use_bf16, cfg.train.grad_accum_steps, cfg.model)
    check_world_size(accelerator, "accelerate", "see docs/pretraining.md")
    set_seed(cfg.seed)

    def say(line: str) -> None:
        _say(accelerator, line)

    def find_resume() -> Path | None:
        checkpoint = find_checkpoint(out_dir / "checkpoints", say=say) if resume else None
        if resume and checkpoint is None and list_checkpoints(out_dir / "checkpoints"):
            raise ValueError(f"no intact checkpoint in {out_dir / 'checkpoints'} (reasons above); pass --no-resume "
                             "--overwrite to start over (which deletes them) or another --output-dir")
        if checkpoint is not None:
            check_same_run(out_dir, cfg)
            check_same_processes(checkpoint, accelerator.num_processes)
        return checkpoint

    with owned_run_folder(out_dir, "pretraining", find_resume, overwrite=overwrite, say=say) as checkpoint:
        return _train_in_folder(cfg, accelerator, out_dir, checkpoint, use_bf16, stop_after_steps, start)


def _train_in_folder(cfg: RunConfig, accelerator, out_dir: Path, checkpoint: Path | None, use_bf16: bool,
                     stop_after_steps: int | None, start: float) -> dict:
    """:func:`run`'s body, with ``out_dir`` owned and the checkpoint to resume from (or None) decided."""
    if accelerator.is_main_process:
        (out_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    accelerator.wait_for_everyone()

    with accelerator.main_process_first():  # the main process trains and saves the tokenizer, the others load it
        data = prepare_data(cfg, out_dir)
    set_seed(cfg.seed)
    model = build_model(cfg, data.tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    _say(accelerator, f"model: {n_params / 1e6:.2f} M parameters, {len(data.train_docs)} training documents "
                      f"({sum(map(len, data.train_docs))} tokens), device {accelerator.device}")

    def evaluate(m):
        return evaluate_lm(m, data.val_rows, data.byte_lengths, cfg.eval.batch_size, accelerator.device,
                           torch.bfloat16 if use_bf16 else None)

    summary = {"seconds": 0.0, "finished": False}
    if checkpoint is None and accelerator.is_main_process:
        summary["bigram"] = BigramBaseline(len(data.tokenizer), cfg.eval.bigram_discount).fit(data.train_docs).evaluate(
            data.val_rows, data.byte_lengths)
        summary["before"] = evaluate(model.to(accelerator.device))
        (out_dir / "baselines.json").write_text(json.dumps({k: summary[k] for k in ("bigram", "before")}))
    if cfg.train.parallelism == "fsdp2_ep":
        source = out_dir / "initial" if checkpoint is None else checkpoint / EP_MODEL  # a fresh run saves it first
        model = expert_parallel_model(accelerator, model, source, save_first=checkpoint is None)
        optimizer = make_optimizer(model, cfg)
    else:
        optimizer = make_optimizer(model, cfg)
        model, optimizer = accelerator.prepare(model, optimizer)
    monitor = TrainingMonitor(out_dir / "tensorboard", cfg.monitor.load_imbalance_threshold,
                              cfg.monitor.histogram_every, enabled=accelerator.is_main_process)
    progress = TrainProgress() if checkpoint is None else load_checkpoint(checkpoint, monitor)
    resume_stage = progress.stage
    if checkpoint is not None:
        _say(accelerator, f"resuming from {checkpoint}")

    for index, stage in enumerate(cfg.train.stages):
        if index < resume_stage:
            continue
        if index > progress.stage:  # a new stage starts from step 0 with the carried model and optimizer
            progress.stage, progress.step = index, 0
        finished = train_stage(accelerator, model, optimizer, index, stage, data, progress, monitor, cfg, out_dir,
                               checkpoint if index == resume_stage else None, stop_after_steps)
        if not finished:
            monitor.close()
            return {**summary, "losses": progress.losses, "seconds": time.perf_counter() - start}

    summary.update(losses=progress.losses, finished=True, tokens=progress.tokens)
    monitor.close(out_dir / "expert_load.png")
    # on every process (a sharded model is gathered); the main process gets the whole model
    trained = consolidated_model(accelerator, model, lambda: build_model(cfg, data.tokenizer))
    if accelerator.is_main_process:
        trained = trained.to(accelerator.device)
        summary.update(json.loads((out_dir / "baselines.json").read_text()))
        summary["after"] = evaluate(trained)
        final_dir = export_model(trained, data.tokenizer, cfg, summary, out_dir / "final")
        reloaded = reload_model(final_dir, accelerator.device)
        summary["reloaded"] = evaluate(reloaded)
        summary["final_dir"] = str(final_dir)
        summary["seconds"] = time.perf_counter() - start
        report = ["validation (held-out documents):",
                  _metrics_line("untrained model", summary["before"]),
                  _metrics_line("token bigram baseline", summary["bigram"]),
                  _metrics_line("trained model", summary["after"]),
                  _metrics_line("trained, reloaded from final/", summary["reloaded"]),
                  f"  perplexity reduction vs untrained: {summary['before']['ppl'] / summary['after']['ppl']:.1f}x; "
                  f"beats bigram: {summary['after']['bpb'] < summary['bigram']['bpb']}"]
        _say(accelerator, "\n".join(report))
        print_samples(reloaded, data.tokenizer, cfg.generate, accelerator.device)
        (out_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=2))
        _say(accelerator, f"done in {summary['seconds']:.0f} s; model folder: {final_dir}")
    accelerator.wait_for_everyone()
    return summary
