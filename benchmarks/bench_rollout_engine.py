"""The batched rollout engine on one GPU against the one-at-a-time cached rollout and TRL's own loop (issue #39,
Deliver 5).

The model is the long-context benchmark's shape (``harness.Shape``: 1.68B total / 0.36B active parameters, vocab
32000, 16 layers with MLA every 4th), bf16 on CUDA, random weights from a fixed seed, random token ids. One device
call (``benchmarks/device_rollout_engine.sh``) runs the parts below in the order asked; each is caught on its own
and ``rollout_engine.json`` is rewritten after every measurement (``harness.Recorder``), so the deadline or a crash
loses nothing measured before it.

The synthetic GRPO round (the same work for every way): ``--prompts`` prompts (8) × ``--generations`` (8) episodes,
each prompt ``C`` random tokens (one of ``--contexts``: 4K, 32K, 128K), the episodes of a prompt sharing it. An
episode plays ``--turns`` (8) assistant turns of exactly ``--gen-tokens`` (64) tokens, greedy, with
``min_new_tokens = max_new_tokens`` so no turn ends early; every turn but the last calls the one tool, which returns
at once, and the tool turn adds ``--result-tokens`` (48) fixed random ids (``tool_suffix_ids``). So an episode
generates ``turns · gen`` tokens and reads ``(turns − 1) · result`` tool tokens. Each turn is parsed as a call of
the tool by a stand-in for TRL's ``parse_response`` (random weights emit no tool-call syntax), patched into the
modules that call it; after ``turns − 1`` tool rounds ``max_tool_calling_iterations`` ends the episode. The three
ways, each timed whole (synchronized wall clock):

* ``engine``: :class:`kdamoe.posttraining.engine.RolloutEngine` with one slot per episode (``--slots``, default
  all), its defaults otherwise (``prefill_chunk_size`` 512, ``max_step_tokens`` 8192): the round is one
  ``engine.run`` of every episode;
* ``cached`` (``grpo.rollout: cached``): ``kdamoe.posttraining.rollout._episode``, the cached rollout's own episode
  loop (``generate`` on the kept cache every turn), one episode after another at batch 1, each prefilling its
  prompt;
* ``trl``: TRL 1.16's own ``GRPOTrainer._generate_single_turn`` (the first turn, then every turn of the loop: the
  rows still going, left-padded, one ``model.generate`` from a fresh cache over each whole sequence) and
  ``GRPOTrainer._tool_call_loop``, run on a stand-in trainer object that holds only the attributes those two
  methods read (:class:`TRLLoopHost`); no ``GRPOTrainer`` is constructed (it would build an optimizer, datasets and
  a reference to the 1.7B model we do not need).

The peers are slow at long contexts, so each gets ``--peer-s`` seconds per context: ``cached`` plays whole episodes
until that is spent (at least one), ``trl`` plays whole turns of the round; the round's time is then **projected**
from what was measured (every cached episode does the same work; a TRL turn is taken to cost what the last measured
one did, which underestimates, as the context grows by ``result + gen`` tokens a turn). The results say which
numbers are measured and which projected (``projected``, ``episodes_measured`` / ``turns_measured``). Per way:
wall seconds of the round, generated tokens per second (``E · turns · gen`` over the round's seconds), peak GPU
memory (``torch.cuda.max_memory_allocated`` from a reset at the way's start, model weights included), and whether
its tokens equal the engine's (greedy; bf16 kernels of different batch shapes may round apart).

Parts (``--only``, comma list, run in the order given; default the cheapest and most telling first):

``steps``
    The engine's decode step (the forward, then sampling each slot's next token; the forward alone is recorded
    too, ``forward_ms``) against the number of active slots, ``--step-slots`` (1, 8, 32, 64) after a
    ``--step-context`` (32K) prompt, the slots in groups of ``--generations`` sharing it (as in a round: a group's
    prompt is prefilled once and its MLA rows are read once per step for the whole group). Each count is one
    ``engine.run`` of ``--step-tokens`` generated tokens per episode (no tools); the engine's ``_step`` and
    ``_forward`` are wrapped to synchronize and time every step, and the decode step's time is the median of the
    steps in which every slot decoded one token (the first two dropped: Triton compiles per specialisation). An
    untimed run at ``--warm-context`` first compiles the kernels; its decode steps are recorded too and enter the
    fit. At the largest slot count, ``--profile-steps`` (3) decode steps run under ``torch.profiler`` (left out of
    the timings): GPU kernel time, kernels and launch calls per step, the top kernels and the top host operators.
``round``
    The GRPO round above at each of ``--contexts``, ``--ways`` (engine, cached, trl) in turn.

The cost model (docs/post-training.md, "Cost of a GRPO round"): a forward costs ``a + b · tokens + c · rows``, with
``a`` the fixed part (reading the active weights once, launches, host work), ``b`` per token of the forward and
``c`` per MLA row read (a group's prefix once per step, each sequence's own rows; one layer's rows counted, the
constant covers all MLA layers). ``a, b, c`` are fitted by least squares (``torch.linalg.lstsq``) to the decode
steps of ``steps``, one point per run (its median step, tokens and rows: the slot counts after ``--step-context``
and the warm-up after ``--warm-context``, whose few rows per slot separate ``b`` from ``c``), then each way's round
is predicted from its forwards (a run without ``steps`` extending an earlier results file, ``--continue-from``,
takes that file's fit):

* ``engine``: the forwards the round actually ran (the wrapped ``_forward`` counts each step's tokens and rows);
* ``cached``: per episode, a prefill of ``C`` tokens (``ceil(C / prefill_chunk_size)`` forwards of the model's
  chunked prefill; rows read: the length so far), ``gen − 1`` one-token forwards per turn reading the episode's
  length, and a ``result + 1``-token forward per tool turn;
* ``trl``: per turn, a prefill of every row's whole sequence (``rows · L`` tokens and rows, in
  ``ceil(L / prefill_chunk_size)`` forwards) and ``gen − 1`` forwards of one token per row, each row reading ``L``.

The constants come from the engine's ragged step; the peers run ``generate`` (chunked prefill, CUDA-graph decode),
and a long prefill costs more per row than the per-row read the model charges, so their predictions are the
engine's cost per forward applied to the peers' forwards, and the measured / predicted ratio shows where that
account fails.

Writes ``rollout_engine.json`` (``raw``: every number; ``rows``; ``notes.fit``: the cost model's constants) and
``rollout_engine.md`` into ``--out``.

    python3 benchmarks/bench_rollout_engine.py --out "$OUT"                    # one GPU (deadline --budget-s)
    python benchmarks/bench_rollout_engine.py --tiny --device cpu --out DIR    # CPU smoke test: tiny shapes
"""

