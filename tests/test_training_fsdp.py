"""FSDP2 pretraining on CPU processes: ``torchrun --nproc_per_node N scripts/train.py --set train.parallelism=fsdp2``
(accelerate's FSDP2 plugin over gloo) reproduces the one-process run for N = 2 and N = 4, resumes after one rank was
killed mid-run, and exports one consolidated Hub folder (issue #15). ``train.parallelism=fsdp2_ep`` (FSDP2 plus expert
parallelism by transformers' engine, each of the 2 ranks holding 2 of the 4 experts) is checked against that FSDP2
run, resumed from a checkpoint, and exported the same way (the ``fsdp2_ep`` tests at the end).

Runs are subprocesses of the documented command, recorded per rank by the ``__main__`` of
``tests/test_training_data_parallel.py`` (rows and router biases after every update), with deadlines, in the
``distributed`` xdist group (see that file).

Why not bitwise against one process: as under DDP, the N processes each sum their rows' gradients and FSDP2's
reduce-scatter adds the N partial sums, so float32 sums are taken in another order (step 1 already differs by
rounding; later steps start from weights ~1e-7 apart). ``LOSS_RTOL = 1e-6`` is the DDP test's bound; a per-process
loss mean instead of the global token mean is off by ~3e-4 on these rows. The resumed run is compared bitwise with
the uninterrupted FSDP2 run: the same shards, reductions and RNG states are restored from the checkpoint.

The kill is a real ``SIGKILL`` of rank 1's process while the 2-process run is in step ``STOP_AT + 1``, once
checkpoint ``STOP_AT`` is final. To make that moment deterministic rather than a race against the next checkpoint,
the recorder's ``KDAMOE_TEST_HOLD`` makes rank 1 publish its pid and sleep before its first forward after the
checkpoint; rank 0 meanwhile enters the step and waits in FSDP2's first all-gather.

``fsdp2_ep`` against ``fsdp2`` on 2 ranks: the same initial weights (the main process saves the seeded model, every
rank loads it with ``DistributedConfig(fsdp_size=2, ep_size=2)``), the same rows, the same loss normalisation. What
may differ is float32 rounding: an expert multiplies the rows routed to it from both ranks in one product instead
of each rank's rows in its own, and the gradient norm is summed per device mesh. Measured here (tied embeddings):
losses of all 5 steps bitwise equal (an untied version differed by 4.3e-8 at step 5), router biases bitwise equal; so
the bounds are the ``LOSS_RTOL`` and ``BIAS_ATOL`` of the one-process comparison (a per-rank loss mean instead of the
global one is off by ~3e-4). The resumed ``fsdp2_ep`` run starts from a copy of the uninterrupted run's folder as it
stood after checkpoint ``STOP_AT`` (what a kill right after that checkpoint leaves; the kill itself is exercised above
for ``fsdp2``), so one uninterrupted run serves both checks, and it reproduces the uninterrupted losses and biases
bitwise.
"""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers.distributed.checkpoint import consolidate_distributed_checkpoint

from kdamoe import KDAMoEConfig, KDAMoEForCausalLM
from kdamoe.common.checkpoint import verify_checkpoint
from kdamoe.common.parallel import make_accelerator
from kdamoe.hub import _validation_ids, validate_hub_folder
from tests.helpers import finish_processes, launch_processes, start_processes
from tests.test_training_data_parallel import HOLD, _write_short_documents
from tests.test_training_resume import _config

STEPS, STOP_AT, GLOBAL_BATCH, ACCUM, DEADLINE_S = 5, 2, 4, 2, 120
LOSS_RTOL, BIAS_ATOL = 1e-6, 1e-6
RECORDER = Path(__file__).resolve().parent / "test_training_data_parallel.py"


