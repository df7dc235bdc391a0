"""The model: exactly the files ``save_pretrained`` copies next to the weights (remote code).

Every module here imports only torch, transformers and its neighbours in this folder (single-dot imports, which
transformers' ``custom_object_save`` follows and copies), plus the optional Triton kernels of ``kdamoe.kernels``
reached by a guarded absolute import in :mod:`.kernel_dispatch`. A saved folder therefore loads and runs with torch +
transformers alone. Nothing here trains, publishes or reads run folders: those jobs live above this package
(``kdamoe.training``, ``kdamoe.posttraining``, ``kdamoe.hub``) and import it, never the reverse (the import-linter
contracts in ``.importlinter``).

This ``__init__`` is not copied (a saved folder's modules import each other directly); it only gathers the public
names for ``kdamoe``'s Auto-class registration.
"""

from .cache_kdamoe import KDAMoECache
from .configuration_kdamoe import KDAMoEConfig
from .modeling_kdamoe import (
    KDAMoEForCausalLM,
    KDAMoEForSequenceClassification,
    KDAMoEModel,
    KDAMoEPreTrainedModel,
)

__all__ = [
    "KDAMoECache",
    "KDAMoEConfig",
    "KDAMoEForCausalLM",
    "KDAMoEForSequenceClassification",
    "KDAMoEModel",
    "KDAMoEPreTrainedModel",
]
