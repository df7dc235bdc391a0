"""kdamoe: Kimi Delta Attention + MLA (NoPE) + Quantile-Balanced Stable LatentMoE + Block AttnRes for transformers.

Importing the package registers ``model_type="kda_moe"`` with the Auto classes and marks the classes for
``save_pretrained`` to write ``auto_map`` and copy the code (remote code). The Triton kernels
(``kdamoe.kernels``) need only torch + triton: where transformers is missing or older than 5.24 (e.g. a
GPU image), ``import kdamoe.kernels`` still works and the model names raise an ImportError that says why.
"""

__all__ = [
    "KDAMoEConfig",
    "KDAMoEPreTrainedModel",
    "KDAMoEModel",
    "KDAMoEForCausalLM",
    "KDAMoEForSequenceClassification",
    "KDAMoECache",
]
_MODEL_NAMES = tuple(__all__)

try:
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
    )

    from .model import (
        KDAMoECache,
        KDAMoEConfig,
        KDAMoEForCausalLM,
        KDAMoEForSequenceClassification,
        KDAMoEModel,
        KDAMoEPreTrainedModel,
    )
except ImportError as error:  # only the kernels are usable
    _IMPORT_ERROR = error

    def __getattr__(name):
        if name in _MODEL_NAMES:
            raise ImportError(f"kdamoe.{name} needs transformers>=5.24,<6 ({_IMPORT_ERROR})") from _IMPORT_ERROR
        raise AttributeError(f"module 'kdamoe' has no attribute {name!r}")

else:
    AutoConfig.register(KDAMoEConfig.model_type, KDAMoEConfig, exist_ok=True)
    AutoModel.register(KDAMoEConfig, KDAMoEModel, exist_ok=True)
    AutoModelForCausalLM.register(KDAMoEConfig, KDAMoEForCausalLM, exist_ok=True)
    AutoModelForSequenceClassification.register(KDAMoEConfig, KDAMoEForSequenceClassification, exist_ok=True)

    KDAMoEConfig.register_for_auto_class()
    KDAMoEModel.register_for_auto_class("AutoModel")
    KDAMoEForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    KDAMoEForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
