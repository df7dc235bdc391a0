"""End-to-end training speed on one GPU: kdamoe against transformers' native KimiLinear (+ fla), issue #14.

One device call (``benchmarks/device_e2e.sh``) runs the parts below. Each measurement is caught on its own (the
error's last line is recorded and the run goes on) and ``e2e.json`` / ``e2e.md`` are rewritten after every one,
so a crash or the deadline (``--budget-s``) loses nothing measured before it; what would not fit in the time
left is recorded as ``skipped: time``.

The shape is ``harness.Shape``, the long-context benchmark's (1.68B total / 0.36B active parameters; the models are
built by ``harness.build_kdamoe`` / ``build_native``): bf16 weights (the model cast with ``.to(torch.bfloat16)``, no
autocast), random weights from a fixed seed, ``model.train()``. Native KimiLinear runs transformers' defaults
(5.24: ``sdpa`` attention, ``grouped_mm`` experts) with fla's kernels where fla is installed (the stack line
says which KDA and conv implementation it found).

One training step is ``zero_grad(set_to_none=True)``, forward with ``labels = input_ids`` (the models' own
shifted cross-entropy over the full vocabulary), ``loss.backward()``; no optimizer step. Input: B=1, T random
token ids in [3, vocab) from a generator seeded with T, so both models see the same ids at the same length.
Each step is timed on the host between two ``torch.cuda.synchronize()``; the number is the median of
``--steps`` (5) steps after ``--warmup`` (2) untimed ones. tokens/s = T / median; MFU = 6 · N_active ·
tokens/s / ``--peak-tflops`` (757 TFLOP/s); N_active = all parameters, embeddings and ``lm_head`` included
(untied), with the routed experts' (parameter names containing ``.experts.``) counted at top_k / num_experts
(8/64); the shared experts, router and dense first layer count in full. 6·N leaves out attention's T² term.
Peak memory: ``torch.cuda.max_memory_allocated`` over the timed steps (weights, gradients and activations);
``allocated_before_gib`` is what the weights took before the first step.

Parts (``--only``, comma list; default all, in this order):

``kdamoe``, ``native``
    The step at ``--train-t`` (8K, 32K). kdamoe runs ``kernel_backend="auto"`` (its Triton kernels).
``recipe``
    kdamoe in the training recipe's shape, ``moe_latent_size=512``, ``attnres_num_blocks=4`` (the routed experts
    run in a 512-wide latent, Block Attention Residuals over 4 blocks), at ``--recipe-t`` (32K, then 8K);
    compared with kdamoe's plain shape at the same length.
``graph``
    kdamoe's plain shape, then the recipe shape, through ``kdamoe.training.train_graph.TrainStepGraph`` (the step
    captured as a CUDA graph and replayed) at ``--graph-t`` (8K, 32K): one eager step first (its loss is recorded next
    to the graphed steps'), then a first call that warms up and captures (timed apart), ``--warmup`` untimed and
    ``--steps`` timed calls, each timed between synchronisations like the eager step. Rows: plain graphed vs native +
    fla, recipe graphed vs plain graphed. Peak memory: from before the capturing call (its eager warm-up steps and the
    graph's memory pool) through the last timed call. CUDA only (elsewhere recorded as skipped).
``native_graph``
    The peer's step captured the same way, so that both sides of a graphed row skip the host's launches: native
    KimiLinear (+ fla) at ``--graph-t``, its whole step (``zero_grad(set_to_none=True)``, forward, loss, backward)
    captured with ``torch.cuda.graph`` after ``--warmup`` eager steps on a side stream (PyTorch's "whole-network
    capture", CUDA semantics notes), then ``--warmup`` untimed and ``--steps`` timed
    replays as above. A step that cannot be captured
    (a host read of a device value inside it, an op that refuses capture) is recorded with the error's last line.
    Row: kdamoe's graphed plain step vs this one. Run it after the other parts: a failed capture can leave the
    CUDA context unusable for what follows. CUDA only.
``profile``
    One kdamoe step at each of ``--profile-t`` (32K, then 8K), then one recipe-shape step at each of
    ``--profile-recipe-t`` (none by default), under ``torch.profiler`` (CPU + CUDA activity),
    after one warm-up step and two unprofiled timed steps: the top 40 GPU kernels by summed time (calls and µs per
    step, share of all GPU time; the markdown shows 25), summed GPU time per step against the unprofiled and the
    profiled wall per step (a GPU busy share well under 1 means the host's launches set the pace), and the top 25
    host-side operators and CUDA runtime calls by self CPU time.
``host``
    Where the host's time goes in a kdamoe step at ``--host-t`` (8K), where the host sets the pace: two untimed
    steps, then ``--host-steps`` (8) steps, each split into the host's time to queue the forward (loss included),
    to queue the backward (``loss.backward()`` returns once the autograd engine has queued every kernel), and the
    wait for the GPU after that; then ``cProfile`` over 2 steps: the 40 Python
    functions with the most own time, and the 30 with the most cumulative time, per step (cProfile's own cost
    inflates both; compare rows with each other).

Writes ``e2e.json`` (``rows``: ``{name, ours_ms, peer, peer_ms, ratio}`` with ratio = ours/peer, peer
``native+fla`` or ``plain``, plus tokens/s, MFU and peak GiB of both sides; ``raw``: every number) and
``e2e.md`` into ``--out``; an ``e2e.json`` already there is extended (a second invocation with ``--only`` adds to it).

    python3 benchmarks/bench_e2e.py --out "$OUT"            # H200; deadline E2E_BUDGET_S (default 420)
    python benchmarks/bench_e2e.py --tiny --out /some/dir   # CPU smoke test: tiny shapes, < 60 s
"""

