"""Million-token agentic RL on one GPU: rollout turns on a kept cache against TRL's re-prefilling loop, and one
memory-bounded GRPO optimizer step over >= 1M tokens of trajectories (issue #16).

The model is the long-context benchmark's shape (``bench_long_context.Shape``: 1.68B total / 0.36B active
parameters, vocab 32000, 16 layers with MLA every 4th, ``max_position_embeddings`` 1M), bf16, random weights from a
fixed seed, random token ids. One device call (``benchmarks/device_long_rl.sh``) runs the parts below; each is
caught on its own and ``long_rl.json`` is rewritten after every measurement (``bench_long_context.Recorder``), so
the deadline or a crash loses nothing measured before it.

Parts (``--only``, comma list; default all):

``turns``
    The cost of one rollout turn against the context it continues, ``--contexts`` (4K ... 1M). A turn is what the
    GRPO tool loop does after a tool call: append ``--result-tokens`` tool-result tokens (random ids standing for
    the tool turn) and generate ``--gen-tokens`` tokens greedily (``min_new_tokens`` = ``max_new_tokens``, so
    every turn generates the same number). Two ways, both ``model.generate`` with the model's defaults (chunked
    prefill, CUDA-graph decode):

    * ``cached`` (``grpo.rollout: cached``, ``kdamoe.posttraining.rollout``): ``generate(ids, cache=
      cache)`` on the cache the earlier turns returned, so only the tokens the cache has not seen are prefilled;
    * ``trl`` (TRL 1.16's ``_tool_call_loop``, which keeps no cache between turns): ``generate(ids)`` from scratch,
      the whole sequence prefilled every turn.

    The cache is grown from one context to the next by an untimed prefill. Wall seconds per turn (synchronized),
    median of ``--repeats`` turns at each context for ``cached`` (each turn continues the previous one), one turn
    for ``trl`` at each context (it repeats the same work); whether both generated the same tokens at their first
    turn there.
``trajectory``
    One multi-turn trajectory measured whole: ``--traj-turns`` turns, each appending ``--traj-result`` tool-result
    tokens then generating ``--gen-tokens``; cumulative seconds per turn for ``cached`` and ``trl``.
``update``
    One GRPO optimizer step with the memory-bounded update (``grpo.long_context: true``): see
    :func:`run_update`.

Writes ``long_rl.json`` (``raw``: every number; ``rows``) and ``long_rl.md`` into ``--out``.

    python3 benchmarks/bench_long_rl.py --out "$OUT"             # H200 (deadline --budget-s)
    python benchmarks/bench_long_rl.py --tiny --out /some/dir    # CPU smoke test: tiny shapes, < 60 s
"""

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_long_context import GIB, TINY, Bench, Recorder, Shape, build_kdamoe, label, stack_versions  # noqa: E402

K, M = 1024, 1 << 20
PARTS = ("turns", "trajectory", "update")


