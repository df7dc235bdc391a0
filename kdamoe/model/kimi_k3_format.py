"""Moonshot's Kimi K3 checkpoint format (``model_type="kimi_k3"``, text model) and kdamoe's, both ways.

Kimi K3's text model is a kdamoe model with the lower-bounded KDA gate and a per-head ``A_log``, the full-rank KDA
output gate (``kda_full_rank_output_gate``), MLA with a shared key part, an output gate (``mla_output_gate``) and its
norms at eps 1e-6, a SiTU-GLU latent MoE whose routed weights are scaled by ``routed_scaling_factor``
(``latent_moe_routed_scaling``) and Block Attention Residuals (docs/checkpoints.md, section Kimi K3, compares the
pieces). This module holds, importing only torch and this folder (it ships next to the weights as remote code):

* the config translation both ways (:func:`kimi_k3_to_kdamoe_config`, :func:`kdamoe_to_kimi_k3_config`), refusing,
  with a ``ValueError`` naming the field, what the other side cannot represent;
* the tensor map both ways as generators over ``(name, tensor)`` pairs (:func:`kimi_k3_to_kdamoe_tensors`,
  :func:`kdamoe_to_kimi_k3_tensors`), streaming as the Kimi Linear map does: only the fused tensors still waiting
  for a piece are held;
* :func:`from_kimi_k3_pretrained`, what ``KDAMoEForCausalLM.from_pretrained`` runs for a folder whose
  ``config.json`` says ``model_type: kimi_k3``.

Names (the released layout as NeMo AutoModel 0.7.0's K3 state-dict adapter writes it; every text tensor is under
``language_model.``, shown here without it; per layer ``model.layers.{i}.``):

=================================================================  ===============================================
Kimi K3                                                             kdamoe
=================================================================  ===============================================
``model.output_attn_res_proj.weight [1, d]`` / ``…_norm.weight``    ``model.final_res.query`` / ``….key_norm.weight``
``self_attention_res_proj.weight [1, d]`` / ``…_norm.weight``       ``attn_res.query [d]`` / ``….key_norm.weight``
``mlp_res_proj.weight [1, d]`` / ``mlp_res_norm.weight``            ``mlp_res.query [d]`` / ``….key_norm.weight``
``self_attn.{q,k,v}_conv1d.weight [H·K, 1, W]`` (three)             ``self_attn.conv1d.weight [3·H·K, 1, W]`` (q|k|v)
``self_attn.A_log [H padded to a multiple of 128]``                 ``self_attn.A_log [H]``
``self_attn.kv_a_proj_with_mqa.weight``                             ``self_attn.kv_a_proj.weight``
``block_sparse_moe.`` (MoE layers)                                  ``mlp.``
``block_sparse_moe.routed_expert_{down_proj,norm,up_proj}.weight``  ``mlp.latent_{down_proj,norm,up_proj}.weight``
``block_sparse_moe.experts.{j}.w1.weight_packed / .weight_scale``   ``mlp.experts.gate_up_proj [E, 2I, ℓ]`` (gate rows,
(MXFP4, uint8 ``[I, ℓ/2]`` / ``[I, ℓ/32]``), ``w3`` the same        then up rows), decoded exactly
``block_sparse_moe.experts.{j}.w2.weight_packed / .weight_scale``   ``mlp.experts.down_proj [E, ℓ, I]``
every other text tensor                                             the same name and shape
``vision_tower.*``, ``mm_projector.*``                              skipped on load (counted in one log line)
=================================================================  ===============================================

An expert projection may also be stored unquantized as ``….w1.weight`` (what :func:`kdamoe_to_kimi_k3_tensors` writes
with ``experts_format="bf16"``; the config then says ``"routed_experts_format": "bf16"``). MXFP4 is decoded by
:mod:`.mxfp4` and encoded by it on export (round to nearest E2M1 per block of 32 with the compressed-tensors scale
rule; decoding then re-encoding a decoded tensor gives back the same bytes, ``tests/test_kimi_k3_checkpoints.py``).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Iterator

import torch
from transformers.utils import logging

from .checkpoint_formats import (
    LOADED_ROUTER_BIAS_UPDATE,
    PieceAssembler,
    build_config,
    check_all_seen,
    check_dtype_name,
    check_expected_shape,
    check_folder,
    fused_source_pattern,
    incomplete_error,
    kda_layer_rules,
    load_streamed,
    parse_load_kwargs,
    split_fused,
    stored_piece_name,
)
from .checkpoint_formats import shape_list as _shape  # short: it is in most messages below
from .configuration_kdamoe import KDAMoEConfig
from .mxfp4 import MXFP4_BLOCK, mxfp4_decode, mxfp4_encode

logger = logging.get_logger(__name__)

KIMI_K3_MODEL_TYPE = "kimi_k3"
TEXT_PREFIX = "language_model."
# Top-level key prefixes of the vision tower and projector (NeMo's adapter and sglang's loader send these to the
# vision model): a text model has nothing to load them into.
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# K3's MLA q_a / kv_a norms are built without an eps argument in NeMo AutoModel's KimiMLAAttention: its RMSNorm
# default, 1e-6 (every other K3 norm uses rms_norm_eps). sglang 0.5.23 uses rms_norm_eps there (docs/checkpoints.md).
KIMI_K3_MLA_RMS_NORM_EPS = 1e-6
# A_log is stored zero-padded to a multiple of this many entries (NeMo's `_pad_checkpoint_a_log`).
A_LOG_PAD = 128
EXPERTS_FORMATS = ("mxfp4", "bf16")
# The config key saying how the routed experts are stored (written by kdamoe's export; a checkpoint without it is
# read from its tensor names, which say the same).
EXPERTS_FORMAT_KEY = "routed_experts_format"
# Text-config fields of a released K3 config that kdamoe reads at a fixed value (field: accepted value).
_FIXED = {"mla_use_nope": True, "latent_moe_use_norm": True, "moe_renormalize": True,
          "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1, "topk_method": "noaux_tc"}

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight_packed|weight_scale|weight)")


# ----------------------------------------------------------------------------------------------------
# Config translation
# ----------------------------------------------------------------------------------------------------
def is_kimi_k3_config(config_dict: dict) -> bool:
    """Whether a ``config.json`` (as a dict) describes a Kimi K3 checkpoint."""
    return isinstance(config_dict, dict) and config_dict.get("model_type") == KIMI_K3_MODEL_TYPE


def _field(text: dict, name: str, default=None, required: bool = True):
    if name in text and text[name] is not None:
        return text[name]
    if required:
        raise ValueError(f"text_config.{name} is missing: kdamoe needs it to build the Kimi K3 text model")
    return default


def _int_field(text: dict, name: str, default=None, required: bool = True, minimum: int = 1) -> int:
    """A text-config integer the translation computes with (sums, ranges, comparisons): anything else would fail
    there with a TypeError naming no field, or build a wrong layer list (``True`` is an ``int`` to Python)."""
    value = _field(text, name, default, required)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"text_config.{name} is {value!r}: expected an integer >= {minimum}")
    return value


def _layer_numbers(linear: dict, name: str) -> set[int]:
    """``linear_attn_config.full_attn_layers`` / ``kda_layers``: a list of 1-based layer numbers (absent: none)."""
    value = linear.get(name)
    if value is None:
        return set()
    if not isinstance(value, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in value):
        raise ValueError(f"text_config.linear_attn_config.{name} is {value!r}: expected a list of 1-based layer "
                         "numbers (integers)")
    return set(value)


# compressed-tensors' name of the scheme the routed experts are stored in (its CompressionFormat
# "mxfp4-pack-quantized"; sglang reads K3's quantization_config as a compressed-tensors config whose format names
# mxfp4, docs/checkpoints.md): another scheme's tensors are not decoded here.
_QUANT_METHOD = "compressed-tensors"


def _check_quantization_config(config, where: str) -> None:
    """Refuse a ``quantization_config`` naming a scheme other than compressed-tensors' MXFP4. The loader reads the
    storage from the tensor names (``weight_packed`` / ``weight_scale`` decoded as MXFP4, ``weight`` as is), so a
    config of another scheme means tensors it would misread had they the same names. Fields other than
    ``quant_method`` and ``format`` (top level, or per ``config_groups`` entry) are not read: the released values are
    not known (docs/checkpoints.md, "The released config")."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise ValueError(f"{where} is {config!r}: expected a dict (compressed-tensors' MXFP4 config) or none")
    method = config.get("quant_method")
    if method != _QUANT_METHOD:
        raise ValueError(f"{where}.quant_method is {method!r}: kdamoe reads Kimi K3's routed experts as "
                         f"{_QUANT_METHOD!r} MXFP4 (weight_packed / weight_scale) or unquantized only")
    groups = config.get("config_groups") or {}
    formats = {f"{where}.format": config.get("format")}
    if isinstance(groups, dict):
        formats.update({f"{where}.config_groups.{k}.format": g.get("format") for k, g in groups.items()
                        if isinstance(g, dict)})
    named = {k: v for k, v in formats.items() if v is not None}
    if named and not any(isinstance(v, str) and "mxfp4" in v for v in named.values()):
        key, value = next(iter(named.items()))
        raise ValueError(f"{key} is {value!r}: kdamoe decodes compressed-tensors' MXFP4 "
                         "('mxfp4-pack-quantized') only")


def kimi_k3_to_kdamoe_config(k3: dict) -> dict:
    """The ``KDAMoEConfig`` keyword arguments of a Kimi K3 ``config.json`` (its ``text_config``).

    Set beyond the fields read one for one: ``kda_use_A_log=True``, ``kda_full_rank_output_gate=True``,
    ``mla_rms_norm_eps=1e-6`` (:data:`KIMI_K3_MLA_RMS_NORM_EPS`), ``latent_moe_routed_scaling=True``,
    ``hidden_act="situ"``, ``router_bias_update="none"`` (the loaded biases stay as released unless the caller picks a
    rule), ``layer_types`` from ``linear_attn_config``'s 1-based ``full_attn_layers`` / ``kda_layers``,
    ``attnres_num_blocks = ceil(L / attn_res_block_size)`` (a block counts decoder layers, as K3's
    ``layer_idx % attn_res_block_size == 0`` starts a block; kdamoe's blocks are ``ceil(L / N)`` layers, so the size
    must be reachable that way).

    Args:
        k3: the parsed ``config.json`` (``model_type`` ``"kimi_k3"``, with a ``text_config``).

    Returns:
        ``dict`` of ``KDAMoEConfig`` keyword arguments (plain JSON values).

    Raises:
        ValueError: naming the field, for a missing field or a value kdamoe cannot represent exactly: a
            ``text_config.model_type`` other than ``kimi_linear``, ``num_key_value_heads`` ≠ ``num_attention_heads``,
            ``hidden_act`` not situ, ``gate_lower_bound`` None, ``use_full_rank_gate`` false (K3's low-rank gate
            tensors are not known here), ``q_lora_rank`` None, no ``routed_expert_hidden_size`` (no latent), no shared
            expert, grouped routing, a field of :data:`_FIXED` at another value, MTP layers, a layer in neither or both
            layer lists, an ``attn_res_block_size`` that ``ceil(L / N)`` cannot give, an unknown
            ``routed_experts_format``; a value of the wrong type (``num_hidden_layers``, ``first_k_dense_replace``,
            ``qk_nope_head_dim`` / ``qk_rope_head_dim`` not integers, layer lists not lists of integers, a ``dtype``
            that names no floating-point torch dtype); a ``quantization_config`` (top level or in ``text_config``)
            of another scheme than compressed-tensors' MXFP4.
    """
    if not is_kimi_k3_config(k3):
        raise ValueError(f"model_type is {k3.get('model_type') if isinstance(k3, dict) else k3!r}, "
                         f"expected {KIMI_K3_MODEL_TYPE!r}")
    text = k3.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"text_config is {text!r}: a Kimi K3 config.json holds its text model's config there")
    if text.get("model_type", "kimi_linear") != "kimi_linear":
        raise ValueError(f"text_config.model_type is {text['model_type']!r}, expected 'kimi_linear'")
    _check_quantization_config(k3.get("quantization_config"), "quantization_config")
    _check_quantization_config(text.get("quantization_config"), "text_config.quantization_config")
    experts_format = k3.get(EXPERTS_FORMAT_KEY, "mxfp4")
    if experts_format not in EXPERTS_FORMATS:
        raise ValueError(f"{EXPERTS_FORMAT_KEY} is {experts_format!r}; expected one of {EXPERTS_FORMATS}")
    for name, value in _FIXED.items():
        if text.get(name, value) != value:
            raise ValueError(f"text_config.{name} is {text[name]!r}: kdamoe reads Kimi K3 with {name}={value!r}")
    if text.get("num_nextn_predict_layers") or 0:
        raise ValueError(f"text_config.num_nextn_predict_layers is {text['num_nextn_predict_layers']!r}: kdamoe has "
                         "no multi-token-prediction layers")
    heads = _field(text, "num_attention_heads")
    if text.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"text_config.num_key_value_heads is {text['num_key_value_heads']!r}, num_attention_heads "
                         f"{heads!r}: kdamoe's MLA expands its latent to one key/value per query head")
    if _field(text, "hidden_act") != "situ":
        raise ValueError(f"text_config.hidden_act is {text['hidden_act']!r}: kdamoe reads Kimi K3 with 'situ' "
                         "(SiTU-GLU) only")
    n_group, topk_group = text.get("num_expert_group") or 1, text.get("topk_group") or 1
    if n_group > 1 and topk_group < n_group:
        raise ValueError(f"text_config.num_expert_group is {n_group} with topk_group {topk_group}: kdamoe's router "
                         "has no group-limited routing")
    if not text.get("num_shared_experts"):
        raise ValueError(f"text_config.num_shared_experts is {text.get('num_shared_experts')!r}: kdamoe reads Kimi K3 "
                         "with shared experts only")
    if text.get("q_lora_rank") is None:
        raise ValueError("text_config.q_lora_rank is None: kdamoe reads Kimi K3's MLA with a low-rank query "
                         "(q_a_proj / q_b_proj) only")
    if text.get("routed_expert_hidden_size") is None:
        raise ValueError("text_config.routed_expert_hidden_size is missing: kdamoe reads Kimi K3's latent MoE only")

    linear = _field(text, "linear_attn_config")
    if not isinstance(linear, dict):
        raise ValueError(f"text_config.linear_attn_config is {linear!r}, expected a dict")
    if linear.get("gate_lower_bound") is None:
        raise ValueError("text_config.linear_attn_config.gate_lower_bound is None: kdamoe reads Kimi K3 with the "
                         "lower-bounded KDA gate only")
    if linear.get("use_full_rank_gate", True) is not True:
        raise ValueError(f"text_config.linear_attn_config.use_full_rank_gate is {linear['use_full_rank_gate']!r}: "
                         "kdamoe reads Kimi K3 with the full-rank KDA output gate (g_proj) only")
    L = _int_field(text, "num_hidden_layers")
    full, kda = _layer_numbers(linear, "full_attn_layers"), _layer_numbers(linear, "kda_layers")
    layer_types = []
    for i in range(1, L + 1):
        if (i in full) == (i in kda):
            raise ValueError(f"text_config.linear_attn_config: layer {i} (1-based) is in "
                             f"{'both' if i in full else 'neither'} of full_attn_layers and kda_layers")
        layer_types.append("full_attention" if i in full else "linear_attention")
    if max(full | kda) > L:
        raise ValueError(f"text_config.linear_attn_config names layer {max(full | kda)} (1-based) of {L}")

    block = _field(text, "attn_res_block_size")
    if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= L:
        raise ValueError(f"text_config.attn_res_block_size is {block!r}: expected an integer in [1, {L}]")
    num_blocks = math.ceil(L / block)
    if math.ceil(L / num_blocks) != block:
        raise ValueError(f"text_config.attn_res_block_size is {block} with {L} layers: kdamoe's Block AttnRes blocks "
                         f"are ceil(num_hidden_layers / attnres_num_blocks) layers, and no block count gives {block}")
    first_dense = _int_field(text, "first_k_dense_replace", 0, required=False, minimum=0)

    kwargs = dict(
        vocab_size=_field(text, "vocab_size"),
        hidden_size=_field(text, "hidden_size"),
        num_hidden_layers=L,
        layer_types=layer_types,
        num_attention_heads=heads,
        kv_lora_rank=_field(text, "kv_lora_rank"),
        q_lora_rank=text["q_lora_rank"],
        qk_head_dim=_int_field(text, "qk_nope_head_dim") + _int_field(text, "qk_rope_head_dim", minimum=0),
        qk_rope_head_dim=text["qk_rope_head_dim"],
        v_head_dim=_field(text, "v_head_dim"),
        mla_rms_norm_eps=KIMI_K3_MLA_RMS_NORM_EPS,
        mla_output_gate=bool(text.get("mla_use_output_gate", False)),
        kda_num_heads=_linear_field(linear, "num_heads"),
        kda_head_dim=_linear_field(linear, "head_dim"),
        kda_short_conv_kernel_size=linear.get("short_conv_kernel_size", 4),
        kda_lower_bound=float(linear["gate_lower_bound"]),
        kda_use_A_log=True,
        kda_full_rank_output_gate=True,
        kda_output_gate_bias=False,
        num_experts=_field(text, "num_experts"),
        num_experts_per_tok=_field(text, "num_experts_per_token"),
        num_shared_experts=text["num_shared_experts"],
        moe_intermediate_size=_field(text, "moe_intermediate_size"),
        moe_latent_size=text["routed_expert_hidden_size"],
        first_k_dense_replace=first_dense,
        mlp_layer_types=["dense" if i < first_dense else "sparse" for i in range(L)],
        intermediate_size=_field(text, "intermediate_size"),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        latent_moe_routed_scaling=True,
        router_bias_update=LOADED_ROUTER_BIAS_UPDATE,
        hidden_act="situ",
        situ_beta=float(text.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(text.get("activation_situ_linear_beta", 25.0)),
        attnres_num_blocks=num_blocks,
        rms_norm_eps=float(_field(text, "rms_norm_eps")),
        max_position_embeddings=text.get("max_position_embeddings", 4096),
        initializer_range=text.get("initializer_range", 0.02),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        pad_token_id=text.get("pad_token_id"),
        bos_token_id=text.get("bos_token_id"),
        eos_token_id=text.get("eos_token_id"),
    )
    dtype = text.get("dtype", text.get("torch_dtype"))
    if dtype is not None:
        check_dtype_name(dtype, "text_config.dtype")
        kwargs["dtype"] = dtype
    return kwargs


def _linear_field(linear: dict, name: str):
    if linear.get(name) is None:
        raise ValueError(f"text_config.linear_attn_config.{name} is missing")
    return linear[name]


def kdamoe_to_kimi_k3_config(config: KDAMoEConfig, experts_format: str = "mxfp4") -> dict:
    """The Kimi K3 ``config.json`` (top level ``kimi_k3`` with a ``text_config`` of model type ``kimi_linear``, the
    released key names) of a kdamoe model K3 can represent; no ``vision_config`` (the text model only).

    Args:
        config: the kdamoe config.
        experts_format: ``"mxfp4"`` (the released storage) or ``"bf16"``; written as ``routed_experts_format``.

    Raises:
        ValueError: naming the kdamoe field K3 cannot represent: ``moe_latent_size`` None, ``attnres_num_blocks`` 0,
            ``hidden_act`` not situ, ``kda_lower_bound`` None, ``kda_full_rank_output_gate`` false, ``q_lora_rank``
            None, an MLA norm eps other than 1e-6, ``routed_scaling_factor`` ≠ 1 without
            ``latent_moe_routed_scaling``, dense layers that are not a leading run, no shared expert; or a bad
            ``experts_format``.
    """
    if experts_format not in EXPERTS_FORMATS:
        raise ValueError(f"experts_format={experts_format!r}: expected one of {EXPERTS_FORMATS}")
    problems = []
    if config.moe_latent_size is None:
        problems.append("moe_latent_size=None (K3's routed experts run in a latent)")
    if not config.attnres_num_blocks:
        problems.append("attnres_num_blocks=0 (K3 has Block Attention Residuals)")
    if config.hidden_act != "situ":
        problems.append(f"hidden_act={config.hidden_act!r} (K3: 'situ')")
    if config.kda_lower_bound is None:
        problems.append("kda_lower_bound=None (K3's KDA gate is lower-bounded)")
    if not config.kda_full_rank_output_gate:
        problems.append("kda_full_rank_output_gate=False (K3's KDA output gate is the full-rank g_proj)")
    if config.q_lora_rank is None:
        problems.append("q_lora_rank=None (K3's MLA query is low rank)")
    if not math.isclose(config.mla_norm_eps, KIMI_K3_MLA_RMS_NORM_EPS, rel_tol=1e-9):
        problems.append(f"mla_rms_norm_eps={config.mla_norm_eps} (K3's MLA norms use {KIMI_K3_MLA_RMS_NORM_EPS})")
    if config.routed_scaling_factor != 1.0 and not config.latent_moe_routed_scaling:
        problems.append(f"routed_scaling_factor={config.routed_scaling_factor} with latent_moe_routed_scaling=False "
                        "(K3 scales the routed weights inside the latent MoE)")
    first_dense = next((i for i, t in enumerate(config.mlp_layer_types) if t != "dense"), config.num_hidden_layers)
    if any(t != "sparse" for t in config.mlp_layer_types[first_dense:]):
        problems.append(f"mlp_layer_types={config.mlp_layer_types} (K3's dense layers are the first "
                        "first_k_dense_replace)")
    if config.num_shared_experts < 1:
        problems.append(f"num_shared_experts={config.num_shared_experts} (K3 has shared experts)")
    if problems:
        raise ValueError("this kdamoe model cannot be written as Kimi K3: " + "; ".join(problems))
    text = {
        "model_type": "kimi_linear",
        "architectures": ["KimiK3ForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "hidden_act": "situ",
        "activation_situ_beta": config.situ_beta,
        "activation_situ_linear_beta": config.situ_linear_beta,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_experts": config.num_experts,
        "num_experts_per_token": config.num_experts_per_tok,
        "num_shared_experts": config.num_shared_experts,
        "routed_expert_hidden_size": config.moe_latent_size,
        "latent_moe_use_norm": True,
        "first_k_dense_replace": first_dense,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": config.routed_scaling_factor if config.latent_moe_routed_scaling else 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": bool(config.mla_output_gate),
        "linear_attn_config": {
            "head_dim": config.kda_head_dim,
            "num_heads": config.kda_num_heads,
            "short_conv_kernel_size": config.kda_short_conv_kernel_size,
            "gate_lower_bound": config.kda_lower_bound,
            "use_full_rank_gate": True,
            "full_attn_layers": [i + 1 for i, t in enumerate(config.layer_types) if t == "full_attention"],
            "kda_layers": [i + 1 for i, t in enumerate(config.layer_types) if t == "linear_attention"],
        },
        "attn_res_block_size": config.attnres_block_size,
        "num_nextn_predict_layers": 0,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    dtype = getattr(config, "dtype", None)
    if dtype is not None:
        text["dtype"] = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": KIMI_K3_MODEL_TYPE,
        EXPERTS_FORMAT_KEY: experts_format,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "text_config": text,
    }


# ----------------------------------------------------------------------------------------------------
# Tensor maps
# ----------------------------------------------------------------------------------------------------
def _k3_text_names(config: KDAMoEConfig) -> dict[str, tuple]:
    """``{K3 name (without language_model.): rule}`` for every text tensor but the per-expert ones. A rule is
    ``("same", kdamoe name)``, ``("vector", kdamoe name)`` (``[1, d]`` ↔ ``[d]``), ``("A_log", kdamoe name)`` or
    ``("conv", kdamoe name, part index)``."""
    names: dict[str, tuple] = {}

    def same(name, target=None, rule="same"):
        names[name] = (rule, target or name)

    same("model.embed_tokens.weight")
    same("model.norm.weight")
    same("lm_head.weight")
    same("model.output_attn_res_proj.weight", "model.final_res.query", "vector")
    same("model.output_attn_res_norm.weight", "model.final_res.key_norm.weight")
    for i, layer_type in enumerate(config.layer_types):
        p = f"model.layers.{i}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            same(p + name)
        for k3, ours in (("self_attention_res", "attn_res"), ("mlp_res", "mlp_res")):
            same(f"{p}{k3}_proj.weight", f"{p}{ours}.query", "vector")
            same(f"{p}{k3}_norm.weight", f"{p}{ours}.key_norm.weight")
        a = p + "self_attn."
        if layer_type == "linear_attention":
            names.update(kda_layer_rules(a, ("g_proj",)))
        else:
            for name in ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_layernorm.weight",
                         "kv_b_proj.weight", "o_proj.weight"):
                same(a + name)
            same(a + "kv_a_proj_with_mqa.weight", a + "kv_a_proj.weight")
            if config.mla_output_gate:
                same(a + "g_proj.weight")
        if config.mlp_layer_types[i] == "dense":
            for proj in ("gate_proj", "up_proj", "down_proj"):
                same(f"{p}mlp.{proj}.weight")
        else:
            m, o = p + "block_sparse_moe.", p + "mlp."
            same(m + "gate.weight", o + "gate.weight")
            same(m + "gate.e_score_correction_bias", o + "gate.e_score_correction_bias")
            for k3, ours in (("down_proj", "down_proj"), ("norm", "norm"), ("up_proj", "up_proj")):
                same(f"{m}routed_expert_{k3}.weight", f"{o}latent_{ours}.weight")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                same(f"{m}shared_experts.{proj}.weight", f"{o}shared_experts.{proj}.weight")
    return names


def kimi_k3_to_kdamoe_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: KDAMoEConfig,
    expected_shapes: dict[str, torch.Size | tuple | list] | None = None,
    optional: Iterable[str] = (),
    experts_dtype: torch.dtype = torch.float32,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Kimi K3 checkpoint tensors → kdamoe tensors, streaming.

    Args:
        tensors: ``(name, tensor)`` pairs under the released names (module docstring's table), any order, e.g. shard
            after shard; an expert's ``weight_packed`` and ``weight_scale`` may come in different shards.
        config: the kdamoe config (:func:`kimi_k3_to_kdamoe_config` of the checkpoint's ``config.json``).
        expected_shapes: ``{kdamoe name: shape}`` of the model to fill; given, the load is strict (every produced
            tensor there with that shape, every name there produced except ``optional``).
        optional: kdamoe names that may be absent (the LM head of a model with tied embeddings).
        experts_dtype: dtype MXFP4 experts are decoded to (float32, bfloat16 or float64: every E2M1 value times a
            power of two is exact in each, up to float32's range); unquantized experts keep their stored dtype.

    Yields:
        ``(kdamoe name, tensor)`` as each is complete. ``A_log`` loses its padding (first ``kda_num_heads`` entries);
        the AttnRes ``[1, d]`` pseudo-queries become ``[d]``; the vision tower's tensors are skipped, their count
        logged once at the end.

    Raises:
        ValueError: naming the tensor: a name no K3 checkpoint of this config holds, a wrong shape, a piece or an
            MXFP4 half stored twice, an MXFP4 half without its other half, an expert index ``≥ num_experts``, an
            ``A_log`` shorter than the heads, an MXFP4 projection that decodes to NaN (scale byte 255) or infinity
            (beyond ``experts_dtype``'s range; not checked for meta tensors), and at the end every tensor that never
            came (missing).
    """
    rules = _k3_text_names(config)
    sparse = {i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse"}
    E, H = config.num_experts, config.kda_num_heads
    out = PieceAssembler(config, expected_shapes, expert_width=config.moe_latent_size)
    halves: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}  # an MXFP4 projection waiting for its other half
    skipped = 0

    for full_name, tensor in tensors:
        if full_name.startswith(VISION_PREFIXES):
            skipped += 1
            continue
        if not full_name.startswith(TEXT_PREFIX):
            raise ValueError(f"unexpected tensor {full_name} {_shape(tensor.shape)}: a Kimi K3 checkpoint keeps its "
                             f"text model under {TEXT_PREFIX!r} and its vision model under {VISION_PREFIXES}")
        source = full_name[len(TEXT_PREFIX):]
        rule = rules.get(source)
        if rule is not None and rule[0] == "same":
            yield out.emit(rule[1], tensor, full_name)
            continue
        if rule is not None and rule[0] == "vector":
            if tensor.dim() != 2 or tensor.shape[0] != 1:
                raise ValueError(f"{full_name}: shape {_shape(tensor.shape)}, expected [1, {config.hidden_size}]")
            yield out.emit(rule[1], tensor.reshape(-1), full_name)
            continue
        if rule is not None and rule[0] == "A_log":
            if tensor.dim() != 1 or tensor.shape[0] < H:
                raise ValueError(f"{full_name}: shape {_shape(tensor.shape)}, expected [n >= {H}] (kda_num_heads={H}, "
                                 f"stored padded to a multiple of {A_LOG_PAD})")
            yield out.emit(rule[1], tensor[:H].clone(), full_name)
            continue
        if rule is not None and rule[0] == "conv":
            fused = out.add_conv(rule[1], rule[2], full_name, tensor)
        else:
            match = _LAYER.fullmatch(source)
            expert = _EXPERT.fullmatch(match.group(2)) if match else None
            if expert is None or int(match.group(1)) not in sparse:
                raise ValueError(f"unexpected tensor {full_name} {_shape(tensor.shape)}: a Kimi K3 checkpoint of "
                                 "this config has no such tensor")
            layer, j, which, kind = int(match.group(1)), int(expert.group(1)), expert.group(2), expert.group(3)
            if j >= E:
                raise ValueError(f"unexpected tensor {full_name} {_shape(tensor.shape)}: expert {j} >= "
                                 f"num_experts={E}")
            if kind != "weight":
                base = full_name.rsplit(".", 1)[0]
                pair = halves.setdefault(base, {})
                if kind in pair:
                    raise ValueError(f"{full_name}: stored twice")
                pair[kind] = (full_name, tensor)
                if len(pair) < 2:
                    continue
                del halves[base]
                tensor = mxfp4_decode(pair["weight_packed"][1], pair["weight_scale"][1], dtype=experts_dtype,
                                      name=base + ".weight")
                if not tensor.is_meta:  # a header-only check (check_kimi_k3_folder) has no values to read
                    _refuse_non_finite(base, pair["weight_scale"][1], tensor)
            fused = out.add_expert(layer, which, j, full_name, tensor)
        if fused.complete:
            yield out.emit_fused(fused, sources_shown=2)

    problems = [f"{base}.{next(iter(pair))} has no {'weight_scale' if 'weight_packed' in pair else 'weight_packed'}"
                for base, pair in halves.items()]
    problems += out.problems(optional,
                             lambda target, key: TEXT_PREFIX + stored_piece_name(target, key, "weight_packed"),
                             lambda name: TEXT_PREFIX + _k3_name_of(name, rules))
    if problems:
        raise incomplete_error("the Kimi K3 checkpoint", problems)
    if skipped:
        logger.warning(f"Kimi K3 checkpoint: skipped {skipped} vision tensors ({', '.join(VISION_PREFIXES)}): kdamoe "
                       "loads the text model only")


def _refuse_non_finite(base: str, scale: torch.Tensor, decoded: torch.Tensor) -> None:
    """Refuse an MXFP4 projection that decodes to NaN or infinity: a scale byte 255 (E8M0's NaN, a whole block of
    NaN) or a block beyond the decode dtype's range (magnitude 4 or 6 at scale byte 254, 6 at 253, in float32 and
    bfloat16). Either would load as a model whose logits are NaN wherever a token reaches the expert; quantisation-
    aware training produces neither, so the checkpoint is damaged. Names the first bad block / element."""
    nan_scale = scale == 255
    if bool(nan_scale.any()):
        row, block = (int(i) for i in nan_scale.nonzero()[0])
        raise ValueError(f"{base}.weight_scale[{row}, {block}] is 255, E8M0's NaN ({int(nan_scale.sum())} such "
                         "bytes in the tensor): its block of 32 weights would be NaN; the checkpoint is damaged")
    # only scale bytes >= 253 (2^126) can overflow float32 / bfloat16 (largest finite just under 2^128: 6 · 2^126
    # is above it, 6 · 2^125 below): reading the bytes (1/32 of the elements) spares a pass over every decoded value
    if not bool((scale >= 253).any()):
        return
    bad = ~torch.isfinite(decoded)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{base}: decodes to {decoded[row, col].item()} at [{row}, {col}] in {decoded.dtype} (scale "
                         f"byte {int(scale[row, col // MXFP4_BLOCK])} = 2^{int(scale[row, col // MXFP4_BLOCK]) - 127}, "
                         "beyond the dtype's range): a damaged checkpoint, or weights only float64 holds")


def _k3_name_of(name: str, rules: dict[str, tuple]) -> str:
    """The K3 name (without ``language_model.``) a kdamoe tensor comes from, for messages."""
    for source, rule in rules.items():
        if rule[0] != "conv" and rule[1] == name:
            return source
    return fused_source_pattern(name, "weight_packed") or name


def kdamoe_to_kimi_k3_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: KDAMoEConfig,
    expected_shapes: dict[str, torch.Size | tuple | list] | None = None,
    optional: Iterable[str] = (),
    experts_format: str = "mxfp4",
) -> Iterator[tuple[str, torch.Tensor]]:
    """kdamoe tensors → Kimi K3 checkpoint tensors (the released names, under ``language_model.``), streaming.

    Args:
        tensors: ``(kdamoe name, tensor)`` pairs, any order.
        config: the kdamoe config; :func:`kdamoe_to_kimi_k3_config` must accept it (call it first).
        expected_shapes: ``{kdamoe name: shape}`` of the model ``config`` builds; given, the input is checked strictly.
        optional: kdamoe names that may be absent (a tied LM head).
        experts_format: ``"mxfp4"``: each expert projection encoded by :func:`.mxfp4.mxfp4_encode` (round to nearest
            E2M1 per block of 32, compressed-tensors' scale rule) as ``weight_packed`` / ``weight_scale``;
            ``"bf16"``: written as ``….weight`` in bfloat16.

    Yields:
        ``(K3 name, tensor)``: the conv split into ``q/k/v_conv1d``, the experts per expert, ``A_log`` zero-padded to
        a multiple of 128 (float32 zeros ``[128·⌈H/128⌉]`` for a model without ``A_log``: ``exp(0) = 1`` is the same
        gate), the AttnRes queries as ``[1, d]``. Every tensor is its own contiguous copy or the input itself.

    Raises:
        ValueError: a kdamoe tensor with no K3 counterpart (e.g. a KDA ``g_b_proj``) or of the wrong shape, naming it;
            an expert width not a multiple of 32 (MXFP4); a bad ``experts_format``; missing tensors at the end.
    """
    if experts_format not in EXPERTS_FORMATS:
        raise ValueError(f"experts_format={experts_format!r}: expected one of {EXPERTS_FORMATS}")
    reverse = {}
    for k3_name, rule in _k3_text_names(config).items():
        if rule[0] != "conv":
            reverse.setdefault(rule[1], (rule[0], k3_name))
    H = config.kda_num_heads
    padded = A_LOG_PAD * math.ceil(H / A_LOG_PAD)
    sparse = {i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse"}
    tied = bool(config.tie_word_embeddings)
    seen: set[str] = set()

    def expert(name: str, weight: torch.Tensor):
        if experts_format == "bf16":
            yield name + ".weight", weight.to(torch.bfloat16).contiguous()
            return
        if weight.shape[-1] % MXFP4_BLOCK:
            raise ValueError(f"{name}: input width {weight.shape[-1]} is not a multiple of {MXFP4_BLOCK} (MXFP4 "
                             "blocks); export with experts_format='bf16'")
        packed, scale = mxfp4_encode(weight, name=name)
        yield name + ".weight_packed", packed
        yield name + ".weight_scale", scale

    for name, tensor in tensors:
        check_expected_shape(expected_shapes, name, name, _shape(tensor.shape))
        seen.add(name)
        if tied and name == "lm_head.weight":
            continue
        rule = reverse.get(name)
        if rule is not None:
            kind, k3_name = rule
            out = TEXT_PREFIX + k3_name
            if kind == "same":
                yield out, tensor
            elif kind == "vector":
                yield out, tensor.reshape(1, -1).clone()
            else:  # A_log
                yield out, torch.cat([tensor.float(), tensor.new_zeros(padded - H, dtype=torch.float32)])
            if tied and name == "model.embed_tokens.weight":
                yield TEXT_PREFIX + "lm_head.weight", tensor.clone()
            if not config.kda_use_A_log and name.endswith("self_attn.dt_bias"):
                yield out.replace("dt_bias", "A_log"), torch.zeros(padded, dtype=torch.float32)
            continue
        pieces = split_fused(name, tensor, config, sparse, expert, prefix=TEXT_PREFIX)
        if pieces is not None:
            yield from pieces
            continue
        raise ValueError(f"unexpected tensor {name} {_shape(tensor.shape)}: it has no Kimi K3 counterpart")
    check_all_seen(expected_shapes, seen, optional)


# ----------------------------------------------------------------------------------------------------
# Loading a Kimi K3 folder into kdamoe
# ----------------------------------------------------------------------------------------------------
def check_kimi_k3_folder(folder, cls) -> None:
    """Check a Kimi K3 folder's tensor names and shapes against the ``cls`` model its ``config.json`` translates to,
    reading the safetensors headers only (the MXFP4 experts are "decoded" on the meta device: shapes, no values) —
    what :func:`from_kimi_k3_pretrained` checks while it loads.

    Raises:
        ValueError: naming the field or the tensor, as :func:`kimi_k3_to_kdamoe_config` and
            :func:`kimi_k3_to_kdamoe_tensors`.
    """
    check_folder(folder, cls, kimi_k3_to_kdamoe_config, kimi_k3_to_kdamoe_tensors)


def from_kimi_k3_pretrained(cls, pretrained, k3_config: dict, kwargs: dict):
    """Load a Kimi K3 folder or Hub id's text model as ``cls`` (``KDAMoEForCausalLM``); what its
    ``from_pretrained`` runs when the ``config.json`` says ``model_type: kimi_k3``.

    The pipeline of :mod:`.checkpoint_formats`, as for Kimi Linear: the config is translated
    (:func:`kimi_k3_to_kdamoe_config`; routers frozen unless ``kwargs`` sets ``router_bias_update``), the model built
    on the ``meta`` device, the shards streamed through :func:`kimi_k3_to_kdamoe_tensors` strictly against its names
    and shapes, each tensor cast to ``dtype`` as it comes (when not given, to the dtype the text config names, if
    any; the router and gate parameters of
    ``FP32_TENSOR_SUFFIXES`` stay float32; MXFP4 experts are decoded straight
    to ``dtype`` when it is float32, bfloat16 or float64 — exact in each — else to float32), and assigned without a
    second copy. The vision tower's tensors are skipped (one log line counts them). Returned in eval mode.

    Args:
        cls: the model class (``KDAMoEForCausalLM`` or a subclass).
        pretrained: folder or Hub id.
        k3_config: its parsed ``config.json``.
        kwargs: ``dtype`` / ``torch_dtype``, ``device_map`` (None or ``"cpu"``), the Hub arguments,
            ``trust_remote_code``, ``attn_implementation``, ``experts_implementation`` and ``KDAMoEConfig`` fields.

    Raises:
        ValueError: a keyword argument not in that list, naming it; ``device_map`` other than None / "cpu";
            ``use_kernels=True``; a config kdamoe cannot represent; a missing, extra or wrongly shaped tensor.
    """
    request = parse_load_kwargs(cls, "Kimi K3", kwargs)
    config_kwargs = kimi_k3_to_kdamoe_config(k3_config)
    if request.dtype is None and config_kwargs.get("dtype") in ("float32", "bfloat16", "float16", "float64"):
        # "as stored" is the dtype the config names: a folder with bf16 experts beside float32 weights (an export with
        # experts_format="bf16" of a float32 model) then loads as one dtype
        request.dtype = getattr(torch, config_kwargs["dtype"])
    config = build_config(request, config_kwargs, pretrained)
    dtype = request.dtype
    experts_dtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float64) else torch.float32
    # With no dtype at all (neither asked for nor named by the config) every tensor keeps its stored dtype.
    return load_streamed(cls, config, request, pretrained,
                         functools.partial(kimi_k3_to_kdamoe_tensors, experts_dtype=experts_dtype),
                         upcast_as_stored=False)


__all__ = [
    "EXPERTS_FORMATS",
    "check_kimi_k3_folder",
    "KIMI_K3_MODEL_TYPE",
    "from_kimi_k3_pretrained",
    "is_kimi_k3_config",
    "kdamoe_to_kimi_k3_config",
    "kdamoe_to_kimi_k3_tensors",
    "kimi_k3_to_kdamoe_config",
    "kimi_k3_to_kdamoe_tensors",
]
