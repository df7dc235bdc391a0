"""Data-parallel post-training on CPU processes: ``torchrun --nproc_per_node N scripts/posttrain.py --config sft``
(transformers' Trainer under TRL's ``SFTTrainer``: ``use_cpu=True`` → accelerate multi-CPU, gloo, DDP) with a
per-device batch of ``B / N`` rows reproduces the one-process run with per-device batch ``B``.

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
before DDP averages), so each token weighs the same on either rank. Measured over these 4 steps: at most 1e-7
relative (step 2 equal), so ``LOSS_RTOL = 1e-5`` leaves a 100x margin; a per-rank mean instead of the global
token mean (``average_tokens_across_devices=false``; the episodes have unequal assistant token counts) was off
by 1.6e-4 to 5.6e-4 relative on steps 2-4 (5e-6 on step 1, the same weights). The Quantile
Balancing histograms count the same tokens in the same bins unless a margin lies within rounding of a bin edge:
measured, the biases equal the one-process run bitwise; they are compared with ``BIAS_ATOL = 1e-6``, and across
ranks bitwise (one all-reduce of the statistics per update: every rank computes from the same sums).
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import launch_processes
from tests.test_posttrain import base  # noqa: F401  (the tiny base folder fixture)

STEPS, GLOBAL_BATCH, DEADLINE_S = 4, 4, 120
LOSS_RTOL, BIAS_ATOL = 1e-5, 1e-6


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


@pytest.mark.xdist_group("distributed")
def test_sft_on_two_processes_reproduces_one_process_with_the_same_global_batch(base, tmp_path):  # noqa: F811
    one = _launch(base, tmp_path / "one", 1)
    two = _launch(base, tmp_path / "two", 2)

    # Same episodes in the same order: at every step rank 0 saw the first half of the one-process batch and
    # rank 1 the second half.
    single = one["ranks"][0]["episodes"]  # per step, GLOBAL_BATCH token lists
    assert len(single) == STEPS and all(len(step) == GLOBAL_BATCH for step in single)
    halves = [a + b for a, b in zip(two["ranks"][0]["episodes"], two["ranks"][1]["episodes"])]
    assert halves == single

    assert len(one["losses"]) == len(two["losses"]) == STEPS
    assert two["losses"] == pytest.approx(one["losses"], rel=LOSS_RTOL)

    biases = [rank["biases"] for rank in two["ranks"]]  # [STEPS, routers, experts] after every update
    assert biases[0].shape[0] == STEPS
    assert torch.equal(biases[0], biases[1])  # one all-reduce of the statistics: the ranks agree bitwise
    reference = one["ranks"][0]["biases"]
    assert torch.count_nonzero(reference[-1]) > 0  # the biases did move
    torch.testing.assert_close(biases[0], reference, rtol=0, atol=BIAS_ATOL)


def test_a_launch_the_trainer_did_not_set_up_is_refused(monkeypatch):
    # What the Trainer builds with use_cpu=false under a 2-process torchrun on a CPU: one lone process each.
    from types import SimpleNamespace

    from kdamoe.posttraining.run import check_world_size

    lone = SimpleNamespace(accelerator=SimpleNamespace(num_processes=1, distributed_type="NO"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2 .* set up 1"):
        check_world_size(lone)
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_world_size(lone)


def _posttrain_recording(dump: Path, argv: list[str]) -> int:
    """``kdamoe.cli.posttrain_main(argv)``, saving ``{"episodes": per forward, the token lists of its episodes,
    "biases": [updates, routers, E]}`` of this rank to ``dump/rank<RANK>.pt``."""
    from kdamoe import KDAMoEForCausalLM, KDAMoEModel
    from kdamoe.cli import posttrain_main

    episodes, biases = [], []
    forward, update = KDAMoEModel.forward, KDAMoEForCausalLM.update_router_biases

    # The backbone's forward: TRL's fused LM head (SFTTrainer) runs it directly, not KDAMoEForCausalLM.forward.
    def recording_forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            ids, positions = kwargs["input_ids"], kwargs["position_ids"]  # padding-free: [1, total tokens]
            assert ids.shape[0] == 1
            starts = (positions[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
            episodes.append([ids[0, a:b].tolist() for a, b in zip(starts, starts[1:])])
        return forward(self, *args, **kwargs)

    def recording_update(self):
        update(self)
        biases.append(torch.stack([r.e_score_correction_bias.clone() for r in self._routers()]))

    KDAMoEModel.forward, KDAMoEForCausalLM.update_router_biases = recording_forward, recording_update
    status = posttrain_main(argv)
    torch.save({"episodes": episodes, "biases": torch.stack(biases)}, dump / f"rank{os.environ.get('RANK', '0')}.pt")
    return status


if __name__ == "__main__":
    sys.exit(_posttrain_recording(Path(sys.argv[1]), sys.argv[2:]))
