"""Tiny configs shared by the model tests (fast on 2 CPU cores), and the launcher of the multi-process tests."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kdamoe import KDAMoEConfig

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(**overrides) -> KDAMoEConfig:
    """A 4-layer model (3 KDA + 1 MLA) with 8 experts top-2, widths of a few dozen."""
    fields = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        kv_lora_rank=16,
        kda_num_heads=2,
        kda_head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_latent_size=16,
        intermediate_size=32,
        attnres_num_blocks=2,
        kda_chunk_size=16,
        kernel_backend="torch",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    return KDAMoEConfig(**fields)


def start_processes(args: list[str], processes: int, env: dict[str, str] | None = None,
                    log: Path | None = None) -> subprocess.Popen:
    """Start ``python args…`` as one process, or as ``processes`` ranks under torchrun (``python -m
    torch.distributed.run --standalone``), from the repo root with one thread per rank and ``env`` added to the
    environment. stdout and stderr are pipes (text), or both go to the file ``log`` — for a caller that polls
    instead of reading them, so that a full pipe cannot stall the run.

    The launcher gets its own session (``start_new_session``), so ``os.killpg(proc.pid, SIGKILL)`` stops it and
    every rank it started.
    """
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    if log is None:
        return subprocess.Popen(launcher + args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(launcher + args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)


def finish_processes(proc: subprocess.Popen, deadline_s: float, what: str) -> tuple[str, str]:
    """Wait up to ``deadline_s`` for a :func:`start_processes` launch; returns ``(stdout, stderr)`` (both None when
    they went to a log file). On the deadline its whole process group is killed and the test fails (``what`` names
    the run) instead of hanging."""
    try:
        return proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"{what} did not finish within {deadline_s} s:\n{(stderr or '')[-6000:]}")


def launch_processes(args: list[str], processes: int, deadline_s: float) -> tuple[str, str]:
    """Run ``python args…`` as one process or as ``processes`` torchrun ranks (:func:`start_processes`) to the end
    within ``deadline_s`` (:func:`finish_processes`) and check it exited 0; returns ``(stdout, stderr)``.

    A dead rank makes torchrun stop the others and exit non-zero within seconds, which fails the test too.
    """
    with start_processes(args, processes) as proc:
        stdout, stderr = finish_processes(proc, deadline_s, f"{processes}-process run")
    assert proc.returncode == 0, f"{processes}-process run failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return stdout, stderr
