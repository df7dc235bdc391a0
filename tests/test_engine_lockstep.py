"""The rollout engine on two sharded CPU processes (gloo): every rank plays its own episodes, the ranks' forwards stay
in step (``RolloutEngine(lockstep_group=...)``, docs/post-training.md, "Several processes"), and multi-turn GRPO runs
under FSDP2 with ``grpo.rollout: batched``.

One ``torchrun --nproc_per_node 2`` run of this file (``__main__``: ``python tests/test_engine_lockstep.py BASE OUT``,
with a timeout on ``init_process_group`` and a deadline on the run, in the ``distributed`` xdist group) does, on
every rank:

1. **Engine, deliberately uneven tools.** The tiny base loaded by transformers' engine, FSDP2 over both ranks
   (``DistributedConfig(fsdp_size=2)``) and then FSDP2 with expert parallelism (``ep_size=2``: every MoE layer's
   routed tokens travel by all-to-all). Rank 0 plays two episodes of three tool rounds each, its tool sleeping
   ``SLOW_TOOL_S`` per call; rank 1 plays one GRPO group of two (one prompt: a fork) with one quick tool round; every
   episode ends with a short answer. Without lockstep the ranks would issue different numbers of sharded forwards
   (on gloo an abort on a collective mismatch, on NCCL a hang). The test process then plays each rank's episodes on
   the unsharded model in one process, and the trajectories must be equal (tokens, masks, parsed turns, tool
   counts; log-probs within ``LOGPROB_ATOL``), and both ranks must have run the same number of forwards.
2. **A GRPO step under FSDP2** (accelerate's, ``trainer.fsdp: true``) in mode ``environment`` with ``grpo.rollout:
   batched``, through :func:`kdamoe.posttraining.run.run_recipe`: a scripted agent (:class:`UnevenAgent`) makes
   rank 0's episodes call the arithmetic environment's tools three times (as far as the completion budget lets
   them) and rank 1's once. What is checked is that the step completes under FSDP2 with uneven tool rounds and
   the same number of forwards on both ranks; its loss is 0 here (greedy: a group's two completions are equal, so
   every advantage is 0), so the update itself is not compared with anything here.

A tiny random model never writes a tool call, so a logits processor forces the planned tool-call turns (the same
processor on both sides). Greedy decoding throughout.

Why log-probs are not compared bitwise: under FSDP2 a rank multiplies the same gathered weights as the one process,
but under expert parallelism an expert multiplies the rows of both ranks in one product; float32 rounding may differ
(``LOGPROB_ATOL = 1e-5``; a wrong state or a skipped token changes a log-prob by O(0.1) or changes tokens).
"""

import datetime
import functools
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoTokenizer, LogitsProcessorList

import kdamoe.posttraining.rollout as rollout_module
from kdamoe import KDAMoEForCausalLM
from kdamoe.common.parallel import load_sharded
from kdamoe.posttraining import load_posttrain_config
from kdamoe.posttraining.engine import EpisodeSpec, RolloutEngine
from kdamoe.posttraining.run import run_recipe
from tests.helpers import launch_processes
from tests.test_posttrain import base  # noqa: F401  (the tiny base folder fixture)
from tests.test_rollout import _RESPONSE, FAST, ScriptedToolCalls, _call
from tests.test_rollout_engine import SCHEMAS, _assert_same, _engine, _greedy, _prompt, add, submit

DEADLINE_S, SLOW_TOOL_S, LOGPROB_ATOL = 240, 0.15, 1e-5
MODES = {"fsdp": {"fsdp_size": 2}, "fsdp_ep": {"fsdp_size": 2, "ep_size": 2}}
# rank 0: three tool rounds per episode; rank 1: one; then a short answer
DONE = {"role": "assistant", "content": "Done."}  # a short last turn (a free one would run to the per-turn cap)
PLAN = {0: [_call("add", a=1, b=2), _call("add", a=3, b=4), _call("submit", answer=7), DONE],
        2: [_call("add", a=2, b=2), _call("add", a=3, b=3), _call("submit", answer=6), DONE],
        1: [_call("submit", answer=3), DONE]}
BUDGET, ROUNDS, SLOTS = 400, 5, 2
GRPO_STEPS = 1


def slow_add(a: int, b: int) -> int:
    """Add two integers (slowly).

    Args:
        a: The first number.
        b: The second number.
    """
    time.sleep(SLOW_TOOL_S)
    return a + b


