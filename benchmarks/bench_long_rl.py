"""Million-token agentic RL on one GPU: rollout turns on a kept cache against TRL's re-prefilling loop, and one
memory-bounded GRPO optimizer step over >= 1M tokens of trajectories (issue #16).

The model is the long-context benchmark's shape (``harness.Shape``: 1.68B total / 0.36B active
parameters, vocab 32000, 16 layers with MLA every 4th, ``max_position_embeddings`` 1M), bf16, random weights from a
fixed seed, random token ids. One device call (``benchmarks/device_long_rl.sh``) runs the parts below; each is
caught on its own and ``long_rl.json`` is rewritten after every measurement (``harness.Recorder``), so
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
    turn there, and how many of the generated tokens agree before the first difference. Untimed turns at the first
    context warm up first (compilation, autotuning, the decode graph's capture): one re-prefill and two cached
    turns, since the second cached turn's new-token count falls into another Triton specialisation.
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
import tempfile
import time
from itertools import pairwise

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import (  # noqa: E402  (the benchmarks folder is not a package)
    GIB,
    Bench,
    K,
    M,
    Recorder,
    add_run_args,
    build_kdamoe,
    check_at_least,
    finish_run_args,
    ints,
    label,
    run_parts,
    start_run,
)

from kdamoe.posttraining.long_update import LongContextGRPOTrainer  # noqa: E402  (harness puts the repo on sys.path)

PARTS = ("turns", "trajectory", "update")


class RLRecorder(Recorder):
    """``harness.Recorder`` writing ``long_rl.{json,md}`` with this benchmark's tables."""

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
                 "context | same tokens | generated tokens equal before the first difference |",
                 "|---|---|---|---|---|---|---|"]
        rows = {r["name"]: r for r in doc["rows"]}
        for key, e in doc["raw"].get("turns", {}).items():
            if isinstance(e, dict) and "cached_s" in e:
                r = rows[f"turn after {key}"]
                lines.append(f"| {key} | {_f(r['cached_s'])} | {_f(r['trl_s'])} | {_f(r['cached_over_trl'])} | "
                             f"{_f(r['cached_over_cached_at_first'])} | {e.get('same_tokens')} | "
                             f"{e.get('matching_tokens')} of {s.get('gen_tokens')} |")
            else:
                lines.append(f"| {key} | {e} | | | | | |")
        traj = doc["raw"].get("trajectory", {})
        if traj:
            lines += ["", "## One trajectory, cumulative seconds", "", "| turn | context after | cached | TRL loop |",
                      "|---|---|---|---|"]
            # the TRL loop's column is padded with None: it may have stopped (time) before the cached one
            for i, (ctx, c, t) in enumerate(zip(traj.get("context", []), traj.get("cached_cum_s", []),
                                                traj.get("trl_cum_s", []) + [None] * 99, strict=False)):
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
                elif key != "trl defaults longest":
                    lines.append(f"| {key} | | | | {e} |")
            if "trl defaults longest" in upd:
                lines += ["", f"Longest trajectory TRL's defaults handled: {upd['trl defaults longest']} tokens "
                          "per row."]
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


def _matching_tokens(seq: torch.Tensor, ref: torch.Tensor, start: int) -> int:
    """How many generated tokens (``seq[0, start:]``) equal ``ref``'s before the first difference."""
    diff = (seq[0, start:] != ref[0, start:]).nonzero()
    return int(diff[0, 0]) if len(diff) else seq.shape[1] - start


