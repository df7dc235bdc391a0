"""The Block AttnRes mix (softmax over depth of the residual sources, arXiv:2603.15031), forward and backward in
one launch each: ``block_attnres``.

Files: ``attnres.py`` (the public op, its argument checks and autograd Function), ``forward.py`` / ``backward.py``
(the Triton kernels of each pass, with their launchers).

Reference: ``kdamoe.model.attnres_torch.block_attnres_torch`` (the model's PyTorch path), run in float64
(``tests/kernels/test_block_attnres.py``)."""

from .attnres import block_attnres

__all__ = ["block_attnres"]
