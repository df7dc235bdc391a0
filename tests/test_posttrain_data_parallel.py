"""Data-parallel post-training on CPU processes: ``torchrun --nproc_per_node N scripts/posttrain.py --config sft``
(transformers' Trainer under TRL's ``SFTTrainer``: ``use_cpu=True`` → accelerate multi-CPU, gloo, DDP) with a
per-device batch of ``B / N`` rows reproduces the one-process run with per-device batch ``B`` (SFT at N = 2 and 4,
one shared one-process run).

Each run is a subprocess: the documented command, except that this file stands in for ``scripts/posttrain.py`` to
record, per rank, the episodes every training forward saw and the router biases after every update
(``python tests/test_posttrain_data_parallel.py DUMP_DIR kdamoe-posttrain-args...``; ``__main__`` below), then
calls the same ``kdamoe.cli.posttrain_main``. The losses are the ones the Trainer logs (``summary.json``'s
``log_history``: the mean over ranks of their losses). Every run has a deadline and torchrun stops the other
ranks when one fails, so a dead rank fails the test instead of hanging the suite; the test shares the
``distributed`` xdist group with the other multi-process tests so they never oversubscribe the two cores.

The shipped ``sft`` config is padding-free (one flattened row per micro-batch, ``position_ids`` restarting per
episode), so the recorder splits each forward's row back into episodes at ``position_ids == 0``.

Why not bitwise: one process sums every assistant token's loss and gradient in one reduction; two processes each
sum theirs and DDP adds the two partial gradients, so float32 sums are taken in another order and the weights
after step 1 differ by float32 rounding. The Trainer divides every rank's token-loss sum by (global token count
/ N) (``average_tokens_across_devices``, default True; TRL's ``SFTTrainer.compute_loss`` then multiplies by N
before DDP averages), so each token weighs the same on every rank. Measured over these 4 steps: at most 1e-7
relative at 2 and at 4 processes (9.7e-8 each), so ``LOSS_RTOL = 1e-5`` leaves a 100x margin; a per-rank mean instead of
the global token mean (``average_tokens_across_devices=false``; the episodes have unequal assistant token counts) was
off by 1.6e-4 to 5.6e-4 relative on steps 2-4 (5e-6 on step 1, the same weights). The Quantile
Balancing histograms count the same tokens in the same bins unless a margin lies within rounding of a bin edge:
measured, the biases equal the one-process run bitwise at 2 and 4 processes; they are compared with
``BIAS_ATOL = 1e-6``, and across ranks bitwise (one all-reduce of the statistics per update: every rank computes from
the same sums).

Other recipes (GRPO in mode ``single_turn`` with a KL term ``beta=0.1``, DPO, RLOO): 5 steps of a global batch
of 4 rows (GRPO / RLOO: 2 prompts x ``num_generations=2``), 1 process x 4 against 2 processes x 2. One launch per
process count runs the three recipes one after the other (``--then`` separates their arguments; the imports cost
more than these runs). What is compared and why:

* Rollouts. TRL's ``GRPOTrainer`` and ``RLOOTrainer`` call ``set_seed(seed, device_specific=True)`` ("to prevent
  duplicate completions"), so rank r samples from another stream than the one process; and even with one seed
  sampling draws the random numbers for all rows of a batch from one stream, so rank 1's rows would not get the
  draws they get in the one-process batch. Sampled completions therefore cannot be equal. Greedy rollouts
  (``top_k=1``) would be equal but make the completions of a group identical, every advantage 0 and every
  gradient 0. So the 2-process run replays the 1-process rollouts: the recorder's ``generate`` returns this
  rank's slice of the recorded completions (after checking its prompts are that slice's prompts), and what is
  compared is everything after sampling — rewards gathered over the ranks, group advantages, loss
  normalisation, gradients, router-bias statistics.
* Reward. The recipes' own (the stated answer) is 0 for every rollout of the untrained tiny base (all advantages
  0), so the recorder swaps in a dense one (:func:`_text_length_reward`).
* Optimizer: SGD (``trainer.optim=sgd``, lr 0.5). AdamW's first step moves every parameter by about
  ``lr * sign(gradient)``, so a gradient entry that is zero up to rounding (GRPO's advantages sum to zero over a
  group, and their terms cancel) comes out as +-lr in one run and -+lr in the other: under AdamW (lr 1e-2) GRPO's
  weights differed by 0.024 and its losses by up to 0.4 % from step 2 on, DPO's and RLOO's by < 1e-5. Under SGD
  the difference stays at rounding.
* Tolerances (measured, SGD): losses ``rel=1e-5`` or ``abs=1e-6`` (GRPO's and RLOO's losses are sums of terms
  that cancel: 1e-3 and 1e-8 in size; measured 7.5e-9 absolute for GRPO, 1.9e-6 relative for DPO, 1e-7 absolute
  for RLOO, whose logged loss is rounding noise around 0 — for RLOO the weights are the evidence); final weights
  ``atol=1e-5`` (measured 3e-7; they moved by 0.06-0.08); router biases across ranks bitwise, against one
  process ``atol=1e-3``: DPO's came out one histogram step (3.7e-4) apart on one expert, a selection margin
  within rounding of a bin edge, while the biases moved by about 1e-2.
"""