import argparse
import cProfile
import math
import os
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402  (the benchmarks folder is not a package)
    GIB,
    NATIVE,
    Bench,
    K,
    Recorder,
    add_run_args,
    build_kdamoe,
    build_native,
    check_at_least,
    compare_row,
    finish_run_args,
    fmt,
    ints,
    kernel_summary,
    label,
    run_parts,
    start_run,
    value_of,
)

from kdamoe.training.train_graph import TrainStepGraph  # noqa: E402  (needs the repository on sys.path: harness)

PARTS = ("kdamoe", "native", "recipe", "graph", "native_graph", "profile", "host")
RECIPE = {"moe_latent_size": 512, "attnres_num_blocks": 4}
TINY_RECIPE = {"moe_latent_size": 32, "attnres_num_blocks": 2}
PLAIN = "plain"


# ------------------------------------------------------------------------------------------------ recording


def _why(entry):
    """A skip's reason, or an error's last line; None for a measurement."""
    if isinstance(entry, str):
        return entry
    return entry["error"] if isinstance(entry, dict) and "error" in entry else None


def _side(prefix: str, entry) -> dict:
    return {f"{prefix}_tok_s": value_of(entry, "tok_s"), f"{prefix}_mfu": value_of(entry, "mfu"),
            f"{prefix}_peak_gib": value_of(entry, "peak_gib"),
            **({f"{prefix}_note": _why(entry)} if value_of(entry, "median_ms") is None and entry is not None else {})}


def make_rows(raw: dict) -> list[dict]:
    """Comparison rows from ``raw``: kdamoe vs native per length, then the recipe shape vs kdamoe's plain shape."""
    ours, native, recipe = raw.get("kdamoe", {}), raw.get("native", {}), raw.get("recipe", {})

    def lengths(*groups: dict) -> list[int]:
        return sorted({int(k[len("train_T"):]) for g in groups for k in g if k.startswith("train_T")})

    rows = []
    for T in lengths(ours, native):
        o, p = ours.get(f"train_T{T}"), native.get(f"train_T{T}")
        rows.append(compare_row(f"train step {label(T)}", value_of(o, "median_ms"), NATIVE, value_of(p, "median_ms"),
                         **_side("ours", o), **_side("peer", p)))
    for T in lengths(recipe):
        o, p = recipe.get(f"train_T{T}"), ours.get(f"train_T{T}")
        rows.append({**compare_row(f"recipe shape train step {label(T)}", value_of(o, "median_ms"), PLAIN,
                                   value_of(p, "median_ms"), **_side("ours", o), **_side("peer", p)),
                     "ours": "kdamoe recipe"})
    graph = raw.get("graph", {})
    plain_g = {k[len("kdamoe_"):]: v for k, v in graph.items() if k.startswith("kdamoe_")}
    recipe_g = {k[len("recipe_"):]: v for k, v in graph.items() if k.startswith("recipe_")}
    for T in lengths(plain_g):
        o, p = plain_g.get(f"train_T{T}"), native.get(f"train_T{T}")
        rows.append({**compare_row(f"CUDA-graph train step {label(T)}", value_of(o, "median_ms"), NATIVE,
                                   value_of(p, "median_ms"), **_side("ours", o), **_side("peer", p)),
                     "ours": "kdamoe, TrainStepGraph"})
    for T in lengths(recipe_g):
        o, p = recipe_g.get(f"train_T{T}"), plain_g.get(f"train_T{T}")
        rows.append({**compare_row(f"recipe shape CUDA-graph train step {label(T)}", value_of(o, "median_ms"),
                                   "plain graphed", value_of(p, "median_ms"), **_side("ours", o), **_side("peer", p)),
                     "ours": "kdamoe recipe, TrainStepGraph"})
    native_g = raw.get("native_graph", {})
    for T in lengths(native_g):
        o, p = plain_g.get(f"train_T{T}"), native_g.get(f"train_T{T}")
        rows.append({**compare_row(f"CUDA-graph train step {label(T)}, both sides graphed", value_of(o, "median_ms"),
                            "native+fla graphed", value_of(p, "median_ms"), **_side("ours", o), **_side("peer", p)),
                     "ours": "kdamoe, TrainStepGraph"})
    return rows


