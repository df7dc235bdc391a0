"""``make posttrain``: SFT then GRPO in the key-hunt environment, scored on held-out tasks (docs/post-training.md).

For each seed:

1. ``sft``: the shipped ``sft`` recipe (scripted demonstrations, a share of them by the hasty agent) from the
   pretrained model;
2. ``grpo``: the shipped ``grpo`` recipe (mode ``environment``: TRL's ``environment_factory`` with
   :class:`~kdamoe.posttraining.environments.keyhunt.KeyHuntEnvironment`, reward from its state) from the SFT
   model, its rollouts played by the batched engine (:data:`GRPO_ROLLOUT`), with a
   :class:`~kdamoe.posttraining.agent.HeldOutSuccessCallback` that scores the policy on the held-out tasks at a
   few steps (the held-out curve, in the Trainer's ``log_history`` and TensorBoard);
3. ``sft_more``, the control: the ``sft`` recipe again from the SFT model, for as long as GRPO trained (its wall
   time without the held-out evaluations; a :class:`TimeLimitCallback` stops it), so a gain of GRPO over SFT
   is not only more optimizer steps.

Every stage runs through :func:`~kdamoe.posttraining.run.run_recipe`, the path ``kdamoe-posttrain`` runs. The
pretrained, SFT, GRPO and control models are scored by :func:`~kdamoe.posttraining.agent.run_episodes` on the
same held-out tasks, which need at least two ``open_door`` calls and appear in no training set: one episode per
task, sampled at the training temperature (1.0) from a fixed seed (the success rate of the policy itself;
greedy decoding of a policy that mixes two behaviours shows only the likelier one).

The verdict (:func:`paired_lower_bound`): for every seed, the one-sided 95 % lower confidence bound of the mean
per-task difference in success, GRPO minus SFT, is at least :data:`MARGIN`, and so is GRPO minus the control.
The comparison is paired: both models play the same held-out tasks.

A seed ``s`` sets the trainers' seed and shifts both recipes' data seeds by ``s``; the held-out tasks are
drawn with one fixed seed but skip that seed's training tasks, so two seeds share most of them, not all.
Results: tables on stdout, ``<output_dir>/results.json``, ``reward_curve.png`` (GRPO's mean training reward per
logged step) and ``heldout_curve.png`` (held-out success during GRPO, on the first :data:`CURVE_TASKS` held-out
tasks, the control's as a dashed line) next to it.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path

import torch
from matplotlib.figure import Figure
from transformers import AutoTokenizer, TrainerCallback

from ..model import KDAMoEForCausalLM
from .agent import HeldOutSuccessCallback, run_episodes, summarize_episodes
from .config import load_posttrain_config
from .environments import make_family_tasks
from .recipes.common import training_tasks
from .run import run_recipe

HELD_OUT_SEED = 20261201
TURN_TOKENS = 40  # tokens per assistant turn: a tool call is ~25 with the 512-token vocabulary
STAGES = ("pretrained", "sft", "grpo", "sft_more")
MARGIN = 0.05  # the verdict's least lower bound of the success difference (5 points)
Z_95_ONE_SIDED = 1.6448536269514722  # the standard normal's 95 % quantile
CURVE_POINTS = 3  # held-out evaluations during GRPO (plus the SFT model at step 0 and the final model)
CURVE_TASKS = 100  # the curve's evaluations play the first 100 held-out tasks: half the time, +-5 points
# The GRPO stage's rollouts: the batched engine (kdamoe.posttraining.engine), which plays a step's 16 episodes
# together and each group's prompt once; it samples each episode from its own seed, so its trajectories differ from
# TRL's loop (one global random stream) only in the draws. Put before the --grpo-set overrides, which may replace it.
GRPO_ROLLOUT = ("grpo.rollout=batched",)


def _stage_config(name: str, model: str, output_dir: Path, seed: int, overrides: list[str]):
    cfg = load_posttrain_config(name, [f"model={model}", f"output_dir={output_dir}", f"seed={seed}", *overrides])
    cfg.data.seed += seed
    return cfg


def held_out_tasks(configs: list, n: int, min_calls: int = 2, max_calls: int = 3) -> list:
    """``n`` key-hunt tasks needing ``min_calls``–``max_calls`` doors, none of them in the training sets of
    ``configs`` (their ``data`` sections), drawn with :data:`HELD_OUT_SEED`."""
    seen = set()
    for cfg in configs:
        seen.update(training_tasks(cfg))
    return make_family_tasks("keyhunt", n, HELD_OUT_SEED, min_calls=min_calls, max_calls=max_calls, exclude=seen)


def paired_lower_bound(better: list, worse: list, z: float = Z_95_ONE_SIDED) -> dict:
    """One-sided lower confidence bound of the mean paired difference ``better[i] - worse[i]``.

    The normal approximation (written out here; scipy is not a dependency): with the per-task differences
    ``d_i`` (each -1, 0 or 1 for success indicators), ``lower = mean(d) - z * sd(d) / sqrt(n)``, ``sd`` with
    ``n - 1`` in the denominator; ``z`` = 1.645 gives a one-sided 95 % bound. Pairing removes the variance the
    two models share through the tasks (a hard task fails for both), so the bound is tighter than one from two
    independent proportions. With ``n`` = 200 the mean of bounded differences is close to normal.

    Args:
        better, worse: per-task scores (floats, e.g. 0/1 successes) of the two models, same length, same task order.
        z: the normal quantile of the bound.
    Returns:
        ``{"n", "difference" (the mean of d), "std_error", "lower" (the bound)}``, fractions (not points).
    Raises:
        ValueError: the lists are empty or differ in length.
    """
    if len(better) != len(worse) or not better:
        raise ValueError(f"paired_lower_bound needs two non-empty lists of one length, got {len(better)} and "
                         f"{len(worse)}")
    d = [float(a) - float(b) for a, b in zip(better, worse, strict=True)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    se = math.sqrt(var / n)
    return {"n": n, "difference": mean, "std_error": se, "lower": mean - z * se}


class TimeLimitCallback(TrainerCallback):
    """Stops training at the first optimizer step that ends ``seconds`` or more after training began.

    Raises:
        ValueError: ``seconds`` is not positive.
    """

    def __init__(self, seconds: float):
        if not seconds > 0:
            raise ValueError(f"seconds must be > 0, got {seconds}")
        self.seconds = seconds
        self._start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if time.perf_counter() - self._start >= self.seconds:
            control.should_training_stop = True
        return control


def _score(model, tokenizer, tasks, seed: int, batch_size: int) -> dict:
    start = time.perf_counter()
    episodes = run_episodes(model, tokenizer, tasks, batch_size=batch_size, max_new_tokens=TURN_TOKENS,
                            do_sample=True, temperature=1.0, seed=seed)
    successes = [int(e["reward"] == 1.0) for e in episodes if e["task"].calls_needed >= 2]
    ended = dict(Counter(e["ended"] for e in episodes))
    return {**summarize_episodes(episodes), "successes": successes, "ended": ended,
            "eval_seconds": round(time.perf_counter() - start, 1)}


def _head(successes: list) -> float:
    """Success on the first :data:`CURVE_TASKS` held-out tasks (the tasks the held-out curve plays)."""
    head = successes[:CURVE_TASKS]
    return sum(head) / len(head)


def _curve_steps(max_steps: int, points: int) -> list[int]:
    """``points`` optimizer steps spread evenly inside ``(0, max_steps)`` (the ends are scored anyway)."""
    return sorted({round(max_steps * (i + 1) / (points + 1)) for i in range(points)} - {0, max_steps})


def run_seed(base: str, output_dir: Path, seed: int, n_held_out: int, sft_overrides=(), grpo_overrides=(),
             batch_size: int = 64, control: bool = True) -> dict:
    """One seed of the demo (module docstring); returns its rows, comparisons, curves and wall times (seconds).

    ``control=False`` skips the ``sft_more`` stage (then the verdict compares GRPO with SFT only).
    """
    folder = output_dir / f"seed{seed}"
    sft_cfg = _stage_config("sft", base, folder / "sft", seed, list(sft_overrides))
    grpo_cfg = _stage_config("grpo", str(folder / "sft" / "final"), folder / "grpo", seed,
                             ["trainer.report_to=tensorboard", *GRPO_ROLLOUT, *grpo_overrides])
    tasks = held_out_tasks([sft_cfg, grpo_cfg], n_held_out)
    rows, seconds = {}, {}

    def score(name, path_or_model, tokenizer):
        rows[name] = _score(path_or_model, tokenizer, tasks, seed, batch_size)
        print(_line(name, rows[name]), flush=True)

    tokenizer = AutoTokenizer.from_pretrained(base)
    score("pretrained", KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32), tokenizer)

    def train(name, cfg, callbacks=()):
        start = time.perf_counter()
        # Each run of the demo starts its stages over: earlier output of the same stage (only what a post-training
        # run writes) is replaced, never resumed under other settings.
        result = run_recipe(cfg, resume=False, overwrite=True, callbacks=callbacks)
        seconds[f"{name}_train"] = round(time.perf_counter() - start, 1)
        final = result["final"]
        score(name, KDAMoEForCausalLM.from_pretrained(final, dtype=torch.float32), AutoTokenizer.from_pretrained(final))
        rows[name]["final"] = final
        rows[name]["steps"] = result["global_step"]
        return result

    train("sft", sft_cfg)
    curve_steps = _curve_steps(int(grpo_cfg.trainer["max_steps"]), CURVE_POINTS)
    curve_cb = HeldOutSuccessCallback(tokenizer, tasks[:CURVE_TASKS], curve_steps, seed=seed, batch_size=batch_size,
                                      max_new_tokens=TURN_TOKENS)
    grpo = train("grpo", grpo_cfg, [curve_cb])
    seconds["grpo_heldout_evals"] = round(curve_cb.seconds, 1)
    grpo_seconds = seconds["grpo_train"] - curve_cb.seconds  # GRPO's own wall time, load and save included

    # the ends from the stages' own episodes on the same first tasks (every held-out task counts: all need >= 2)
    curve = [(0, _head(rows["sft"]["successes"]))] + [(s, m["success"]) for s, m in curve_cb.points]
    curve.append((grpo["global_step"], _head(rows["grpo"]["successes"])))

    compare = {"grpo_vs_sft": paired_lower_bound(rows["grpo"]["successes"], rows["sft"]["successes"])}
    if control:
        # as many SFT steps as fit GRPO's wall time at the SFT stage's pace, stopped at that time in any case
        pace = seconds["sft_train"] / max(rows["sft"]["steps"], 1)
        steps = max(1, round(grpo_seconds / pace))
        more_cfg = _stage_config("sft", rows["sft"]["final"], folder / "sft_more", seed,
                                 [*sft_overrides, f"trainer.max_steps={steps}"])
        train("sft_more", more_cfg, [TimeLimitCallback(grpo_seconds)])
        compare["grpo_vs_sft_more"] = paired_lower_bound(rows["grpo"]["successes"], rows["sft_more"]["successes"])
    return {"seed": seed, "held_out": len(tasks), "rows": rows, "compare": compare,
            "verdict": all(c["lower"] >= MARGIN for c in compare.values()),
            "heldout_curve": curve, "reward_curve": grpo["reward_curve"], "seconds": seconds}


def _line(name: str, row: dict) -> str:
    return (f"  {name:<10} success {row['success']:6.1%}  mean reward {row['mean_reward']:.3f}  "
            f"≥2 tool calls {row['multi_call_share']:6.1%}  ({row['eval_seconds']:.0f} s)")


def _plot(curves: dict, path: Path, ylabel: str, levels: dict | None = None) -> None:
    """One line per entry of ``curves`` (``label -> [(step, value)]``); ``levels`` (``label -> value``) as dashed
    horizontal lines."""
    fig = Figure(figsize=(5, 3))  # no pyplot: its global backend and figure list stay untouched
    ax = fig.subplots()
    for label, points in curves.items():
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o", label=label)
    for label, value in (levels or {}).items():
        ax.axhline(value, linestyle="--", linewidth=1, color="gray")
        ax.annotate(label, (0, value), textcoords="offset points", xytext=(2, 3), fontsize=7, color="gray")
    ax.set_xlabel("GRPO optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def print_tables(summary: dict) -> None:
    """The demo's three tables: models, paired comparisons with their bounds, the held-out curve."""
    results = summary["results"]
    print(f"\nheld-out key hunts needing >= 2 tool calls ({summary['held_out']} tasks; one episode each, sampled at "
          "temperature 1):")
    print(f"{'seed':>4}  {'model':<10} {'steps':>5} {'success':>8} {'>=2 calls':>9} {'train s':>8}")
    for r in results:
        for name in STAGES:
            if name in r["rows"]:
                row = r["rows"][name]
                print(f"{r['seed']:>4}  {name:<10} {row.get('steps', 0):>5} {row['success']:8.1%} "
                      f"{row['multi_call_share']:9.1%} {r['seconds'].get(f'{name}_train', 0):8.0f}")
    print(f"\npaired success difference on the same tasks (points), one-sided 95% lower bound; verdict: "
          f"bound >= {MARGIN:.0%} on every comparison")
    print(f"{'seed':>4}  {'comparison':<18} {'diff':>6} {'lower':>6} {'holds':>5}")
    for r in results:
        for name, c in r["compare"].items():
            print(f"{r['seed']:>4}  {name:<18} {100 * c['difference']:6.1f} {100 * c['lower']:6.1f} "
                  f"{c['lower'] >= MARGIN!s:>5}")
    print(f"\nheld-out success during GRPO, first {CURVE_TASKS} held-out tasks (step 0: the SFT model; last: the final "
          "GRPO model)")
    for r in results:
        print(f"  seed {r['seed']}: " + "  ".join(f"{s}: {v:.1%}" for s, v in r["heldout_curve"]))


