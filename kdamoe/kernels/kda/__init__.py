"""Kimi Delta Attention kernels: ``chunk_kda`` (training / prefill, differentiable) and ``fused_recurrent_kda``
(decoding), with fla's signatures (fla ``ops/kda``), and ``fused_recurrent_kda_slots`` (one decode token per sequence
on states kept in a slot pool, updated in place: the rollout engine's step); ``chunk_kda`` with
``initial_state_indices`` reads each packed sequence's start state from a pool row and writes its final state back
there (forward only: the engine's prompt chunks and tool turns).

Files: ``chunk.py`` (the public op and autograd Function, the math), the chunked algorithm's stages ``prepare.py`` /
``intra.py`` / ``state.py`` / ``output.py`` / ``backward.py``, ``fused_recurrent.py`` (the decode step),
``fused_recurrent_slots.py`` (the decode step over a slot pool) and ``naive.py`` (the references).

Reference: ``naive.py``'s token-by-token recurrence with the lower-bounded gate (``naive_kda_lowerbound_gate``),
run in float64 (``tests/kernels/test_kda_chunk.py``, ``test_kda_recurrent.py``); the model's
``kdamoe.model.kda_torch`` is checked against it too (``tests/test_kda_torch.py``). The slot-pool step against
``naive.py``'s ``naive_recurrent_kda_slots`` (gather, recurrence in float64, scatter) and against gather →
``fused_recurrent_kda`` → scatter (``tests/kernels/test_kda_recurrent_slots.py``); the pool-indexed ``chunk_kda``
against ``naive_recurrent_kda`` in float64 per sequence from its pool row (``tests/kernels/test_kda_chunk_pool.py``)."""

from .chunk import chunk_kda
from .fused_recurrent import fused_recurrent_kda
from .fused_recurrent_slots import fused_recurrent_kda_slots

__all__ = ["chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_slots"]