def _specs(tokenizer, rank: int) -> list:
    """Rank 0: episodes EP0 and EP2 (slow tools); rank 1: EP1 twice (one GRPO group)."""
    keys, tools = ([0, 2], {"add": slow_add, "submit": submit}) if rank == 0 else ([1, 1], {"add": add,
                                                                                             "submit": submit})
    return [EpisodeSpec(_prompt(tokenizer, k), tools=tools, schemas=SCHEMAS, seed=i) for i, k in enumerate(keys)]


def _config(tokenizer):
    return _greedy(tokenizer, max_new_tokens=45)  # a tool-call turn is 34-39 tokens; a free turn stops at 45


class WatchedEngine:
    """Wraps an engine's idle step to count the ones run while one of the rank's tool calls was still running."""

    def __init__(self, engine):
        self.engine, self.idle_during_tools = engine, 0
        poll, idle = engine._poll_tools, engine._idle_step

        def poll_tools(running):
            self.running = running
            return poll(running)

        def idle_step():
            self.idle_during_tools += any(e.job is not None for e in self.running)
            return idle()

        engine._poll_tools, engine._idle_step = poll_tools, idle_step


class UnevenAgent(ScriptedToolCalls):
    """The forced turns of ``tests/test_rollout.py``'s scripted agent, planned by rank: ``calls - 1`` calls of
    ``add``, then ``submit``, then a short answer."""

    def __init__(self, tokenizer, calls: int):
        super().__init__(tokenizer, steps_of=None)
        self.calls = calls

    def _reply(self, text):
        results = _RESPONSE.findall(text)
        if results and results[-1] == "submitted":
            return DONE
        if len(results) < self.calls - 1:
            return _call("add", a=len(results), b=1)
        return _call("submit", answer=0)


