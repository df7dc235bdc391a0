"""Token → expert permutation (rows grouped by expert) without a host synchronisation.

``order`` lists the flat slots ``t·k + j`` sorted by expert (stable, so tokens keep their order inside an
expert); slots whose index equals ``E`` (tokens owned by another rank in expert parallelism) sort last and
belong to no expert. ``row_offs[e] : row_offs[e+1]`` is expert e's row range ([E+1], int32).
``tile_offs(row counts, BM)`` gives the per-expert tile prefix sum used by the grouped GEMMs.
"""

import torch


def expert_permutation(top_k_index: torch.Tensor, num_experts: int):
    """Group the slots of ``top_k_index`` ([N, k], ints in [0, E]) by expert.

    Returns ``(order [N·k] int32, counts [E] int32, row_offs [E+1] int32)``.
    """
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    counts.index_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    counts = counts[:num_experts]
    row_offs = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    torch.cumsum(counts, 0, out=row_offs[1:])
    return order, counts, row_offs


def tile_offsets(counts: torch.Tensor, block_m: int) -> torch.Tensor:
    """Prefix sum ([E+1], int32) of ``ceil(counts / block_m)``."""
    tiles = (counts + (block_m - 1)) // block_m
    offs = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    torch.cumsum(tiles, 0, out=offs[1:])
    return offs
