"""Data-parallel pretraining on CPU processes: ``torchrun --nproc_per_node N scripts/train.py`` (gloo, DDP) with a
per-process batch of ``B / N`` rows reproduces the one-process run with batch ``B``, for N = 2 and N = 4 (issue #15;
``B = 4``, one thread per rank, so four ranks fit the two cores of CI).

Each run is a subprocess: the documented command, except that this file stands in for ``scripts/train.py`` to
record, per rank, the rows every training forward saw and the router biases after every update
(``python tests/test_training_data_parallel.py DUMP_DIR kdamoe-train-args...``; ``__main__`` below), then calls
the same ``kdamoe.cli.train_main``. The losses are the ones the trainer logs (``progress.json`` of the stage-end
checkpoint). Every run has a deadline and torchrun stops the other ranks when one fails, so a dead rank fails the
test instead of hanging the suite; the test shares the ``distributed`` xdist group with the other multi-process
tests so they never oversubscribe the two cores.

Why not bitwise: the one-process run sums every token's gradient (and loss) in one reduction, N processes each sum
their rows and DDP adds the N partial gradients (then divides by N), so float32 sums are taken in another order.
Step 1's loss therefore already differs by float32 rounding, and later steps start from weights that differ by
~1e-7 relative. Measured on these 5 steps: at most 9e-8 relative for 2 and for 4 processes, so ``LOSS_RTOL =
1e-6`` leaves a 10x margin; a per-process mean instead of the global token mean (the bug this guards against:
the short documents below give the rows unequal target counts) is off by ~3e-4. The Quantile Balancing
histograms count the same tokens in the same bins unless a margin lies within rounding of a bin edge (bins are
``(max b − min b + 2) / qb_num_bins`` ≈ 2e-3 wide), so the biases came out bitwise equal; ``BIAS_ATOL = 1e-6``.
"""

import atexit
import json
import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch

from kdamoe import KDAMoEForCausalLM
from kdamoe.cli import train_main
from kdamoe.training.config import load_config
from kdamoe.training.trainer import run
from tests.helpers import launch_processes
from tests.test_training_resume import WORDS, _config

STEPS, GLOBAL_BATCH, ACCUM, DEADLINE_S = 5, 4, 2, 120
LOSS_RTOL, BIAS_ATOL = 1e-6, 1e-6


def _write_short_documents(folder: Path) -> None:
    """60 documents of 2 to 12 words: every 16-token row holds document starts (masked targets) in varying number,
    so the ranks' rows carry different numbers of targets and a per-rank mean would weight tokens unequally."""
    rng = random.Random(0)
    folder.mkdir()
    for i in range(60):
        (folder / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 13))))


