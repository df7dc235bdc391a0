"""The Block AttnRes mix (softmax over depth of the residual sources, arXiv:2603.15031), forward and backward in
one launch each: ``block_attnres``. See ``attnres.py`` for the semantics and ``kernels.py`` for the kernels."""

from .attnres import block_attnres

__all__ = ["block_attnres"]
