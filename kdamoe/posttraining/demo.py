"""``make posttrain``: SFT then GRPO in the key-hunt environment, scored on held-out tasks (docs/post-training.md).

For each seed: the shipped ``sft`` recipe (scripted demonstrations, a share of them by the hasty agent) from
the pretrained model, then the shipped ``grpo`` recipe (mode ``environment``: TRL's ``environment_factory`` with
:class:`~kdamoe.posttraining.keyhunt.KeyHuntEnvironment`, reward from its state) from the SFT model — the
same :func:`~kdamoe.posttraining.run.run_recipe` path ``kdamoe-posttrain`` runs. The pretrained, SFT and
GRPO models are then scored by :func:`~kdamoe.posttraining.agent.run_episodes` on held-out tasks that need
at least two ``open_door`` calls and appear in neither training set: episodes sampled at the training
temperature (1.0) from a fixed seed: the success rate of the policy itself (greedy decoding of a policy
that mixes two behaviours shows only the likelier one).

A seed ``s`` sets the trainers' seed and shifts both recipes' data seeds by ``s``; the held-out tasks are
drawn with one fixed seed but skip that seed's training tasks, so two seeds share most of them, not all
(measured: 165 of 200 between seeds 0 and 1). Results: a table on stdout and ``<output_dir>/results.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..model import KDAMoEForCausalLM
from .agent import run_episodes, summarize_episodes
from .config import load_posttrain_config
from .data import make_family_tasks
from .recipes.common import training_tasks
from .run import run_recipe

HELD_OUT_SEED = 20261201
TURN_TOKENS = 40  # tokens per assistant turn: a tool call is ~25 with the 512-token vocabulary
STAGES = ("pretrained", "sft", "grpo")


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


def _score(model, tokenizer, tasks, seed: int, batch_size: int) -> dict:
    start = time.perf_counter()
    episodes = run_episodes(model, tokenizer, tasks, batch_size=batch_size, max_new_tokens=TURN_TOKENS,
                            do_sample=True, temperature=1.0, seed=seed)
    return {**summarize_episodes(episodes), "eval_seconds": round(time.perf_counter() - start, 1)}


def run_seed(base: str, output_dir: Path, seed: int, n_held_out: int, sft_overrides=(), grpo_overrides=(),
             batch_size: int = 64) -> dict:
    """One seed of the demo (module docstring); returns its rows and wall times (seconds)."""
    folder = output_dir / f"seed{seed}"
    sft_cfg = _stage_config("sft", base, folder / "sft", seed, list(sft_overrides))
    grpo_cfg = _stage_config("grpo", str(folder / "sft" / "final"), folder / "grpo", seed, list(grpo_overrides))
    tasks = held_out_tasks([sft_cfg, grpo_cfg], n_held_out)
    rows, seconds = {}, {}

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32)
    rows["pretrained"] = _score(model, tokenizer, tasks, seed, batch_size)
    print(_line("pretrained", rows["pretrained"]), flush=True)
    for name, cfg in (("sft", sft_cfg), ("grpo", grpo_cfg)):
        start = time.perf_counter()
        result = run_recipe(cfg)
        seconds[f"{name}_train"] = round(time.perf_counter() - start, 1)
        trained = KDAMoEForCausalLM.from_pretrained(result["final"], dtype=torch.float32)
        rows[name] = _score(trained, AutoTokenizer.from_pretrained(result["final"]), tasks, seed, batch_size)
        rows[name]["final"] = result["final"]
        print(_line(name, rows[name]), flush=True)
    return {"seed": seed, "held_out": len(tasks), "rows": rows, "seconds": seconds}


def _line(name: str, row: dict) -> str:
    return (f"  {name:<10} success {row['success']:6.1%}  mean reward {row['mean_reward']:.3f}  "
            f"≥2 tool calls {row['multi_call_share']:6.1%}  ({row['eval_seconds']:.0f} s)")


def run_demo(base: str = "outputs/cpu_default/final", output_dir: str = "outputs/posttrain", seeds=(0,),
             n_held_out: int = 200, sft_overrides=(), grpo_overrides=()) -> dict:
    """The whole demo; prints the table and writes ``output_dir/results.json``.

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
        results.append(run_seed(base, out, seed, n_held_out, sft_overrides, grpo_overrides))
    summary = {"base": base, "seeds": list(seeds), "held_out": n_held_out, "results": results,
               "grpo_beats_sft_every_seed": all(r["rows"]["grpo"]["success"] > r["rows"]["sft"]["success"]
                                                for r in results),
               "wall_seconds": round(time.perf_counter() - start, 1)}
    print(f"\nheld-out key hunts needing >= 2 tool calls ({n_held_out} tasks; episodes sampled at temperature 1):")
    print(f"{'seed':>4}  {'model':<10} {'success':>8} {'reward':>7} {'>=2 calls':>9}")
    for r in results:
        for name in STAGES:
            row = r["rows"][name]
            print(f"{r['seed']:>4}  {name:<10} {row['success']:8.1%} {row['mean_reward']:7.3f} "
                  f"{row['multi_call_share']:9.1%}")
    print(f"GRPO beats SFT on held-out success on every seed: {summary['grpo_beats_sft_every_seed']}; "
          f"{summary['wall_seconds']:.0f} s in all")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
