"""Input validation of the KDAMoE forward: malformed inputs raise a ``ValueError`` naming them before anything runs.

Copied next to saved weights with the modeling file (remote code): imports torch, transformers and this folder only.
"""

import contextlib
import contextvars

import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin

from .cache_kdamoe import KDAMoELatentCacheLayer


def validate_model_inputs(config, input_ids, inputs_embeds, attention_mask, position_ids, past: int | None,
                          targets: torch.Tensor | None = None, ignore_index: int = -100) -> dict:
    """Raise ``ValueError`` naming the bad input before anything runs; return what the same sync learned.

    ``input_ids`` must be a non-empty integer ``[B, T]`` tensor with ids in ``[0, vocab_size)``; ``inputs_embeds``
    ``[B, T, hidden_size]``; a 2-D ``attention_mask`` ``[B, past + T]`` of 0 / 1 values (``past`` = cached tokens,
    ``None`` when the cache cannot tell: an all-linear-attention model); ``position_ids`` ``[B or 1, T]``; ``targets``
    (the class ids a causal-LM loss will read, any shape: the shifted ``labels`` or ``shift_labels``) an integer
    tensor with values in ``[0, vocab_size)`` or equal to ``ignore_index`` (the fused loss kernel cannot raise, and
    PyTorch's raises a device assert on CUDA). The value checks cost one device sync together, and so do the two
    facts the forward needs from the values, which ride on it (a sync stalls the launch queue: the GPU idles while
    the host catches up).

    Returns:
        ``{"mask_all_ones": bool}`` for a 2-D ``attention_mask`` (no padding: the plain causal kernels apply),
        ``{"position_restarts": bool}`` for ``position_ids`` with ``T > 1`` (a restart at 0 marks packed
        documents) and, with both, ``{"restarts_between_tokens": bool}`` (a restart between two real tokens, which
        the forward refuses next to padding); a key is absent when its input is.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Specify exactly one of `input_ids` or `inputs_embeds`")
    if input_ids is not None:
        if input_ids.dtype not in (torch.int64, torch.int32):  # what the embedding lookup takes
            raise ValueError("`input_ids` must be an int64 (or int32) tensor of token ids, "
                             f"got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"`input_ids` must be 2-D [batch, seq_len], got shape {list(input_ids.shape)}")
        shape = input_ids.shape
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
            raise ValueError(
                f"`inputs_embeds` must be [batch, seq_len, hidden_size={config.hidden_size}], "
                f"got {list(inputs_embeds.shape)}"
            )
        shape = inputs_embeds.shape[:2]
    B, T = shape
    if B == 0 or T == 0:
        raise ValueError(f"the input has shape {list(shape)}: batch and sequence length must both be at least 1")
    # One device sync for the value checks: the ids' range and whether a 2-D mask holds anything but 0 / 1 (a mask of
    # 2 or 0.5 would act as "keep" on some paths and as a weight on none: a silent wrong result).
    checks = {}
    if input_ids is not None:
        checks["low"], checks["high"] = torch.aminmax(input_ids)
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.numel() > 0:
        checks["mask_not_binary"] = ((attention_mask != 0) & (attention_mask != 1)).any()
        checks["mask_all_ones"] = attention_mask.all()
    position_ok = position_ids is not None and position_ids.dim() == 2 and position_ids.shape[-1] == T
    if position_ok and T > 1:
        checks["position_restarts"] = (position_ids[:, 1:] == 0).any()
        if (attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[0] == B
                and attention_mask.shape[-1] >= T and position_ids.shape[0] in (1, B)):
            # A restart between two real tokens (not the first real token after left padding) marks packed documents.
            real = attention_mask[:, -T:] != 0
            checks["restarts_between_tokens"] = ((position_ids[:, 1:] == 0) & real[:, 1:] & real[:, :-1]).any()
    if targets is not None:
        if not isinstance(targets, torch.Tensor):
            raise ValueError(f"`labels` / `shift_labels` must be a tensor of class ids, got {type(targets).__name__}")
        if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
            raise ValueError(f"`labels` must be an integer tensor of class ids, got dtype {targets.dtype}")
        if targets.numel() > 0:  # ignored targets count as 0, a valid id, so only the others can fail the range
            kept = torch.where(targets == ignore_index, 0, targets)
            checks["target_low"], checks["target_high"] = torch.aminmax(kept)
    if checks:
        device = (input_ids if input_ids is not None else inputs_embeds).device  # the labels may lie elsewhere
        values = torch.stack([v.to(device, torch.float64) for v in checks.values()]).tolist()
        checks = dict(zip(checks, values, strict=True))
    if input_ids is not None and (checks["low"] < 0 or checks["high"] >= config.vocab_size):
        bad = int(checks["low"] if checks["low"] < 0 else checks["high"])
        raise ValueError(f"`input_ids` contains {bad}, outside [0, vocab_size={config.vocab_size})")
    if "target_low" in checks and (checks["target_low"] < 0 or checks["target_high"] >= config.vocab_size):
        bad = int(checks["target_low"] if checks["target_low"] < 0 else checks["target_high"])
        raise ValueError(f"the loss targets (`labels` shifted by one, or `shift_labels`) contain {bad}, outside "
                         f"[0, vocab_size={config.vocab_size}) and not ignore_index={ignore_index}")
    if checks.get("mask_not_binary"):
        others = sorted(set(attention_mask.unique().tolist()) - {0, 1})[:5]
        raise ValueError(f"`attention_mask` must hold only 0 (padding) and 1 (token), got also {others}")
    if attention_mask is not None and attention_mask.dim() == 2:
        expected = T if past is None else past + T
        if (attention_mask.shape[0] != B or attention_mask.shape[1] < T
                or (past is not None and attention_mask.shape[1] != expected)):
            want = f"[{B}, {expected}]" if past is not None else f"[{B}, >= {T}]"
            raise ValueError(
                f"`attention_mask` has shape {list(attention_mask.shape)}; expected {want} (cached tokens + new tokens)"
            )
    elif attention_mask is not None and attention_mask.dim() != 4:
        raise ValueError("`attention_mask` must be 2-D [batch, past + seq_len] (or a 4-D mask), "
                         f"got {list(attention_mask.shape)}")
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[0] not in (1, B)
                                     or position_ids.shape[1] != T):
        raise ValueError(f"`position_ids` has shape {list(position_ids.shape)}; expected [{B}, {T}]")
    if position_ids is not None and (position_ids.dtype.is_floating_point or position_ids.dtype.is_complex
                                     or position_ids.dtype == torch.bool):
        raise ValueError(f"`position_ids` must be an integer tensor, got dtype {position_ids.dtype}")
    return {key: bool(checks[key]) for key in ("mask_all_ones", "position_restarts", "restarts_between_tokens")
            if key in checks}


def check_cache_matches(config, cache: Cache, rows: int) -> None:
    """Raise ``ValueError`` when ``cache`` was not built for this model and batch: its layer count, each layer's kind
    (KDA state vs attention cache), the KDA state shapes, the MLA latent width and the rows it holds must match
    ``config`` and the ``rows`` of the inputs (a mismatch would otherwise fail deep in a kernel or, for some
    shapes, give wrong logits silently). Reads shapes only."""
    if len(cache.layers) != config.num_hidden_layers:
        raise ValueError(f"the cache has {len(cache.layers)} layers but the model has {config.num_hidden_layers}; "
                         "pass a cache built for this model (or none)")
    H, K = config.kda_num_heads, config.kda_head_dim
    for i, (layer, layer_type) in enumerate(zip(cache.layers, config.layer_types, strict=True)):
        linear = isinstance(layer, LinearAttentionCacheLayerMixin)
        if linear != (layer_type == "linear_attention"):
            raise ValueError(f"cache layer {i} is a {type(layer).__name__} but model layer {i} is {layer_type!r}; "
                             "pass a cache built for this model (or none)")
        found = None
        if linear:
            state = layer.recurrent_states.get(0)
            conv = layer.conv_states.get(0)
            if state is not None and tuple(state.shape[1:]) != (H, K, K):
                found = f"a KDA state of shape {list(state.shape)} (the model's is [B, {H}, {K}, {K}])"
            elif conv is not None and conv.shape[1] != 3 * H * K:
                found = f"a conv state of {conv.shape[1]} channels (the model's has {3 * H * K})"
            batch = next((t.shape[0] for t in (state, conv) if t is not None), None)
        elif isinstance(layer, KDAMoELatentCacheLayer):
            batch = None if layer.latents is None else layer.latents.shape[0]
            width = config.kv_lora_rank + config.qk_rope_head_dim  # a row is [normed latent | shared key part]
            if layer.latents is not None and layer.latents.shape[-1] != width:
                found = (f"latents of width {layer.latents.shape[-1]} (the model's rows are kv_lora_rank + "
                         f"qk_rope_head_dim = {config.kv_lora_rank} + {config.qk_rope_head_dim} = {width} wide)")
        else:
            keys = getattr(layer, "keys", None)
            batch = keys.shape[0] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else None
            if batch is not None and tuple(keys.shape[1:2]) + tuple(keys.shape[3:]) != (config.num_attention_heads,
                                                                                   config.qk_head_dim):
                found = f"keys of shape {list(keys.shape)}"
        if found:
            raise ValueError(f"cache layer {i} holds {found}; pass a cache built for this model (or none)")
        if batch is not None and batch != rows:
            raise ValueError(f"the cache holds {batch} rows but the inputs have batch size {rows}; pass a cache of "
                             "this batch (or reorder / select its rows first)")


_INPUTS_PREVALIDATED = contextvars.ContextVar("kdamoe_inputs_prevalidated", default=False)


@contextlib.contextmanager
def inputs_prevalidated():
    """Within this context the model's forward skips :func:`validate_model_inputs`: for a caller that ran the check
    itself on the real inputs, e.g. ``train_graph.TrainStepGraph`` while it captures a step (a host read cannot run
    during a CUDA graph capture), which checks each batch before its replay."""
    token = _INPUTS_PREVALIDATED.set(True)
    try:
        yield
    finally:
        _INPUTS_PREVALIDATED.reset(token)


def inputs_are_prevalidated() -> bool:
    """Whether the current context is inside :func:`inputs_prevalidated`."""
    return _INPUTS_PREVALIDATED.get()
