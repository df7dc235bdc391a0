"""Causal depthwise convolution + SiLU (the KDA layer's short conv): ``causal_conv1d`` (training / prefill,
differentiable in x, weight and the cached state), ``causal_conv1d_parts`` (the same over q|k|v in one launch, one
contiguous output per part) and ``causal_conv1d_update`` (one decoding step).
See ``conv.py`` for the semantics and the stage files."""

from .conv import causal_conv1d, causal_conv1d_parts, causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_parts", "causal_conv1d_update"]
