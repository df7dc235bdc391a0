"""FSDP2 pretraining on CPU processes: ``torchrun --nproc_per_node 2 scripts/train.py --set train.parallelism=fsdp2``
(accelerate's FSDP2 plugin over gloo) reproduces the one-process run, resumes from its sharded checkpoints, and
exports one consolidated Hub folder.

Runs are subprocesses of the documented command, recorded per rank by the ``__main__`` of
``tests/test_training_data_parallel.py`` (rows and router biases after every update), with deadlines, in the
``distributed`` xdist group (see that file).

Why not bitwise against one process: as under DDP, the two processes each sum their rows' gradients and FSDP2's
reduce-scatter adds the two partial sums, so float32 sums are taken in another order (step 1 already differs by
rounding; later steps start from weights ~1e-7 apart). ``LOSS_RTOL = 1e-6`` is the DDP test's bound; a per-process
loss mean instead of the global token mean is off by ~3e-4 on these rows. The resumed run is compared bitwise with
the uninterrupted FSDP2 run: the same shards, reductions and RNG states are restored from the checkpoint.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import launch_processes
from tests.test_training_data_parallel import _write_short_documents
from tests.test_training_resume import _config

STEPS, STOP_AT, GLOBAL_BATCH, ACCUM, DEADLINE_S = 6, 3, 4, 2, 120
LOSS_RTOL, BIAS_ATOL = 1e-6, 1e-6
RECORDER = Path(__file__).resolve().parent / "test_training_data_parallel.py"


def _launch(tmp_path, name: str, processes: int, parallelism: str, *extra: str) -> dict:
    """Train run ``name`` (``STEPS`` steps of global batch ``GLOBAL_BATCH``, a checkpoint every ``STOP_AT`` steps)
    on ``processes`` ranks; ``extra`` are more ``kdamoe-train`` arguments. Returns the logged losses of the newest
    checkpoint and every rank's recording."""
    if not (tmp_path / "corpus").exists():
        _write_short_documents(tmp_path / "corpus")
    stage = {"name": "only", "seq_len": 16, "batch_size": GLOBAL_BATCH, "steps": STEPS, "lr": 3e-3, "warmup_steps": 1}
    _config(tmp_path, name, stages=[stage], grad_accum_steps=ACCUM, checkpoint_every=STOP_AT, keep_checkpoints=4,
            parallelism=parallelism)
    dump = tmp_path / f"{name}_ranks{len(list(tmp_path.glob(f'{name}_ranks*')))}"
    dump.mkdir()
    args = [str(RECORDER), str(dump), "--config", str(tmp_path / f"{name}.yaml"),
            "--set", f"train.stages.0.batch_size={GLOBAL_BATCH // processes}", *extra]
    launch_processes(args, processes, DEADLINE_S)
    newest = sorted((tmp_path / name / "checkpoints").glob("stage0-step*"))[-1]
    progress = json.loads((newest / "progress.json").read_text())
    ranks = [torch.load(dump / f"rank{rank}.pt") for rank in range(processes)]
    return {"losses": [loss for _, loss in progress["losses"]], "ranks": ranks, "checkpoint": newest}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fsdp")
    one = _launch(tmp_path, "one", 1, "ddp", "--no-resume")
    fsdp = _launch(tmp_path, "fsdp", 2, "fsdp2", "--no-resume")
    return tmp_path, one, fsdp


@pytest.mark.xdist_group("distributed")
def test_fsdp2_on_two_processes_reproduces_one_process(runs):
    _, one, fsdp = runs
    assert len(one["losses"]) == len(fsdp["losses"]) == STEPS
    assert fsdp["losses"] == pytest.approx(one["losses"], rel=LOSS_RTOL)
    biases = [rank["biases"] for rank in fsdp["ranks"]]  # [STEPS, routers, experts] after every update
    assert biases[0].shape[0] == STEPS
    assert torch.equal(biases[0], biases[1])
    assert torch.count_nonzero(one["ranks"][0]["biases"][-1]) > 0  # the biases did move
    torch.testing.assert_close(biases[0], one["ranks"][0]["biases"], rtol=0, atol=BIAS_ATOL)
