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

import math
import re
from collections.abc import Iterable, Iterator

import torch

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
    shape_list,
    split_fused,
    stored_piece_name,
)
from .configuration_kdamoe import KDAMoEConfig

KIMI_LINEAR_MODEL_TYPE = "kimi_linear"
# Kimi Linear's MLA norms (``q_a_layernorm``, ``kv_a_layernorm``) are built with the RMSNorm's default eps in
# transformers' modeling_kimi_linear.py (``KimiLinearRMSNorm(dim)``, eps 1e-6), not ``rms_norm_eps``.
KIMI_MLA_RMS_NORM_EPS = 1e-6
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


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
    for field in ("dtype", "torch_dtype"):
        if kimi.get(field) is not None:  # before transformers' config, which fails on 'bf16' with an AttributeError
            check_dtype_name(kimi[field], field)
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
    if dtype is not None:
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
            names.update(kda_layer_rules(a, ("g_a_proj", "g_b_proj")))
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
    out = PieceAssembler(config, expected_shapes, expert_width=config.hidden_size)

    for source, tensor in tensors:
        rule = rules.get(source)
        if rule is not None and rule[0] == "same":
            yield out.emit(rule[1], tensor, source)
            continue
        if rule is not None and rule[0] == "A_log":
            H = config.kda_num_heads
            if shape_list(tensor.shape) not in ([1, 1, H, 1], [H]):
                raise ValueError(f"{source}: shape {shape_list(tensor.shape)}, expected [1, 1, {H}, 1] "
                                 f"(kda_num_heads={H})")
            yield out.emit(rule[1], tensor.reshape(H), source)
            continue
        if rule is not None and rule[0] == "conv":
            fused = out.add_conv(rule[1], rule[2], source, tensor)
        else:
            match = _LAYER.fullmatch(source)
            expert = _EXPERT.fullmatch(match.group(2)) if match else None
            if expert is None or int(match.group(1)) not in sparse_layers:
                raise ValueError(f"unexpected tensor {source} {shape_list(tensor.shape)}: a Kimi Linear checkpoint of "
                                 "this config has no such tensor")
            layer, j, which = int(match.group(1)), int(expert.group(1)), expert.group(2)
            if j >= E:
                raise ValueError(f"unexpected tensor {source} {shape_list(tensor.shape)}: expert {j} >= "
                                 f"num_experts={E}")
            fused = out.add_expert(layer, which, j, source, tensor)
        if fused.complete:
            yield out.emit_fused(fused)

    problems = out.problems(optional, lambda target, key: stored_piece_name(target, key, "weight"), _kimi_name_of)
    if problems:
        raise incomplete_error("the Kimi Linear checkpoint", problems)


def _kimi_name_of(name: str) -> str:
    """The Kimi Linear name(s) a kdamoe tensor comes from (for messages)."""
    fused = fused_source_pattern(name, "weight")
    if fused is not None:
        return fused
    if name.endswith("kv_a_proj.weight"):
        return name.replace("kv_a_proj", "kv_a_proj_with_mqa")
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
    H = config.kda_num_heads
    with_A_log = bool(getattr(config, "kda_use_A_log", False))
    sparse_layers = {i for i, kind in enumerate(_mlp_layer_types(config)) if kind == "sparse"}
    seen: set[str] = set()
    tied = bool(config.tie_word_embeddings)
    for name, tensor in tensors:
        check_expected_shape(expected_shapes, name, name, shape_list(tensor.shape))
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
        pieces = split_fused(name, tensor, config, sparse_layers,
                             lambda base, weight: [(base + ".weight", weight.clone())])
        if pieces is not None:
            yield from pieces
            continue
        raise ValueError(f"unexpected tensor {name} {shape_list(tensor.shape)}: it has no Kimi Linear counterpart")
    check_all_seen(expected_shapes, seen, optional)


# ----------------------------------------------------------------------------------------------------
# Loading a Kimi Linear folder or Hub id into kdamoe
# ----------------------------------------------------------------------------------------------------
def check_kimi_linear_folder(folder, cls) -> None:
    """Check a Kimi Linear folder's tensor names and shapes against the ``cls`` model its ``config.json`` translates
    to, reading the safetensors headers only (what :func:`from_kimi_linear_pretrained` checks while it loads).

    Raises:
        ValueError: naming the field or the tensor, as :func:`kimi_linear_to_kdamoe_config` and
            :func:`kimi_linear_to_kdamoe_tensors`.
    """
    check_folder(folder, cls, kimi_linear_to_kdamoe_config, kimi_linear_to_kdamoe_tensors)


def from_kimi_linear_pretrained(cls, pretrained, kimi_config: dict, kwargs: dict):
    """Load a Kimi Linear folder or Hub id as ``cls`` (``KDAMoEForCausalLM``); what its ``from_pretrained`` runs
    when the ``config.json`` says ``model_type: kimi_linear``.

    The pipeline of :mod:`.checkpoint_formats` with this format's config translation
    (:func:`kimi_linear_to_kdamoe_config`; routers frozen, ``router_bias_update="none"``, unless ``kwargs`` sets it) and
    tensor map (:func:`kimi_linear_to_kdamoe_tensors`): the model is built on the ``meta`` device (no memory); the
    shards are read one at a time and mapped strictly against that model's tensor names and shapes, each tensor cast to
    ``dtype`` as it comes (the tensors of ``FP32_TENSOR_SUFFIXES`` stay float32, also when loading as stored, as
    transformers' ``_keep_in_fp32_modules_strict`` keeps them), and the mapped tensors become the model's own
    (``load_state_dict(..., assign=True)``: no second copy). The model is returned in eval mode, with the folder's
    ``generation_config.json`` when it has one.

    Args:
        cls: the model class (``KDAMoEForCausalLM`` or a subclass: the checkpoint has an LM head).
        pretrained: folder or Hub id.
        kimi_config: its parsed ``config.json``.
        kwargs: ``from_pretrained``'s keyword arguments. Taken: ``dtype`` / ``torch_dtype`` (a dtype, its name or
            ``"auto"``: as stored), ``device_map`` (None or ``"cpu"``), the Hub arguments (``HUB_ARGUMENTS``),
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
    request = parse_load_kwargs(cls, "Kimi Linear", kwargs)
    config = build_config(request, kimi_linear_to_kdamoe_config(kimi_config), pretrained)
    # The float32 tensors are float32 whatever the dtype, also when none is given ("as stored"): transformers' class
    # upcasts them from a bf16 shard too.
    return load_streamed(cls, config, request, pretrained, kimi_linear_to_kdamoe_tensors, upcast_as_stored=True)


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
