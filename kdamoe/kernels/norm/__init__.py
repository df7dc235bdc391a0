"""RMSNorm, the KDA output's gated RMSNorm (sigmoid gate) and the residual add + RMSNorm, forward and backward in one
launch each: ``rms_norm``, ``gated_rms_norm`` and ``add_rms_norm``.

Files: ``norm.py`` (the public ops, their checks and autograd Function), ``forward.py`` / ``backward.py`` (the Triton
kernels of each pass, with their launchers).

Reference: ``kdamoe.model.norm_torch`` (``rms_norm_torch``, ``gated_rms_norm_torch``, ``add_rms_norm_torch``), run in
float64 (``tests/kernels/test_norm.py``)."""

from .norm import add_rms_norm, gated_rms_norm, rms_norm

__all__ = ["add_rms_norm", "gated_rms_norm", "rms_norm"]
