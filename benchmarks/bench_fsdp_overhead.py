"""The FSDP2 wrapper's overhead on one GPU: the pretraining job with ``train.parallelism=fsdp2`` on one process
against the plain path (issue #15, deliverable 5; used to plan a multi-GPU run).

    python benchmarks/bench_fsdp_overhead.py [--steps 40] [--seq-len 4096] [--batch-size 4] [--out DIR]

Both runs are the documented job on the GPU preset (``kdamoe-train --config gpu_h200.yaml``) with one short stage,
no mid-stage checkpoints and a small evaluation:

* plain: ``python -m kdamoe.cli ...`` (one process, no wrapper);
* fsdp2: ``torchrun --standalone --nproc_per_node 1 -m kdamoe.cli ... --set train.parallelism=fsdp2`` (every
  decoder layer its own ``fully_shard`` unit over a one-rank mesh: all-gathers and reduce-scatters of one rank,
  the FSDP2 hooks, its mixed-precision casts and its sharded checkpoint).

Tokens/s is the job's own per-step figure (TensorBoard ``train/tokens_per_s``, written every step here), median
over the steps after the first ``--skip`` (compilation and autotuning). The final losses of the two runs are
reported too: on one rank FSDP2 computes the same step, so they should agree to bf16 rounding. Writes
``fsdp_overhead.{json,md}`` into ``--out`` ($OUT).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import scalars, stream_job, write_json, write_text  # noqa: E402  (the benchmarks folder is not a package)


def run_job(mode: str, out_dir: str, a) -> dict:
    stage = (f"train.stages=[{{name: bench, seq_len: {a.seq_len}, batch_size: {a.batch_size}, steps: {a.steps}, "
             f"lr: 1.0e-3, warmup_steps: 4}}]")
    job = ["-m", "kdamoe.cli", "--config", "gpu_h200.yaml", "--output-dir", out_dir, "--no-resume",
           "--set", stage, "--set", "train.checkpoint_every=0", "--set", "train.log_every=1",
           "--set", "eval.max_rows=8", "--set", "generate.max_new_tokens=8"]
    if mode == "fsdp2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *job,
               "--set", "train.parallelism=fsdp2"]
    else:
        cmd = [sys.executable, *job]
    log_path = os.path.join(a.out, f"fsdp_{mode}.log")
    with open(log_path, "w") as log:
        run = stream_job(cmd, log, a.timeout_s)
    row = {"mode": mode, "command": " ".join(cmd[1:]), "exit": run["exit"], "wall_s": run["wall_s"]}
    if run["killed"]:
        row["error"] = (f"killed after {a.timeout_s} s (--timeout-s); the job's output is in "
                        f"{os.path.basename(log_path)}")
    elif run["exit"] != 0:
        row["error"] = "".join(run["tail"])[-1500:]
    tps = scalars(out_dir, "train/tokens_per_s")  # also what a killed run wrote before the kill
    loss = scalars(out_dir, "train/loss")
    kept = [v for s, v in tps if s > a.skip]
    row.update(steps=len(tps), tokens_per_s_median=statistics.median(kept) if kept else None,
               tokens_per_s_steps=[round(v) for _, v in tps], losses=[round(v, 5) for _, v in loss])
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=10, help="steps left out of the median (warm-up)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--timeout-s", type=int, default=240, help="per run")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    a = p.parse_args()
    if a.skip >= a.steps:
        raise SystemExit(f"--skip ({a.skip}) must be below --steps ({a.steps})")
    rows = []
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("plain", "fsdp2"):
            rows.append(run_job(mode, os.path.join(tmp, mode), a))
            print(json.dumps(rows[-1]), flush=True)
    plain, fsdp = (r.get("tokens_per_s_median") for r in rows)
    result = {"settings": vars(a), "rows": rows,
              "fsdp2_over_plain_step_time": (plain / fsdp) if plain and fsdp else None}
    write_json(os.path.join(a.out, "fsdp_overhead.json"), result)
    lines = ["# FSDP2 wrapper on one GPU against the plain path (pretraining job, GPU preset)", "",
             f"Stage: seq_len {a.seq_len}, batch {a.batch_size}, {a.steps} steps; median tokens/s over steps "
             f"> {a.skip}.", "", "| mode | exit | tokens/s | job wall s | last loss |", "|---|---|---|---|---|"]
    for r in rows:
        tps = r.get("tokens_per_s_median")
        last = r["losses"][-1] if r.get("losses") else None
        lines.append(f"| {r['mode']} | {r['exit']} | {'' if tps is None else f'{tps:.0f}'} | {r['wall_s']} | {last} |")
    ratio = result["fsdp2_over_plain_step_time"]
    lines += ["", f"FSDP2 step time / plain step time: {'' if ratio is None else f'{ratio:.3f}'}"]
    write_text(os.path.join(a.out, "fsdp_overhead.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
