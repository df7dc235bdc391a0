"""Quantile Balancing across ranks: two gloo processes on CPU, each routing its own tokens with the Triton
kernel (interpreter), counts summed by the QB module's all-reduce, quantile read off the summed
histogram and compared with the exact quantile of both ranks' r values pooled (≤ one bin width)."""

import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from moe_reference import margins_ref

from kdamoe.kernels import moe_route
from kdamoe.model.quantile_balancing import (
    all_reduce_sum,
    histogram_range,
    quantile_balancing_update,
    quantile_from_histogram,
)

N, E, K, WORLD = 300, 12, 2, 2


def rank_inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    logits = torch.randn(N, E, generator=g) * 2.0 + rank * 0.3 * torch.randn(E, generator=g)
    mask = torch.rand(N, generator=g) < 0.9  # padded tokens excluded
    return logits, mask


def bias():
    return torch.randn(E, generator=torch.Generator().manual_seed(7)) * 0.05


def _worker(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        b = bias()
        logits, mask = rank_inputs(rank)
        own = moe_route(logits, b, K, token_mask=mask, num_bins=1024).histogram
        counts = all_reduce_sum(own.clone())
        # the all-reduced counts equal this rank's counts plus the other rank's, routed here by the kernel
        lg_other, mask_other = rank_inputs(1 - rank)
        other = moe_route(lg_other, b, K, token_mask=mask_other, num_bins=1024).histogram
        assert torch.equal(counts, own + other) and counts.sum() == (mask.sum() + mask_other.sum()) * E
        lo, hi = histogram_range(b)
        q = K / E
        est = quantile_from_histogram(counts, lo, hi, q)
        # exact: the ceil(q·n)-th smallest pooled margin r = τ − s (float64 brute force, padding left out)
        rs = []
        for r in range(WORLD):
            lg, m = rank_inputs(r)
            s = torch.sigmoid(lg.double())
            sel = torch.topk(s + b.double(), K, dim=-1).indices
            rs.append(margins_ref(s, b, sel, K)[m])
        pooled = torch.cat(rs)
        kth = max(1, math.ceil(q * pooled.shape[0] - 1e-9))
        exact = torch.sort(pooled, dim=0).values[kth - 1]
        width = (hi - lo) / counts.shape[1]
        assert (est - exact).abs().max() <= width + 1e-6, ((est - exact).abs().max(), width)
        # every rank computes the same centred bias
        new_b = quantile_balancing_update(counts, lo, hi, K)
        gathered = [torch.empty_like(new_b) for _ in range(WORLD)]
        dist.all_gather(gathered, new_b)
        assert all(torch.equal(gathered[0], x) for x in gathered) and abs(new_b.mean().item()) < 1e-9
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.xdist_group("distributed")
def test_qb_histogram_all_reduce_two_ranks():
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