class RLRecorder(Recorder):
    """``bench_long_context.Recorder`` writing ``long_rl.{json,md}`` with this benchmark's tables."""

    stem = "long_rl"

    def rows(self) -> list[dict]:
        rows = []
        turns = self.raw.get("turns", {})
        base = turns.get(label(min(self.settings.get("contexts", [0]) or [0])), {})
        for key, entry in turns.items():
            if not isinstance(entry, dict) or "cached_s" not in entry:
                continue
            rows.append({"name": f"turn after {key}", "cached_s": entry["cached_s"], "trl_s": entry.get("trl_s"),
                         "cached_over_trl": _ratio(entry["cached_s"], entry.get("trl_s")),
                         "cached_over_cached_at_first": _ratio(entry["cached_s"], base.get("cached_s"))})
        return rows

    def markdown(self, doc: dict) -> str:
        s = doc["settings"]
        lines = ["# Million-token agentic RL on one GPU: cached rollout turns, memory-bounded GRPO step", "",
                 f"Stack: {doc['stack']}.", "",
                 f"Model: {s.get('shape')}; bf16 on CUDA. A turn: {s.get('result_tokens')} tool-result tokens "
                 f"appended, {s.get('gen_tokens')} tokens generated greedily.", "",
                 "## Rollout turn against context", "",
                 "| context | cached s / turn | TRL loop s / turn | cached / TRL | cached / cached at the first "
                 "context | same tokens |", "|---|---|---|---|---|---|"]
        for key, e in doc["raw"].get("turns", {}).items():
            if isinstance(e, dict) and "cached_s" in e:
                base = doc["rows"][0]["cached_s"] if doc["rows"] else None
                lines.append(f"| {key} | {_f(e['cached_s'])} | {_f(e.get('trl_s'))} | "
                             f"{_f(_ratio(e['cached_s'], e.get('trl_s')))} | {_f(_ratio(e['cached_s'], base))} | "
                             f"{e.get('same_tokens')} |")
            else:
                lines.append(f"| {key} | {e} | | | | |")
        traj = doc["raw"].get("trajectory", {})
        if traj:
            lines += ["", "## One trajectory, cumulative seconds", "", "| turn | context after | cached | TRL loop |",
                      "|---|---|---|---|"]
            for i, (ctx, c, t) in enumerate(zip(traj.get("context", []), traj.get("cached_cum_s", []),
                                                traj.get("trl_cum_s", []) + [None] * 99)):
                lines.append(f"| {i + 1} | {label(ctx)} | {_f(c)} | {_f(t)} |")
            for k, v in traj.items():
                if k not in ("context", "cached_cum_s", "trl_cum_s"):
                    lines.append(f"\n{k}: {v}")
        upd = doc["raw"].get("update", {})
        if upd:
            lines += ["", "## GRPO optimizer step", "", "| case | tokens | wall s | peak GiB | note |",
                      "|---|---|---|---|---|"]
            for key, e in upd.items():
                if isinstance(e, dict) and "s" in e:
                    lines.append(f"| {key} | {e.get('tokens')} | {_f(e['s'])} | {_f(e.get('peak_gib'))} | "
                                 f"{e.get('note', '')} |")
                else:
                    lines.append(f"| {key} | | | | {e} |")
        if doc.get("notes"):
            lines += ["", "## Notes", ""] + [f"- {k}: {v}" for k, v in doc["notes"].items()]
        return "\n".join(lines) + "\n"


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _f(x, digits=3):
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return "" if x is None else str(x)


# ------------------------------------------------------------------------------------------------ rollout turns
@torch.no_grad()
def generate_turn(bench: Bench, model, ids: torch.Tensor, cache, gen_tokens: int):
    """One turn: ``generate`` ``gen_tokens`` greedy tokens after ``ids [1, L]`` (continuing ``cache`` when given).

    Returns ``(seconds, ids with the new tokens appended, the returned cache)``."""
    bench.sync()
    t0 = time.perf_counter()
    # as kdamoe.posttraining.rollout._generate_turn and TRL's loop call it: an all-ones mask, the step logits kept
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=gen_tokens,
                         min_new_tokens=gen_tokens, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, pad_token_id=0)
    bench.sync()
    return time.perf_counter() - t0, out.sequences, out.cache


@torch.no_grad()
def extend(bench: Bench, model, ids: torch.Tensor, cache, n: int):
    """Append ``n`` random tokens to ``ids`` and prefill them on ``cache`` (untimed set-up; ``cache`` None: a fresh
    prefill). Returns ``(ids, cache)``."""
    ids = torch.cat([ids, bench.ids(1, n)], 1) if ids is not None else bench.ids(1, n)
    seen = 0 if cache is None else cache.get_seq_length()
    out = model(input_ids=ids[:, seen:], cache=cache, use_cache=True, logits_to_keep=1)
    return ids, out.cache


def run_turns(bench: Bench, model) -> None:
    a, rec = bench.args, bench.rec
    ids, cache = None, None
    for T in a.contexts:
        key = label(T)
        have = 0 if ids is None else ids.shape[1]
        # trl re-prefills T tokens (~19 s at 1M on an H200); the cache extension prefills T - have
        if not rec.need("turns", key, bench.est(2 * 20.0 * T / M + 5)):
            break
        try:
            ids, cache = extend(bench, model, ids, cache, T - have)
            first = torch.cat([ids, bench.ids(1, a.result_tokens)], 1)
            # the TRL loop's turn: everything from scratch
            bench.free()
            trl_s, trl_seq, _ = generate_turn(bench, model, first, None, a.gen_tokens)
            times, same = [], None
            turn_ids = first
            for r in range(a.repeats):
                s, seq, cache = generate_turn(bench, model, turn_ids, cache, a.gen_tokens)
                if r == 0:
                    same = bool(torch.equal(seq, trl_seq))
                times.append(s)
                turn_ids = torch.cat([seq, bench.ids(1, a.result_tokens)], 1)
            ids = seq  # the context grows by the turns played; the next context extends from here
            rec.put("turns", key, {"context": T, "cached_s": statistics.median(times), "cached_turns_s": times,
                                   "trl_s": trl_s, "same_tokens": same,
                                   "peak_gib": torch.cuda.max_memory_allocated() / GIB if bench.cuda else None})
        except Exception:
            rec.error("turns", key)
            return
        print(f"turns {key}: {rec.raw['turns'][key]}", flush=True)