def _engine_part(base_dir: str, out: Path, rank: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    for mode, sizes in MODES.items():
        model = load_sharded(KDAMoEForCausalLM, base_dir, sizes, dtype=torch.float32).eval()
        engine = _engine(model, tokenizer, PLAN, _config(tokenizer), slots=SLOTS, budget=BUDGET, rounds=ROUNDS,
                         cls=functools.partial(RolloutEngine, lockstep_group=dist.group.WORLD))
        watched = WatchedEngine(engine)
        episodes = engine.run(_specs(tokenizer, rank))
        torch.save({"episodes": episodes, "stats": dict(engine.stats), "idle_during_tools": watched.idle_during_tools},
                   out / f"{mode}_rank{rank}.pt")


def _grpo_part(base_dir: str, out: Path, rank: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    script = UnevenAgent(tokenizer, calls=3 if rank == 0 else 1)
    engine_class, stats = rollout_module.RolloutEngine, []

    def scripted_engine(*args, **kwargs):
        engine = engine_class(*args, logits_processor=LogitsProcessorList([script]), **kwargs)
        stats.append(engine.stats)
        return engine

    rollout_module.RolloutEngine = scripted_engine
    overrides = [f"model={base_dir}", f"output_dir={out / 'grpo'}", *FAST, "grpo.rollout=batched",
                 "trainer.fsdp=true", f"trainer.max_steps={GRPO_STEPS}", "trainer.max_completion_length=160",
                 "trainer.generation_kwargs={do_sample: false, max_new_tokens: 40}", "trainer.logging_steps=1"]
    cfg = load_posttrain_config("grpo", overrides)
    result = run_recipe(cfg, resume=False, overwrite=True)
    trainer = result["trainer"]
    torch.save({"stats": [dict(s) for s in stats], "global_step": result["global_step"],
                "fsdp": bool(getattr(trainer, "is_fsdp_enabled", False)) and trainer.accelerator.is_fsdp2,
                "loss": [row["loss"] for row in result["log_history"] if "loss" in row]},
               out / f"grpo_rank{rank}.pt")


def _rank_main(base_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    _engine_part(base_dir, Path(out), rank)
    _grpo_part(base_dir, Path(out), rank)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    root = tmp_path_factory.mktemp("lockstep")
    launch_processes([str(Path(__file__)), base, str(root)], 2, DEADLINE_S)
    results = {name: [torch.load(root / f"{name}_rank{r}.pt") for r in range(2)] for name in (*MODES, "grpo")}
    return {"root": root, **results}


@pytest.fixture(scope="module")
def one_process(base):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    """Each rank's episodes played on the unsharded model in this process, without lockstep."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return [_engine(model, tokenizer, PLAN, _config(tokenizer), slots=SLOTS, budget=BUDGET,
                    rounds=ROUNDS).run(_specs(tokenizer, rank)) for rank in range(2)]


@pytest.mark.xdist_group("distributed")
@pytest.mark.parametrize("mode", MODES)
def test_uneven_tool_episodes_on_sharded_ranks_equal_one_process(runs, one_process, mode):
    ranks = runs[mode]
    for got, want in zip(ranks, one_process, strict=True):
        for g, w in zip(got["episodes"], want, strict=True):
            _assert_same(g, w, check_logprobs=False)
            diff = (torch.tensor(g["logprobs"]) - torch.tensor(w["logprobs"])).abs()
            assert float(diff.max()) <= LOGPROB_ATOL
    assert [e["ended"] for r in ranks for e in r["episodes"]] == ["eos"] * 4  # every plan ran to its end
    assert [e["tool_calls"] for e in ranks[0]["episodes"]] == [3, 3]  # the plan ran: uneven tool rounds
    assert [e["tool_calls"] for e in ranks[1]["episodes"]] == [1, 1]
    stats = [r["stats"] for r in ranks]
    # the same number of forwards on both ranks, made up by idle steps on the rank with less to do at the time
    assert stats[0]["steps"] + stats[0]["idle_steps"] == stats[1]["steps"] + stats[1]["idle_steps"]
    assert stats[0]["steps"] != stats[1]["steps"]
    assert stats[1]["idle_steps"] > 0  # rank 1 finished first and kept joining rank 0's steps
    assert ranks[0]["idle_during_tools"] > 0  # rank 0 joined rank 1's steps while its slow tool ran
    assert stats[1]["forks"] == 1


@pytest.mark.xdist_group("distributed")
def test_multi_turn_grpo_step_under_fsdp2_with_batched_rollouts(runs):
    ranks = runs["grpo"]
    assert [r["global_step"] for r in ranks] == [GRPO_STEPS] * 2
    assert all(r["fsdp"] for r in ranks)  # FSDP2, not DDP
    stats = [r["stats"] for r in ranks]
    assert len(stats[0]) == len(stats[1]) >= 1
    for zero, one in zip(*stats, strict=True):
        assert zero["tool_rounds"] > one["tool_rounds"] > 0  # uneven tool rounds
        assert zero["steps"] + zero["idle_steps"] == one["steps"] + one["idle_steps"]
        assert zero["idle_steps"] + one["idle_steps"] > 0
    assert len(ranks[0]["loss"]) == GRPO_STEPS  # the step was logged
    summary = json.loads((runs["root"] / "grpo" / "summary.json").read_text())
    assert summary["global_step"] == GRPO_STEPS and os.path.isdir(summary["final"])


def test_lockstep_group_without_a_process_group_is_refused(base):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    """(``dist.group.WORLD`` itself is None before ``init_process_group``: a stand-in group object is passed.)"""
    assert not dist.is_initialized()
    model = KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32)
    with pytest.raises(ValueError, match="lockstep_group=.*torch.distributed is not initialized"):
        RolloutEngine(model, _config(AutoTokenizer.from_pretrained(base)), num_slots=1, eos_token_ids=[2],
                      max_completion_length=8, lockstep_group="a process group")


@pytest.mark.parametrize("mode", ["single_turn", "tools", "environment"])
def test_batched_rollout_loads_with_distributed_config_in_every_mode(base, monkeypatch, mode):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    """The engine steps in lockstep on a model sharded by transformers' engine too (the test above): ``batched`` loads
    with ``distributed_config`` in every GRPO mode, where ``trl`` loads in ``single_turn`` only."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    common = [f"model={base}", "recipe=grpo", f"grpo.mode={mode}", "data.environment=arithmetic",
              "distributed_config={fsdp_size: 2, ep_size: 2}"]
    cfg = load_posttrain_config("grpo", [*common, "grpo.rollout=batched"])
    assert cfg.grpo.rollout == "batched" and cfg.distributed_config == {"fsdp_size": 2, "ep_size": 2}
    if mode != "single_turn":
        with pytest.raises(ValueError, match=r"with distributed_config and grpo.rollout: trl: .*grpo.rollout: batched"):
            load_posttrain_config("grpo", [*common, "grpo.rollout=trl"])


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
