"""kdamoe: Kimi Delta Attention + MLA (NoPE) + Quantile-Balanced Stable LatentMoE + Block AttnRes for transformers.

Importing the package registers ``model_type="kda_moe"`` with the Auto classes and marks the classes for
``save_pretrained`` to write ``auto_map`` and copy the code (remote code). The Triton kernels
(``kdamoe.kernels``) are not imported here.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from .configuration_kdamoe import KDAMoEConfig
from .modeling_kdamoe import (
    KDAMoEForCausalLM,
    KDAMoEForSequenceClassification,
    KDAMoEModel,
    KDAMoEPreTrainedModel,
)

AutoConfig.register(KDAMoEConfig.model_type, KDAMoEConfig, exist_ok=True)
AutoModel.register(KDAMoEConfig, KDAMoEModel, exist_ok=True)
AutoModelForCausalLM.register(KDAMoEConfig, KDAMoEForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(KDAMoEConfig, KDAMoEForSequenceClassification, exist_ok=True)

KDAMoEConfig.register_for_auto_class()
KDAMoEModel.register_for_auto_class("AutoModel")
KDAMoEForCausalLM.register_for_auto_class("AutoModelForCausalLM")
KDAMoEForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")

__all__ = [
    "KDAMoEConfig",
    "KDAMoEPreTrainedModel",
    "KDAMoEModel",
    "KDAMoEForCausalLM",
    "KDAMoEForSequenceClassification",
]