def run_trajectory(bench: Bench, model) -> None:
    a, rec = bench.args, bench.rec
    n, R, G = a.traj_turns, a.traj_result, a.gen_tokens
    final = a.traj_prompt + n * (R + G)
    if not rec.need("trajectory", "run", bench.est(3 * 20.0 * (final / M) ** 2 * n / 3 + 10)):
        return
    prompt = bench.ids(1, a.traj_prompt)
    results = [bench.ids(1, R) for _ in range(n)]  # the same tool results for both ways
    context, cum = [], {"cached": [], "trl": []}
    for way in ("cached", "trl"):
        ids, cache, total = prompt, None, 0.0
        for i in range(n):
            s, seq, returned = generate_turn(bench, model, ids, cache, G)
            cache = returned if way == "cached" else None
            total += s
            cum[way].append(total)
            ids = torch.cat([seq, results[i]], 1)
            if way == "cached":
                context.append(seq.shape[1])
            if rec.left() < 5:
                break
        bench.free()
    rec.put("trajectory", "context", context)
    rec.put("trajectory", "cached_cum_s", cum["cached"])
    rec.put("trajectory", "trl_cum_s", cum["trl"])
    rec.put("trajectory", "shape", f"prompt {a.traj_prompt}, {n} turns of {G} generated + {R} tool-result tokens")


# ------------------------------------------------------------------------------------------------ GRPO update
def run_update(bench: Bench, model) -> None:
    raise NotImplementedError("the update part is added with the memory-bounded GRPO update")


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--only", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and lengths (CPU smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--contexts", type=ints, default=None, help="turn contexts (default 4K,16K,64K,256K,1M)")
    p.add_argument("--result-tokens", type=int, default=None, help="tool-result tokens per turn (default 48)")
    p.add_argument("--gen-tokens", type=int, default=None, help="generated tokens per turn (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="cached turns per context")
    p.add_argument("--traj-prompt", type=int, default=None, help="trajectory prompt tokens (default 4K)")
    p.add_argument("--traj-turns", type=int, default=None, help="trajectory turns (default 8)")
    p.add_argument("--traj-result", type=int, default=None, help="trajectory tool-result tokens per turn (default 32K)")
    a = p.parse_args(argv)
    t = a.tiny
    defaults = dict(contexts=[64, 256, 1024] if t else [4 * K, 16 * K, 64 * K, 256 * K, M],
                    result_tokens=5 if t else 48, gen_tokens=4 if t else 64, traj_prompt=32 if t else 4 * K,
                    traj_turns=3 if t else 8, traj_result=40 if t else 32 * K)
    for name, value in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    a.only = [x.strip() for x in a.only.split(",") if x.strip()]
    bad = [x for x in a.only if x not in PARTS]
    if bad:
        p.error(f"--only: unknown part(s) {bad}; choose from {', '.join(PARTS)}")
    for name in ("result_tokens", "gen_tokens", "repeats", "traj_turns", "traj_result", "traj_prompt"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(a, name)})")
    if sorted(a.contexts) != a.contexts or min(a.contexts) < 2:
        p.error(f"--contexts must be increasing lengths >= 2, got {a.contexts}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.tiny and a.device == "cpu":
        torch.set_num_threads(1)
    settings = {"tiny": a.tiny, "shape": asdict(TINY if a.tiny else Shape()), "contexts": a.contexts,
                "result_tokens": a.result_tokens, "gen_tokens": a.gen_tokens, "repeats": a.repeats}
    rec = RLRecorder(a.out, a.budget_s, settings)
    bench = Bench(a, rec)
    rec.stack = stack_versions(bench)
    rec.save()
    model = build_kdamoe(bench.shape, bench.device, bench.dtype)
    runners = {"turns": run_turns, "trajectory": run_trajectory, "update": run_update}
    for part in a.only:
        t0 = time.time()
        try:
            runners[part](bench, model)
        except Exception:
            rec.error(part, "part")
        bench.free()
        print(f"part {part}: {time.time() - t0:.0f} s; {rec.left():.0f} s left", flush=True)
    rec.save()
    with open(os.path.join(a.out, "long_rl.md")) as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