import argparse
import contextlib
import math
import os
import shutil
import statistics
import sys
import time
import types
from unittest import mock

import torch
import trl.trainer.grpo_trainer as trl_grpo
from accelerate import Accelerator
from transformers import GenerationConfig
from trl import GRPOTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import (  # noqa: E402  (the benchmarks folder is not a package)
    GIB,
    Bench,
    K,
    Recorder,
    add_run_args,
    build_kdamoe,
    check_at_least,
    finish_run_args,
    fmt,
    ints,
    label,
    run_parts,
    start_run,
)
from harness import (
    kernel_summary as harness_kernel_summary,
)

from kdamoe.posttraining import rollout as cached_module  # noqa: E402
from kdamoe.posttraining.engine import EpisodeSpec, RolloutEngine  # noqa: E402

PARTS = ("steps", "round")
WAYS = ("engine", "cached", "trl")
TOOL = "env"


class OutOfTime(Exception):
    """A peer's time share is spent: what it measured so far is projected to the whole round."""


class EngineRecorder(Recorder):
    """``harness.Recorder`` writing ``rollout_engine.{json,md}`` with this benchmark's tables."""

    stem = "rollout_engine"
    strip_paths = True

    def rows(self) -> list[dict]:
        rows = []
        for key, entry in self.raw.get("round", {}).items():
            if not isinstance(entry, dict):
                continue
            engine = entry.get("engine") if isinstance(entry.get("engine"), dict) else {}
            for way in ("cached", "trl"):
                peer = entry.get(way)
                if isinstance(peer, dict) and engine.get("round_s") and peer.get("round_s"):
                    rows.append({"name": f"round after {key}: engine vs {way}", "engine_s": engine["round_s"],
                                 "peer_s": peer["round_s"], "speedup": peer["round_s"] / engine["round_s"],
                                 "peer_projected": peer.get("projected")})
        steps = self.raw.get("steps", {})
        ones = [e for e in steps.values() if isinstance(e, dict) and e.get("slots") == 1 and not e.get("warm_up")]
        for key, e in steps.items():
            if isinstance(e, dict) and e.get("step_ms") and ones and not e.get("warm_up"):
                rows.append({"name": f"decode step {key} vs 1 slot", "step_ms": e["step_ms"],
                             "one_slot_ms": ones[0]["step_ms"], "ratio": e["step_ms"] / ones[0]["step_ms"]})
        return rows

    def markdown(self, doc: dict) -> str:
        s = doc["settings"]
        fit = doc["notes"].get("fit") if isinstance(doc["notes"].get("fit"), dict) else None
        lines = ["# The batched rollout engine against the one-at-a-time cached rollout and TRL's loop", "",
                 f"Stack: {doc['stack']}.", "",
                 f"Model: {s.get('shape')}; bf16 on CUDA. A round: {s.get('prompts')} prompts × "
                 f"{s.get('generations')} generations, {s.get('turns')} turns of {s.get('gen_tokens')} generated "
                 f"tokens with {s.get('result_tokens')} tool-result tokens between turns, greedy, forced lengths.", "",
                 "## Decode step against active slots", "",
                 "| case | slots | groups | context | step ms | forward ms | × 1 slot | predicted ms | prefill s |",
                 "|---|---|---|---|---|---|---|---|---|"]
        ratios = {r["name"]: r for r in doc["rows"]}
        for key, e in doc["raw"].get("steps", {}).items():
            if isinstance(e, dict) and "step_ms" in e:
                r = ratios.get(f"decode step {key} vs 1 slot", {})
                pred = _predict_ms(fit, 1, e.get("slots", 0), e.get("rows_per_step", 0))
                lines.append(f"| {key} | {e.get('slots')} | {e.get('groups')} | {label(e.get('context', 0))} | "
                             f"{fmt(e['step_ms'])} | {fmt(e.get('forward_ms'))} | "
                             f"{fmt(r.get('ratio'))} | {fmt(pred)} | {fmt(e.get('prefill_s'))} |")
            else:
                lines.append(f"| {key} | {e} | | | | | | | |")
        for key, e in doc["raw"].get("steps", {}).items():
            prof = e.get("profile") if isinstance(e, dict) else None
            if prof:
                lines += ["", f"## Profile of a decode step, {key} (mean of {prof.get('steps')} steps)", "",
                          f"GPU kernels {fmt(prof.get('kernel_ms'))} ms per step, {fmt(prof.get('kernels_per_step'))} "
                          f"kernels, launch calls {prof.get('launch_calls_per_step')}.", "",
                          "| top kernels | calls | µs | share |", "|---|---|---|---|"]
                lines += [f"| {r['name']} | {fmt(r['calls'])} | {fmt(r['us'])} | {fmt(r['share'])} |"
                          for r in prof.get("table", [])]
                lines += ["", "| top host operators (self CPU) | calls | µs |", "|---|---|---|"]
                lines += [f"| {r['name']} | {fmt(r['calls'])} | {fmt(r['self_cpu_us'])} |"
                          for r in prof.get("host_top", [])]
        if fit:
            lines += ["", f"Cost model fit (per forward, s = a + b·tokens + c·rows): a = {fmt(fit['a_ms'])} ms, "
                      f"b = {fmt(fit['b_us_per_token'])} µs/token, c = {fmt(fit['c_ns_per_row'])} ns/row, over "
                      f"{fit['points']} runs' median decode steps; largest relative residual "
                      f"{fmt(fit['max_rel_residual'])}."]
        lines += ["", "## GRPO round", "",
                  "| context | way | round s | tokens/s | peak GiB | predicted s | measured / predicted | projected | "
                  "engine speed-up | same tokens as engine |", "|---|---|---|---|---|---|---|---|---|---|"]
        for key, entry in doc["raw"].get("round", {}).items():
            if not isinstance(entry, dict) or "error" in entry:
                lines.append(f"| {key} | {entry} | | | | | | | | |")
                continue
            engine = entry.get("engine") if isinstance(entry.get("engine"), dict) else {}
            for way in WAYS:
                e = entry.get(way)
                if not isinstance(e, dict) or "round_s" not in e:
                    lines.append(f"| {key} | {way} | {e} | | | | | | | |")
                    continue
                speedup = e["round_s"] / engine["round_s"] if engine.get("round_s") and way != "engine" else None
                ratio = e["round_s"] / e["predicted_s"] if e.get("predicted_s") else None
                what = "no"
                if e.get("projected"):
                    what = (f"yes, from {e['episodes_measured']} of {s.get('prompts', 0) * s.get('generations', 0)} "
                            "episodes" if way == "cached" else f"yes, from {e.get('turns_measured')} of "
                            f"{s.get('turns')} turns")
                lines.append(f"| {key} | {way} | {fmt(e['round_s'])} | {fmt(e.get('tokens_per_s'))} | "
                             f"{fmt(e.get('peak_gib'))} | {fmt(e.get('predicted_s'))} | {fmt(ratio)} | {what} | "
                             f"{fmt(speedup)} | {_same(e)} |")
        if doc.get("notes"):
            lines += ["", "## Notes", ""] + [f"- {k}: {v}" for k, v in doc["notes"].items() if k != "fit"]
        return "\n".join(lines) + "\n"


