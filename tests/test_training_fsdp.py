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
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import launch_processes
from tests.test_training_data_parallel import _write_short_documents
from tests.test_training_resume import _config

STEPS, STOP_AT, GLOBAL_BATCH, ACCUM, DEADLINE_S = 4, 2, 4, 2, 120
LOSS_RTOL, BIAS_ATOL = 1e-6, 1e-6
RECORDER = Path(__file__).resolve().parent / "test_training_data_parallel.py"


def _launch(tmp_path, name: str, processes: int, parallelism: str, *extra: str) -> dict:
    """Train run ``name`` (in ``tmp_path/name``; resumed when it holds checkpoints, unless ``--no-resume``) (``STEPS`` steps of global batch ``GLOBAL_BATCH``, a checkpoint every ``STOP_AT`` steps)
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
    files = {p.relative_to(fsdp["checkpoint"]).as_posix() for p in fsdp["checkpoint"].rglob("*") if p.is_file()}
    assert "model.safetensors" not in files  # a sharded checkpoint: each rank wrote its own shard
    assert {"pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp"} <= files


@pytest.mark.xdist_group("distributed")
def test_fsdp2_resume_after_a_kill_reproduces_the_uninterrupted_run_bitwise(runs):
    tmp_path, _, fsdp = runs
    # The run as a kill right after checkpoint STOP_AT leaves it: the uninterrupted run's folder without what came later.
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "fsdp", killed, ignore=shutil.ignore_patterns("final", "summary.json"))
    for later in sorted((killed / "checkpoints").glob("stage0-step*"))[1:]:
        shutil.rmtree(later)
    assert [p.name for p in (killed / "checkpoints").iterdir()] == [f"stage0-step{STOP_AT:06d}"]
    resumed = _launch(tmp_path, "killed", 2, "fsdp2")  # the same command again: resumes from the sharded checkpoint
    assert (killed / "final" / "model.safetensors").is_file()
    assert resumed["losses"] == fsdp["losses"]  # exact float equality, every step
    for rank in range(2):
        torch.testing.assert_close(resumed["ranks"][rank]["biases"], fsdp["ranks"][rank]["biases"][STOP_AT:],
                                   rtol=0, atol=0)


@pytest.mark.xdist_group("distributed")
def test_fsdp2_export_is_one_consolidated_hub_folder(runs, tmp_path):
    """``final/`` holds the full weights (equal to the last sharded checkpoint consolidated by torch's own
    ``dcp_to_torch_save``, router biases included) and loads in a process without kdamoe with the same logits."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from kdamoe import KDAMoEConfig, KDAMoEForCausalLM
    from kdamoe.hub import _validation_ids, validate_hub_folder

    _, _, fsdp = runs
    final = fsdp["checkpoint"].parent.parent / "final"
    assert (final / "model.safetensors").is_file() and (final / "modeling_kdamoe.py").is_file()
    assert not list(final.glob("pytorch_model_fsdp*")) and not list(final.rglob("*.distcp"))
    dcp_to_torch_save(fsdp["checkpoint"] / "pytorch_model_fsdp_0", tmp_path / "consolidated.pt")
    sharded = torch.load(tmp_path / "consolidated.pt")["model"]  # accelerate saves {"model": state dict}
    exported = load_file(final / "model.safetensors")
    assert set(exported) <= set(sharded) and any("e_score_correction_bias" in k for k in exported)
    for key, value in exported.items():
        assert torch.equal(value, sharded[key]), key

    config = KDAMoEConfig.from_pretrained(final)
    config.kernel_backend = "torch"
    model = KDAMoEForCausalLM(config).eval()
    model.load_state_dict(sharded, strict=True)
    input_ids = _validation_ids(config.vocab_size)
    with torch.no_grad():
        reference = model(input_ids=input_ids).logits.float()
    report = validate_hub_folder(final, reference, input_ids)
    assert report["max_abs_diff"] is not None and report["max_abs_diff"] <= 1e-4


def test_parallelism_is_checked_when_the_config_loads(tmp_path):
    with pytest.raises(ValueError, match="train.parallelism.*'fsdp'"):
        _config(tmp_path, "bad", parallelism="fsdp")


def test_fsdp2_with_one_process_is_a_config_error(tmp_path, monkeypatch):
    from kdamoe.training.trainer import make_accelerator

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="train.parallelism: fsdp2 needs at least 2 processes"):
        make_accelerator(_config(tmp_path, "one", parallelism="fsdp2"), use_bf16=False)
