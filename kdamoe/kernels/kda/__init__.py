"""Kimi Delta Attention kernels: ``chunk_kda`` (training / prefill, differentiable) and ``fused_recurrent_kda``
(decoding), with fla's signatures (fla ``ops/kda``).

Files: ``chunk.py`` (the public op and autograd Function, the math), the chunked algorithm's stages ``prepare.py`` /
``intra.py`` / ``state.py`` / ``output.py`` / ``backward.py``, ``fused_recurrent.py`` (the decode step) and
``naive.py`` (the reference).

Reference: ``naive.py``'s token-by-token recurrence with the lower-bounded gate (``naive_kda_lowerbound_gate``),
run in float64 (``tests/kernels/test_kda_chunk.py``, ``test_kda_recurrent.py``); the model's
``kdamoe.model.kda_torch`` is checked against it too (``tests/test_kda_torch.py``)."""

from .chunk import chunk_kda
from .fused_recurrent import fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]
