"""Causal depthwise convolution + SiLU (the KDA layer's short conv): ``causal_conv1d`` (training / prefill,
differentiable in x, weight and the cached state), ``causal_conv1d_parts`` (the same over q|k|v in one launch, one
contiguous output per part), ``causal_conv1d_update`` (one decoding step) and ``causal_conv1d_update_slots`` (one
decoding step on windows kept in a slot pool, updated in place: the rollout engine's step).

Files: ``conv.py`` (the public ops, their checks and autograd Function), ``forward.py`` / ``backward.py`` /
``update.py`` / ``update_slots.py`` (the Triton kernels of each pass, of the decode step and of the slot-pool decode
step).

References: ``kdamoe.model.kda_torch.causal_conv1d_torch`` in float64 and a brute-force loop over the taps
(``tests/kernels/test_conv.py``); the slot-pool step against gather → ``causal_conv1d_torch`` → scatter and a
float64 loop over the taps (``tests/kernels/test_conv_update_slots.py``)."""

from .conv import causal_conv1d, causal_conv1d_parts, causal_conv1d_update, causal_conv1d_update_slots

__all__ = ["causal_conv1d", "causal_conv1d_parts", "causal_conv1d_update", "causal_conv1d_update_slots"]