def _launch(tmp_path, name: str, processes: int) -> dict:
    """Train ``STEPS`` steps of global batch ``GLOBAL_BATCH`` on ``processes`` ranks; returns losses and dumps."""
    if not (tmp_path / "corpus").exists():  # else _config writes its corpus of a few long documents
        _write_short_documents(tmp_path / "corpus")
    stage = {"name": "only", "seq_len": 16, "batch_size": GLOBAL_BATCH, "steps": STEPS, "lr": 3e-3, "warmup_steps": 1}
    _config(tmp_path, name, stages=[stage], grad_accum_steps=ACCUM, checkpoint_every=0)
    dump = tmp_path / f"{name}_ranks"
    dump.mkdir()
    args = [str(Path(__file__)), str(dump), "--config", str(tmp_path / f"{name}.yaml"), "--no-resume",
            "--set", f"train.stages.0.batch_size={GLOBAL_BATCH // processes}"]
    launch_processes(args, processes, DEADLINE_S)
    progress = json.loads((tmp_path / name / "checkpoints" / f"stage0-step{STEPS:06d}" / "progress.json").read_text())
    ranks = [torch.load(dump / f"rank{rank}.pt") for rank in range(processes)]
    # kdamoe-train destroys the process group it set up before the interpreter finalizes: one left to finalization
    # can abort a finished rank (gloo threads; seen as SIGABRT on a 4-process run in CI)
    assert [(dump / f"exit{rank}.txt").read_text() for rank in range(processes)] == ["False"] * processes
    return {"losses": [loss for _, loss in progress["losses"]], "ranks": ranks}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process reference run, shared by every process count."""
    tmp_path = tmp_path_factory.mktemp("one")
    return tmp_path, _launch(tmp_path, "one", 1)


@pytest.mark.xdist_group("distributed")
@pytest.mark.parametrize("processes", [2, 4])
def test_n_processes_reproduce_one_process_with_the_same_global_batch(one_process, processes):
    tmp_path, one = one_process
    many = _launch(tmp_path, f"ranks{processes}", processes)

    # Same global rows in the same order: at every micro-batch rank r saw the r-th slice of the one-process batch.
    single_rows = one["ranks"][0]["rows"]  # [STEPS·ACCUM, GLOBAL_BATCH, T]
    assert single_rows.shape[:2] == (STEPS * ACCUM, GLOBAL_BATCH)
    slices = torch.stack([rank["rows"] for rank in many["ranks"]], 1)  # [STEPS·ACCUM, N, GLOBAL_BATCH / N, T]
    assert slices.shape[1:3] == (processes, GLOBAL_BATCH // processes)
    assert torch.equal(slices.flatten(1, 2), single_rows)

    assert len(one["losses"]) == len(many["losses"]) == STEPS
    assert many["losses"] == pytest.approx(one["losses"], rel=LOSS_RTOL)

    biases = [rank["biases"] for rank in many["ranks"]]  # [STEPS, routers, experts] after every update
    for other in biases[1:]:
        assert torch.equal(other, biases[0])  # one all-reduce of the statistics: the ranks agree bitwise
    reference = one["ranks"][0]["biases"]
    assert torch.count_nonzero(reference[-1]) > 0  # the biases did move
    torch.testing.assert_close(biases[0], reference, rtol=0, atol=BIAS_ATOL)

    # This run's checkpoint resumed on one process would change the global batch: refused before anything runs.
    with pytest.raises(ValueError, match=f"written by a run on {processes} processes and this run has 1"):
        run(load_config(tmp_path / f"ranks{processes}.yaml",
                        [f"train.stages.0.batch_size={GLOBAL_BATCH // processes}"]), resume=True)


HOLD = "KDAMOE_TEST_HOLD"  # "<rank>:<n>": that rank stops before its (n+1)-th training forward, to be killed


def _hold_here(dump: Path) -> None:
    """Publish this process's pid as ``dump/hold.pid`` (written whole, then renamed) and sleep until killed."""
    (dump / "hold.pid.tmp").write_text(str(os.getpid()))
    os.replace(dump / "hold.pid.tmp", dump / "hold.pid")
    while True:
        time.sleep(60)


def _train_recording(dump: Path, argv: list[str]) -> int:
    """``kdamoe.cli.train_main(argv)``, saving ``{"rows": [micro-batches, B, T], "biases": [updates, routers, E]}``
    of this rank to ``dump/rank<RANK>.pt``. With ``KDAMOE_TEST_HOLD=<rank>:<n>`` in the environment, rank
    ``<rank>`` instead stops at its (n+1)-th training forward (:func:`_hold_here`) for the test to kill it."""
    rows, biases = [], []
    forward, update = KDAMoEForCausalLM.forward, KDAMoEForCausalLM.update_router_biases
    hold_rank, _, hold_at = os.environ.get(HOLD, "-1:0").partition(":")
    hold_at = int(hold_at) if hold_rank == os.environ.get("RANK", "0") else None

    def recording_forward(self, *args, **kwargs):
        if self.training and kwargs.get("labels") is not None:
            if len(rows) == hold_at:
                _hold_here(dump)
            rows.append(kwargs["input_ids"].clone())
        return forward(self, *args, **kwargs)

    def recording_update(self):
        update(self)
        biases.append(torch.stack([r.e_score_correction_bias.clone() for r in self._routers()]))

    KDAMoEForCausalLM.forward, KDAMoEForCausalLM.update_router_biases = recording_forward, recording_update
    # registered before kdamoe-train registers its own hook, so it runs after it (atexit runs hooks last-in first-out)
    atexit.register(lambda: (dump / f"exit{os.environ.get('RANK', '0')}.txt").write_text(
        str(torch.distributed.is_initialized())))
    status = train_main(argv)
    torch.save({"rows": torch.stack(rows), "biases": torch.stack(biases)},
               dump / f"rank{os.environ.get('RANK', '0')}.pt")
    return status


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(_train_recording(Path(sys.argv[1]), sys.argv[2:]))
