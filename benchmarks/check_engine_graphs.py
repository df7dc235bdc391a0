"""Check, then time, the rollout engine's CUDA graphs of its decode steps (issue #39, batched rollouts part 2).

On one GPU, for each slot count N: N episodes (GRPO groups of up to 8 generations per prompt, a ~2K-token prompt each)
played by the engine twice, with ``cuda_graphs=False`` (the static decode steps run eagerly) and ``cuda_graphs=True``
(each bucket's first decode step eager, the next captured, the rest replayed). Checked: the two runs give the same
greedy tokens and log-probs within bf16 noise (max |Δ| recorded); one more case runs 6 sampled episodes on 8 slots, so
the bucket has padding rows. Timed: every decode step of all N slots, after the first three of the run (warm-up,
capture, first replay), ``torch.cuda.synchronize()`` before and after; the median step (the engine's ``_step``:
forward, sampling, bookkeeping) and forward. ``<out>/engine_graphs.json`` is rewritten after every run, so a time
limit leaves what was measured; the checks fail (exit 1) only after everything was written.

Compiles: the Triton cache may be cold, so the steps that carry prompt pieces (the prefills, and the mixed steps
beside them) run with ``kernel_backend="torch"`` (``--prefill-backend``; the engine reads the backend at every step),
and only the decode steps' kernels compile; the decode-only steps run on ``"auto"`` (the kdamoe kernels).

Model: the engine benchmark's shape (``harness.Shape``) reduced to 4 layers (3 KDA, 1 MLA), 64 experts top-8, random
weights, bf16, ``kernel_backend="auto"`` (the kdamoe kernels on CUDA). Needs torch, triton, transformers and this
checkout's ``kdamoe`` (not TRL: ``kdamoe.posttraining``'s package init, which imports the recipes, is skipped).

    python benchmarks/check_engine_graphs.py                      # GPU: slots 1,8,32,64 after 2K tokens
    python benchmarks/check_engine_graphs.py --smoke --out /tmp/x  # CPU: tiny model, 1 and 2 slots (a check of the
                                                                  # script; the engine takes its static path on the
                                                                  # CPU only where the slot kernels apply)
"""

import argparse
import os
import statistics
import sys
import time
import types

import torch
from harness import TINY, Shape, build_kdamoe, commit, ints, stack_versions, write_json

import kdamoe  # the real package (the model); then the engine module without kdamoe.posttraining's __init__

if "kdamoe.posttraining" not in sys.modules:
    _package = types.ModuleType("kdamoe.posttraining")
    _package.__path__ = [os.path.join(os.path.dirname(kdamoe.__file__), "posttraining")]
    sys.modules["kdamoe.posttraining"] = _package
from transformers import GenerationConfig  # noqa: E402

from kdamoe.posttraining.engine import EpisodeSpec, RolloutEngine  # noqa: E402

SKIPPED_STEPS = 3  # a run's first decode steps of N slots: eager warm-up, capture (then its replay), first replay
LOGPROB_TOL = 0.05  # |Δ log-prob| between the graph and the eager run: bf16 noise (the same kernels run in both)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of engine_graphs.json (default $OUT)")
    p.add_argument("--slots", type=ints, default=None, help="slot counts (default 1,8,64,32; smoke: 1,2)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens (default 2048; smoke: 12)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per run (default 20; smoke: 2)")
    p.add_argument("--budget-s", type=float, default=62.0, help="start no run after this many seconds")
    p.add_argument("--prefill-backend", default="torch",
                   help="kernel_backend of the steps carrying prompt pieces (default torch: no prefill compiles)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU: a check of the script")
    a = p.parse_args(argv)
    a.slots = a.slots or ([1, 2] if a.smoke else [1, 8, 64, 32])
    a.context = a.context or (12 if a.smoke else 2048)
    a.steps = a.steps or (2 if a.smoke else 20)
    if min(a.slots) < 1 or a.context < 1 or a.steps < 1:
        p.error(f"--slots, --context and --steps must be positive, got {a.slots}, {a.context}, {a.steps}")
    return a


def build_model(smoke: bool):
    if smoke:  # one KDA head (few interpreter programs); kernel_backend "torch" (the CPU's)
        model = build_kdamoe(Shape(**{**TINY.__dict__, "kda_num_heads": 1}), "cpu", torch.float32)
        model.config.kernel_backend = "torch"
        return model
    return build_kdamoe(Shape(num_hidden_layers=4), "cuda", torch.bfloat16)