import json
import os
import shutil
import sys
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from kdamoe import KDAMoEForCausalLM, KDAMoEModel
from kdamoe.cli import posttrain_main
from kdamoe.common.parallel import check_world_size
from kdamoe.posttraining.recipes import grpo, rloo
from kdamoe.posttraining.recipes.grpo import _text
from tests.helpers import launch_processes
from tests.test_posttrain import base  # noqa: F401  (the tiny base folder fixture)

STEPS, GLOBAL_BATCH, DEADLINE_S = 4, 4, 120
LOSS_RTOL, BIAS_ATOL = 1e-5, 1e-6
RL_DEADLINE_S, RL_LOSS_RTOL, RL_LOSS_ATOL, RL_WEIGHT_ATOL, RL_BIAS_ATOL = 180, 1e-5, 1e-6, 1e-5, 1e-3


def _launch(base_dir: str, out: Path, processes: int, *extra: str) -> dict:
    """``STEPS`` SFT steps of global batch ``GLOBAL_BATCH`` on ``processes`` ranks; returns losses and dumps."""
    dump = out.with_name(out.name + "_ranks")
    dump.mkdir()
    overrides = [f"model={base_dir}", f"trainer.max_steps={STEPS}", "trainer.warmup_steps=0",
                 f"trainer.per_device_train_batch_size={GLOBAL_BATCH // processes}", "trainer.learning_rate=1e-2",
                 "trainer.save_strategy='no'", "trainer.logging_steps=1", f"data.num_tasks={STEPS * GLOBAL_BATCH}",
                 "data.environment=arithmetic", "data.min_calls=1", "data.max_calls=2", "data.max_operand=5", *extra]
    args = [str(Path(__file__)), str(dump), "--config", "sft", "--output-dir", str(out), "--no-resume"]
    args += [a for o in overrides for a in ("--set", o)]
    launch_processes(args, processes, DEADLINE_S)
    history = json.loads((out / "summary.json").read_text())["log_history"]
    losses = [row["loss"] for row in history if "loss" in row]
    ranks = [torch.load(dump / f"rank{rank}.pt") for rank in range(processes)]
    return {"losses": losses, "ranks": ranks}


@pytest.fixture(scope="module")
def sft_one(base, tmp_path_factory):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    """The one-process SFT run both process counts are compared with."""
    return _launch(base, tmp_path_factory.mktemp("sft_one"), 1)


@pytest.mark.xdist_group("distributed")
@pytest.mark.parametrize("processes", [2, 4])
def test_sft_on_n_processes_reproduces_one_process_with_the_same_global_batch(base, sft_one, processes,  # noqa: F811 (the imported base fixture, which pytest passes by name)
                                                                              tmp_path):
    one = sft_one
    many = _launch(base, tmp_path / "many", processes)

    # Same episodes in the same order: at every step rank r saw the r-th slice of the one-process batch.
    single = one["ranks"][0]["episodes"]  # per step, GLOBAL_BATCH token lists
    assert len(single) == STEPS and all(len(step) == GLOBAL_BATCH for step in single)
    slices = [sum(step, []) for step in zip(*(rank["episodes"] for rank in many["ranks"]), strict=True)]
    assert slices == single

    assert len(one["losses"]) == len(many["losses"]) == STEPS
    assert many["losses"] == pytest.approx(one["losses"], rel=LOSS_RTOL)

    biases = [rank["biases"] for rank in many["ranks"]]  # [STEPS, routers, experts] after every update
    assert biases[0].shape[0] == STEPS
    for other in biases[1:]:
        assert torch.equal(biases[0], other)  # one all-reduce of the statistics: the ranks agree bitwise
    reference = one["ranks"][0]["biases"]
    assert torch.count_nonzero(reference[-1]) > 0  # the biases did move
    torch.testing.assert_close(biases[0], reference, rtol=0, atol=BIAS_ATOL)


# GRPO, DPO and RLOO: one launch per process count runs all three recipes (module docstring, "Other recipes").
RL_STEPS, RL_GLOBAL_BATCH = 5, 4
RL_RECIPES = {
    "grpo": ["--config", "grpo_single_turn", "--set", "trainer.num_generations=2", "--set",
             "trainer.max_completion_length=8", "--set", "trainer.beta=0.1"],
    "dpo": ["--config", "dpo"],
    "rloo": ["--config", "rloo", "--set", "trainer.num_generations=2", "--set", "trainer.max_completion_length=8"],
}