def _command(tmp_path, name: str, processes: int, parallelism: str, *extra: str) -> tuple[list[str], Path]:
    """The recorded ``kdamoe-train`` command of run ``name`` (in ``tmp_path/name``; resumed when it holds
    checkpoints, unless ``--no-resume``): ``STEPS`` steps of global batch ``GLOBAL_BATCH`` on ``processes`` ranks, a
    checkpoint every ``STOP_AT`` steps; ``extra`` are more ``kdamoe-train`` arguments. Returns the arguments and the
    new folder the ranks' recordings go to."""
    if not (tmp_path / "corpus").exists():
        _write_short_documents(tmp_path / "corpus")
    stage = {"name": "only", "seq_len": 16, "batch_size": GLOBAL_BATCH, "steps": STEPS, "lr": 3e-3, "warmup_steps": 1}
    _config(tmp_path, name, stages=[stage], grad_accum_steps=ACCUM, checkpoint_every=STOP_AT, keep_checkpoints=4,
            parallelism=parallelism)
    dump = tmp_path / f"{name}_ranks{len(list(tmp_path.glob(f'{name}_ranks*')))}"
    dump.mkdir()
    # tied embeddings, as in the shipped CPU preset: a resumed fsdp2_ep run once failed to save them
    args = [str(RECORDER), str(dump), "--config", str(tmp_path / f"{name}.yaml"),
            "--set", f"train.stages.0.batch_size={GLOBAL_BATCH // processes}",
            "--set", "model.tie_word_embeddings=true", *extra]
    return args, dump


def _launch(tmp_path, name: str, processes: int, parallelism: str, *extra: str) -> dict:
    """Run :func:`_command` to the end; returns the logged losses of the newest checkpoint, that checkpoint and
    every rank's recording."""
    args, dump = _command(tmp_path, name, processes, parallelism, *extra)
    launch_processes(args, processes, DEADLINE_S)
    newest = sorted((tmp_path / name / "checkpoints").glob("stage0-step*"))[-1]
    progress = json.loads((newest / "progress.json").read_text())
    ranks = [torch.load(dump / f"rank{rank}.pt") for rank in range(processes)]
    return {"losses": [loss for _, loss in progress["losses"]], "ranks": ranks, "checkpoint": newest}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def one(workdir):
    return _launch(workdir, "one", 1, "ddp", "--no-resume")


@pytest.fixture(scope="module")
def fsdp(workdir):
    """The uninterrupted 2-process FSDP2 run."""
    return _launch(workdir, "fsdp", 2, "fsdp2", "--no-resume")


@pytest.mark.xdist_group("distributed")
@pytest.mark.parametrize("processes", [2, 4])
def test_fsdp2_on_n_processes_reproduces_one_process(workdir, one, fsdp, processes):
    run = fsdp if processes == 2 else _launch(workdir, f"fsdp{processes}", processes, "fsdp2", "--no-resume")
    assert len(one["losses"]) == len(run["losses"]) == STEPS
    assert run["losses"] == pytest.approx(one["losses"], rel=LOSS_RTOL)
    biases = [rank["biases"] for rank in run["ranks"]]  # [STEPS, routers, experts] after every update
    assert biases[0].shape[0] == STEPS
    for other in biases[1:]:
        assert torch.equal(other, biases[0])
    assert torch.count_nonzero(one["ranks"][0]["biases"][-1]) > 0  # the biases did move
    torch.testing.assert_close(biases[0], one["ranks"][0]["biases"], rtol=0, atol=BIAS_ATOL)
    files = {p.relative_to(run["checkpoint"]).as_posix() for p in run["checkpoint"].rglob("*") if p.is_file()}
    assert "model.safetensors" not in files  # a sharded checkpoint: each rank wrote its own shard
    assert {f"pytorch_model_fsdp_0/__{rank}_0.distcp" for rank in range(processes)} <= files


def _wait_for(path: Path, proc, log: Path) -> None:
    """Poll until ``path`` exists; fail (with the tail of ``log``) if the launch ``proc`` exits first or after
    ``DEADLINE_S`` seconds."""
    deadline = time.monotonic() + DEADLINE_S
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited ({proc.returncode})" if proc.returncode is not None else f"ran {DEADLINE_S} s"
            pytest.fail(f"the run {why} before {path.name} appeared:\n{log.read_text()[-6000:]}")
        time.sleep(0.05)


