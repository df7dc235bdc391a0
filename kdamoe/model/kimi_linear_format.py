"""Moonshot's Kimi Linear checkpoint format (transformers' ``model_type="kimi_linear"``) and kdamoe's, both ways.

Kimi Linear is the special case of this model with the unbounded KDA gate and a per-head ``A_log``
(``kda_lower_bound=None``, ``kda_use_A_log=True``), no KDA output-gate bias, MLA with a shared (not rotated) key part
(``qk_rope_head_dim``) and its norms at eps 1e-6, a plain full-width SwiGLU MoE (``moe_latent_size=None``,
``hidden_act="silu"``) and the standard residual stream (``attnres_num_blocks=0``). This module holds, with no
other import than torch, transformers and this folder (it ships next to the weights as remote code):

* the config translation both ways (:func:`kimi_linear_to_kdamoe_config`, :func:`kdamoe_to_kimi_linear_config`),
  refusing, with a ``ValueError`` naming the field, what the other side cannot represent;
* the tensor map both ways as generators over ``(name, tensor)`` pairs (:func:`kimi_linear_to_kdamoe_tensors`,
  :func:`kdamoe_to_kimi_linear_tensors`). The fused kdamoe tensors (the q|k|v short conv, the experts' 3-D weights) are
  assembled from their pieces in whatever order and shard the pieces come: only the fused tensors still waiting for a
  piece are held, each allocated once at its final size;
* :func:`from_kimi_linear_pretrained`, what ``KDAMoEForCausalLM.from_pretrained`` runs for a folder or Hub id whose
  ``config.json`` says ``model_type: kimi_linear``.

The on-disk names are those of the released checkpoints, which transformers' ``save_pretrained`` of
``KimiLinearForCausalLM`` also writes (the reverse of its ``conversion_mapping`` entry ``"kimi_linear"``):

==============================================================  ==================================================
Kimi Linear (per layer ``model.layers.{i}.``)                    kdamoe
==============================================================  ==================================================
``self_attn.{q,k,v}_conv1d.weight [H·K, 1, W]`` (three)          ``self_attn.conv1d.weight [3·H·K, 1, W]`` (q|k|v)
``self_attn.A_log [1, 1, H, 1]``                                 ``self_attn.A_log [H]``
``self_attn.kv_a_proj_with_mqa.weight``                          ``self_attn.kv_a_proj.weight``
``block_sparse_moe.`` (sparse layers; dense ones: ``mlp.``, or  ``mlp.``
``block_sparse_moe.`` as transformers' ``save_pretrained`` writes)
``block_sparse_moe.experts.{j}.w1.weight [I, d]`` / ``w3``       ``mlp.experts.gate_up_proj [E, 2I, d]`` (gate rows,
                                                                 then up rows)
``block_sparse_moe.experts.{j}.w2.weight [d, I]``                ``mlp.experts.down_proj [E, d, I]``
every other tensor                                               the same name and shape
==============================================================  ==================================================

Why not transformers' ``WeightConverter`` / ``MergeModulelist`` / ``Concatenate`` (``core_model_loading``): they are
applied by ``from_pretrained`` only to the model types registered in transformers' own ``conversion_mapping``, looked
up by ``model_type``; registering ``kda_moe`` there would be process-wide and would also rename the tensors of every
kdamoe folder on ``save_pretrained`` (the reverse mapping runs on save), so kdamoe's own folders would stop being
kdamoe folders. The mapping here is a few renames, one reshape and two fusions; written out, it also streams shard by
shard for the offline converter, which ``from_pretrained`` does not offer.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Iterator

import torch

from .configuration_kdamoe import KDAMoEConfig

KIMI_LINEAR_MODEL_TYPE = "kimi_linear"
# Kimi Linear's MLA norms (``q_a_layernorm``, ``kv_a_layernorm``) are built with the RMSNorm's default eps in
# transformers' modeling_kimi_linear.py (``KimiLinearRMSNorm(dim)``, eps 1e-6), not ``rms_norm_eps``.
KIMI_MLA_RMS_NORM_EPS = 1e-6
# The router rule a loaded release gets unless the caller asks for another: frozen biases. Kimi Linear was trained with
# its own balancing rule; starting Quantile Balancing (kdamoe's default) on its biases would move them from the first
# optimizer step on, which nobody asked for (docs/checkpoints.md).
LOADED_ROUTER_BIAS_UPDATE = "none"
# Tensors a Kimi Linear checkpoint loads in float32 whatever `dtype` asks for: those of kdamoe's
# `_keep_in_fp32_modules_strict` (the router's bias, the gate's dt_bias and A_log) and the router weight, which
# transformers' KimiLinearForCausalLM keeps in float32 too (its `_keep_in_fp32_modules_strict` names `gate.weight`),
# so a float32-stored router routes as it does there.
FP32_TENSOR_SUFFIXES = ("e_score_correction_bias", "dt_bias", "A_log", ".mlp.gate.weight")

# `from_pretrained` keyword arguments that locate files (passed to transformers' hub utilities).
HUB_ARGUMENTS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_FUSED_EXPERT = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)")
_CONV_PARTS = ("q", "k", "v")


# ----------------------------------------------------------------------------------------------------
# Config translation
# ----------------------------------------------------------------------------------------------------
def is_kimi_linear_config(config_dict: dict) -> bool:
    """Whether a ``config.json`` (as a dict) describes a Kimi Linear checkpoint."""
    return isinstance(config_dict, dict) and config_dict.get("model_type") == KIMI_LINEAR_MODEL_TYPE


def kimi_linear_to_kdamoe_config(kimi: dict) -> dict:
    """The ``KDAMoEConfig`` keyword arguments of a Kimi Linear ``config.json``.

    The dict is read through transformers' own ``KimiLinearConfig`` (its aliases such as ``num_experts`` /
    ``num_local_experts``, its defaults, and its precedence for the layer types: ``layer_types`` >
    ``linear_attn_config``'s 1-based ``full_attn_layers`` / ``kda_layers`` > every 4th layer), so both the released
    ``config.json`` and what transformers' ``save_pretrained`` writes translate the same way. Keys transformers ignores
    but the released remote code reads are checked here too (``mla_use_nope``, ``moe_router_activation_func``,
    ``moe_layer_freq``, ``num_nextn_predict_layers``).

    The result sets ``router_bias_update="none"`` (:data:`LOADED_ROUTER_BIAS_UPDATE`: the loaded biases stay as
    released unless the caller picks a rule), ``kda_lower_bound=None`` with ``kda_use_A_log=True`` (the softplus gate
    ``g = −exp(A_log_h)·softplus(f + dt_bias)``), ``kda_output_gate_bias=False``, ``moe_latent_size=None``,
    ``hidden_act="silu"``, ``attnres_num_blocks=0`` and ``mla_rms_norm_eps=1e-6``.

    Args:
        kimi: the parsed ``config.json`` (``model_type`` must be ``"kimi_linear"``).

    Returns:
        ``dict`` of ``KDAMoEConfig`` keyword arguments (plain JSON values).

    Raises:
        ValueError: naming the field, for a config kdamoe cannot represent exactly: grouped routing
            (``num_expert_group`` > 1 with ``topk_group`` < ``num_expert_group``), ``moe_renormalize`` false,
            ``attention_bias`` true, ``num_key_value_heads`` ≠ ``num_attention_heads``, ``hidden_act`` not silu,
            ``mla_use_nope`` false (rotary MLA), a router activation other than sigmoid, ``moe_layer_freq`` ≠ 1 without
            ``mlp_layer_types``, multi-token-prediction layers, no shared expert, a quantized checkpoint, a layer that
            is in neither ``full_attn_layers`` nor ``kda_layers`` or is numbered outside 1..``num_hidden_layers``, a
            config transformers' ``KimiLinearConfig`` refuses (its message, on one line); or when transformers has no
            ``kimi_linear``.
    """
    if not is_kimi_linear_config(kimi):
        raise ValueError(f"model_type is {kimi.get('model_type') if isinstance(kimi, dict) else kimi!r}, "
                         f"expected {KIMI_LINEAR_MODEL_TYPE!r}")
    _check_raw_kimi_fields(kimi)
    try:
        from transformers import KimiLinearConfig  # noqa: PLC0415 (only a Kimi Linear checkpoint needs it)
    except ImportError as err:
        raise ValueError("reading a kimi_linear config needs a transformers release with KimiLinearConfig "
                         f"(transformers>=5.24): {err}") from err
    fields = {k: v for k, v in kimi.items() if k not in ("auto_map", "architectures", "transformers_version")}
    try:
        c = KimiLinearConfig.from_dict(fields)
    except Exception as err:  # transformers' own validation (strict dataclass fields, layer-type lists): one line
        reason = " ".join(str(err).split())
        raise ValueError(f"config.json: transformers' KimiLinearConfig refuses it: {reason}") from err

    if c.num_key_value_heads != c.num_attention_heads:
        raise ValueError(f"num_key_value_heads is {c.num_key_value_heads}, num_attention_heads "
                         f"{c.num_attention_heads}: kdamoe's MLA expands its latent to one key/value per query head "
                         "(no grouping)")
    if c.attention_bias:
        raise ValueError("attention_bias is true: kdamoe's MLA projections have no bias")
    if c.hidden_act != "silu":
        raise ValueError(f"hidden_act is {c.hidden_act!r}: kdamoe reads a Kimi Linear checkpoint with 'silu' only "
                         "(SwiGLU MLPs, SiLU after the KDA short conv)")
    if not c.norm_topk_prob:
        raise ValueError("moe_renormalize (norm_topk_prob) is false: kdamoe's router always renormalises the top-k "
                         "scores")
    n_group, topk_group = c.n_group or 1, c.topk_group or 1
    if n_group > 1 and topk_group < n_group:
        raise ValueError(f"num_expert_group (n_group) is {n_group} with topk_group {topk_group}: kdamoe's router "
                         "has no group-limited routing")
    if not c.n_shared_experts:
        raise ValueError(f"num_shared_experts is {c.n_shared_experts!r}: kdamoe reads Kimi Linear checkpoints with "
                         "shared experts only (transformers builds a zero-width shared MLP otherwise)")
    layer_types = list(c.layer_types)
    for i, kind in enumerate(layer_types):
        if kind not in ("linear_attention", "full_attention"):
            raise ValueError(f"layer_types[{i}] is {kind!r} (layer {i + 1} is in neither linear_attn_config's "
                             "full_attn_layers nor its kda_layers)")
    mlp_layer_types = list(c.mlp_layer_types)
    for i, kind in enumerate(mlp_layer_types):
        if kind not in ("dense", "sparse"):
            raise ValueError(f"mlp_layer_types[{i}] is {kind!r}, expected 'dense' or 'sparse'")
    first_dense = next((i for i, kind in enumerate(mlp_layer_types) if kind != "dense"), len(mlp_layer_types))

    kwargs = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        layer_types=layer_types,
        num_attention_heads=c.num_attention_heads,
        kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank,
        qk_head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        mla_rms_norm_eps=KIMI_MLA_RMS_NORM_EPS,
        kda_num_heads=c.linear_num_heads,
        kda_head_dim=c.linear_head_dim,
        kda_short_conv_kernel_size=c.linear_conv_kernel_dim,
        kda_lower_bound=None,
        kda_use_A_log=True,
        kda_output_gate_bias=False,
        num_experts=c.num_local_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        num_shared_experts=c.n_shared_experts,
        moe_intermediate_size=c.moe_intermediate_size,
        moe_latent_size=None,
        first_k_dense_replace=first_dense,
        mlp_layer_types=mlp_layer_types,
        intermediate_size=c.intermediate_size,
        routed_scaling_factor=float(c.routed_scaling_factor),
        router_bias_update=LOADED_ROUTER_BIAS_UPDATE,
        hidden_act="silu",
        attnres_num_blocks=0,
        rms_norm_eps=float(c.rms_norm_eps),
        max_position_embeddings=c.max_position_embeddings,
        initializer_range=c.initializer_range,
        # transformers' KimiLinearForCausalLM never ties (its `_tied_weights_keys` is empty): the head is its own tensor
        tie_word_embeddings=False,
        use_cache=bool(c.use_cache),
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
    )
    dtype = kimi.get("dtype", kimi.get("torch_dtype"))
    if isinstance(dtype, str):
        kwargs["dtype"] = dtype
    return kwargs


def _check_raw_kimi_fields(kimi: dict) -> None:
    """The keys of the released ``config.json`` that transformers' ``KimiLinearConfig`` ignores but the released remote
    code (and vLLM) reads: values that change the model kdamoe would build are refused."""
    if kimi.get("quantization_config"):
        raise ValueError("quantization_config is set: kdamoe reads unquantized Kimi Linear checkpoints only "
                         "(bf16 / fp32 weights)")
    if kimi.get("mla_use_nope", True) is not True:
        raise ValueError(f"mla_use_nope is {kimi['mla_use_nope']!r}: kdamoe's MLA has no rotary part (NoPE)")
    activation = kimi.get("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise ValueError(f"moe_router_activation_func is {activation!r}: kdamoe's router is a sigmoid router")
    if kimi.get("moe_layer_freq", 1) != 1 and kimi.get("mlp_layer_types") is None:
        raise ValueError(f"moe_layer_freq is {kimi['moe_layer_freq']!r}: kdamoe derives the MoE layers from "
                         "first_k_dense_replace alone; give mlp_layer_types explicitly")
    if kimi.get("num_nextn_predict_layers") or 0:
        raise ValueError(f"num_nextn_predict_layers is {kimi['num_nextn_predict_layers']!r}: kdamoe has no "
                         "multi-token-prediction layers")
    linear = kimi.get("linear_attn_config")
    if "linear_attn_config" in kimi and not isinstance(linear, dict):
        raise ValueError(f"linear_attn_config is {linear!r}: expected a mapping (num_heads, head_dim, "
                         "short_conv_kernel_size, full_attn_layers, kda_layers)")
    n = kimi.get("num_hidden_layers")
    if kimi.get("layer_types") is None and isinstance(linear, dict) and "full_attn_layers" in linear \
            and "kda_layers" in linear and isinstance(n, int) and not isinstance(n, bool):
        # transformers reads these 1-based lists into a list indexed from 0: a layer 0 would land on the last layer
        # and a layer in neither list would become None, so both are refused here, naming the layer.
        listed = set()
        for key in ("full_attn_layers", "kda_layers"):
            layers = linear[key]
            if not isinstance(layers, (list, tuple)):
                raise ValueError(f"linear_attn_config.{key} is {layers!r}: expected a list of 1-based layer numbers")
            for layer in layers:
                if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= n:
                    raise ValueError(f"linear_attn_config.{key} holds {layer!r}: layers are numbered 1 to "
                                     f"num_hidden_layers={n!r}")
                listed.add(layer)
        missing = sorted(set(range(1, n + 1)) - listed)
        if missing:
            raise ValueError(f"layer {missing[0]} (1-based) is in neither linear_attn_config's full_attn_layers nor "
                             f"its kda_layers" + (f" (nor are layers {missing[1:]})" if len(missing) > 1 else ""))


def kdamoe_to_kimi_linear_config(config: KDAMoEConfig) -> dict:
    """The Kimi Linear ``config.json`` (released key names, plus the ``layer_types`` / ``mlp_layer_types`` lists that
    transformers' ``KimiLinearConfig`` writes) of a kdamoe model Kimi Linear can represent.

    ``kda_use_A_log=False`` is represented exactly by ``A_log = 0`` (``exp(0) = 1``;
    :func:`kdamoe_to_kimi_linear_tensors` writes those zeros). ``first_k_dense_replace`` is written as the number of
    leading dense layers; when the dense layers are not exactly a leading run, only transformers (which reads
    ``mlp_layer_types``) rebuilds the model.

    Raises:
        ValueError: naming the kdamoe field Kimi Linear cannot represent: ``moe_latent_size`` (latent MoE),
            ``attnres_num_blocks`` > 0 (Block AttnRes), ``hidden_act`` "situ", a float ``kda_lower_bound``
            (lower-bounded gate), ``kda_output_gate_bias`` true, ``mla_rms_norm_eps`` ≠ 1e-6, no shared expert.
    """
    problems = []
    if config.moe_latent_size is not None:
        problems.append(f"moe_latent_size={config.moe_latent_size} (latent MoE; Kimi Linear's experts run at full "
                        "width: None)")
    if config.attnres_num_blocks:
        problems.append(f"attnres_num_blocks={config.attnres_num_blocks} (Block Attention Residuals; Kimi Linear: 0)")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act={config.hidden_act!r} (Kimi Linear: 'silu')")
    if getattr(config, "kda_lower_bound", None) is not None:
        problems.append(f"kda_lower_bound={config.kda_lower_bound} (lower-bounded KDA gate; Kimi Linear: None, the "
                        "softplus gate)")
    if getattr(config, "kda_full_rank_output_gate", False):
        problems.append("kda_full_rank_output_gate=True (Kimi Linear's KDA output gate is low rank)")
    elif getattr(config, "kda_output_gate_bias", True):
        problems.append("kda_output_gate_bias=True (Kimi Linear's g_b_proj has no bias)")
    if getattr(config, "mla_output_gate", False):
        problems.append("mla_output_gate=True (Kimi Linear's MLA has no output gate)")
    mla_eps = _mla_eps(config)
    if not math.isclose(mla_eps, KIMI_MLA_RMS_NORM_EPS, rel_tol=1e-9):
        problems.append(f"mla_rms_norm_eps={mla_eps} (Kimi Linear's MLA norms use {KIMI_MLA_RMS_NORM_EPS})")
    if config.num_shared_experts < 1:
        problems.append(f"num_shared_experts={config.num_shared_experts} (Kimi Linear always has a shared expert)")
    if problems:
        raise ValueError("this kdamoe model cannot be written as Kimi Linear: " + "; ".join(problems))

    rope = _rope_dim(config)
    mlp_layer_types = _mlp_layer_types(config)
    first_dense = next((i for i, kind in enumerate(mlp_layer_types) if kind != "dense"), len(mlp_layer_types))
    out = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": KIMI_LINEAR_MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "kv_lora_rank": config.kv_lora_rank,
        "q_lora_rank": config.q_lora_rank,
        "qk_nope_head_dim": config.qk_head_dim - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": config.v_head_dim,
        "mla_use_nope": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i, t in enumerate(config.layer_types) if t == "full_attention"],
            "kda_layers": [i + 1 for i, t in enumerate(config.layer_types) if t == "linear_attention"],
            "num_heads": config.kda_num_heads,
            "head_dim": config.kda_head_dim,
            "short_conv_kernel_size": config.kda_short_conv_kernel_size,
        },
        "layer_types": list(config.layer_types),
        "mlp_layer_types": mlp_layer_types,
        "first_k_dense_replace": first_dense,
        "moe_layer_freq": 1,
        "num_experts": config.num_experts,
        "num_experts_per_token": config.num_experts_per_tok,
        "num_shared_experts": config.num_shared_experts,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": config.routed_scaling_factor,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": config.rms_norm_eps,
        "model_max_length": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        # a tied kdamoe head is written out as its own tensor: transformers' Kimi Linear class never ties
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    dtype = getattr(config, "dtype", None)
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    return out


def _rope_dim(config: KDAMoEConfig) -> int:
    return int(getattr(config, "qk_rope_head_dim", 0) or 0)


def _mla_eps(config: KDAMoEConfig) -> float:
    eps = getattr(config, "mla_rms_norm_eps", None)
    return float(config.rms_norm_eps if eps is None else eps)


def _mlp_layer_types(config: KDAMoEConfig) -> list[str]:
    types = getattr(config, "mlp_layer_types", None)
    if types is None:
        types = ["dense" if i < config.first_k_dense_replace else "sparse" for i in range(config.num_hidden_layers)]
    return list(types)


# ----------------------------------------------------------------------------------------------------
# Tensor maps
# ----------------------------------------------------------------------------------------------------
def _shape(shape) -> list[int]:
    return [int(s) for s in shape]


class _Fused:
    """One fused kdamoe tensor being assembled from its pieces (the KDA short conv, or an expert weight).

    Allocated once, at its full size, when the first piece arrives; each piece is copied into its slice and
    dropped, so at most the fused tensor is held."""

    def __init__(self, target: str, keys: list, piece_shape: list[int], place):
        self.target, self.keys, self.piece_shape, self.place = target, keys, piece_shape, place
        self.tensor = None
        self.sources: dict = {}

    def add(self, key, source: str, piece: torch.Tensor, full_shape: list[int]) -> None:
        if key in self.sources:
            raise ValueError(f"{source}: stored twice (also as {self.sources[key]})")
        if _shape(piece.shape) != self.piece_shape:
            raise ValueError(f"{source}: shape {_shape(piece.shape)}, expected {self.piece_shape} (a piece of "
                             f"{self.target} {full_shape})")
        if self.tensor is None:
            self.tensor = torch.empty(full_shape, dtype=piece.dtype, device=piece.device)
        elif piece.dtype != self.tensor.dtype:
            raise ValueError(f"{source}: dtype {piece.dtype}, but the other pieces of {self.target} are "
                             f"{self.tensor.dtype}")
        self.place(self.tensor, key, piece)
        self.sources[key] = source

    @property
    def complete(self) -> bool:
        return len(self.sources) == len(self.keys)


def _kimi_source_names(config: KDAMoEConfig) -> dict[str, tuple]:
    """``{Kimi Linear name: rule}`` for every tensor a Kimi Linear checkpoint of ``config`` holds except the
    per-expert weights (matched by pattern). A rule is ``("same", kdamoe name)``, ``("A_log", kdamoe name)`` or
    ``("conv", kdamoe name, part index)``."""
    names: dict[str, tuple] = {}

    def same(name, target=None):
        names[name] = ("same", target or name)

    same("model.embed_tokens.weight")
    same("model.norm.weight")
    same("lm_head.weight")
    mlp_types = _mlp_layer_types(config)
    for i, layer_type in enumerate(config.layer_types):
        p = f"model.layers.{i}."
        same(p + "input_layernorm.weight")
        same(p + "post_attention_layernorm.weight")
        a = p + "self_attn."
        if layer_type == "linear_attention":
            for proj in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj",
                         "o_proj"):
                same(f"{a}{proj}.weight")
            same(a + "dt_bias")
            same(a + "o_norm.weight")
            names[a + "A_log"] = ("A_log", a + "A_log")
            for j, part in enumerate(_CONV_PARTS):
                names[f"{a}{part}_conv1d.weight"] = ("conv", a + "conv1d.weight", j)
        else:
            if config.q_lora_rank is None:
                same(a + "q_proj.weight")
            else:
                for name in ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"):
                    same(a + name)
            same(a + "kv_a_proj_with_mqa.weight", a + "kv_a_proj.weight")
            for name in ("kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"):
                same(a + name)
        if mlp_types[i] == "dense":
            for proj in ("gate_proj", "up_proj", "down_proj"):
                same(f"{p}mlp.{proj}.weight")
            # The release names a dense MLP `mlp.`; transformers' save_pretrained writes `block_sparse_moe.` on every
            # layer (the reverse of its load-time rename `.block_sparse_moe.` → `.mlp.`). Both are read; `mlp.` is
            # written (the first name of a target is the one `kdamoe_to_kimi_linear_tensors` uses).
            for proj in ("gate_proj", "up_proj", "down_proj"):
                same(f"{p}block_sparse_moe.{proj}.weight", f"{p}mlp.{proj}.weight")
        else:
            same(p + "block_sparse_moe.gate.weight", p + "mlp.gate.weight")
            same(p + "block_sparse_moe.gate.e_score_correction_bias", p + "mlp.gate.e_score_correction_bias")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                same(f"{p}block_sparse_moe.shared_experts.{proj}.weight", f"{p}mlp.shared_experts.{proj}.weight")
    return names


def _expected_shape(expected_shapes: dict | None, name: str, sources: str, shape: list[int]) -> None:
    """``ValueError`` when a produced tensor is not in ``expected_shapes`` or has another shape there."""
    if expected_shapes is None:
        return
    if name not in expected_shapes:
        raise ValueError(f"unexpected tensor {sources} {shape}: the kdamoe model of this config has no {name}")
    want = _shape(expected_shapes[name])
    if shape != want:
        raise ValueError(f"{sources}: shape {shape}, expected {want} ({name} of the kdamoe model of this config)")


def kimi_linear_to_kdamoe_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: KDAMoEConfig,
    expected_shapes: dict[str, torch.Size | tuple | list] | None = None,
    optional: Iterable[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Kimi Linear checkpoint tensors → kdamoe tensors, streaming.

    Args:
        tensors: ``(name, tensor)`` pairs under the released names (module docstring's table), in any order, e.g.
            shard after shard; the per-expert ``w1/w2/w3`` of one layer may be spread over several shards.
        config: the kdamoe config (:func:`kimi_linear_to_kdamoe_config` of the checkpoint's ``config.json``).
        expected_shapes: ``{kdamoe name: shape}`` of the model to fill (its ``state_dict()`` on the meta device);
            given, the load is strict: every produced tensor must be there with that shape, and every name there must
            be produced (except ``optional``).
        optional: kdamoe names that may be absent (the LM head of a model with tied embeddings).

    Yields:
        ``(kdamoe name, tensor)``, each as soon as it is complete, in its stored dtype (a fused tensor in its pieces'
        dtype). ``A_log`` is reshaped ``[1, 1, H, 1] → [H]``.

    Raises:
        ValueError: naming the tensor and its shapes: a name no Kimi Linear checkpoint of this config holds (extra),
            a wrong shape, a piece stored twice or in another dtype than its siblings, an expert index
            ``≥ num_experts``, and at the end every tensor (or piece) that never came (missing).
    """
    rules = _kimi_source_names(config)
    sparse_layers = {i for i, kind in enumerate(_mlp_layer_types(config)) if kind == "sparse"}
    E = config.num_experts
    pending: dict[str, _Fused] = {}
    produced: set[str] = set()

    def emit(name: str, tensor: torch.Tensor, sources: str):
        if name in produced:  # e.g. a dense MLP stored under both of its names
            raise ValueError(f"{sources}: {name} is stored twice")
        _expected_shape(expected_shapes, name, sources, _shape(tensor.shape))
        produced.add(name)
        return name, tensor

    for source, tensor in tensors:
        rule = rules.get(source)
        if rule is not None and rule[0] == "same":
            yield emit(rule[1], tensor, source)
            continue
        if rule is not None and rule[0] == "A_log":
            H = config.kda_num_heads
            if _shape(tensor.shape) not in ([1, 1, H, 1], [H]):
                raise ValueError(f"{source}: shape {_shape(tensor.shape)}, expected [1, 1, {H}, 1] "
                                 f"(kda_num_heads={H})")
            yield emit(rule[1], tensor.reshape(H), source)
            continue
        if rule is not None and rule[0] == "conv":
            target, part = rule[1], rule[2]
            width = config.kda_num_heads * config.kda_head_dim
            W = config.kda_short_conv_kernel_size
            fused = pending.get(target)
            if fused is None:
                fused = pending[target] = _Fused(target, list(range(3)), [width, 1, W], _place_conv)
            fused.add(part, source, tensor, [3 * width, 1, W])
        else:
            match = _LAYER.fullmatch(source)
            expert = _EXPERT.fullmatch(match.group(2)) if match else None
            if expert is None or int(match.group(1)) not in sparse_layers:
                raise ValueError(f"unexpected tensor {source} {_shape(tensor.shape)}: a Kimi Linear checkpoint of "
                                 "this config has no such tensor")
            layer, j, which = int(match.group(1)), int(expert.group(1)), expert.group(2)
            if j >= E:
                raise ValueError(f"unexpected tensor {source} {_shape(tensor.shape)}: expert {j} >= num_experts={E}")
            inter, d = config.moe_intermediate_size, config.hidden_size
            p = f"model.layers.{layer}.mlp.experts."
            if which == "w2":
                target, key, full, piece = p + "down_proj", j, [E, d, inter], [d, inter]
                place = _place_down
            else:
                target, key, full, piece = p + "gate_up_proj", (which, j), [E, 2 * inter, d], [inter, d]
                place = _place_gate_up
            fused = pending.get(target)
            if fused is None:
                keys = list(range(E)) if which == "w2" else [(w, e) for w in ("w1", "w3") for e in range(E)]
                fused = pending[target] = _Fused(target, keys, piece, place)
            fused.add(key, source, tensor, full)
        if fused.complete:
            del pending[target]
            yield emit(target, fused.tensor, ", ".join(str(s) for s in fused.sources.values()))

    problems = []
    for target, fused in pending.items():
        missing = [k for k in fused.keys if k not in fused.sources]
        problems.append(f"{target} lacks {len(missing)} of its {len(fused.keys)} pieces "
                        f"(first: {_piece_name(target, missing[0])})")
    if expected_shapes is not None:
        optional = set(optional)
        for name in sorted(set(expected_shapes) - produced - set(pending) - optional):
            problems.append(f"missing {_kimi_name_of(name)} (→ {name} {_shape(expected_shapes[name])})")
    if problems:
        raise ValueError("the Kimi Linear checkpoint is incomplete: " + "; ".join(problems[:6])
                         + (f"; and {len(problems) - 6} more" if len(problems) > 6 else ""))


def _place_conv(full: torch.Tensor, part: int, piece: torch.Tensor) -> None:
    width = piece.shape[0]  # q, k, v in this order: the order the fused conv's channels (and fla's) are in
    full[part * width:(part + 1) * width].copy_(piece)


def _place_down(full: torch.Tensor, j: int, piece: torch.Tensor) -> None:
    full[j].copy_(piece)


def _place_gate_up(full: torch.Tensor, key: tuple, piece: torch.Tensor) -> None:
    which, j = key
    inter = piece.shape[0]
    # gate (w1) rows first, then up (w3): the order the experts' `chunk(2)` reads in both models
    rows = slice(0, inter) if which == "w1" else slice(inter, 2 * inter)
    full[j, rows].copy_(piece)


def _piece_name(target: str, key) -> str:
    """The Kimi Linear name of one missing piece of a fused kdamoe tensor."""
    if target.endswith("conv1d.weight"):
        return target.replace("conv1d.weight", f"{_CONV_PARTS[key]}_conv1d.weight")
    base = target.replace(".mlp.experts.", ".block_sparse_moe.experts.").rsplit(".", 1)[0]
    if isinstance(key, tuple):
        return f"{base}.{key[1]}.{key[0]}.weight"
    return f"{base}.{key}.w2.weight"


def _kimi_name_of(name: str) -> str:
    """The Kimi Linear name(s) a kdamoe tensor comes from (for messages)."""
    if name.endswith("self_attn.conv1d.weight"):
        return name.replace("conv1d.weight", "{q,k,v}_conv1d.weight")
    if name.endswith("kv_a_proj.weight"):
        return name.replace("kv_a_proj", "kv_a_proj_with_mqa")
    expert = _FUSED_EXPERT.search(name)
    if expert:
        base = name[: expert.start()] + "block_sparse_moe.experts.{j}."
        return base + ("{w1,w3}.weight" if expert.group(1) == "gate_up_proj" else "w2.weight")
    return name.replace(".mlp.", ".block_sparse_moe.") if ".mlp.gate." in name or ".mlp.shared_experts." in name \
        else name


def kdamoe_to_kimi_linear_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: KDAMoEConfig,
    expected_shapes: dict[str, torch.Size | tuple | list] | None = None,
    optional: Iterable[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """kdamoe tensors → Kimi Linear checkpoint tensors (the released names), streaming.

    Args:
        tensors: ``(kdamoe name, tensor)`` pairs (a ``state_dict()``'s items, or a folder's shards), any order.
        config: the kdamoe config; :func:`kdamoe_to_kimi_linear_config` must accept it (call it first: it names the
            option Kimi Linear lacks).
        expected_shapes: ``{kdamoe name: shape}`` of the model ``config`` builds; given, the input is checked
            strictly (unknown name, wrong shape, and at the end every missing name except ``optional``).
        optional: kdamoe names that may be absent (a tied LM head).

    Yields:
        ``(Kimi Linear name, tensor)``: the conv split into ``q/k/v_conv1d``, the experts into per-expert
        ``w1``/``w3``/``w2`` (each a contiguous copy, so safetensors stores no shared storage), ``A_log`` as
        ``[1, 1, H, 1]`` (zeros, float32, for a model without ``A_log``: ``exp(0) = 1`` is the same gate).

    Raises:
        ValueError: naming the tensor and its shapes, as :func:`kimi_linear_to_kdamoe_tensors`; a kdamoe tensor with
            no Kimi Linear counterpart (e.g. a KDA ``g_b_proj.bias``) is "unexpected".
    """
    reverse = {}
    for kimi_name, rule in _kimi_source_names(config).items():
        if rule[0] in ("same", "A_log"):
            reverse.setdefault(rule[1], (rule[0], kimi_name))
    H, K = config.kda_num_heads, config.kda_head_dim
    with_A_log = bool(getattr(config, "kda_use_A_log", False))
    sparse_layers = {i for i, kind in enumerate(_mlp_layer_types(config)) if kind == "sparse"}
    seen: set[str] = set()
    tied = bool(config.tie_word_embeddings)
    for name, tensor in tensors:
        _expected_shape(expected_shapes, name, name, _shape(tensor.shape))
        seen.add(name)
        if tied and name == "lm_head.weight":
            continue  # written from the embeddings below (a state dict lists the tied head too)
        rule = reverse.get(name)
        if tied and name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor.clone()
        if rule is not None and rule[0] == "same":
            yield rule[1], tensor
            if not with_A_log and name.endswith("self_attn.dt_bias"):
                # Kimi Linear always has A_log: zeros keep the gate −softplus(f + dt_bias) of a model without one
                yield name.replace("dt_bias", "A_log"), torch.zeros(1, 1, H, 1, dtype=torch.float32)
            continue
        if rule is not None and rule[0] == "A_log":
            yield rule[1], tensor.reshape(1, 1, H, 1).clone()
            continue
        match = _LAYER.fullmatch(name)
        rest = match.group(2) if match else ""
        layer = int(match.group(1)) if match else -1
        if (rest == "self_attn.conv1d.weight" and 0 <= layer < config.num_hidden_layers
                and config.layer_types[layer] == "linear_attention"):
            for part, piece in zip(_CONV_PARTS, tensor.split(H * K, dim=0), strict=True):
                yield f"model.layers.{layer}.self_attn.{part}_conv1d.weight", piece.clone()
            continue
        expert = _FUSED_EXPERT.fullmatch(rest)
        if expert and layer in sparse_layers:
            base = f"model.layers.{layer}.block_sparse_moe.experts."
            if expert.group(1) == "down_proj":
                for j in range(tensor.shape[0]):
                    yield f"{base}{j}.w2.weight", tensor[j].clone()
            else:
                gate, up = tensor.chunk(2, dim=1)
                for j in range(tensor.shape[0]):
                    yield f"{base}{j}.w1.weight", gate[j].clone()
                    yield f"{base}{j}.w3.weight", up[j].clone()
            continue
        raise ValueError(f"unexpected tensor {name} {_shape(tensor.shape)}: it has no Kimi Linear counterpart")
    if expected_shapes is not None:
        missing = sorted(set(expected_shapes) - seen - set(optional))
        if missing:
            raise ValueError("the kdamoe weights are incomplete: missing "
                             + ", ".join(f"{k} {_shape(expected_shapes[k])}" for k in missing[:6])
                             + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))


# ----------------------------------------------------------------------------------------------------
# Loading a Kimi Linear folder or Hub id into kdamoe
# ----------------------------------------------------------------------------------------------------
def read_config_dict(pretrained, hub_kwargs: dict | None = None) -> dict | None:
    """The parsed ``config.json`` of a folder or Hub id, or None when there is none (or ``pretrained`` is not a
    path / id)."""
    if not isinstance(pretrained, (str, os.PathLike)):
        return None
    from transformers.utils import cached_file  # noqa: PLC0415 (transformers' hub utilities, needed only here)

    hub_kwargs = {k: v for k, v in (hub_kwargs or {}).items() if k in HUB_ARGUMENTS and v is not None}
    try:
        path = cached_file(pretrained, "config.json", _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **hub_kwargs)
    except (OSError, ValueError):  # not a folder nor a valid Hub id: the caller's own loading says so in its words
        return None
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err


def checkpoint_files(pretrained, hub_kwargs: dict | None = None) -> list[str]:
    """The safetensors files of a folder or Hub id (one ``model.safetensors`` or the shards its index lists, in the
    index's order), downloaded when needed.

    Raises:
        ValueError: when neither ``model.safetensors`` nor ``model.safetensors.index.json`` exists.
    """
    from transformers.utils import cached_file  # noqa: PLC0415
    from transformers.utils.hub import get_checkpoint_shard_files  # noqa: PLC0415

    hub_kwargs = {k: v for k, v in (hub_kwargs or {}).items() if k in HUB_ARGUMENTS and v is not None}
    index = cached_file(pretrained, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False,
                        **hub_kwargs)
    if index is not None:
        try:
            files, _ = get_checkpoint_shard_files(pretrained, index, **hub_kwargs)
        except json.JSONDecodeError as err:
            raise ValueError(f"{index}: not valid JSON ({err})") from err
        except (OSError, KeyError) as err:  # a shard the index lists is absent, or the index has no weight_map
            raise ValueError(f"{index}: its shards cannot be read ({type(err).__name__}: {err})") from err
        return list(files)
    single = cached_file(pretrained, "model.safetensors", _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    if single is None:
        raise ValueError(f"{pretrained}: no model.safetensors or model.safetensors.index.json")
    return [single]


def iter_safetensors(files: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor of the files, one file open at a time, one tensor read at a time."""
    from safetensors import safe_open  # noqa: PLC0415 (a transformers dependency)

    for file in files:
        with _open_safetensors(safe_open, file) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _open_safetensors(safe_open, file):
    """``safe_open(file)``; a file that is absent or that safetensors cannot read (truncated, not safetensors) is a
    ``ValueError`` naming it."""
    if not os.path.isfile(file):
        raise ValueError(f"{file}: no such file (a shard the checkpoint's index lists)")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as err:  # safetensors' SafetensorError (not an OSError) says what, not which file
        raise ValueError(f"{file}: not a readable safetensors file (truncated or corrupt?): {err}") from err


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def iter_safetensors_shapes(files: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, meta tensor)`` of every tensor of the files: the stored shape and dtype, read from the headers only
    (nothing is loaded); fed to :func:`kimi_linear_to_kdamoe_tensors` it checks a checkpoint strictly for free."""
    from safetensors import safe_open  # noqa: PLC0415 (a transformers dependency)

    for file in files:
        with _open_safetensors(safe_open, file) as f:
            for name in f.keys():
                part = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(part.get_dtype(), torch.float32)
                yield name, torch.empty(part.get_shape(), dtype=dtype, device="meta")


def check_kimi_linear_folder(folder, cls) -> None:
    """Check a Kimi Linear folder's tensor names and shapes against the ``cls`` model its ``config.json`` translates
    to, reading the safetensors headers only (what :func:`from_kimi_linear_pretrained` checks while it loads).

    Raises:
        ValueError: naming the field or the tensor, as :func:`kimi_linear_to_kdamoe_config` and
            :func:`kimi_linear_to_kdamoe_tensors`.
    """
    kimi = read_config_dict(str(folder))
    config = KDAMoEConfig(**kimi_linear_to_kdamoe_config(kimi))
    with torch.device("meta"):
        model = cls(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    for _ in kimi_linear_to_kdamoe_tensors(iter_safetensors_shapes(checkpoint_files(str(folder))), config, expected,
                                           tied):
        pass


def _resolve_dtype(dtype) -> torch.dtype | None:
    """``dtype=`` of ``from_pretrained`` → a ``torch.dtype``, or None for ``"auto"`` / None (as stored)."""
    if dtype is None or dtype == "auto":
        return None
    resolved = dtype
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
    if isinstance(resolved, torch.dtype) and resolved.is_floating_point:
        return resolved
    # an integer dtype would fail deep inside load_state_dict; the weights are floating point
    raise ValueError(f"dtype is {dtype!r}: expected a floating-point torch.dtype, its name (e.g. 'bfloat16') or "
                     "'auto'")


def from_kimi_linear_pretrained(cls, pretrained, kimi_config: dict, kwargs: dict):
    """Load a Kimi Linear folder or Hub id as ``cls`` (``KDAMoEForCausalLM``); what its ``from_pretrained`` runs
    when the ``config.json`` says ``model_type: kimi_linear``.

    The config is translated (:func:`kimi_linear_to_kdamoe_config`; routers frozen, ``router_bias_update="none"``,
    unless ``kwargs`` sets it) and the model built on the ``meta`` device (no memory); the shards are read one at a
    time and mapped (:func:`kimi_linear_to_kdamoe_tensors`) strictly against that model's tensor names and shapes, each
    tensor cast to ``dtype`` as it comes (the tensors of :data:`FP32_TENSOR_SUFFIXES` stay float32, as transformers'
    ``_keep_in_fp32_modules_strict`` keeps them), and the mapped tensors become the model's own
    (``load_state_dict(..., assign=True)``: no second copy). The model is returned in eval mode, with the folder's
    ``generation_config.json`` when it has one.

    Args:
        cls: the model class (``KDAMoEForCausalLM`` or a subclass: the checkpoint has an LM head).
        pretrained: folder or Hub id.
        kimi_config: its parsed ``config.json``.
        kwargs: ``from_pretrained``'s keyword arguments. Taken: ``dtype`` / ``torch_dtype`` (a dtype, its name or
            ``"auto"``: as stored), ``device_map`` (None or ``"cpu"``), the Hub arguments of :data:`HUB_ARGUMENTS`,
            ``trust_remote_code`` (not needed), ``attn_implementation``, ``experts_implementation``, ``use_kernels``
            (off only), and any ``KDAMoEConfig`` field (``router_bias_update``, ``kernel_backend``, ...), which
            overrides the translated value.

    Returns:
        the ``cls`` model on the CPU.

    Raises:
        ValueError: a keyword argument not in that list, naming it; a ``device_map`` other than None / "cpu";
            ``use_kernels=True``; a config kdamoe cannot represent (:func:`kimi_linear_to_kdamoe_config`); a missing,
            extra or wrongly shaped tensor (:func:`kimi_linear_to_kdamoe_tensors`); a ``cls`` that is not a
            ``KDAMoEForCausalLM``.
    """
    if not any(base.__name__ == "KDAMoEForCausalLM" for base in cls.__mro__):
        raise ValueError(f"{cls.__name__} cannot load a Kimi Linear checkpoint (it holds a causal LM): use "
                         "KDAMoEForCausalLM")
    kwargs = dict(kwargs)
    hub = {k: kwargs.pop(k) for k in HUB_ARGUMENTS if k in kwargs}
    kwargs.pop("trust_remote_code", None)
    attn_implementation = kwargs.pop("attn_implementation", None)
    experts_implementation = kwargs.pop("experts_implementation", None)
    if kwargs.pop("use_kernels", None):
        raise ValueError("use_kernels=True: loading a Kimi Linear checkpoint does not kernelize; convert it first "
                         "(`kdamoe-convert SRC DST --to kda_moe`) and load DST")
    dtype = kwargs.pop("dtype", None)
    torch_dtype = kwargs.pop("torch_dtype", None)
    dtype = _resolve_dtype(dtype if dtype is not None else torch_dtype)
    device_map = kwargs.pop("device_map", None)
    if device_map not in (None, "cpu"):
        raise ValueError(f"device_map={device_map!r}: loading a Kimi Linear checkpoint takes device_map=None or 'cpu' "
                         "(convert it first with `kdamoe-convert SRC DST --to kda_moe`, then load DST with any "
                         "device_map), or move the model with .to() after loading")
    config_kwargs = kimi_linear_to_kdamoe_config(kimi_config)
    own_fields = set(KDAMoEConfig().to_dict()) | set(config_kwargs)
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in own_fields}
    if kwargs:
        raise ValueError(f"from_pretrained of a Kimi Linear checkpoint does not take {sorted(kwargs)}; it takes dtype, "
                         f"device_map=None, {', '.join(HUB_ARGUMENTS)}, attn_implementation, experts_implementation "
                         "and KDAMoEConfig fields")
    config_kwargs.update(overrides)
    if dtype is not None:
        config_kwargs["dtype"] = str(dtype).removeprefix("torch.")
    config = KDAMoEConfig(**config_kwargs)
    config._name_or_path = str(pretrained)

    with torch.device("meta"):
        model = cls(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    state_dict = {}
    for name, tensor in kimi_linear_to_kdamoe_tensors(iter_safetensors(checkpoint_files(pretrained, hub)), config,
                                                      expected, tied):
        # The float32 tensors are float32 whatever the dtype, also when none is given ("as stored"): transformers'
        # class upcasts them from a bf16 shard too.
        if tensor.is_floating_point() and name.endswith(FP32_TENSOR_SUFFIXES):
            tensor = tensor.to(torch.float32)
        elif dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state_dict[name] = tensor
    # Every name and shape was checked above; `strict` only leaves out a tied head, tied again below.
    model.load_state_dict(state_dict, strict=not (tied - set(state_dict)), assign=True)
    del state_dict
    if tied:
        model.tie_weights()
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    if experts_implementation is not None:
        model.set_experts_implementation(experts_implementation)
    _load_generation_config(model, pretrained, hub)
    return model.eval()


def _load_generation_config(model, pretrained, hub: dict) -> None:
    """The folder's ``generation_config.json``, when it has one, replaces the one built from the config."""
    from transformers import GenerationConfig  # noqa: PLC0415

    try:
        model.generation_config = GenerationConfig.from_pretrained(pretrained, **hub)
    except OSError:  # none in the folder: keep the default built from the config
        pass


__all__ = [
    "KIMI_LINEAR_MODEL_TYPE",
    "check_kimi_linear_folder",
    "LOADED_ROUTER_BIAS_UPDATE",
    "from_kimi_linear_pretrained",
    "is_kimi_linear_config",
    "kdamoe_to_kimi_linear_config",
    "kdamoe_to_kimi_linear_tensors",
    "kimi_linear_to_kdamoe_config",
    "kimi_linear_to_kdamoe_tensors",
]
