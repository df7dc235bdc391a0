"""Kimi Delta Attention kernels: ``chunk_kda`` (training / prefill, differentiable) and
``fused_recurrent_kda`` (decoding). See ``chunk.py`` for the math and the stage files."""

from .chunk import chunk_kda
from .fused_recurrent import fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]
