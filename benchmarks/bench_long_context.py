"""Long context on one GPU: kdamoe against transformers' native KimiLinear (+ fla), prefill and decode to 1M tokens.

One device call (``benchmarks/device_long_context.sh``) runs the parts below; each measurement is one function,
each is caught on its own (an error is recorded and the run goes on), and ``long_context.json`` is rewritten
after every one, so a crash or the deadline loses nothing measured before it.

Both models have the same shape (1.68B total / 0.36B active parameters): vocab 32000, hidden 1024, 16 layers,
every 4th layer MLA (kdamoe's default ``layer_types``; native gets the same list: its own default puts full
attention at layers 4, 8 and 12, three layers, not four), 8 MLA heads, ``kv_lora_rank`` 256, value head dim 128
(query/key head dim: ours 128; native 128 + a 64-wide shared part, ``qk_rope_head_dim`` 64, which it does not
rotate), 8 KDA heads x 128, 64 experts top-8 + 1 shared (``moe_intermediate_size`` 512), the first layer dense
(2816), bf16, random weights from a fixed seed and random token ids (never zeros).

Parts (``--only``, comma list; default all):

``kdamoe``, ``native``
    Prefill at T = 128K, 512K, 1M (B=1, ``logits_to_keep=1``, no grad, ``use_cache=True``): wall seconds
    (synchronized before and after) and peak memory (``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats``; it includes the weights, ``allocated_before_gib`` says how much). kdamoe runs
    its default ``prefill_chunk_size``; ``--chunk2`` adds the 1M prefill at other chunk lengths. Decode after
    4K, 128K and 1M tokens: median wall time of ``--steps`` steps after ``--warmup`` steps, greedy token fed
    back, synchronized per step. B=1, then B=8 from the same cache repeated 8 times per row
    (``Cache.batch_repeat_interleave``; transformers 5.24's ``LinearAttentionLayer`` lacks it, so native's
    cache is expanded with ``reorder_cache`` on repeated indices, which copies the same rows). Native skips B=8
    at 1M: every step expands the MLA latent of every cached token into per-head keys and values (the number of
    GiB is computed and recorded). kdamoe also decodes with ``config.decode_cuda_graphs=False`` at 4K and 1M.
    Before the first timed prefill each model runs one untimed prefill longer than kdamoe's chunk plus decode
    steps, so compilation and autotuning stay out of the numbers (autotuning keyed on the length still is not;
    ``settings.tcache_restored`` says whether the Triton cache of an earlier call was restored).
``floor``
    The four MLA layers' causal attention alone at 1M: ``F.scaled_dot_product_attention(q, k, v,
    is_causal=True)`` on bf16 ``[1, 8, 1M, 128]`` (PyTorch's default choice, then the flash and cuDNN
    backends forced; the fastest is the floor), one call x 4; FLOP = 4 layers x 2·2·H·d·T²/2 (QK and PV
    products, causal half).
``profile``
    One kdamoe decode step after 32K (B=1) under ``torch.profiler`` with CUDA activity, 5 steps, CUDA graph
    replay and eager: unprofiled wall per step against summed GPU kernel time per step, kernels run and host
    launch calls per step, the top kernels.
``greedy``
    A model trained by the GPU preset (``--model-dir``, its ``final/`` folder, loaded with
    ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``): greedy 64 new tokens after ~4K tokens
    of the preset's held-out plays, (a) ``prefill_chunk_size=0``, graphs off, (b) a small odd chunk, graphs on;
    equal or the first index where they differ (with run (a)'s top-1 margin there), in float32 and bfloat16.

Writes ``long_context.json`` (``rows``: ``{name, ours_ms, peer, peer_ms, ratio}`` with ratio = ours/peer, peer
``native+fla``, ``floor`` or ``eager``; prefill rows add ``ours_peak_gib`` / ``peer_peak_gib``; ``raw``: every
number) and ``long_context.md`` into ``--out``. An existing ``long_context.json`` there is extended, so two
invocations (the device script's bench, then ``--only greedy`` after training) end in one file.

    python3 benchmarks/bench_long_context.py --out "$OUT"            # H200; deadline LC_BUDGET_S (default 480)
    python benchmarks/bench_long_context.py --tiny --out /some/dir   # CPU smoke test: tiny shapes, < 60 s
"""

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402  (the benchmarks folder is not a package)
    GIB,
    NATIVE,
    Bench,
    K,
    M,
    Recorder,
    Shape,
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

from kdamoe.training import load_config  # noqa: E402  (needs the repository on sys.path: harness)
from kdamoe.training.corpus import load_corpus  # noqa: E402  (the same)

