"""Causal depthwise convolution + SiLU (the KDA layer's short conv): ``causal_conv1d`` (training / prefill,
differentiable in x, weight and the cached state), ``causal_conv1d_parts`` (the same over q|k|v in one launch, one
contiguous output per part) and ``causal_conv1d_update`` (one decoding step).

Files: ``conv.py`` (the public ops, their checks and autograd Function), ``forward.py`` / ``backward.py`` /
``update.py`` (the Triton kernels of each pass and of the decode step).

References: ``kdamoe.model.kda_torch.causal_conv1d_torch`` in float64 and a brute-force loop over the taps
(``tests/kernels/test_conv.py``)."""

from .conv import causal_conv1d, causal_conv1d_parts, causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_parts", "causal_conv1d_update"]