@pytest.mark.xdist_group("distributed")
def test_fsdp2_resume_after_a_kill_reproduces_the_uninterrupted_run_bitwise(workdir, fsdp):
    """SIGKILL rank 1 during step ``STOP_AT + 1`` (rank 0 is then inside that step's first FSDP all-gather), after
    checkpoint ``STOP_AT`` is final; torchrun tears the group down; the same command again resumes from the sharded
    checkpoint and reproduces the uninterrupted run bitwise."""
    args, dump = _command(workdir, "killed", 2, "fsdp2", "--no-resume")
    # Rank 1 stops before its first forward after checkpoint STOP_AT: a deterministic moment for the kill, not a race.
    log = workdir / "killed.log"
    with start_processes(args, 2, env={HOLD: f"1:{STOP_AT * ACCUM}"}, log=log) as proc:
        try:
            _wait_for(dump / "hold.pid", proc, log)
            checkpoints = workdir / "killed" / "checkpoints"
            # Final: renamed from .tmp-<name> into place after its manifest (kdamoe.common.checkpoint), and intact.
            assert [p.name for p in checkpoints.iterdir()] == [f"stage0-step{STOP_AT:06d}"]
            assert verify_checkpoint(checkpoints / f"stage0-step{STOP_AT:06d}") is None
            os.kill(int((dump / "hold.pid").read_text()), signal.SIGKILL)
            finish_processes(proc, DEADLINE_S, "torchrun after the kill")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, log.read_text()[-3000:]  # torchrun saw rank 1 die and stopped rank 0
    assert "(SIGKILL)" in log.read_text()  # torchrun's report names the signal that ended rank 1
    assert [p.name for p in checkpoints.iterdir()] == [f"stage0-step{STOP_AT:06d}"]
    assert not (workdir / "killed" / "final").exists()

    resumed = _launch(workdir, "killed", 2, "fsdp2")  # the same command without --no-resume
    assert (workdir / "killed" / "final" / "model.safetensors").is_file()
    assert resumed["losses"] == fsdp["losses"]  # exact float equality, every step
    for rank in range(2):
        torch.testing.assert_close(resumed["ranks"][rank]["biases"], fsdp["ranks"][rank]["biases"][STOP_AT:],
                                   rtol=0, atol=0)


def _assert_final_holds(final: Path, sharded: dict) -> dict:
    """``final/model.safetensors`` holds exactly the consolidated checkpoint's tensors ``sharded`` (router biases
    included), and the folder loads without kdamoe (``validate_hub_folder``) with the logits of a plain model holding
    ``sharded``. Returns the exported tensors."""
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
    return exported


@pytest.mark.xdist_group("distributed")
def test_fsdp2_export_is_one_consolidated_hub_folder(fsdp, tmp_path):
    """``final/`` holds the full weights (equal to the last sharded checkpoint consolidated by torch's own
    ``dcp_to_torch_save``, router biases included) and loads in a process without kdamoe with the same logits."""
    final = fsdp["checkpoint"].parent.parent / "final"
    assert (final / "model.safetensors").is_file() and (final / "modeling_kdamoe.py").is_file()
    assert not list(final.glob("pytorch_model_fsdp*")) and not list(final.rglob("*.distcp"))
    dcp_to_torch_save(fsdp["checkpoint"] / "pytorch_model_fsdp_0", tmp_path / "consolidated.pt")
    sharded = torch.load(tmp_path / "consolidated.pt")["model"]  # accelerate saves {"model": state dict}
    _assert_final_holds(final, sharded)


def test_parallelism_is_checked_when_the_config_loads(tmp_path):
    with pytest.raises(ValueError, match="train.parallelism.*'fsdp'"):
        _config(tmp_path, "bad", parallelism="fsdp")


def test_an_unknown_parallelism_is_refused_before_any_set_up():
    with pytest.raises(ValueError, match="train.parallelism: must be one of ddp, fsdp2, fsdp2_ep, got 'fsdp'"):
        make_accelerator("fsdp", use_bf16=False)


def test_fsdp2_with_one_process_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = _config(tmp_path, "one", parallelism="fsdp2")
    with pytest.raises(ValueError, match="train.parallelism: fsdp2 needs at least 2 processes"):
        make_accelerator(cfg.train.parallelism, use_bf16=False, model=cfg.model)


@pytest.fixture(scope="module")
def ep(workdir):
    """The uninterrupted 2-process ``fsdp2_ep`` run."""
    return _launch(workdir, "ep", 2, "fsdp2_ep", "--no-resume")


@pytest.fixture(scope="module")
def ep_resumed(workdir, ep):
    """``fsdp2_ep`` resumed from checkpoint ``STOP_AT``: a copy of the run folder ``ep`` as a kill right after that
    checkpoint leaves it (no later checkpoint, no ``final/``), then the same command without ``--no-resume``."""
    source, target = workdir / "ep", workdir / "ep_resumed"
    kept = f"checkpoints/stage0-step{STOP_AT:06d}"
    for name in ("tokenizer", "initial", "tensorboard", kept):
        shutil.copytree(source / name, target / name)
    for name in ("config.yaml", "baselines.json"):
        shutil.copy(source / name, target / name)
    return _launch(workdir, "ep_resumed", 2, "fsdp2_ep")