def _same(e: dict) -> str:
    if not e.get("same_tokens_of"):
        return ""
    return f"{e['same_tokens_as_engine']} of {e['same_tokens_of']} episodes"


def _predict_ms(fit, forwards, tokens, rows):
    if not fit:
        return None
    return fit["a_ms"] * forwards + fit["b_us_per_token"] * 1e-3 * tokens + fit["c_ns_per_row"] * 1e-6 * rows


# ------------------------------------------------------------------------------------------------ the synthetic task
def tool_call_message(*_args, **_kwargs) -> dict:
    """The stand-in for TRL's ``parse_response`` (and the engine's ``parse_turn``): every turn calls the tool."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": TOOL, "arguments": {}}}]}


def env_tool() -> str:
    """The synthetic environment's one tool: returns at once (its tokens are ``tool_suffix_ids``)."""
    return "ok"


class Task:
    """The round's fixed inputs: prompts, the tool-turn ids, the generation config, the completion budget."""

    def __init__(self, bench: Bench, context: int, prompts: int, turns: int | None = None):
        a = bench.args
        self.context, self.turns, self.gen = context, turns or a.turns, a.gen_tokens
        self.prompts = [bench.ids(1, context)[0].tolist() for _ in range(prompts)]
        self.result_ids = bench.ids(1, a.result_tokens)[0].tolist()
        self.budget = self.turns * a.gen_tokens + (self.turns - 1) * a.result_tokens
        self.config = GenerationConfig(do_sample=False, max_new_tokens=a.gen_tokens, min_new_tokens=a.gen_tokens,
                                       eos_token_id=2, pad_token_id=0, bos_token_id=1)

    def suffix(self, _messages) -> list[int]:
        return list(self.result_ids)