PARTS = ("kdamoe", "native", "floor", "profile", "greedy")


# ------------------------------------------------------------------------------------------------ recording


class LongContextRecorder(Recorder):
    """``harness.Recorder`` writing ``long_context.{json,md}`` with this benchmark's rows and tables."""

    stem = "long_context"

    def rows(self) -> list[dict]:
        return make_rows(self.raw)

    def markdown(self, doc: dict) -> str:
        return render_markdown(doc)


def make_rows(raw: dict) -> list[dict]:
    """The comparison rows, derived from ``raw`` (kdamoe is "ours"; a missing side is ``None``, with the reason)."""
    ours, native, rows = raw.get("kdamoe", {}), raw.get("native", {}), []

    def ms(entry, field="s"):
        value = value_of(entry, field)
        return None if value is None else (value * 1e3 if field == "s" else value)

    def why(entry):  # a skip's reason, or the last line of an error
        if isinstance(entry, str):
            return entry
        return entry["error"].strip().splitlines()[-1] if isinstance(entry, dict) and "error" in entry else None

    lengths = sorted({int(k.split("_T")[1]) for k in ours.keys() | native.keys() if k.startswith("prefill_T")
                      and "_chunk" not in k})
    for T in lengths:
        o, p = ours.get(f"prefill_T{T}"), native.get(f"prefill_T{T}")
        if o is None and p is None:
            continue
        rows.append(compare_row(f"prefill {label(T)}", ms(o), NATIVE, ms(p), ours_peak_gib=value_of(o, "peak_gib"),
                         peer_peak_gib=value_of(p, "peak_gib"), ours_chunk=value_of(o, "chunk"),
                         **({"peer_note": why(p)} if ms(p) is None else {}),
                         **({"ours_note": why(o)} if ms(o) is None else {})))
    for key in sorted(k for k in ours if k.startswith("prefill_T") and "_chunk" in k):
        T, chunk = (int(x) for x in key[len("prefill_T"):].split("_chunk"))
        p = native.get(f"prefill_T{T}")
        rows.append(compare_row(f"prefill {label(T)} (kdamoe chunk {chunk})", ms(ours[key]), NATIVE, ms(p),
                         ours_peak_gib=value_of(ours[key], "peak_gib"), peer_peak_gib=value_of(p, "peak_gib"),
                         **({"ours_note": why(ours[key])} if ms(ours[key]) is None else {})))
    decodes = sorted({(int(k.split("_")[1][1:]), int(k.split("_T")[1].split("_")[0]))
                      for k in ours.keys() | native.keys() if k.startswith("decode_b") and not k.endswith("_eager")},
                     key=lambda bt: (bt[0], bt[1]))
    for B, T in decodes:
        o, p = ours.get(f"decode_b{B}_T{T}"), native.get(f"decode_b{B}_T{T}")
        rows.append(compare_row(f"decode B={B} after {label(T)}", ms(o, "median_ms"), NATIVE, ms(p, "median_ms"),
                         **({"peer_note": why(p)} if ms(p, "median_ms") is None else {}),
                         **({"ours_note": why(o)} if ms(o, "median_ms") is None else {})))
    for key in sorted((k for k in ours if k.endswith("_eager")), key=lambda k: int(k.split("_T")[1].split("_")[0])):
        graph = ours.get(key[: -len("_eager")])
        T = int(key.split("_T")[1].split("_")[0])
        rows.append(compare_row(f"decode B=1 after {label(T)}: CUDA graph vs eager", ms(graph, "median_ms"), "eager",
                         ms(ours[key], "median_ms")))
    floor = raw.get("floor", {}).get("sdpa")
    if isinstance(floor, dict):
        T = floor["T"]
        rows.append(compare_row(f"prefill {label(T)} vs its {floor['layers']} MLA layers' causal attention alone",
                         ms(ours.get(f"prefill_T{T}")), "floor", floor["floor_ms"]))
        p = ms(native.get(f"prefill_T{T}"))
        if p is not None:
            rows.append({**compare_row(f"native prefill {label(T)} vs the same floor", p, "floor", floor["floor_ms"]),
                         "ours": NATIVE})
    return rows


# ------------------------------------------------------------------------------------------------ markdown