@pytest.mark.xdist_group("distributed")
def test_fsdp2_ep_reproduces_fsdp2(fsdp, ep):
    assert len(ep["losses"]) == len(fsdp["losses"]) == STEPS
    assert ep["losses"] == pytest.approx(fsdp["losses"], rel=LOSS_RTOL)
    biases = [rank["biases"] for rank in ep["ranks"]]  # [STEPS, routers, experts] after every update
    assert biases[0].shape[0] == STEPS and torch.count_nonzero(biases[0][-1]) > 0
    assert torch.equal(biases[1], biases[0])  # one all-reduce of the statistics: the ranks agree bitwise
    torch.testing.assert_close(biases[0], fsdp["ranks"][0]["biases"], rtol=0, atol=BIAS_ATOL)
    # The same rows: rank r saw what rank r saw under fsdp2.
    for rank in range(2):
        assert torch.equal(ep["ranks"][rank]["rows"], fsdp["ranks"][rank]["rows"])
    # transformers' sharded checkpoint, one shard file per rank; no accelerate model or optimizer files.
    files = {p.relative_to(ep["checkpoint"]).as_posix() for p in ep["checkpoint"].rglob("*") if p.is_file()}
    assert {f"model/shard-0000{rank + 1}-model-00001-of-00001.safetensors" for rank in range(2)} <= files
    assert {"optimizer/__0_0.distcp", "optimizer/__1_0.distcp", "random_states_1.pkl"} <= files
    assert not {"model.safetensors", "optimizer.bin"} & files and not any("fsdp" in name for name in files)


@pytest.mark.xdist_group("distributed")
def test_fsdp2_ep_resume_reproduces_the_uninterrupted_run_bitwise(ep, ep_resumed):
    assert ep_resumed["losses"] == ep["losses"]  # exact float equality: steps 1..STOP_AT from the checkpoint, then
    for rank in range(2):  # the recomputed ones; the biases after each recomputed update
        assert ep_resumed["ranks"][rank]["rows"].shape[0] == (STEPS - STOP_AT) * ACCUM
        torch.testing.assert_close(ep_resumed["ranks"][rank]["biases"], ep["ranks"][rank]["biases"][STOP_AT:],
                                   rtol=0, atol=0)
    assert (ep_resumed["checkpoint"].parent.parent / "final" / "model.safetensors").is_file()


@pytest.mark.xdist_group("distributed")
def test_fsdp2_ep_export_is_one_consolidated_hub_folder(ep, tmp_path):
    """``final/`` holds the weights of the stage-end checkpoint's shards (consolidated by transformers'
    ``consolidate_distributed_checkpoint``, experts of both ranks and router biases included) and loads in a process
    without kdamoe with the logits of a plain model holding those weights."""
    final = ep["checkpoint"].parent.parent / "final"
    assert (final / "model.safetensors").is_file() and (final / "modeling_kdamoe.py").is_file()
    assert not list(final.glob("shard-*")) and not list(final.rglob("*.distcp"))
    consolidate_distributed_checkpoint(ep["checkpoint"] / "model", tmp_path)
    (consolidated,) = tmp_path.glob("*.safetensors")
    exported = _assert_final_holds(final, load_file(consolidated))
    assert any(k.endswith("experts.gate_up_proj") and v.shape[0] == 4 for k, v in exported.items())  # all 4 experts


def test_fsdp2_ep_with_one_process_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = _config(tmp_path, "one", parallelism="fsdp2_ep")  # outside torchrun the config loads; the run refuses
    with pytest.raises(ValueError, match="train.parallelism: fsdp2_ep needs at least 2 processes"):
        make_accelerator(cfg.train.parallelism, use_bf16=False, model=cfg.model)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="train.parallelism: fsdp2_ep needs at least 2 processes"):
        _config(tmp_path, "one", parallelism="fsdp2_ep")


def test_fsdp2_ep_experts_not_divisible_by_the_processes_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun --nproc_per_node 3 sets it; the model has 4 experts
    with pytest.raises(ValueError, match="model.num_experts: 4 experts cannot be split evenly over 3 processes"):
        _config(tmp_path, "three", parallelism="fsdp2_ep")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _config(tmp_path, "two", parallelism="fsdp2_ep").train.parallelism == "fsdp2_ep"
