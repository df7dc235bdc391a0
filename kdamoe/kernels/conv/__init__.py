"""Causal depthwise convolution + SiLU (the KDA layer's short conv): ``causal_conv1d`` (training / prefill,
differentiable in x, weight and the cached state), ``causal_conv1d_parts`` (the same over q|k|v in one launch, one
contiguous output per part), ``causal_conv1d_update`` (one decoding step) and ``causal_conv1d_update_slots`` (one
decoding step on windows kept in a slot pool, updated in place: the rollout engine's step) and
``causal_conv1d_varlen_slots`` (packed sequences of any length on windows kept in a slot pool, read and updated in
place by ``cache_indices``: the engine's prompt chunks and tool turns).

Files: ``conv.py`` (the public ops, their checks and autograd Function), ``forward.py`` / ``backward.py`` /
``update.py`` / ``update_slots.py`` / ``varlen_slots.py`` (the Triton kernels of each pass, of the decode step, of
the slot-pool decode step and of the slot-pool packed sequences).

References: ``kdamoe.model.kda_torch.causal_conv1d_torch`` in float64 and a brute-force loop over the taps
(``tests/kernels/test_conv.py``); the slot-pool step against gather → ``causal_conv1d_torch`` → scatter and a
float64 loop over the taps (``tests/kernels/test_conv_update_slots.py``); the slot-pool packed sequences against a
float64 direct convolution of each sequence from its pool row (``tests/kernels/test_conv_varlen_slots.py``)."""

from .conv import (
    causal_conv1d,
    causal_conv1d_parts,
    causal_conv1d_update,
    causal_conv1d_update_slots,
    causal_conv1d_varlen_slots,
)

__all__ = ["causal_conv1d", "causal_conv1d_parts", "causal_conv1d_update", "causal_conv1d_update_slots",
           "causal_conv1d_varlen_slots"]