def _peak_reset(bench: Bench) -> None:
    bench.free()
    if bench.cuda:
        torch.cuda.reset_peak_memory_stats()


def _peak(bench: Bench):
    return torch.cuda.max_memory_allocated() / GIB if bench.cuda else None


# ------------------------------------------------------------------------------------------------ the engine
def make_engine(model, task: Task, slots: int, tools: bool) -> RolloutEngine:
    return RolloutEngine(model, task.config, num_slots=slots, eos_token_ids=[2], max_completion_length=task.budget,
                         max_tool_calling_iterations=task.turns - 1 if tools else None,
                         parse_turn=tool_call_message, tool_suffix_ids=task.suffix)


def instrument(engine: RolloutEngine, bench: Bench, timed: bool) -> list[dict]:
    """Wrap ``engine._forward`` to record each step's cost-model features (sequences, tokens, MLA rows read: each
    group's prefix once, each sequence's own rows and new tokens; one layer's count) and, when ``timed``, its
    synchronized seconds (``forward_s``); with ``timed``, ``engine._step`` is wrapped too, for the whole step's
    seconds (``s``: the forward, then sampling every episode's next token and the bookkeeping). Returns the list the
    steps are appended to."""
    steps, forward, step = [], engine._forward, engine._step
    mla = next((layer.self_attn.layer_idx for layer in engine.backbone.layers
                if layer.layer_type == "full_attention"), None)

    def wrapped(feeds):
        prefixes, own = {}, 0
        for episode, tokens in feeds:
            if episode.prefix is not None and mla is not None:
                prefixes[id(episode.prefix)] = episode.prefix[mla].shape[0]
            rows = episode.own.get(mla)
            own += (rows.length if rows is not None else 0) + len(tokens)
        entry = {"sequences": len(feeds), "tokens": sum(len(t) for _, t in feeds),
                 "decode": all(len(t) == 1 for _, t in feeds), "rows": sum(prefixes.values()) + own}
        if timed:
            bench.sync()
            t0 = time.perf_counter()
        out = forward(feeds)
        if timed:
            bench.sync()
            entry["forward_s"] = time.perf_counter() - t0
        steps.append(entry)
        return out

    def timed_step(runnable):
        bench.sync()
        t0 = time.perf_counter()
        step(runnable)  # one _forward: its entry is the last one
        bench.sync()
        steps[-1]["s"] = time.perf_counter() - t0

    engine._forward = wrapped
    if timed:
        engine._step = timed_step
    return steps


def specs_for(task: Task, generations: int, tools: bool) -> list[EpisodeSpec]:
    return [EpisodeSpec(list(prompt), tools={TOOL: env_tool} if tools else None)
            for prompt in task.prompts for _ in range(generations)]


def run_steps(bench: Bench, model, fits: list) -> None:
    a, rec = bench.args, bench.rec
    top = max(a.step_slots)
    cases = [(a.warm_context, min(top, a.generations), True)] + [(a.step_context, s, False) for s in a.step_slots]
    for context, slots, warm in cases:
        key = f"warm-up {slots} slots after {label(context)}" if warm else f"{slots} slots after {label(context)}"
        groups = math.ceil(slots / a.generations)
        if not rec.need("steps", key, bench.est(15 + groups * context / 15000)):
            continue
        try:
            _peak_reset(bench)
            task = Task(bench, context, groups)
            task.config.max_new_tokens = task.config.min_new_tokens = a.step_tokens
            engine = make_engine(model, task, top, tools=False)
            steps = instrument(engine, bench, timed=True)
            profile = {}
            if a.profile_steps and slots == top and not warm:
                profile_steps(engine, bench, steps, a.profile_steps, profile)
            specs = specs_for(task, a.generations, tools=False)[:slots]
            t0 = time.perf_counter()
            engine.run(specs)
            wall = time.perf_counter() - t0
            decode = [e for e in steps if e["decode"] and e["sequences"] == slots and not e.get("profiled")]
            kept = decode[2:] if len(decode) > 4 else decode
            entry = {"slots": slots, "groups": groups, "context": context, "warm_up": warm,
                     "step_ms": 1e3 * statistics.median(e["s"] for e in kept),
                     "forward_ms": 1e3 * statistics.median(e["forward_s"] for e in kept),
                     "step_ms_all": [round(1e3 * e["s"], 3) for e in decode],
                     "rows_per_step": statistics.median(e["rows"] for e in kept),
                     "prefill_s": sum(e["s"] for e in steps if not e["decode"]), "run_s": wall,
                     "peak_gib": _peak(bench)}
            if profile:
                entry["profile"] = profile
            # one point per run, its medians: a straggler step (a late compile) moves a median, not the fit
            fits.append({"tokens": statistics.median(e["tokens"] for e in kept),
                         "rows": entry["rows_per_step"], "s": statistics.median(e["s"] for e in kept)})
            rec.put("steps", key, entry)
            del engine
        except Exception:
            rec.error("steps", key)
        fit_cost_model(rec, fits)
        print(f"steps {key}: {rec.raw['steps'][key]}", flush=True)