def run_turns(bench: Bench, model) -> None:
    a, rec = bench.args, bench.rec
    # untimed warm-up at the first context, both ways: the first generate compiles and autotunes the kernels and
    # captures the decode CUDA graph, which would otherwise be timed as the first context's turn
    warm_ids, warm_cache = extend(bench, model, None, None, a.contexts[0])
    warm_ids = torch.cat([warm_ids, bench.ids(1, a.result_tokens)], 1)
    generate_turn(bench, model, warm_ids, None, a.gen_tokens)
    # two cached turns: the second prefills result + 1 tokens (the last generated token is not in the cache yet),
    # a count whose divisibility by 16 differs, and Triton compiles integer arguments specialised on it
    _, seq, warm_cache = generate_turn(bench, model, warm_ids, warm_cache, a.gen_tokens)
    generate_turn(bench, model, torch.cat([seq, bench.ids(1, a.result_tokens)], 1), warm_cache, a.gen_tokens)
    del warm_ids, warm_cache, seq
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
                    matching = _matching_tokens(seq, trl_seq, first.shape[1])
                times.append(s)
                turn_ids = torch.cat([seq, bench.ids(1, a.result_tokens)], 1)
            ids = seq  # the context grows by the turns played; the next context extends from here
            rec.put("turns", key, {"context": T, "cached_s": statistics.median(times), "cached_turns_s": times,
                                   "trl_s": trl_s, "same_tokens": same,
                                   "matching_tokens": matching,
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
def _tokenizer(vocab_size: int):
    """A word-level tokenizer over the model's ids (``t0`` ... ``t{V-1}``; pad 0, bos 1, eos 2): TRL's trainers need
    a processing class, the benchmark feeds token ids directly."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2")


def _trainer(bench: Bench, cls, rows_per_micro_batch: int, group: int, out_dir: str):
    """A fresh model of the benchmark's shape in a ``cls`` (``GRPOTrainer`` or ``LongContextGRPOTrainer``) with
    TRL's defaults except: the micro-batch, ``num_generations`` = the group, no KL (``beta`` 0: no reference model in
    memory; its pass is the no-grad pass timed apart), bf16 on CUDA, nothing saved or reported."""
    model = build_kdamoe(bench.shape, bench.device, bench.dtype).train()
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=rows_per_micro_batch,
                      gradient_accumulation_steps=group // rows_per_micro_batch, num_generations=group, beta=0.0,
                      bf16=bench.cuda, use_cpu=not bench.cuda, report_to=[], save_strategy="no")
    trainer = cls(model=model, args=args, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                  train_dataset=Dataset.from_dict({"prompt": ["t5 t6"] * group}),
                  processing_class=_tokenizer(bench.shape.vocab_size))
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # Trainer.train() sets it
    if args.activation_checkpointing:  # TRL's default; Trainer.train() turns it on
        trainer.model.activation_checkpointing_enable(args.activation_checkpointing_kwargs)
    return trainer


def _group(bench: Bench, rows: int, T: int, prompt: int, ragged: bool) -> dict:
    """GRPO inputs of ``rows`` trajectories of ``T`` tokens: one ``prompt``-token prompt shared by the group, the rest
    a multi-turn completion whose tool-result spans (every 8th span of 1024 tokens, the tool turns) have tool_mask 0.
    ``ragged``: the completions get unequal lengths (row r is ``r · T/16`` shorter, right-padded), as a group's rollouts
    have. Random ids and advantages from the benchmark's seed."""
    C = T - prompt
    prompt_ids = bench.ids(1, prompt).expand(rows, prompt).contiguous()
    completion_ids = bench.ids(rows, C)
    completion_mask = torch.ones(rows, C, dtype=torch.long, device=bench.device)
    if ragged:
        for r in range(rows):
            completion_mask[r, C - r * (T // 16):] = 0
    span = 1024 if not bench.args.tiny else 8
    tool_mask = torch.ones_like(completion_mask)
    for start in range(span, C, 8 * span):
        tool_mask[:, start: start + span] = 0
    adv = torch.randn(rows, generator=bench.gen).to(bench.device)
    return dict(prompt_ids=prompt_ids, prompt_mask=torch.ones(rows, prompt, dtype=torch.long, device=bench.device),
                completion_ids=completion_ids, completion_mask=completion_mask, tool_mask=tool_mask,
                advantages=adv - adv.mean(), num_items_in_batch=(completion_mask * tool_mask).sum())


def grpo_step(bench: Bench, trainer, inputs: dict, rows_per_micro_batch: int) -> dict:
    """One GRPO optimizer step: TRL's loss (``compute_loss``) and backward per micro-batch, then AdamW. Returns wall
    seconds (synchronized), peak GiB (``max_memory_allocated`` after a reset; weights, gradients and AdamW state
    included) and the summed loss."""
    model = trainer.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows = inputs["prompt_ids"].shape[0]
    bench.free()
    if bench.cuda:
        torch.cuda.reset_peak_memory_stats()
    bench.sync()
    t0 = time.perf_counter()
    total = 0.0
    for r0 in range(0, rows, rows_per_micro_batch):
        micro = {k: v[r0: r0 + rows_per_micro_batch] if v.dim() else v for k, v in inputs.items()}
        loss = trainer.compute_loss(model, micro)
        loss.backward()
        total += float(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    bench.sync()
    return {"s": time.perf_counter() - t0, "peak_gib": torch.cuda.max_memory_allocated() / GIB if bench.cuda else None,
            "loss": total, "tokens": int(inputs["prompt_ids"].numel() + inputs["completion_mask"].sum())}


@torch.no_grad()
def old_policy_pass(bench: Bench, trainer, inputs: dict) -> dict:
    """The no-grad per-token pass over the group (what the reference model's and the old policy's log-probs cost:
    our chunked prefill under TRL's fused head), one row at a time."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    bench.free()
    if bench.cuda:
        torch.cuda.reset_peak_memory_stats()
    bench.sync()
    t0 = time.perf_counter()
    trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, inputs["completion_ids"].shape[1])
    bench.sync()
    return {"s": time.perf_counter() - t0, "peak_gib": torch.cuda.max_memory_allocated() / GIB if bench.cuda else None,
            "tokens": int(mask.sum())}


def _oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run_update(bench: Bench) -> None:
    """One GRPO optimizer step over a group of trajectories totalling >= 1M tokens, and TRL's defaults until OOM.

    * ``ours``: ``LongContextGRPOTrainer`` (``grpo.long_context: true``), ``--update-rows`` rows of ``--update-t``
      tokens (default 4 x 290K: row r is r·T/16 shorter, so the group holds 3.625·T = 1,076,480 >= 2^20 tokens), one row
      per micro-batch (``per_device_train_batch_size`` 1, gradient accumulation
      over the group), activation checkpointing per layer, TRL's fused LM head, rows of unequal length; plus the
      no-grad pass over the same group (reference / old-policy log-probs).
    * ``trl defaults``: ``GRPOTrainer`` as TRL configures it (activation checkpointing on, one micro-batch holding the
      group, padded to its longest row), the same group shape at ``--trl-t`` tokens per row (64K ... 1M) until a
      length runs out of memory; the longest that ran is recorded.
    """
    a, rec = bench.args, bench.rec  # each case builds its own model: TRL patches the one it is given
    rows, T = a.update_rows, a.update_t
    with tempfile.TemporaryDirectory() as tmp:
        key = f"ours {rows} x {label(T)}"
        if rec.need("update", key, bench.est(60 + 60 * rows * T / M)):
            trainer = None
            try:
                trainer = _trainer(bench, LongContextGRPOTrainer, 1, rows, tmp)
                inputs = _group(bench, rows, T, a.update_prompt, ragged=True)
                rec.put("update", key, {**grpo_step(bench, trainer, inputs, 1),
                                        "note": "LongContextGRPOTrainer, 1 row per micro-batch"})
                rec.put("update", f"ours no-grad pass {rows} x {label(T)}",
                        {**old_policy_pass(bench, trainer, inputs), "note": "reference / old-policy log-probs"})
            except Exception as exc:
                if _oom(exc):
                    rec.put("update", key, f"out of memory: {str(exc).splitlines()[0][:160]}")
                else:
                    rec.error("update", key)
            del trainer
            bench.free()
        longest = None
        for t in a.trl_t:
            key = f"trl defaults {rows} x {label(t)}"
            if not rec.need("update", key, bench.est(60 + 60 * rows * t / M)):
                break
            trainer = None
            try:
                trainer = _trainer(bench, GRPOTrainer, rows, rows, tmp)
                inputs = _group(bench, rows, t, a.update_prompt, ragged=True)
                rec.put("update", key, {**grpo_step(bench, trainer, inputs, rows),
                                        "note": "GRPOTrainer, the group in one padded micro-batch"})
                longest = t
            except Exception as exc:
                if not _oom(exc):
                    rec.error("update", key)
                    break
                rec.put("update", key, f"out of memory: {str(exc).splitlines()[0][:160]}")
                break
            finally:
                del trainer
                bench.free()
        rec.put("update", "trl defaults longest", None if longest is None else label(longest))


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    add_run_args(p, PARTS, out_default="bench_out", out_help="results folder ($OUT; default bench_out)",
                 budget_default=480.0)
    p.add_argument("--contexts", type=ints, default=None, help="turn contexts (default 4K,16K,64K,256K,1M)")
    p.add_argument("--result-tokens", type=int, default=None, help="tool-result tokens per turn (default 48)")
    p.add_argument("--gen-tokens", type=int, default=None, help="generated tokens per turn (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="cached turns per context")
    p.add_argument("--traj-prompt", type=int, default=None, help="trajectory prompt tokens (default 4K)")
    p.add_argument("--traj-turns", type=int, default=None, help="trajectory turns (default 8)")
    p.add_argument("--traj-result", type=int, default=None, help="trajectory tool-result tokens per turn (default 32K)")
    p.add_argument("--update-rows", type=int, default=None, help="trajectories in the GRPO group (default 4)")
    p.add_argument("--update-t", type=int, default=None,
                   help="tokens per trajectory, ours (default 290K: a ragged group of 4 then holds >= 1M tokens)")
    p.add_argument("--update-prompt", type=int, default=None, help="prompt tokens per trajectory (default 4K)")
    p.add_argument("--trl-t", type=ints, default=None, help="TRL defaults' lengths per row (default 64K,...,1M)")
    a = p.parse_args(argv)
    t = a.tiny
    defaults = dict(contexts=[64, 256, 1024] if t else [4 * K, 16 * K, 64 * K, 256 * K, M],
                    result_tokens=5 if t else 48, gen_tokens=4 if t else 64, traj_prompt=32 if t else 4 * K,
                    traj_turns=3 if t else 8, traj_result=40 if t else 32 * K, update_rows=2 if t else 4,
                    update_t=96 if t else 290 * K, update_prompt=16 if t else 4 * K,
                    trl_t=[64, 128] if t else [64 * K, 128 * K, 256 * K, 512 * K, M])
    finish_run_args(p, a, PARTS, defaults)
    check_at_least(p, a, ("result_tokens", "gen_tokens", "repeats", "traj_turns", "traj_result", "traj_prompt",
                          "update_rows", "update_prompt"))
    # each context extends the one before, which has grown by the turns played there
    played = a.repeats * (a.result_tokens + a.gen_tokens)
    if min(a.contexts) < 2 or any(b < c + played for c, b in pairwise(a.contexts)):
        p.error(f"--contexts must be lengths >= 2, each at least --repeats x (--result-tokens + --gen-tokens) = "
                f"{played} above the one before (the turns played there), got {a.contexts}")
    # row r of a group of t-token rows is r·t/16 shorter (``_group``): its completion must keep a token at every t
    if any(t <= a.update_prompt + (a.update_rows - 1) * (t // 16) for t in [a.update_t] + a.trl_t):
        p.error("--update-t / --trl-t must leave every row's completion a token after --update-prompt")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    bench = start_run(a, RLRecorder, {"contexts": a.contexts, "result_tokens": a.result_tokens,
                                      "gen_tokens": a.gen_tokens, "repeats": a.repeats})
    bench.rec.save()
    rollout_parts = {"turns": run_turns, "trajectory": run_trajectory}
    shared = {}  # the rollout parts share one eval-mode model; the update builds its own per case

    def rollout_part(part):
        if "model" not in shared:
            shared["model"] = build_kdamoe(bench.shape, bench.device, bench.dtype)
        rollout_parts[part](bench, shared["model"])

    def update_part():
        shared.clear()  # the update builds its own model per case: the rollout parts' model goes first
        bench.free()
        run_update(bench)

    return run_parts(bench, {"turns": lambda: rollout_part("turns"), "trajectory": lambda: rollout_part("trajectory"),
                             "update": update_part})


if __name__ == "__main__":
    sys.exit(main())