def render_markdown(doc: dict) -> str:
    """``long_context.md``: the rows table, the stack line, decode details, the floor, the profiles, the greedy
    check."""
    st, raw = doc["stack"], doc["raw"]
    lines = ["# Long context on one GPU: kdamoe vs transformers' native KimiLinear (+ fla)", ""]
    if st:
        lines += [f"Stack: {st.get('gpu')}, torch {st.get('torch')}, triton {st.get('triton')}, transformers "
                  f"{st.get('transformers')}, fla {st.get('fla')} (native's chunk_kda from "
                  f"{st.get('native_kda_from')}, causal conv from {st.get('native_conv_from')}), "
                  f"CUDA {st.get('cuda')}.", ""]
    s = doc["settings"]
    lines += [f"Shape: {s.get('shape')}. B=1 unless named; decode: median of {s.get('steps')} steps after "
              f"{s.get('warmup')} warm-up steps; kdamoe prefill chunk {s.get('kdamoe_prefill_chunk')}; Triton cache "
              f"restored: {s.get('tcache_restored')}; tiny: {s.get('tiny')}.", "",
              "| case | kdamoe ms | peer | peer ms | kdamoe/peer | kdamoe peak GiB | peer peak GiB | note |",
              "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        note = "; ".join(str(r[k]) for k in ("ours_note", "peer_note") if r.get(k))
        name = r["name"] if r.get("ours") is None else f"{r['name']} (ours = {r['ours']})"
        lines.append(f"| {name} | {fmt(r['ours_ms'], 4)} | {r['peer']} | {fmt(r['peer_ms'], 4)} | "
                     f"{fmt(r['ratio'])} | {fmt(r.get('ours_peak_gib'))} | {fmt(r.get('peer_peak_gib'))} | "
                     f"{note[:160]} |")
    lines += ["", "## Decode details", "",
              "| model | case | median ms | min ms | max ms | rows agree | graphs captured | cache expanded by |",
              "|---|---|---|---|---|---|---|---|"]
    for model in ("kdamoe", "native"):
        for key, e in raw.get(model, {}).items():
            if key.startswith("decode_b") and isinstance(e, dict) and "median_ms" in e:
                lines.append(f"| {model} | {key} | {fmt(e['median_ms'], 4)} | {fmt(min(e['steps_ms']), 4)} | "
                             f"{fmt(max(e['steps_ms']), 4)} | {e.get('rows_agree', '—')} | "
                             f"{fmt(e.get('graphs_captured'))} | {e.get('cache_expand', '—')} |")
    floor = raw.get("floor", {}).get("sdpa")
    if isinstance(floor, dict):
        lines += ["", "## Floor: the MLA layers' causal attention alone", "",
                  f"`scaled_dot_product_attention(q, k, v, is_causal=True)`, {floor['dtype']} "
                  f"[1, {floor['H']}, {floor['T']}, {floor['d']}], {floor['layers']} layers; "
                  f"{floor['flops']:.3g} FLOP in all. Per backend, one call "
                  "(ms): " + ", ".join(f"{b} {fmt(t, 4)}" for b, t in floor["one_call_ms"].items()) +
                  f". Floor: {floor['best_backend']}, {fmt(floor['floor_ms'], 4)} ms for {floor['layers']} layers, "
                  f"{fmt(floor['tflops'])} TFLOP/s."]
    for kind, prof in (raw.get("profile") or {}).items():
        if not isinstance(prof, dict) or "table" not in prof:
            continue
        lines += ["", f"## Profile: one kdamoe decode step after {label(prof['T'])}, {kind}", "",
                  f"Wall per step (unprofiled median of {prof['timed_steps']}): {fmt(prof['wall_ms'], 4)} ms; "
                  f"under the profiler {fmt(prof['profiled_wall_ms'], 4)} ms. GPU kernel time per step (sum): "
                  f"{fmt(prof['kernel_ms'], 4)} ms ({fmt(prof['busy_share'])} of the unprofiled wall). Kernels run "
                  f"per step: {fmt(prof['kernels_per_step'])}; host launch calls per step: "
                  + ", ".join(f"{n} {fmt(c)}" for n, c in prof["launch_calls_per_step"].items()) + ".", "",
                  "| kernel | calls/step | µs/step | share |", "|---|---|---|---|"]
        lines += [f"| `{r['name']}` | {fmt(r['calls'])} | {fmt(r['us'])} | {fmt(r['share'])} |" for r in prof["table"]]
    for dtype, g in (raw.get("greedy") or {}).items():
        if isinstance(g, dict) and "equal" in g:
            lines += ["", f"## Greedy check ({dtype})", "",
                      f"{g['new_tokens']} new tokens after a {g['prompt_tokens']}-token prompt ({g['prompt']}), "
                      f"model {g['model_dir']}: "
                      f"(a) {g['a']} vs (b) {g['b']}: equal = {g['equal']}"
                      + ("" if g["equal"] else f", first difference at new token {g['first_diff']} (run (a)'s top-1 "
                         f"margin there: {fmt(g['margin_a'])})")
                      + f"; relative L2 difference of the first step's logits: {fmt(g['step0_logits_rel_diff'])}."]
    problems = [(f"{group}/{key}", v if isinstance(v, str) else v["error"].strip().splitlines()[-1])
                for group, entries in raw.items() if isinstance(entries, dict) for key, v in entries.items()
                if isinstance(v, str) or (isinstance(v, dict) and "error" in v)]
    if problems:
        lines += ["", "## Skipped or failed", ""] + [f"- {k}: {v[:300]}" for k, v in problems]
    if doc.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {k}: {v}" for k, v in doc["notes"].items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ measurements


@torch.no_grad()
def prefill(bench: Bench, model, T: int, **kwargs) -> tuple[dict, object]:
    """One prefill of ``T`` random tokens (B=1, ``logits_to_keep=1``, ``use_cache=True``).

    Returns ``({"s", "peak_gib", "allocated_before_gib"}, output)``; ``s`` is host wall time between two
    synchronizations, ``peak_gib`` the peak of allocated memory during the call (weights included).
    """
    ids = bench.ids(1, T)
    bench.free()
    if bench.cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() / GIB if bench.cuda else None
    bench.sync()
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
    bench.sync()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / GIB if bench.cuda else None
    return {"s": seconds, "peak_gib": peak, "allocated_before_gib": before}, out


@torch.no_grad()
def decode(bench: Bench, model, cache, token: torch.Tensor, warmup: int, steps: int):
    """``warmup + steps`` one-token steps, each one's greedy token fed to the next; wall time per step between
    two synchronizations. Returns ``({"median_ms", "steps_ms", "warmup", "rows_agree"}, cache, last token)``;
    ``rows_agree``: every row chose the same token at every step (the rows of an expanded cache are copies, so
    a row that drifts points at a broken expansion or a stale captured graph); ``graphs_captured``: how many
    decode graphs the cache holds afterwards (``None`` for a cache without them)."""
    times, agree = [], True
    for i in range(warmup + steps):
        bench.sync()
        t0 = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        bench.sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        agree = agree and bool((token == token[:1]).all())
        cache = out.cache
    graphs = getattr(cache, "graphs", None)  # KDAMoECache: the captured decode graphs (none: every step ran eagerly)
    return {"median_ms": statistics.median(times), "steps_ms": times, "warmup": warmup, "rows_agree": agree,
            "graphs_captured": None if graphs is None else len(graphs)}, cache, token


def expand_cache(cache, batch: int, repeats: int) -> str:
    """Repeat each of the ``batch`` rows of ``cache`` ``repeats`` times in place; returns the method used.

    ``Cache.batch_repeat_interleave`` where every layer has it; else ``reorder_cache`` with each row index
    repeated (transformers 5.24's ``LinearAttentionLayer``, native KimiLinear's KDA layers, has no
    ``batch_repeat_interleave``; ``index_select`` on repeated indices makes the same copies).
    """
    layers = getattr(cache, "layers", None)
    if layers is None or all(hasattr(layer, "batch_repeat_interleave") for layer in layers):
        cache.batch_repeat_interleave(repeats)
        return "batch_repeat_interleave"
    device = next(t.device for t in _cache_tensors(cache))
    cache.reorder_cache(torch.arange(batch, device=device).repeat_interleave(repeats))
    return "reorder_cache"


def _cache_tensors(cache):
    for layer in cache.layers:
        for name in ("keys", "values"):
            if isinstance(getattr(layer, name, None), torch.Tensor):
                yield getattr(layer, name)
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            yield from (t for t in states.values() if isinstance(t, torch.Tensor))


def native_b8_kv_gib(shape: Shape, batch: int, T: int) -> float:
    """GiB of the per-head keys and values native KimiLinear expands from its MLA latent in one layer and step."""
    width = shape.head_dim + shape.native_rope_dim + shape.head_dim
    return batch * shape.num_attention_heads * T * width * 2 / GIB


def run_model(bench: Bench, name: str) -> None:
    """Prefill and decode of one model at every length, in increasing order (see the module docstring)."""
    a, rec = bench.args, bench.rec
    if not rec.need(name, "build", bench.est(40)):
        return
    try:
        model = (build_kdamoe if name == "kdamoe" else build_native)(bench.shape, bench.device, bench.dtype)
        info = {"params": sum(p.numel() for p in model.parameters()),
                "attn_implementation": getattr(model.config, "_attn_implementation", None)}
        if name == "kdamoe":
            info["config_prefill_chunk_size"] = model.config.prefill_chunk_size
            if a.chunk is not None:
                model.config.prefill_chunk_size = a.chunk
            info["prefill_chunk_size"] = rec.settings["kdamoe_prefill_chunk"] = model.config.prefill_chunk_size
            info["decode_cuda_graphs"] = model.config.decode_cuda_graphs
        rec.put(name, "model", info)
        print(name, info, flush=True)
    except Exception:
        rec.error(name, "build")
        return
    chunk = getattr(model.config, "prefill_chunk_size", None) or 0
    # prefill seconds per token for the deadline (1M: 31 s / 22 s)
    per_token = 35.0 / M if name == "native" else 30.0 / M
    step_s = 0.25 if name == "native" else 0.05  # decode seconds per step, B=8 at 128K, generous
    try:
        warm_up(bench, model, a.warm_t if not chunk else chunk + a.warm_t, name)
    except Exception:
        rec.error(name, "warmup")
    bench.free()

    for T in sorted(set(a.prefill_t) | set(a.decode_t)):
        key = f"prefill_T{T}" if T in a.prefill_t else f"context_T{T}"
        if not rec.need(name, key, bench.est(5 + per_token * T + (3 * step_s * 30 if T in a.decode_t else 0))):
            continue
        out = cache = tok = None
        try:
            stats, out = prefill(bench, model, T)
            stats["chunk"] = chunk if name == "kdamoe" else None
            stats["cache_class"] = type(out.cache).__name__
            if T in a.prefill_t:
                rec.put(name, key, stats)
            print(name, "prefill", label(T), f"{stats['s']:.2f} s, peak {stats['peak_gib']} GiB", flush=True)
            cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
            out = None
        except Exception:
            rec.error(name, key)
        if cache is None or T not in a.decode_t:
            del out, cache, tok
            bench.free()
            continue
        cache, tok = decode_set(bench, name, model, cache, tok, T, step_s)
        del out, cache, tok
        bench.free()

    if name == "kdamoe":
        for c in a.chunk2:
            T = max(a.prefill_t)
            key = f"prefill_T{T}_chunk{c}"
            if not rec.need(name, key, bench.est(5 + per_token * T)):
                continue
            try:
                stats, out = prefill(bench, model, T, prefill_chunk_size=c)
                rec.put(name, key, {**stats, "chunk": c})
                print(name, "prefill", label(T), "chunk", c, f"{stats['s']:.2f} s", flush=True)
                del out
            except Exception:
                rec.error(name, key)
            bench.free()
    del model
    bench.free()


def warm_up(bench: Bench, model, T: int, name: str) -> None:
    """Compile and autotune outside the timed calls: a prefill of ``T`` tokens (past kdamoe's chunk, so a chunk that
    continues a cache runs too), decode steps at B=1 as a user runs them (kdamoe: eager, then graph capture and
    replay), then eager steps at B=``--batch``. The eager B=8 steps are there because a ``KDAMoECache`` expanded
    after decode steps captures its B=8 graph on the first B=8 step, with no eager step at that batch size before
    it, so any kernel that autotunes for the new shape would do so inside the capture."""
    a = bench.args
    stats, out = prefill(bench, model, T)
    _, cache, tok = decode(bench, model, out.cache, out.logits[:, -1:].argmax(-1), a.warmup, 1)
    del out
    expand_cache(cache, 1, a.batch)
    graphs = getattr(model.config, "decode_cuda_graphs", None)
    try:
        if graphs is not None:
            model.config.decode_cuda_graphs = False
        decode(bench, model, cache, tok.repeat_interleave(a.batch, 0), 1, 1)
    finally:
        if graphs is not None:
            model.config.decode_cuda_graphs = graphs
    bench.rec.put(name, "warmup", {"T": T, "s": stats["s"], "eager_batch": a.batch})


def decode_set(bench: Bench, name: str, model, cache, tok, T: int, step_s: float):
    """After a prefill of ``T``: B=1 decode; kdamoe also eager at ``--eager-t``; then B=8 from the same cache."""
    a, rec = bench.args, bench.rec
    n = a.warmup + a.steps
    key = f"decode_b1_T{T}"
    try:
        stats, cache, tok = decode(bench, model, cache, tok, a.warmup, a.steps)
        stats["graphs"] = getattr(model.config, "decode_cuda_graphs", None)
        rec.put(name, key, stats)
        print(name, key, f"{stats['median_ms']:.3f} ms", flush=True)
    except Exception:
        rec.error(name, key)
        return cache, tok
    if name == "kdamoe" and T in a.eager_t and rec.need(name, key + "_eager", bench.est(n * 0.25)):
        graphs = model.config.decode_cuda_graphs if hasattr(model.config, "decode_cuda_graphs") else None
        try:
            model.config.decode_cuda_graphs = False
            stats, cache, tok = decode(bench, model, cache, tok, a.warmup, a.steps)
            rec.put(name, key + "_eager", {**stats, "graphs": False})
            print(name, key, "eager", f"{stats['median_ms']:.3f} ms", flush=True)
        except Exception:
            rec.error(name, key + "_eager")
        finally:
            model.config.decode_cuda_graphs = graphs
    B = a.batch
    key = f"decode_b{B}_T{T}"
    if name == "native" and T >= M:
        gib = native_b8_kv_gib(bench.shape, B, T)
        rec.put(name, key, f"skipped: does not fit: each step expands the MLA latent of all {T} cached tokens into "
                           f"per-head keys and values, {gib:.0f} GiB per layer at B={B}")
        return cache, tok
    if not rec.need(name, key, bench.est(n * step_s * 4)):
        return cache, tok
    try:
        method = expand_cache(cache, 1, B)
        stats, cache, tok = decode(bench, model, cache, tok.repeat_interleave(B, 0), a.warmup, a.steps)
        rec.put(name, key, {**stats, "cache_expand": method,
                            "graphs": getattr(model.config, "decode_cuda_graphs", None)})
        print(name, key, f"{stats['median_ms']:.3f} ms", method, flush=True)
    except Exception:
        rec.error(name, key)
    return cache, tok


def run_floor(bench: Bench) -> None:
    """The MLA layers' causal attention alone at the longest prefill length (module docstring, ``floor``)."""
    s, rec = bench.shape, bench.rec
    T, H, d = max(bench.args.prefill_t), s.num_attention_heads, s.head_dim
    layers = s.layer_types.count("full_attention")
    flops = layers * 2 * 2 * H * d * T * T / 2
    if not rec.need("floor", "sdpa", bench.est(45)):
        return
    times = {}
    try:
        gen = torch.Generator(device=bench.device).manual_seed(1)  # drawn on the device: 3 x 1G values at 1M
        q, k, v = (torch.randn(1, H, T, d, generator=gen, device=bench.device, dtype=bench.dtype) for _ in range(3))
        backends = {"default": None}
        if bench.cuda:
            backends.update(flash=SDPBackend.FLASH_ATTENTION, cudnn=SDPBackend.CUDNN_ATTENTION)
        for name, backend in backends.items():
            if not rec.need("floor", f"sdpa_{name}", bench.est(12)):
                continue
            try:
                ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
                with ctx, torch.no_grad():
                    short = min(T, 16 * K)  # load and compile the kernel outside the timed call
                    F.scaled_dot_product_attention(q[:, :, :short], k[:, :, :short], v[:, :, :short], is_causal=True)
                    bench.sync()
                    t0 = time.perf_counter()
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    bench.sync()
                    times[name] = (time.perf_counter() - t0) * 1e3
                print("floor sdpa", name, f"{times[name]:.1f} ms", flush=True)
            except Exception:
                rec.error("floor", f"sdpa_{name}")
        del q, k, v
    except Exception:
        rec.error("floor", "sdpa")
    bench.free()
    if times:
        best = min(times, key=times.get)
        rec.put("floor", "sdpa", {"T": T, "H": H, "d": d, "dtype": str(bench.dtype).replace("torch.", ""),
                                  "layers": layers, "flops": flops, "one_call_ms": times,
                                  "best_backend": best, "floor_ms": times[best] * layers,
                                  "tflops": flops / (times[best] * layers / 1e3) / 1e12})


@torch.no_grad()
def profile_steps(bench: Bench, model, cache, tok, steps: int):
    """``steps`` decode steps under ``torch.profiler`` (CPU + CUDA activity); parsed from the exported trace.

    Returns ``(summary, cache, token)``: profiled wall per step, summed GPU kernel (and memcpy/memset) time per
    step, kernels run per step, host launch calls per step by API name, and the top kernels by time.
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.cuda else [])
    with profile(activities=activities) as prof:
        bench.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=tok, cache=cache, use_cache=True)
            tok, cache = out.logits[:, -1:].argmax(-1), out.cache
        bench.sync()
        wall = time.perf_counter() - t0
    return {"profiled_wall_ms": wall / steps * 1e3, **kernel_summary(prof, steps)}, cache, tok


def run_profile(bench: Bench) -> None:
    """kdamoe decode after ``--profile-t`` tokens, CUDA graph replay then eager (module docstring, ``profile``)."""
    a, rec = bench.args, bench.rec
    if not rec.need("profile", "graph", bench.est(50)):
        return
    try:
        model = build_kdamoe(bench.shape, bench.device, bench.dtype)
        _, out = prefill(bench, model, a.profile_t)
        cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
        del out
        for kind, graphs in (("graph", True), ("eager", False)):
            if kind == "eager" and not rec.need("profile", kind, bench.est(20)):
                continue
            try:
                model.config.decode_cuda_graphs = graphs
                timed, cache, tok = decode(bench, model, cache, tok, a.warmup, a.steps)
                prof, cache, tok = profile_steps(bench, model, cache, tok, a.profile_steps)
                wall = timed["median_ms"]
                rec.put("profile", kind, {"T": a.profile_t, "graphs": graphs, "wall_ms": wall,
                                          "timed_steps": a.steps, **prof,
                                          "busy_share": prof["kernel_ms"] / wall if wall else None})
                print("profile", kind, f"wall {wall:.3f} ms, kernels {prof['kernel_ms']:.3f} ms", flush=True)
            except Exception:
                rec.error("profile", kind)
        del model, cache, tok
    except Exception:
        rec.error("profile", "graph")
    bench.free()


# ------------------------------------------------------------------------------------------------ greedy check


def held_out_prompt(tokenizer, n_tokens: int) -> torch.Tensor:
    """``[1, n_tokens]``: bos + the start of the GPU preset's held-out plays (``data.val_documents``)."""
    _, val = load_corpus(load_config("gpu_h200.yaml").data)
    text = "\n\n".join(d.text for d in val)
    ids = tokenizer(text[: 40 * n_tokens], add_special_tokens=False)["input_ids"][: n_tokens - 1]
    if len(ids) < n_tokens - 1:
        raise ValueError(f"held-out text gives {len(ids) + 1} tokens, fewer than the {n_tokens} asked for")
    return torch.tensor([[tokenizer.bos_token_id, *ids]])


def tiny_model_folder(bench: Bench, folder: str) -> str:
    """A random tiny kdamoe saved with its code (the tiny mode's stand-in for a trained ``final/`` folder)."""
    model = build_kdamoe(bench.shape, "cpu", torch.float32)
    model.save_pretrained(folder)
    return folder


@torch.no_grad()
def greedy_pair(bench: Bench, model, ids: torch.Tensor, new_tokens: int, chunk: int) -> dict:
    """Greedy ``generate`` twice: (a) single-pass prefill, eager decode; (b) prefill in ``chunk``-token pieces,
    CUDA-graph decode. Returns whether the new tokens are equal, the first index where they differ, run (a)'s
    top-1 margin there, and the relative L2 difference of the first step's logits."""
    runs = {}
    for tag, c, graphs in (("a", 0, False), ("b", chunk, True)):
        model.config.prefill_chunk_size = c
        model.config.decode_cuda_graphs = graphs
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, output_logits=True,
                             return_dict_in_generate=True)
        runs[tag] = (out.sequences[0, ids.shape[1]:].tolist(), [step[0].float() for step in out.logits])
    (ta, la), (tb, lb) = runs["a"], runs["b"]
    first = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), None)
    margin = None
    if first is not None:
        top = la[first].topk(2).values
        margin = float(top[0] - top[1])
    return {"a": "prefill_chunk_size=0, decode_cuda_graphs=False",
            "b": f"prefill_chunk_size={chunk}, decode_cuda_graphs=True",
            "prompt_tokens": ids.shape[1], "new_tokens": new_tokens, "equal": ta == tb and first is None,
            "first_diff": first, "margin_a": margin,
            "step0_logits_rel_diff": float((la[0] - lb[0]).norm() / la[0].norm()), "tokens_a": ta, "tokens_b": tb}