def profile_steps(engine: RolloutEngine, bench: Bench, steps: list, n: int, into: dict) -> None:
    """Profile ``n`` decode steps of ``engine`` (``torch.profiler``, from its third decode step on; wraps
    ``engine._step`` over :func:`instrument`'s wrapper) and fill ``into`` with ``harness.kernel_summary`` (GPU kernel
    ms, kernels and launch calls per step, the top kernels) and the top host operators by self CPU time per step.
    The profiled steps are marked (``profiled``) and left out of the timed medians."""
    inner, state = engine._step, {"decodes": 0, "done": 0, "prof": None}
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if bench.cuda else [])

    def step(runnable):
        decode = all(len(e.pending) == 1 for e in runnable)
        state["decodes"] += decode
        if decode and state["decodes"] == 3 and state["prof"] is None:
            state["prof"] = torch.profiler.profile(activities=activities)
            state["prof"].__enter__()
        inner(runnable)
        prof = state["prof"]
        if prof is None or state["done"] >= n:
            return
        steps[-1]["profiled"] = True
        state["done"] += 1
        if state["done"] == n:
            bench.sync()
            prof.__exit__(None, None, None)
            into.update(harness_kernel_summary(prof, n))
            ops = sorted(prof.key_averages(), key=lambda ev: -ev.self_cpu_time_total)[:15]
            into["host_top"] = [{"name": ev.key[:90], "calls": ev.count / n, "self_cpu_us": ev.self_cpu_time_total / n}
                                for ev in ops]
            into["steps"] = n

    engine._step = step


def fit_cost_model(rec: Recorder, points: list) -> None:
    """Least-squares ``s = a + b·tokens + c·rows`` over the runs' median decode steps (module docstring); recorded
    in the notes as ``fit`` once three independent points exist."""
    x = torch.tensor([[1.0, p["tokens"], p["rows"]] for p in points], dtype=torch.float64)
    if len(points) < 3 or torch.linalg.matrix_rank(x) < 3:
        return
    y = torch.tensor([p["s"] for p in points], dtype=torch.float64)
    sol = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
    residual = ((x @ sol - y) / y).abs().max()
    rec.notes["fit"] = {"a_ms": 1e3 * float(sol[0]), "b_us_per_token": 1e6 * float(sol[1]),
                        "c_ns_per_row": 1e9 * float(sol[2]), "points": len(points),
                        "max_rel_residual": float(residual),
                        "how": "torch.linalg.lstsq of step seconds on [1, tokens, rows], one point per run of the "
                               "'steps' part: the medians of its decode steps with every slot active (the first two "
                               "dropped)"}
    rec.save()


# ------------------------------------------------------------------------------------------------ the peers
class TRLLoopHost(GRPOTrainer):
    """The attributes TRL 1.16's ``GRPOTrainer._generate_single_turn`` and ``_tool_call_loop`` read, and nothing
    else: made with ``object.__new__`` (``GRPOTrainer.__init__`` never runs), so those two methods run unchanged on
    our model. A subclass because ``_generate_single_turn`` calls ``super()._prepare_inputs`` (transformers'
    ``Trainer``: moves the tensors to ``args.device``)."""

    @classmethod
    def make(cls, model, task: Task, episodes: int, device: torch.device):
        host = object.__new__(cls)
        accelerator = Accelerator(cpu=device.type == "cpu")
        host.__dict__.update(
            accelerator=accelerator, model=model, model_wrapped=model, use_vllm=False, vllm_mode=None,
            use_transformers_continuous_batching=False, pad_to_multiple_of=None, generation_config=task.config,
            generation_kwargs=None, eos_token_ids=[2], _tokenizer=types.SimpleNamespace(pad_token_id=0),
            _is_vlm=False, tools=[env_tool], environment_factories=None, max_completion_length=task.budget,
            max_tool_calling_iterations=task.turns - 1, _sync_tool_dicts=[{TOOL: env_tool}] * episodes,
            _async_tool_dicts=[{}] * episodes, _get_tool_suffix_ids=task.suffix,
            state=types.SimpleNamespace(global_step=0), is_deepspeed_enabled=False,
            args=types.SimpleNamespace(device=device, report_to=[], ds3_gather_for_generation=True,
                                       gradient_checkpointing_kwargs=None),
            _dist=types.SimpleNamespace(summon_full_params=lambda *_a, **_k: contextlib.nullcontext()))
        return host