def run_demo(base: str = "outputs/cpu_default/final", output_dir: str = "outputs/posttrain", seeds=(0,),
             n_held_out: int = 200, sft_overrides=(), grpo_overrides=(), control: bool = True) -> dict:
    """The whole demo; prints the tables, writes ``output_dir/results.json`` and the two curve images.

    Returns:
        The summary written to ``results.json`` (rewritten after every seed, ``"complete"`` false until the last);
        ``"verdict"`` is true when the paired bound held on every seed.
    Raises:
        ValueError: ``base`` is not a model folder (run ``make train`` first), no seeds, ``n_held_out < 1``.
    """
    if not (Path(base) / "config.json").is_file():
        raise ValueError(f"base model {base}: no config.json there; run `make train` first (it writes "
                         "outputs/cpu_default/final) or pass --base")
    if not seeds:
        raise ValueError("seeds: give at least one")
    if n_held_out < 1:
        raise ValueError(f"n_held_out must be >= 1, got {n_held_out}")
    out = Path(output_dir)
    start = time.perf_counter()
    results = []
    for seed in seeds:
        print(f"seed {seed}", flush=True)
        seed_start = time.perf_counter()
        results.append(run_seed(base, out, seed, n_held_out, sft_overrides, grpo_overrides, control=control))
        results[-1]["seconds"]["seed_total"] = round(time.perf_counter() - seed_start, 1)
        # after every seed, so a long multi-seed run that is stopped keeps the seeds it finished
        summary = {"base": base, "seeds": list(seeds), "held_out": n_held_out, "margin": MARGIN,
                   "results": results, "complete": len(results) == len(seeds),
                   "verdict": all(r["verdict"] for r in results), "wall_seconds": round(time.perf_counter() - start, 1)}
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_tables(summary)
    print(f"verdict (GRPO beats SFT{' and the SFT control' if control else ''} by a paired 95% lower bound >= "
          f"{MARGIN:.0%} on every seed): {summary['verdict']}; {summary['wall_seconds']:.0f} s in all")
    _plot({f"seed {r['seed']}": r["reward_curve"] for r in results}, out / "reward_curve.png", "mean training reward")
    _plot({f"seed {r['seed']}": r["heldout_curve"] for r in results}, out / "heldout_curve.png", "held-out success",
          {f"SFT control, seed {r['seed']}": _head(r["rows"]["sft_more"]["successes"])
           for r in results if "sft_more" in r["rows"]})
    return summary