def run_greedy(bench: Bench) -> None:
    """The greedy check on the trained model of ``--model-dir`` (module docstring, ``greedy``)."""
    a, rec = bench.args, bench.rec
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if a.tiny and not a.model_dir:
                folder, prompt = tiny_model_folder(bench, tmp), "random token ids"
                ids = bench.ids(1, a.greedy_prompt).cpu()
            else:
                if not a.model_dir or not os.path.isdir(a.model_dir):
                    rec.put("greedy", "model", f"skipped: no trained model folder ({a.model_dir!r})")
                    return
                folder, prompt = a.model_dir, "the GPU preset's held-out plays"
                ids = held_out_prompt(AutoTokenizer.from_pretrained(folder, trust_remote_code=True), a.greedy_prompt)
        except Exception:
            rec.error("greedy", "model")
            return
        for dtype in (torch.float32, torch.bfloat16) if bench.cuda else (torch.float32,):
            key = str(dtype).replace("torch.", "")
            if not rec.need("greedy", key, bench.est(40)):
                continue
            try:
                model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=dtype)
                model = model.to(bench.device).eval()
                result = greedy_pair(bench, model, ids.to(bench.device), a.greedy_new, a.greedy_chunk)
                name = "a random tiny model" if folder == tmp else os.path.basename(os.path.normpath(folder))
                rec.put("greedy", key, {**result, "prompt": prompt, "model_dir": name})
                print("greedy", key, "equal:", result["equal"], "first diff:", result["first_diff"], flush=True)
                del model
            except Exception:
                rec.error("greedy", key)
            bench.free()


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, PARTS, out_default=".", out_help="folder for long_context.{json,md}",
                 budget_default=float(os.environ.get("LC_BUDGET_S", "480")))
    p.add_argument("--prefill-t", type=ints, default=None, help="prefill lengths (default 128K,512K,1M)")
    p.add_argument("--decode-t", type=ints, default=None, help="decode after these lengths (default 4K,128K,1M)")
    p.add_argument("--eager-t", type=ints, default=None, help="kdamoe eager decode after these (default 4K,1M)")
    p.add_argument("--chunk", type=int, default=None,
                   help="kdamoe's prefill_chunk_size (default: the config's; --tiny: 100)")
    p.add_argument("--chunk2", type=ints, default=ints(os.environ.get("LC_CHUNK2", "")),
                   help="kdamoe prefill chunk lengths to try at the longest length besides the default (env LC_CHUNK2)")
    p.add_argument("--batch", type=int, default=8, help="the batched decode's rows")
    p.add_argument("--warmup", type=int, default=None, help="decode warm-up steps (default 3)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 16)")
    p.add_argument("--warm-t", type=int, default=None,
                   help="untimed warm-up prefill length, past the chunk (default 8K)")
    p.add_argument("--profile-t", type=int, default=None, help="profiled decode after this many tokens (default 32K)")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--model-dir", default=os.environ.get("LC_MODEL_DIR"),
                   help="trained final/ folder for the greedy check")
    p.add_argument("--greedy-prompt", type=int, default=None, help="prompt tokens (default 4096)")
    p.add_argument("--greedy-new", type=int, default=None, help="new tokens (default 64)")
    p.add_argument("--greedy-chunk", type=int, default=None, help="run (b)'s prefill chunk (default 1000)")
    a = p.parse_args(argv)
    small = a.tiny
    defaults = dict(prefill_t=[64, 256] if small else [128 * K, 512 * K, M],
                    decode_t=[64, 256] if small else [4 * K, 128 * K, M],
                    eager_t=[64, 256] if small else [4 * K, M], warmup=1 if small else 3, steps=3 if small else 16,
                    warm_t=32 if small else 8 * K, profile_t=64 if small else 32 * K,
                    greedy_prompt=96 if small else 4 * K, greedy_new=6 if small else 64,
                    greedy_chunk=37 if small else 1000)
    finish_run_args(p, a, PARTS, defaults)
    if small and not a.chunk2:
        a.chunk2 = [48]
    if small and a.chunk is None:
        a.chunk = 100
    check_at_least(p, a, ("warmup", "steps", "batch", "profile_steps", "greedy_new"))
    if a.profile_steps < 1 or min(a.prefill_t + a.decode_t) < 2:
        p.error("lengths must be >= 2")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    bench = start_run(a, LongContextRecorder, {"warmup": a.warmup, "steps": a.steps,
                                               "tcache_restored": os.environ.get("LC_TCACHE_RESTORED") == "1"})
    rec = bench.rec
    n_layers = bench.shape.num_hidden_layers
    rec.notes.update(
        native_layer_types=f"native gets kdamoe's layer_types (full attention at 0-based layers "
                           f"{[i for i, t in enumerate(bench.shape.layer_types) if t == 'full_attention']}); "
                           f"transformers' default would put it at {[i for i in range(n_layers) if i and i % 4 == 0]}",
        native_qk_head_dim=f"native's query/key head dim is {bench.shape.head_dim} + {bench.shape.native_rope_dim} "
                           f"(qk_rope_head_dim, a shared key part it does not rotate); ours {bench.shape.head_dim}",
        warmup="each model: one untimed prefill past kdamoe's chunk, decode steps at B=1, eager steps at B=8 "
               "(see warm_up in the script)")
    rec.save()
    print("stack:", rec.stack, flush=True)
    runners = {"kdamoe": lambda: run_model(bench, "kdamoe"), "native": lambda: run_model(bench, "native"),
               "floor": lambda: run_floor(bench), "profile": lambda: run_profile(bench),
               "greedy": lambda: run_greedy(bench)}
    return run_parts(bench, runners)


if __name__ == "__main__":
    sys.exit(main())