def _rl_argv(base_dir: str, root: Path, processes: int, recipe: str) -> list[str]:
    dump = root / f"{recipe}_ranks"
    dump.mkdir(parents=True)
    overrides = [f"model={base_dir}", f"trainer.max_steps={RL_STEPS}", "trainer.warmup_steps=0",
                 f"trainer.per_device_train_batch_size={RL_GLOBAL_BATCH // processes}", "trainer.optim=sgd",
                 "trainer.learning_rate=0.5",
                 "trainer.save_strategy='no'", "trainer.logging_steps=1",
                 f"data.num_tasks={RL_STEPS * RL_GLOBAL_BATCH}",
                 "data.environment=arithmetic", "data.min_calls=1", "data.max_calls=1", "data.max_operand=5"]
    return [str(dump), "--output-dir", str(root / recipe), "--no-resume", *[a for o in overrides for a in ("--set", o)],
            *RL_RECIPES[recipe]]  # last: the recipe's own overrides win


def _rl_results(root: Path, processes: int) -> dict:
    out = {}
    for recipe in RL_RECIPES:
        history = json.loads((root / recipe / "summary.json").read_text())["log_history"]
        out[recipe] = {"losses": [row["loss"] for row in history if "loss" in row],
                       "ranks": [torch.load(root / f"{recipe}_ranks" / f"rank{r}.pt") for r in range(processes)],
                       "weights": load_file(root / recipe / "final" / "model.safetensors")}
    return out


@pytest.fixture(scope="module")
def rl_runs(base, tmp_path_factory):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    """``{processes: {recipe: {"losses", "ranks", "weights"}}}`` for 1 and 2 processes; the 2-process GRPO and
    RLOO runs replay the 1-process rollouts."""
    root = tmp_path_factory.mktemp("rl")
    runs = {}
    for processes in (1, 2):
        argvs = [_rl_argv(base, root / str(processes), processes, recipe) for recipe in RL_RECIPES]
        if processes > 1:
            for recipe in ("grpo", "rloo"):
                shutil.copy(root / "1" / f"{recipe}_ranks" / "rollouts0.pt",
                            root / str(processes) / f"{recipe}_ranks" / "replay.pt")
        args = [str(Path(__file__))] + [a for argv in argvs for a in ("--then", *argv)][1:]
        launch_processes(args, processes, RL_DEADLINE_S)
        runs[processes] = _rl_results(root / str(processes), processes)
    return {**runs, "base": base}


@pytest.mark.xdist_group("distributed")
@pytest.mark.parametrize("recipe", RL_RECIPES)
def test_rl_recipes_on_two_processes_reproduce_one_process_with_the_same_global_batch(rl_runs, recipe):
    one, two = rl_runs[1][recipe], rl_runs[2][recipe]
    assert len(one["losses"]) == len(two["losses"]) == RL_STEPS
    assert len(set(one["losses"])) > 1  # the loss moves with the weights
    assert two["losses"] == pytest.approx(one["losses"], rel=RL_LOSS_RTOL, abs=RL_LOSS_ATOL)

    biases = [rank["biases"] for rank in two["ranks"]]  # [RL_STEPS, routers, experts] after every update
    assert biases[0].shape[0] == RL_STEPS
    assert torch.equal(biases[0], biases[1])  # one all-reduce of the statistics: the ranks agree bitwise
    reference = one["ranks"][0]["biases"]
    assert reference[-1].abs().max() > 5 * RL_BIAS_ATOL  # the biases did move, by more than the tolerance
    torch.testing.assert_close(biases[0], reference, rtol=0, atol=RL_BIAS_ATOL)

    # final/: the weights after the 5 SGD steps (the router biases, buffers there too, are compared above).
    start = load_file(Path(rl_runs["base"]) / "model.safetensors")
    weights = [name for name in start if not name.endswith("e_score_correction_bias")]
    assert one["weights"].keys() == two["weights"].keys() == start.keys()
    assert max((one["weights"][n] - start[n]).abs().max().item() for n in weights) > 100 * RL_WEIGHT_ATOL
    for name in weights:
        torch.testing.assert_close(two["weights"][name], one["weights"][name], rtol=0, atol=RL_WEIGHT_ATOL, msg=name)


def test_a_launch_the_trainer_did_not_set_up_is_refused(monkeypatch):
    # What the Trainer builds with use_cpu=false under a 2-process torchrun on a CPU: one lone process each.
    lone = SimpleNamespace(num_processes=1, distributed_type="NO")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2 .* set up 1"):
        check_world_size(lone, "the Trainer", "use_cpu=True")
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_world_size(lone, "the Trainer", "use_cpu=True")