def play(model, specs, slots: int, graphs: bool, new_tokens: int, do_sample: bool, prefill_backend: str) -> dict:
    """One engine run; returns its results, stats and the timings of its decode steps of ``slots`` sequences."""
    cuda = model.device.type == "cuda"
    decode_backend = model.config.kernel_backend
    config = GenerationConfig(do_sample=do_sample, temperature=1.0 if do_sample else None, max_new_tokens=new_tokens,
                              pad_token_id=0)
    # an eos id the random model is unlikely to pick, so turns run to their cap (the steps stay full)
    engine = RolloutEngine(model, config, num_slots=slots, eos_token_ids=[model.config.vocab_size - 1],
                           max_completion_length=new_tokens, prefill_chunk_size=2048, cuda_graphs=graphs)
    step, forward = engine._step, engine._forward
    steps, forwards = [], []

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed_forward(feeds):
        decode = all(len(t) == 1 for _, t in feeds)
        model.config.kernel_backend = decode_backend if decode else prefill_backend
        sync()
        start = time.perf_counter()
        out = forward(feeds)
        sync()
        forwards.append((len(feeds), decode, time.perf_counter() - start))
        model.config.kernel_backend = decode_backend
        return out

    def timed_step(runnable):
        sync()
        start = time.perf_counter()
        step(runnable)
        sync()
        steps.append(time.perf_counter() - start)

    engine._forward, engine._step = timed_forward, timed_step
    start = time.perf_counter()
    results = engine.run(specs)
    total = time.perf_counter() - start
    full = [i for i, (n, decode, _) in enumerate(forwards) if decode and n == slots][SKIPPED_STEPS:]
    return dict(results=results, stats=dict(engine.stats), static_path=engine._static_applies(), total_s=total,
                step_ms=[1e3 * steps[i] for i in full], forward_ms=[1e3 * forwards[i][2] for i in full],
                other_steps_s=sum(s for (n, decode, _), s in zip(forwards, steps, strict=True) if not decode))


def compare(eager: list[dict], graph: list[dict]) -> dict:
    same = all(e["completion_ids"] == g["completion_ids"] for e, g in zip(eager, graph, strict=True))
    deltas = [abs(a - b) for e, g in zip(eager, graph, strict=True)
              for a, b in zip(e["logprobs"], g["logprobs"], strict=False)]
    return dict(same_tokens=same, max_abs_logprob_delta=max(deltas, default=0.0),
                ok=same and max(deltas, default=0.0) <= LOGPROB_TOL)


def episodes(model, slots: int, context: int, group: int, seed: int) -> list[EpisodeSpec]:
    """``slots`` episodes, groups of ``group`` sharing a random prompt of ``context`` ids."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, model.config.vocab_size - 1, (context,), generator=gen).tolist()
               for _ in range(-(-slots // group))]
    return [EpisodeSpec(prompts[i // group], seed=seed * 1000 + i) for i in range(slots)]


def main(argv=None) -> int:
    a = parse_args(argv)
    began = time.perf_counter()
    cuda = not a.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on the CPU")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "engine_graphs.json")
    model = build_model(a.smoke)
    doc = dict(meta=dict(commit=commit(), stack=stack_versions(cuda), smoke=a.smoke, dtype=str(model.dtype),
                         config={k: getattr(model.config, k) for k in (
                             "vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_experts",
                             "num_experts_per_tok", "kv_lora_rank", "kda_num_heads", "kda_head_dim")},
                         context=a.context, prefill_backend=a.prefill_backend, timed_steps=a.steps,
                         skipped_steps=SKIPPED_STEPS,
                         command=" ".join(["python", "benchmarks/check_engine_graphs.py", *(argv or sys.argv[1:])])),
               runs=[], checks=[])
    write_json(path, doc)
    # + 3 tokens: the groups admitted in the first step start decoding up to two steps before the last group, and
    # end as many steps before it (those steps have fewer than N sequences)
    cases = [("greedy", n, n, min(n, 8), a.context, a.steps + SKIPPED_STEPS + 3, False) for n in a.slots]
    # 6 sampled episodes (3 prompts) on 8 slots: the bucket of 8 with padding rows; short prompts
    padding = ("sampled, padding rows", 8 if not a.smoke else 4, 6 if not a.smoke else 3, 2, 16, 8, True)
    cases.insert(1, padding)
    for name, slots, count, group, context, new_tokens, sample in cases:
        if time.perf_counter() - began > a.budget_s:
            doc["checks"].append(dict(case=name, slots=slots, skipped="time"))
            write_json(path, doc)
            continue
        specs = episodes(model, count, context, group, seed=slots)
        runs = {}
        for graphs in (False, True):
            run = play(model, specs, slots, graphs, new_tokens, sample, a.prefill_backend)
            runs[graphs] = run
            row = dict(case=name, slots=slots, episodes=count, context=context, graphs=graphs,
                       static_path=run["static_path"], steps_timed=len(run["step_ms"]),
                       step_ms=statistics.median(run["step_ms"]) if run["step_ms"] else None,
                       forward_ms=statistics.median(run["forward_ms"]) if run["forward_ms"] else None,
                       other_steps_s=run["other_steps_s"], total_s=run["total_s"],
                       graph_captures=run["stats"]["graph_captures"], graph_replays=run["stats"]["graph_replays"])
            doc["runs"].append(row)
            write_json(path, doc)
            print(row, flush=True)
        check = dict(case=name, slots=slots, **compare(runs[False]["results"], runs[True]["results"]),
                     captured=runs[True]["stats"]["graph_captures"] > 0 if cuda else None)
        doc["checks"].append(check)
        write_json(path, doc)
        print(check, flush=True)
    failed = [c for c in doc["checks"] if not c.get("skipped") and (not c["ok"] or c["captured"] is False)]
    doc["passed"] = not failed
    write_json(path, doc)
    if failed:
        print(f"FAILED: {failed}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