def render_markdown(doc: dict) -> str:
    """``e2e.md``: the rows table, the stack, the models' parameter counts, the profile, skips and errors."""
    st, s, raw = doc["stack"], doc["settings"], doc["raw"]
    lines = ["# End-to-end training step on one GPU: kdamoe vs transformers' native KimiLinear (+ fla)", ""]
    if st:
        lines += [f"Stack: {st.get('gpu')}, torch {st.get('torch')}, triton {st.get('triton')}, transformers "
                  f"{st.get('transformers')}, fla {st.get('fla')} (native's chunk_kda from "
                  f"{st.get('native_kda_from')}, causal conv from {st.get('native_conv_from')}), "
                  f"CUDA {st.get('cuda')}.", ""]
    lines += [f"Step: {s.get('step')}. B=1, {s.get('dtype')} weights, median of {s.get('steps')} steps after "
              f"{s.get('warmup')} warm-up steps. MFU = 6 · active parameters · tokens/s / {s.get('peak_tflops')} "
              f"TFLOP/s ({s.get('active_params')}). Recipe shape: {s.get('recipe')}. Triton cache restored: "
              f"{s.get('tcache_restored')}; tiny: {s.get('tiny')}.", "",
              "| case | ours ms | peer | peer ms | ours/peer | ours tok/s | peer tok/s | ours MFU | peer MFU | "
              "ours peak GiB | peer peak GiB | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        note = "; ".join(str(r[k]) for k in ("ours_note", "peer_note") if r.get(k))
        lines.append(f"| {r['name']} ({r.get('ours', 'kdamoe')}) | {fmt(r['ours_ms'], 4)} | {r['peer']} | "
                     f"{fmt(r['peer_ms'], 4)} | {fmt(r['ratio'])} | {fmt(r['ours_tok_s'])} | "
                     f"{fmt(r['peer_tok_s'])} | {fmt(r['ours_mfu'])} | {fmt(r['peer_mfu'])} | "
                     f"{fmt(r['ours_peak_gib'])} | {fmt(r['peer_peak_gib'])} | {note[:160]} |")
    models = [(name, raw[name]["model"]) for name in ("kdamoe", "native", "recipe")
              if isinstance(raw.get(name, {}).get("model"), dict)]
    if models:
        lines += ["", "| model | parameters | active | routed experts | attention | experts |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {name} | {m['params_total'] / 1e9:.4g}B | {m['params_active'] / 1e9:.4g}B | "
                  f"{m['params_routed'] / 1e9:.4g}B | {m.get('attn_implementation')} | {m.get('experts')} |"
                  for name, m in models]
    for key, prof in (raw.get("profile") or {}).items():
        if not isinstance(prof, dict) or "table" not in prof:
            continue
        shape = "recipe-shape " if key.startswith("recipe") else ""
        lines += ["", f"## Profile: one {shape}kdamoe training step at {label(prof['T'])}", "",
                  f"Wall per step: {fmt(prof['wall_ms'], 4)} ms unprofiled (median of {prof['timed_steps']}), "
                  f"{fmt(prof['profiled_wall_ms'], 4)} ms under the profiler ({prof['profiled_steps']} step(s)). "
                  f"GPU time per step (kernels, memcpy, memset summed): {fmt(prof['kernel_ms'], 4)} ms, "
                  f"{fmt(prof['busy_share'])} of the unprofiled wall. Kernels per step: "
                  f"{fmt(prof['kernels_per_step'])}.", "",
                  "| kernel | calls/step | µs/step | share |", "|---|---|---|---|"]
        lines += [f"| `{r['name']}` | {fmt(r['calls'])} | {fmt(r['us'])} | {fmt(r['share'])} |"
                  for r in prof["table"][:25]]
        if prof.get("host_table"):
            lines += ["", f"Host side at {label(prof['T'])} (self CPU time per step under the profiler):", "",
                      "| operator or runtime call | calls/step | self µs/step |", "|---|---|---|"]
            lines += [f"| `{r['name']}` | {fmt(r['calls'])} | {fmt(r['self_us'])} |" for r in prof["host_table"]]
    for host in (raw.get("host") or {}).values():
        if not isinstance(host, dict) or "step_ms_median" not in host:
            continue
        lines += ["", f"## Host: where a kdamoe step at {label(host['T'])} spends the host's time", "",
                  f"{host['steps']} steps, each timed between synchronisations; medians: the host queues the forward "
                  f"(loss included) in {fmt(host['forward_ms_median'], 4)} ms, the backward in "
                  f"{fmt(host['backward_ms_median'], 4)} ms, then waits {fmt(host['gpu_tail_ms_median'], 4)} ms for "
                  f"the GPU; the step takes {fmt(host['step_ms_median'], 4)} ms (steps: "
                  f"{', '.join(fmt(x, 4) for x in host['step_ms_all'])}). A GPU wait near 0 means the host sets the "
                  f"pace. Under cProfile: {fmt(host['cprofile_wall_ms'], 4)} ms per step, own time of all functions "
                  f"{fmt(host['own_total_ms'], 4)} ms."]
        for order, rows in (("own time", host["by_own"]), ("cumulative time", host["by_cumulative"])):
            lines += ["", f"| function (by {order}) | calls/step | own ms/step | cumulative ms/step |",
                      "|---|---|---|---|"]
            lines += [f"| `{r['function']}` | {fmt(r['calls'])} | {fmt(r['own_ms'])} | {fmt(r['cum_ms'])} |"
                      for r in rows[:30]]
    problems = [(f"{group}/{key}", _why(v)) for group, entries in raw.items() if isinstance(entries, dict)
                for key, v in entries.items() if _why(v) is not None]
    if problems:
        lines += ["", "## Skipped or failed", ""] + [f"- {k}: {v[:300]}" for k, v in problems]
    if doc.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {k}: {v}" for k, v in doc["notes"].items()]
    return "\n".join(lines) + "\n"


class E2ERecorder(Recorder):
    """``harness.Recorder`` writing ``e2e.json`` / ``e2e.md`` with this benchmark's rows; a recorded error line has
    the folders cut from its paths (the file name stays): the saved files name no machine's paths."""

    stem = "e2e"
    strip_paths = True

    def rows(self) -> list[dict]:
        return make_rows(self.raw)

    def markdown(self, doc: dict) -> str:
        return render_markdown(doc)


# ------------------------------------------------------------------------------------------------ measurements


def parameter_counts(model, top_k: int, num_experts: int) -> dict:
    """``params_total``, ``params_routed`` (names containing ``.experts.``) and ``params_active`` = total with the
    routed experts counted at ``top_k / num_experts`` (see the module docstring)."""
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    if routed == 0:
        raise ValueError("no parameter name contains '.experts.': the routed experts cannot be told apart")
    return {"params_total": total, "params_routed": routed,
            "params_active": total - routed + routed * top_k / num_experts}


def token_ids(bench: Bench, T: int) -> torch.Tensor:
    """``[1, T]`` int64 random ids in [3, vocab) from a generator seeded with ``T`` (the same for every model)."""
    gen = torch.Generator(device="cpu").manual_seed(T)
    return torch.randint(3, bench.shape.vocab_size, (1, T), generator=gen).to(bench.device)


def train_step(model, ids: torch.Tensor) -> torch.Tensor:
    """One training step without an optimizer: gradients set to None, forward with ``labels = ids``, backward.
    Returns the loss (a 0-d tensor, not synchronized)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


def time_steps(bench: Bench, model, T: int, warmup: int, steps: int) -> dict:
    """``warmup + steps`` training steps on ``T`` tokens, each timed between two synchronizations.

    Returns ``median_ms``, ``steps_ms``, ``warmup_ms`` (the untimed steps' times: compilation and autotuning show
    there), ``tok_s``, ``peak_gib`` over the timed steps and ``allocated_before_gib`` (None on CPU), the first and
    last loss. Raises ``FloatingPointError`` when a loss is not finite (a broken step must not give a number).
    """
    ids = token_ids(bench, T)
    model.train()
    bench.free()
    before = torch.cuda.memory_allocated() / GIB if bench.cuda else None
    times, losses = [], []
    try:
        for i in range(warmup + steps):
            if i == warmup and bench.cuda:
                torch.cuda.reset_peak_memory_stats()
            bench.sync()
            t0 = time.perf_counter()
            loss = train_step(model, ids)
            bench.sync()
            times.append((time.perf_counter() - t0) * 1e3)
            losses.append(loss.item())
    finally:
        model.zero_grad(set_to_none=True)
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"non-finite loss at T={T}: {losses}")
    median = statistics.median(times[warmup:])
    return {"T": T, "median_ms": median, "steps_ms": times[warmup:], "warmup_ms": times[:warmup],
            "tok_s": T / median * 1e3,
            "peak_gib": torch.cuda.max_memory_allocated() / GIB if bench.cuda else None,
            "allocated_before_gib": before, "loss_first": losses[0], "loss_last": losses[-1]}


def build(bench: Bench, part: str):
    """The model of ``part`` (``kdamoe``, ``recipe``: kdamoe in the recipe's shape, ``native``) and its info."""
    s = bench.shape
    if part == "native":
        model = build_native(s, bench.device, bench.dtype)
    else:
        extra = (TINY_RECIPE if bench.args.tiny else RECIPE) if part == "recipe" else {}
        model = build_kdamoe(s, bench.device, bench.dtype, **extra)
    info = {**parameter_counts(model, s.num_experts_per_tok, s.num_experts),
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "experts": getattr(model.config, "_experts_implementation", None) or "kdamoe experts op"}
    if part != "native":
        info["kernel_backend"] = model.config.kernel_backend
        info["moe_latent_size"] = model.config.moe_latent_size
        info["attnres_num_blocks"] = model.config.attnres_num_blocks
    return model.train(), info


def step_estimate(bench: Bench, T: int, steps: int) -> float:
    """Seconds ``steps`` steps at ``T`` need on the H200, generously (32K: 0.61 s native, 0.81 s recipe, per step),
    plus 30 s for a first step that compiles and autotunes; 0 in the tiny mode."""
    return bench.est(30 + steps * T * 32e-6)


def run_train(bench: Bench, part: str) -> None:
    """Build one model, then the step at each of its lengths (module docstring, ``kdamoe``/``native``/``recipe``)."""
    a, rec = bench.args, bench.rec
    lengths = a.recipe_t if part == "recipe" else a.train_t
    if not rec.need(part, "model", bench.est(30) + step_estimate(bench, min(lengths), a.warmup + a.steps)):
        return
    try:
        model, info = build(bench, part)
        peak = a.peak_tflops * 1e12
        rec.put(part, "model", info)
        print(part, info, flush=True)
    except Exception:
        rec.error(part, "model")
        return
    for T in lengths:
        key = f"train_T{T}"
        if not rec.need(part, key, step_estimate(bench, T, a.warmup + a.steps)):
            continue
        try:
            stats = time_steps(bench, model, T, a.warmup, a.steps)
            stats["mfu"] = 6 * info["params_active"] * stats["tok_s"] / peak
            rec.put(part, key, stats)
            print(part, label(T), f"{stats['median_ms']:.1f} ms, {stats['tok_s']:.0f} tok/s, MFU {stats['mfu']:.3f}, "
                  f"peak {stats['peak_gib']} GiB", flush=True)
        except Exception:
            rec.error(part, key)
        bench.free()
    del model
    bench.free()


def time_graphed_calls(bench: Bench, call, n: int, T: int) -> tuple[list[float], list[float]]:
    """``n`` calls of ``call()`` (it returns the step's 0-d loss), each timed in ms between two synchronisations;
    returns the times and the losses. Raises ``FloatingPointError`` when a loss is not finite."""
    times, losses = [], []
    for _ in range(n):
        bench.sync()
        t0 = time.perf_counter()
        loss = call()
        bench.sync()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"non-finite loss at T={T}: {losses}")
    return times, losses


def graphed_stats(bench: Bench, info: dict, T: int, times: list[float], losses: list[float], eager: float,
                  **extra) -> dict:
    """The record of a graphed part: ``times`` after the capture, of which the first ``--warmup`` are untimed;
    ``losses`` are every call's (for ``TrainStepGraph`` the capturing call's too, so one more than ``times``)."""
    a = bench.args
    timed = times[a.warmup:]
    median = statistics.median(timed)
    return {"T": T, "median_ms": median, "steps_ms": timed, "warmup_ms": times[:a.warmup], "tok_s": T / median * 1e3,
            "mfu": 6 * info["params_active"] * (T / median * 1e3) / (a.peak_tflops * 1e12),
            "peak_gib": torch.cuda.max_memory_allocated() / GIB, "eager_loss": eager, "graph_losses": losses, **extra}


def graph_kdamoe(bench: Bench, model, info: dict, ids: torch.Tensor, eager: float) -> dict:
    """kdamoe's step through ``TrainStepGraph``: the first call warms up and captures (timed apart), then
    ``--warmup`` untimed and ``--steps`` timed calls."""
    a, T = bench.args, ids.shape[1]
    step = TrainStepGraph(model)
    times, losses = time_graphed_calls(bench, lambda: step(ids), 1 + a.warmup + a.steps, T)
    return graphed_stats(bench, info, T, times[1:], losses, eager, capture_call_ms=times[0], captures=step.captures)


def capture_step(model, ids: torch.Tensor, warmup: int):
    """Native's training step (``train_step``) on ``ids [1, T]`` captured as a CUDA graph: ``warmup`` eager steps on
    a side stream, then the capture (PyTorch CUDA semantics notes, "whole-network capture"). The gradients are set
    to None before the capture, so the backward allocates them from the graph's pool and each replay writes them,
    as ``zero_grad(set_to_none=True)`` then ``backward()`` does. Returns ``(graph, loss)``: ``loss`` is the graph's
    0-d output, rewritten by every replay. Raises whatever the capture raises (e.g. a host read inside the step)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            train_step(model, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = train_step(model, ids)  # its zero_grad only sets attributes: nothing of it is captured
    return graph, loss


def graph_native(bench: Bench, model, info: dict, ids: torch.Tensor, eager: float) -> dict:
    """Native's step captured by ``capture_step`` (timed apart), then ``--warmup`` untimed and ``--steps`` timed
    replays."""
    a, T = bench.args, ids.shape[1]
    bench.sync()
    t0 = time.perf_counter()
    graph, loss = capture_step(model, ids, a.warmup)
    bench.sync()
    capture_ms = (time.perf_counter() - t0) * 1e3

    def replay():
        graph.replay()
        return loss

    times, losses = time_graphed_calls(bench, replay, a.warmup + a.steps, T)
    return graphed_stats(bench, info, T, times, losses, eager, capture_call_ms=capture_ms)


def run_graphed(bench: Bench, group: str) -> None:
    """The ``graph`` part (kdamoe's plain and recipe shapes through ``TrainStepGraph``, keys ``{part}_train_T{T}``)
    or the ``native_graph`` part (native's step through ``capture_step``, keys ``train_T{T}``); module docstring.
    Each length first runs one eager step, whose loss is recorded next to the graphed steps'."""
    a, rec = bench.args, bench.rec
    if not bench.cuda:
        rec.put(group, "device", "skipped: CUDA graphs need CUDA; this run is not on CUDA")
        return
    parts, measure = (("kdamoe", "recipe"), graph_kdamoe) if group == "graph" else (("native",), graph_native)
    for part in parts:
        prefix = f"{part}_" if group == "graph" else ""
        if not rec.need(group, f"{prefix}model", bench.est(30) + step_estimate(bench, min(a.graph_t), 4 + a.steps)):
            continue
        model, info = build(bench, part)
        for T in a.graph_t:
            key = f"{prefix}train_T{T}"
            if not rec.need(group, key, step_estimate(bench, T, 6 + a.warmup + a.steps)):
                continue
            try:
                ids = token_ids(bench, T)
                eager = train_step(model, ids).item()  # the same step eagerly, for the loss check
                torch.cuda.reset_peak_memory_stats()  # from before the capture, which allocates the graph's memory
                stats = measure(bench, model, info, ids, eager)
                rec.put(group, key, stats)
                print(group, part, label(T), f"{stats['median_ms']:.1f} ms, loss {stats['graph_losses'][-1]:.6f} vs "
                      f"eager {eager:.6f}", flush=True)
            except Exception:
                rec.error(group, key)
            model.zero_grad(set_to_none=True)
            bench.free()
        del model
        bench.free()


def run_profile(bench: Bench) -> None:
    """One kdamoe step at each ``--profile-t`` length, then one recipe-shape step at each ``--profile-recipe-t``
    length, under ``torch.profiler`` (module docstring, ``profile``)."""
    for part, lengths in (("kdamoe", bench.args.profile_t), ("recipe", bench.args.profile_recipe_t)):
        model = None
        for T in lengths:
            model = profile_one(bench, model, T, part)
        del model
        bench.free()


def host_summary(prof, steps: int, top: int = 25) -> list[dict]:
    """The host side of a finished ``torch.profiler.profile`` over ``steps`` steps: the ``top`` operators and CUDA
    runtime calls by self CPU time (``calls`` and ``self_us`` per step). Where the GPU idles, this is what the host
    spends the step on (launch calls, synchronisations, Python-side operator overhead); the profiler's own cost
    inflates every row, so compare rows with each other, not with the unprofiled wall."""
    rows = [{"name": e.key if len(e.key) <= 90 else e.key[:87] + "...", "calls": e.count / steps,
             "self_us": e.self_cpu_time_total / steps} for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r["self_us"])[:top]


def profile_one(bench: Bench, model, T: int, part: str = "kdamoe"):
    """The profile of ``part`` (``kdamoe`` or ``recipe``) at ``T`` tokens with ``model`` (built here when None);
    returns the model for the next length."""
    a, rec = bench.args, bench.rec
    key = f"{part}_T{T}"
    if not rec.need("profile", key, bench.est(30) + step_estimate(bench, T, 3 + 2 * a.profile_steps)):
        return model
    try:
        if model is None:
            model, _ = build(bench, part)
        timed = time_steps(bench, model, T, warmup=1, steps=2)
        ids = token_ids(bench, T)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.cuda else [])
        with profile(activities=activities) as prof:
            bench.sync()
            t0 = time.perf_counter()
            for _ in range(a.profile_steps):
                train_step(model, ids)
            bench.sync()
            wall = (time.perf_counter() - t0) / a.profile_steps * 1e3
        model.zero_grad(set_to_none=True)
        summary = kernel_summary(prof, a.profile_steps, top=40)
        rec.put("profile", key, {"T": T, "wall_ms": timed["median_ms"], "timed_steps": len(timed["steps_ms"]),
                                 "profiled_wall_ms": wall, "profiled_steps": a.profile_steps, **summary,
                                 "host_table": host_summary(prof, a.profile_steps, top=25),
                                 "busy_share": summary["kernel_ms"] / timed["median_ms"]})
        print("profile", label(T), f"wall {timed['median_ms']:.1f} ms, GPU {summary['kernel_ms']:.1f} ms", flush=True)
        del prof
    except Exception:
        rec.error("profile", key)
    bench.free()
    return model


def _func_name(func: tuple) -> str:
    """``file:line(name)`` of a ``pstats`` key with the folders cut (the saved files name no machine's paths)."""
    path, line, name = func
    return f"{os.path.basename(path)}:{line}({name})" if path != "~" else name


def run_host(bench: Bench) -> None:
    """The host part (module docstring, ``host``): step times with the short launch path and with Triton's, then a
    cProfile table."""
    a, rec = bench.args, bench.rec
    T = a.host_t
    if not rec.need("host", f"kdamoe_T{T}", bench.est(30) + step_estimate(bench, T, 2 + a.host_steps + 2)):
        return
    model, _ = build(bench, "kdamoe")
    try:
        ids = token_ids(bench, T)
        split = {"forward_ms": [], "backward_ms": [], "gpu_tail_ms": [], "step_ms": []}
        for i in range(2 + a.host_steps):  # two untimed steps first (compilation, autotuning, the allocator)
            model.zero_grad(set_to_none=True)
            bench.sync()
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            t1 = time.perf_counter()  # the host has queued the forward; the GPU may still be running it
            loss.backward()
            t2 = time.perf_counter()
            bench.sync()
            t3 = time.perf_counter()
            if i >= 2:
                for key, (x, y) in {"forward_ms": (t0, t1), "backward_ms": (t1, t2), "gpu_tail_ms": (t2, t3),
                                    "step_ms": (t0, t3)}.items():
                    split[key].append((y - x) * 1e3)
        model.zero_grad(set_to_none=True)
        prof = cProfile.Profile()
        bench.sync()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(2):
            train_step(model, ids)
        bench.sync()
        prof.disable()
        wall = (time.perf_counter() - t0) / 2 * 1e3
        model.zero_grad(set_to_none=True)
        stats = pstats.Stats(prof).stats  # {func: (primitive calls, calls, own s, cumulative s, callers)}
        rows = [{"function": _func_name(f), "calls": v[1] / 2, "own_ms": v[2] / 2 * 1e3, "cum_ms": v[3] / 2 * 1e3}
                for f, v in stats.items()]
        medians = {key: statistics.median(v) for key, v in split.items()}
        rec.put("host", f"kdamoe_T{T}", {
            "T": T, "steps": a.host_steps, **{f"{key}_all": v for key, v in split.items()},
            **{f"{key}_median": v for key, v in medians.items()},
            "cprofile_wall_ms": wall, "own_total_ms": sum(r["own_ms"] for r in rows),
            "by_own": sorted(rows, key=lambda r: -r["own_ms"])[:40],
            "by_cumulative": sorted(rows, key=lambda r: -r["cum_ms"])[:30]})
        print("host", label(T), ", ".join(f"{key} {v:.1f}" for key, v in medians.items()),
              f"cProfile wall {wall:.1f} ms", flush=True)
    except Exception:
        rec.error("host", f"kdamoe_T{T}")
    del model
    bench.free()


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, PARTS, out_default=".", out_help="folder for e2e.{json,md}",
                 budget_default=float(os.environ.get("E2E_BUDGET_S", "420")))
    p.add_argument("--train-t", type=ints, default=None, help="kdamoe and native lengths (default 8K,32K)")
    p.add_argument("--recipe-t", type=ints, default=None, help="recipe-shape lengths, in this order (default 32K,8K)")
    p.add_argument("--graph-t", type=ints, default=None,
                   help="the graph and native_graph parts' lengths (default 8K,32K)")
    p.add_argument("--profile-t", type=ints, default=None,
                   help="the profiled steps' lengths, in order (default 32K,8K)")
    p.add_argument("--profile-recipe-t", type=ints, default=[], help="recipe-shape profiled lengths (default none)")
    p.add_argument("--profile-steps", type=int, default=1, help="profiled steps")
    p.add_argument("--host-t", type=int, default=None, help="the host part's length (default 8K)")
    p.add_argument("--host-steps", type=int, default=8, help="the host part's timed steps per launch setting")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before the timed ones (default 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    p.add_argument("--peak-tflops", type=float, default=757.0, help="the bf16 peak MFU divides by (TFLOP/s)")
    a = p.parse_args(argv)
    defaults = dict(train_t=[64, 128] if a.tiny else [8 * K, 32 * K], recipe_t=[128, 64] if a.tiny else [32 * K, 8 * K],
                    profile_t=[64] if a.tiny else [32 * K, 8 * K], warmup=1 if a.tiny else 2, steps=2 if a.tiny else 5,
                    graph_t=[64] if a.tiny else [8 * K, 32 * K],
                    host_t=64 if a.tiny else 8 * K)
    finish_run_args(p, a, PARTS, defaults)
    check_at_least(p, a, ("warmup", "steps", "profile_steps", "host_steps"))
    for name in ("train_t", "recipe_t", "graph_t", "profile_t", "profile_recipe_t", "host_t"):
        value = getattr(a, name)
        values = value if isinstance(value, list) else [value]
        if (not values and name != "profile_recipe_t") or any(v < 2 for v in values):
            p.error(f"--{name.replace('_', '-')} must be lengths >= 2 (got {value})")
    if not a.peak_tflops > 0:
        p.error(f"--peak-tflops must be > 0 (got {a.peak_tflops})")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    settings = {"recipe": TINY_RECIPE if a.tiny else RECIPE,
                "warmup": a.warmup, "steps": a.steps, "peak_tflops": a.peak_tflops,
                "step": "zero_grad(set_to_none=True), forward with labels=input_ids, loss.backward(); "
                        "no optimizer step",
                "active_params": "all parameters, embeddings and lm_head included, routed experts at top_k/num_experts",
                "tcache_restored": os.environ.get("E2E_TCACHE_RESTORED") == "1"}
    bench = start_run(a, E2ERecorder, settings)
    rec = bench.rec
    rec.settings["dtype"] = str(bench.dtype).replace("torch.", "")  # bf16 on CUDA, float32 on the CPU
    rec.notes.update(
        earlier_method="the earlier measurement of issue #14 accumulated gradients across its steps (no zero_grad) "
                       "and timed with triton.testing.do_bench; here each step sets them to None first, as a "
                       "training loop does, and is timed between synchronizations",
        mfu="6·N_active·tokens/s counts the matmuls of the weights only; the causal attention of the MLA layers "
            "(T² per layer) is not in it, so MFU understates the work at 32K")
    rec.save()
    print("stack:", rec.stack, flush=True)
    runners = {part: (lambda part=part: run_train(bench, part)) for part in ("kdamoe", "native", "recipe")}
    runners.update(profile=lambda: run_profile(bench), host=lambda: run_host(bench),
                   graph=lambda: run_graphed(bench, "graph"), native_graph=lambda: run_graphed(bench, "native_graph"))
    return run_parts(bench, runners)


if __name__ == "__main__":
    sys.exit(main())