def run_trl(bench: Bench, model, task: Task, episodes: int, share_s: float) -> dict:
    """TRL's loop over the round (module docstring): each ``_generate_single_turn`` call is a turn of the round,
    synchronized and timed; past ``share_s`` (or the deadline) the next turn is not started."""
    host = TRLLoopHost.make(model, task, episodes, bench.device)
    single = GRPOTrainer._generate_single_turn.__get__(host)
    turns, start = [], time.perf_counter()

    def timed_turn(*args, **kwargs):
        spent = time.perf_counter() - start
        if turns and (spent + turns[-1] > share_s or bench.rec.left() < turns[-1] + 10):
            raise OutOfTime
        bench.sync()
        t0 = time.perf_counter()
        out = single(*args, **kwargs)
        bench.sync()
        turns.append(time.perf_counter() - t0)
        return out

    host._generate_single_turn = timed_turn
    prompt_ids = [list(p) for p in task.prompts for _ in range(episodes // len(task.prompts))]
    completions_out, done = None, False
    with torch.no_grad(), mock.patch.object(trl_grpo, "parse_response", tool_call_message):
        try:
            t0 = time.perf_counter()
            completion_ids, logprobs = host._generate_single_turn(prompt_ids, None, {}, 1)
            completions = [[tool_call_message()] for _ in completion_ids]
            prompts = [[{"role": "user", "content": "synthetic"}] for _ in completion_ids]
            _, _, completions_out, _, _, _, _ = host._tool_call_loop(prompts, prompt_ids, completion_ids,
                                                                     completions, logprobs, None, {})
            bench.sync()
            wall, done = time.perf_counter() - t0, True
        except OutOfTime:
            wall = sum(turns)
    projected = None if done else wall + (task.turns - len(turns)) * turns[-1]
    return {"turns_s": turns, "turns_measured": len(turns), "completions": completions_out,
            "round_s": projected if projected is not None else wall, "projected": not done}


def run_cached(bench: Bench, model, task: Task, episodes: int, share_s: float) -> dict:
    """The cached rollout's episode loop, one episode after another (module docstring); past ``share_s`` (or the
    deadline) the next episode is not started and the round is projected from the measured ones."""
    trainer = types.SimpleNamespace(
        max_completion_length=task.budget, model=model, generation_config=task.config, eos_token_ids=[2],
        temperature=1.0, _tokenizer=None, max_tool_calling_iterations=task.turns - 1,
        _get_tool_suffix_ids=task.suffix)
    per_prompt = episodes // len(task.prompts)
    times, completions = [], []
    start = time.perf_counter()
    with torch.no_grad(), mock.patch.object(cached_module, "parse_response", tool_call_message):
        for i in range(episodes):
            spent = time.perf_counter() - start
            if times and (spent + times[-1] > share_s or bench.rec.left() < times[-1] + 10):
                break
            bench.sync()
            t0 = time.perf_counter()
            out = cached_module._episode(model, trainer, list(task.prompts[i // per_prompt]), None, {TOOL: env_tool})
            bench.sync()
            times.append(time.perf_counter() - t0)
            completions.append(out["completion_ids"])
    done = len(times) == episodes
    return {"episodes_s": times, "episodes_measured": len(times), "completions": completions,
            "round_s": sum(times) if done else statistics.mean(times) * episodes, "projected": not done}


def predicted_forwards(way: str, task: Task, episodes: int, chunk: int) -> tuple[float, float, float]:
    """``(forwards, tokens, rows)`` of a peer's round as the cost model counts them (module docstring)."""
    C, G, R, n = task.context, task.gen, len(task.result_ids), task.turns
    F = T = rows = 0.0
    if way == "cached":
        F, T, rows = math.ceil(C / chunk), C, C
        L = C
        for turn in range(n):
            if turn:
                F, T, rows = F + 1, T + R + 1, rows + L + R + 1
                L += R
            for _ in range(G - 1):
                L += 1
                F, T, rows = F + 1, T + 1, rows + L
            L += 1
        return F * episodes, T * episodes, rows * episodes
    L = C
    for turn in range(n):
        if turn:
            L += R
        F, T, rows = F + math.ceil(L / chunk), T + episodes * L, rows + episodes * L
        for _ in range(G - 1):
            L += 1
            F, T, rows = F + 1, T + episodes, rows + episodes * L
        L += 1
    return F, T, rows


def play(bench: Bench, model, way: str, task: Task, episodes: int, share_s: float) -> tuple[dict, list]:
    """One way's round of ``episodes`` episodes on ``task``: ``(measurements, completion ids per played episode)``;
    the measurements hold the cost model's ``forwards``, ``tokens`` and ``rows`` of the round."""
    a = bench.args
    if way == "engine":
        engine = make_engine(model, task, a.slots or episodes, tools=True)
        steps = instrument(engine, bench, timed=False)
        bench.sync()
        t0 = time.perf_counter()
        results = engine.run(specs_for(task, episodes // len(task.prompts), tools=True))
        bench.sync()
        out = {"round_s": time.perf_counter() - t0, "projected": False, "stats": dict(engine.stats),
               "ended": sorted({r["ended"] for r in results}), "forwards": len(steps),
               "tokens": sum(e["tokens"] for e in steps), "rows": sum(e["rows"] for e in steps)}
        got = [r["completion_ids"] for r in results]
    else:
        out = (run_cached if way == "cached" else run_trl)(bench, model, task, episodes, share_s)
        got = out.pop("completions") or []
        chunk = model.config.prefill_chunk_size or 1 << 62
        out["forwards"], out["tokens"], out["rows"] = predicted_forwards(way, task, episodes, chunk)
    out["completion_lengths"] = sorted({len(c) for c in got})
    return out, got


def first_unit_s(bench: Bench, way: str, task: Task, episodes: int) -> float:
    """Seconds the first indivisible piece of a way is guessed to take (the whole engine round, one cached episode,
    TRL's first turn): its prefill tokens at ``--prefill-tok-s`` plus 10 ms per decode forward, plus 10 s; the
    engine's decode steps also pay 50 ns per id of every episode's sequence (its per-episode sampling builds a
    tensor of the whole sequence from a Python list every step: ~130 ns an id measured on a loaded CPU core)."""
    a = bench.args
    host = 50e-9 * episodes * task.context if way == "engine" else 0.0
    decodes = task.turns * task.gen * (0.01 + host)
    prefill = {"engine": len(task.prompts) * task.context, "cached": task.context, "trl": episodes * task.context}
    return bench.est(10 + prefill[way] / a.prefill_tok_s + (decodes if way != "trl" else decodes / task.turns))


def run_round(bench: Bench, model) -> None:
    a, rec = bench.args, bench.rec
    episodes = a.prompts * a.generations
    generated = episodes * a.turns * a.gen_tokens
    # untimed warm-up of every way at --warm-context, two turns, the round's batch shapes (the engine's tool-turn
    # steps, generate's decode graphs at batch 1 and at every row of TRL's batch): compiles and captures go here
    t0 = time.perf_counter()
    for way in a.ways:
        try:
            count = 1 if way == "cached" else episodes
            play(bench, model, way, Task(bench, a.warm_context, 1 if way == "cached" else a.prompts, turns=2),
                 count, 1e9)
        except Exception:
            rec.error("round", f"warm-up {way}")
    rec.notes["round warm-up"] = f"{time.perf_counter() - t0:.1f} s at {label(a.warm_context)}, two turns per way"
    bench.free()
    for C in a.contexts:
        key = label(C)
        task = Task(bench, C, a.prompts)
        entry = rec.raw.setdefault("round", {}).setdefault(key, {})
        engine_tokens = None
        for way in a.ways:
            need = first_unit_s(bench, way, task, episodes)
            if rec.left() < need:
                entry[way] = f"skipped: time ({rec.left():.0f} s left, needs ~{need:.0f} s)"
                rec.put("round", key, entry)
                print(f"round {key} {way}: {entry[way]}", flush=True)
                continue
            try:
                _peak_reset(bench)
                out, got = play(bench, model, way, task, episodes, a.peer_s)
                if way == "engine":
                    engine_tokens = got
                elif engine_tokens is not None:
                    out["same_tokens_as_engine"] = sum(x == y for x, y in zip(got, engine_tokens, strict=False))
                    out["same_tokens_of"] = len(got)
                out.update(peak_gib=_peak(bench), tokens_per_s=generated / out["round_s"])
                fit = rec.notes.get("fit")
                if isinstance(fit, dict):
                    out["predicted_s"] = 1e-3 * _predict_ms(fit, out["forwards"], out["tokens"], out["rows"])
                entry[way] = out
                rec.put("round", key, entry)
            except Exception:
                rec.error("round", f"{key} {way}")  # the traceback to the log; the error line into the entry
                entry[way] = rec.raw["round"].pop(f"{key} {way}")
                rec.put("round", key, entry)
            print(f"round {key} {way}: {entry.get(way)}", flush=True)


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    add_run_args(p, PARTS, out_default="bench_out", out_help="results folder ($OUT; default bench_out)",
                 budget_default=420.0)
    p.add_argument("--contexts", type=ints, default=None, help="round contexts, prompt tokens (default 4K,32K,128K)")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma list of {', '.join(WAYS)}, run in this order")
    p.add_argument("--prompts", type=int, default=None, help="prompts per round (default 8)")
    p.add_argument("--generations", type=int, default=None, help="episodes per prompt, the GRPO group (default 8)")
    p.add_argument("--turns", type=int, default=None, help="assistant turns per episode (default 8)")
    p.add_argument("--result-tokens", type=int, default=None, help="tool-result tokens per tool turn (default 48)")
    p.add_argument("--gen-tokens", type=int, default=None, help="generated tokens per turn (default 64)")
    p.add_argument("--slots", type=int, default=0, help="engine slots in the round (0: one per episode)")
    p.add_argument("--peer-s", type=float, default=None,
                   help="seconds each peer may spend per context before its round is projected (default 45)")
    p.add_argument("--continue-from", default=None,
                   help="an earlier rollout_engine.json to extend (its measurements kept, its cost-model fit used "
                        "when this run has no 'steps' part)")
    p.add_argument("--prefill-tok-s", type=float, default=50000.0,
                   help="prefill tokens/s the deadline guesses with (default 50000: bench_long_rl's 1M re-prefill)")
    p.add_argument("--step-slots", type=ints, default=None, help="active slots of the decode steps (default 1,8,32,64)")
    p.add_argument("--step-context", type=int, default=None,
                   help="prompt tokens before the decode steps (default 32K)")
    p.add_argument("--warm-context", type=int, default=None, help="the compile run's prompt tokens (default 1K)")
    p.add_argument("--profile-steps", type=int, default=None,
                   help="decode steps profiled at the largest slot count (default 3; 0: none)")
    p.add_argument("--step-tokens", type=int, default=None,
                   help="tokens generated per slot in a steps run (default 16)")
    a = p.parse_args(argv)
    t = a.tiny
    defaults = dict(contexts=[48, 96] if t else [4 * K, 32 * K, 128 * K], prompts=2 if t else 8,
                    generations=2 if t else 8, turns=3 if t else 8, result_tokens=5 if t else 48,
                    gen_tokens=4 if t else 64, peer_s=1e9 if t else 45.0, step_slots=[1, 2, 4] if t else [1, 8, 32, 64],
                    step_context=64 if t else 32 * K, warm_context=32 if t else K, step_tokens=6 if t else 16,
                    profile_steps=1 if t else 3)
    finish_run_args(p, a, PARTS, defaults)
    a.ways = [w.strip() for w in a.ways.split(",") if w.strip()]
    if not a.ways or any(w not in WAYS for w in a.ways):
        p.error(f"--ways: choose from {', '.join(WAYS)} (got {a.ways})")
    check_at_least(p, a, ("prompts", "generations", "turns", "result_tokens", "gen_tokens", "step_context",
                          "warm_context"))
    check_at_least(p, a, ("slots", "profile_steps"), low=0)
    check_at_least(p, a, ("step_tokens",), low=2)
    if not a.contexts or min(a.contexts) < 1 or not a.step_slots or min(a.step_slots) < 1:
        p.error(f"--contexts and --step-slots must be positive lengths / counts (got {a.contexts}, {a.step_slots})")
    if a.continue_from and not os.path.isfile(a.continue_from):
        p.error(f"--continue-from {a.continue_from!r}: no such file")
    if not a.peer_s > 0 or not a.prefill_tok_s > 0:
        p.error(f"--peer-s and --prefill-tok-s must be > 0 (got {a.peer_s}, {a.prefill_tok_s})")
    if "cached" in a.ways and "engine" in a.ways and a.ways.index("cached") < a.ways.index("engine"):
        p.error("--ways: the engine runs before the peers (their tokens are compared with its)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    target = os.path.join(a.out, f"{EngineRecorder.stem}.json")
    if a.continue_from and os.path.abspath(a.continue_from) != os.path.abspath(target):
        os.makedirs(a.out, exist_ok=True)
        shutil.copyfile(a.continue_from, target)  # the recorder extends the file it finds in --out
    bench = start_run(a, EngineRecorder, {k: getattr(a, k) for k in (
        "contexts", "ways", "prompts", "generations", "turns", "result_tokens", "gen_tokens", "slots", "peer_s",
        "step_slots", "step_context", "warm_context", "step_tokens", "profile_steps")})
    calls = bench.rec.notes.setdefault("calls", [])
    calls.append({"gpu": bench.rec.stack.get("gpu"), "only": a.only, "contexts": a.contexts, "ways": a.ways})
    if len({c["gpu"] for c in calls}) > 1:
        bench.rec.notes["warning"] = "the calls in this file ran on different devices: compare within one call only"
    bench.rec.save()
    shared, fits = {}, []

    def part(fn):
        def go():
            if "model" not in shared:
                shared["model"] = build_kdamoe(bench.shape, bench.device, bench.dtype)
            fn(bench, shared["model"])
        return go

    return run_parts(bench, {"steps": part(lambda b, m: run_steps(b, m, fits)), "round": part(run_round)})


if __name__ == "__main__":
    sys.exit(main())
