"""Token → expert permutation (rows grouped by expert) without a host synchronisation.

``order`` lists the flat slots ``t·k + j`` sorted by expert (stable, so tokens keep their order inside an
expert); slots whose index equals ``E`` (tokens owned by another rank in expert parallelism) sort last and
belong to no expert. ``row_offs[e] : row_offs[e+1]`` is expert e's row range ([E+1], int32).
``tile_offs(row counts, BM)`` gives the per-expert tile prefix sum used by the grouped GEMMs.
"""

import torch

from ..utils import cached_arange


def expert_permutation(top_k_index: torch.Tensor, num_experts: int):
    """Group the slots of ``top_k_index`` ([N, k], ints in [0, E]) by expert.

    Returns ``(order [N·k] int32, counts [E] int32, row_offs [E+1] int32)``.
    """
    flat = top_k_index.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    # offsets by binary search in the sorted ids: no atomics (heavily contended for small E), no host sync; the
    # bounds 0..E are a cached constant and the search writes int32 itself (no arange, no cast launched per call)
    bounds = cached_arange(num_experts + 1, sorted_ids.dtype, flat.device)
    row_offs = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    counts = row_offs[1:] - row_offs[:-1]
    return order.to(torch.int32), counts, row_offs


def tile_offsets(counts: torch.Tensor, block_m: int) -> torch.Tensor:
    """Prefix sum ([E+1], int32) of ``ceil(counts / block_m)``."""
    tiles = (counts + (block_m - 1)) // block_m
    offs = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    torch.cumsum(tiles, 0, out=offs[1:])
    return offs
