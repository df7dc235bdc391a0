"""Quantile Balancing on the model across data-parallel ranks: two gloo processes on CPU, each counting its own
batches, must end every bias update with identical biases, equal (bitwise: the statistics are float64 counts) to one
process that counted both ranks' batches, after one all-reduce per update.

Both processes get a timeout on ``init_process_group`` and the test a deadline, so a dead rank fails the test
instead of hanging the suite; the test shares the ``distributed`` xdist group with the other multi-process tests so
they never oversubscribe the two cores.
"""

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kdamoe.model.quantile_balancing as qb
from kdamoe import KDAMoEForCausalLM
from tests.helpers import tiny_config

WORLD, STEPS, DEADLINE_S = 2, 3, 180


def _model():
    torch.manual_seed(0)
    return KDAMoEForCausalLM(tiny_config(num_experts=8, num_experts_per_tok=2, qb_num_bins=64)).train()


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(1000 * step + rank))


def _biases(model) -> torch.Tensor:
    return torch.stack([router.e_score_correction_bias.clone() for router in model._routers()])


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    calls = []
    real = qb.dist.all_reduce
    qb.dist.all_reduce = lambda tensor, **kw: calls.append(tensor.numel()) or real(tensor, **kw)
    try:
        model = _model()
        biases = []
        for step in range(STEPS):
            model(_batch(rank, step))  # a training forward (train mode, grad on) counts the routing
            model.update_router_biases()
            biases.append(_biases(model))
        torch.save({"biases": torch.stack(biases), "calls": len(calls)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        qb.dist.all_reduce = real
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.xdist_group("distributed")
def test_ranks_hold_identical_biases_equal_to_one_process_seeing_every_batch(tmp_path):
    context = mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"the {WORLD} ranks did not finish within {DEADLINE_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()

    reference = _model()
    expected = []
    for step in range(STEPS):
        for rank in range(WORLD):
            reference(_batch(rank, step))
        reference.update_router_biases()
        expected.append(_biases(reference))
    expected = torch.stack(expected)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    assert not torch.equal(expected[0], torch.zeros_like(expected[0]))  # the biases did move
    for result in results:
        assert result["calls"] == STEPS  # one all-reduce per update, for all routers together
        assert torch.equal(result["biases"], expected)