def _text_length_reward(completions, **kwargs) -> list[float]:
    """The test's dense reward for GRPO and RLOO: the completion's length in characters / 10. The recipes' own
    (the stated answer) is 0 for every rollout of the untrained tiny base, so every advantage would be 0 and no
    weight would move; the cross-process logic under test (gathered rewards, group baselines, loss
    normalisation) does not depend on which deterministic reward it is."""
    return [len(_text(completion)) / 10 for completion in completions]


def _posttrain_recording(runs: list[list[str]]) -> int:
    """``kdamoe.cli.posttrain_main(argv)`` for each ``[DUMP_DIR, *argv]`` of ``runs`` in turn (one process start
    for several recipes: the imports cost more than these runs), saving this rank's ``{"episodes": per training
    forward, the token lists of its episodes (padding-free SFT only), "biases": [updates, routers, E] after every
    update, "sharded": per update, whether every parameter is an FSDP2 shard (a DTensor)}`` to
    ``DUMP_DIR/rank<RANK>.pt``.

    Rollouts (GRPO, RLOO: TRL samples with ``model.generate``): every ``generate`` call's prompts (unpadded token
    lists) and completions (``[rows, C]``, padded after EOS) go to ``DUMP_DIR/rollouts<RANK>.pt``. When
    ``DUMP_DIR/replay.pt`` exists (the one-process run's ``rollouts0.pt``), ``generate`` returns this rank's
    contiguous slice of the recorded completions instead of sampling, after checking that its prompts are that
    slice's prompts."""
    grpo.stated_answer_reward = rloo.stated_answer_reward = _text_length_reward
    originals = KDAMoEModel.forward, KDAMoEForCausalLM.update_router_biases, KDAMoEForCausalLM.generate
    rank = int(os.environ.get("RANK", "0"))
    for dump, *argv in runs:
        status = _run_recorded(Path(dump), argv, rank, *originals)
        if status:
            return status
    return 0


def _run_recorded(dump: Path, argv: list[str], rank: int, forward, update, generate) -> int:
    """One run of :func:`_posttrain_recording`: ``posttrain_main(argv)`` with the model's ``forward``,
    ``update_router_biases`` and ``generate`` replaced by recording ones that call ``forward``, ``update`` and
    ``generate`` (the unpatched methods); the records go to ``dump``. Returns ``posttrain_main``'s status."""
    episodes, biases, rollouts, sharded = [], [], [], []
    replay = torch.load(dump / "replay.pt") if (dump / "replay.pt").exists() else None

    # The backbone's forward: TRL's fused LM head (SFTTrainer) runs it directly, not KDAMoEForCausalLM.forward.
    def recording_forward(self, *args, **kwargs):
        positions = kwargs.get("position_ids")
        if self.training and torch.is_grad_enabled() and positions is not None:
            ids = kwargs["input_ids"]  # padding-free: [1, total tokens]
            assert ids.shape[0] == 1
            starts = (positions[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
            episodes.append([ids[0, a:b].tolist() for a, b in pairwise(starts)])
        return forward(self, *args, **kwargs)

    def recording_update(self):
        update(self)
        biases.append(torch.stack([r.e_score_correction_bias.clone() for r in self._routers()]))
        sharded.append(all(isinstance(p, DTensor) for p in self.parameters()))  # FSDP2 holds DTensor shards

    def recording_generate(self, input_ids, attention_mask, **kwargs):
        prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask, strict=True)]
        if replay is None:
            completions = generate(self, input_ids=input_ids, attention_mask=attention_mask,
                                   **kwargs)[:, input_ids.shape[1]:]
        else:
            recorded = replay[len(rollouts)]
            rows = slice(rank * len(prompts), (rank + 1) * len(prompts))
            assert recorded["prompts"][rows] == prompts, "this rank's prompts are not its slice of the batch"
            completions = recorded["completions"][rows]
        rollouts.append({"prompts": prompts, "completions": completions})
        return torch.cat([input_ids, completions], dim=1)

    KDAMoEModel.forward, KDAMoEForCausalLM.update_router_biases = recording_forward, recording_update
    KDAMoEForCausalLM.generate = recording_generate
    status = posttrain_main(argv)
    if status:
        return status
    torch.save({"episodes": episodes, "biases": torch.stack(biases), "sharded": sharded}, dump / f"rank{rank}.pt")
    torch.save(rollouts, dump / f"rollouts{rank}.pt")
    return 0


def _split_runs(argv: list[str]) -> list[list[str]]:
    runs = [[]]
    for arg in argv:
        runs.append([]) if arg == "--then" else runs[-1].append(arg)
    return runs


if __name__ == "__main__":
    sys.exit(_posttrain_recording(_split_runs(sys.argv[1:])))
