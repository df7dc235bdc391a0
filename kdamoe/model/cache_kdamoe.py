"""KDAMoE's generation cache: a latent-only MLA layer and in-place linear-attention states (transformers ``Cache`` API).

Why a cache of our own (docs/long-context.md):

* **MLA layers keep only the latent.** With no positional encoding, ``k_h = W_uk,h c`` and ``v_h = W_uv,h c`` are
  linear in the latent ``c`` (DeepSeek-V2 §2.1.2, "absorbed" projections): the cache stores ``c [B, L, kv_lora_rank]``
  per MLA layer instead of per-head keys and values (for the 1.68 B preset at 1M tokens: 2 GiB for four layers instead
  of 16 GiB), and decoding attends in the latent space.
* **Preallocated, written in place.** The latent buffer has room for ``max_cache_len`` tokens (``generate`` passes its
  ``max_length``) and grows by one copy of the history with 1/8 headroom when a forward outgrows it, so a decode step
  never copies the history, unlike ``DynamicLayer``'s concatenation.
* **Fixed addresses.** Every update, beam reorder and reset writes into the same tensors, so a captured CUDA graph
  of a decode step (``decode_graph.py``) stays valid; a change of shape (batch repeat / select, growth) drops the
  graphs captured on this cache.

The cache counts tokens on the host (``get_seq_length``) and mirrors the count at the start of the running forward in
a device tensor, :attr:`KDAMoECache.past_length`, which the MLA layers read (so a graph replays with the current
length). ``begin_forward`` / ``end_forward`` are called by the model around its layers, or by the decode graph around
a replay.
"""

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

# Latent rows are allocated in multiples of this (keeps the decode kernel's splits aligned and growth rare).
_ALIGN = 256


def _round_up(n: int, multiple: int = _ALIGN) -> int:
    return -(-n // multiple) * multiple


class KDAMoELatentCacheLayer(CacheLayerMixin):
    """Latent-only cache of one MLA layer: ``latents [B, capacity, kv_lora_rank]``, the first ``length`` rows valid.

    Follows ``CacheLayerMixin`` (``get_seq_length``, ``get_mask_sizes``, ``reorder_cache``, ``crop``,
    ``batch_repeat_interleave``, ``batch_select_indices``, ``reset``); ``update(latent)`` appends like
    ``DynamicLayer.update`` but returns ``(latents[:, :length], None)``, there being no separate values.

    Args:
        max_cache_len: rows to preallocate on the first update (at least what that update needs); ``None`` sizes the
            buffer from the first update (its length plus 1/8, at least 256 rows of headroom).
    """

    is_compileable = False  # graphs are captured by kdamoe itself; transformers' compile path would build 4-D masks
    is_croppable = True
    is_sliding = False

    def __init__(self, max_cache_len: int | None = None, **kwargs):
        super().__init__()
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool)
                                          or max_cache_len < 1):
            raise ValueError("max_cache_len must be None or a positive integer number of tokens, "
                             f"got {max_cache_len!r}")
        self.max_cache_len = max_cache_len
        self.latents: torch.Tensor | None = None
        self.length = 0
        self.cache: "KDAMoECache | None" = None  # set by KDAMoECache, which owns the device length

    # transformers reads `keys` to tell an initialised layer (offloading, `is_initialized`); the latent is our key.
    @property
    def keys(self):
        return self.latents

    @keys.setter
    def keys(self, value):
        if value is not None:
            raise AttributeError("KDAMoELatentCacheLayer stores latents; write through update()")

    @property
    def capacity(self) -> int:
        return 0 if self.latents is None else self.latents.shape[1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def reserve(self, needed: int, like: torch.Tensor | None = None) -> bool:
        """Make room for ``needed`` rows (one copy of the valid rows if the buffer grows); True if it moved."""
        if self.latents is not None and needed <= self.capacity:
            return False
        if self.latents is None and like is None:
            return False  # nothing known yet about batch, width, dtype; the first update allocates
        ref = self.latents if self.latents is not None else like
        if self.latents is None and self.max_cache_len is not None and needed <= self.max_cache_len:
            capacity = _round_up(self.max_cache_len)
        else:
            capacity = _round_up(needed + max(_ALIGN, needed // 8))
        grown = ref.new_empty(ref.shape[0], capacity, ref.shape[-1])
        if self.latents is not None and self.length:
            grown[:, : self.length].copy_(self.latents[:, : self.length])
        self.latents = grown
        if self.cache is not None:
            self.cache.drop_graphs()
        return True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args, **kwargs):
        """Write ``key_states [B, T, R]`` (the new latents) at rows ``length … length+T−1``.

        The rows are written at the device position :attr:`KDAMoECache.past_length` (so a CUDA graph replays at the
        current length); the host count advances in :meth:`KDAMoECache.end_forward`. Returns
        ``(latents[:, :length+T], None)``.

        Raises:
            ValueError: the batch size, width or dtype differs from the cached latents.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        B, T, R = key_states.shape
        if self.latents is not None and (self.latents.shape[0] != B or self.latents.shape[2] != R
                                         or self.latents.dtype != key_states.dtype):
            raise ValueError(
                f"the cache holds latents of shape [B={self.latents.shape[0]}, *, R={self.latents.shape[2]}] "
                f"({self.latents.dtype}); got new latents {list(key_states.shape)} ({key_states.dtype})"
            )
        self.reserve(self.length + T, like=key_states)
        position = self.cache.past_length + torch.arange(T, device=key_states.device)
        self.latents.index_copy_(1, position, key_states)
        return self.latents[:, : self.length + T], None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows on demand

    def reset(self) -> None:
        self.length = 0

    def offload(self):
        if self.latents is not None:
            self.latents = self.latents.to("cpu", non_blocking=True)

    def prefetch(self):
        if self.latents is not None and self.latents.device != self.device:
            self.latents = self.latents.to(self.device, non_blocking=True)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``b`` becomes row ``beam_idx[b]``, in place (the buffer keeps its address)."""
        if self.length:
            valid = self.latents[:, : self.length]
            valid.copy_(valid.index_select(0, beam_idx.to(valid.device)))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def drop_first(self, n: int) -> None:
        """Forget the first ``n`` tokens (a packed batch's earlier documents); the rest move to the front."""
        if n > 0 and self.length:
            kept = self.latents[:, n : self.length].clone()
            self.latents[:, : kept.shape[1]].copy_(kept)
            self.length = kept.shape[1]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.latents is not None:
            self.latents = self.latents.repeat_interleave(repeats, dim=0)
            self.cache.drop_graphs()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.latents is not None:
            self.latents = self.latents[indices].contiguous()
            self.cache.drop_graphs()


class KDAMoELinearAttentionLayer(LinearAttentionLayer):
    """transformers' ``LinearAttentionLayer`` (conv + recurrent state, updated in place) whose beam reorder also
    writes in place, plus the batch repeat / select that the base class lacks."""

    def _states(self):
        for states, initialised in ((self.conv_states, self.is_conv_states_initialized),
                                    (self.recurrent_states, self.is_recurrent_states_initialized)):
            for i in range(self.number_of_states):
                if initialised[i]:
                    yield states, i

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """Every kdamoe conv op returns the row's whole window (its last W inputs, ``[B, C, W]``), so after the first
        step the window is copied in place as it is; the base class concatenates old and new windows first (for ops
        that return only the new columns) and keeps the last W columns, which is the same window, one kernel more."""
        if (self.is_conv_states_initialized[state_idx] and self.has_previous_state[state_idx] and not self.record_past
                and conv_states.shape == self.conv_states[state_idx].shape):
            self.conv_states[state_idx].copy_(conv_states)
            return self.conv_states[state_idx]
        return super().update_conv_state(conv_states, state_idx, conv_kernel_size, **kwargs)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        for states, i in self._states():
            states[i].copy_(states[i].index_select(0, beam_idx.to(states[i].device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for states, i in self._states():
            states[i] = states[i].repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for states, i in self._states():
            states[i] = states[i][indices].contiguous()


def attention_seq_length(cache: Cache) -> int:
    """Tokens cached per row, as the first attention (MLA) layer of ``cache`` counts them.

    transformers 5.24's ``Cache.get_seq_length()`` asked the first attention layer when layer 0 is a linear-attention
    layer; 5.25 asks layer 0 itself, whose count there follows its conv-state updates (the conv window's width per
    forward, not the tokens) and so is not the cache's length for a KDA layer. This reads the attention layer under
    either version; a cache without one answers through its own ``get_seq_length()`` (a :class:`KDAMoECache` counts
    the tokens its forwards reported; the model then refuses a cache built for another layer layout anyway).
    """
    for layer in cache.layers:
        if not isinstance(layer, LinearAttentionCacheLayerMixin) or isinstance(layer, CacheLayerMixin):
            return int(layer.get_seq_length())
    return int(cache.get_seq_length())


class KDAMoECache(DynamicCache):
    """The cache KDAMoE builds by default (``forward(use_cache=True)``, ``generate``): one
    :class:`KDAMoELinearAttentionLayer` per KDA layer and one :class:`KDAMoELatentCacheLayer` per MLA layer.

    A ``DynamicCache`` in every respect transformers relies on (``get_seq_length``, ``get_mask_sizes``,
    ``reorder_cache``, ``crop``, ``batch_repeat_interleave``, ``batch_select_indices``, ``reset``), so ``generate``,
    beam search and multi-turn continuation (pass the returned cache with the new tokens) work unchanged. A plain
    ``DynamicCache(config=...)`` passed by the user still works: the MLA layers then cache per-head keys and values.

    Args:
        config: the model's ``KDAMoEConfig`` (its ``layer_types``).
        max_cache_len: tokens to preallocate per MLA layer (``generate`` passes its ``max_length``); the buffers grow
            past it when needed.

    Raises:
        ValueError: an unknown entry in ``config.layer_types`` or a non-positive ``max_cache_len``.
    """

    def __init__(self, config, max_cache_len: int | None = None):
        layers = []
        for layer_type in config.layer_types:
            if layer_type == "linear_attention":
                layers.append(KDAMoELinearAttentionLayer())
            elif layer_type == "full_attention":
                layers.append(KDAMoELatentCacheLayer(max_cache_len=max_cache_len))
            else:
                raise ValueError(f"config.layer_types holds {layer_type!r}; "
                                 "expected 'linear_attention' or 'full_attention'")
        super().__init__()
        self.layers = layers
        self.layer_class_to_replicate = None
        for layer in self.latent_layers:
            layer.cache = self
        self.max_cache_len = max_cache_len
        self.past_length: torch.Tensor | None = None  # [] int64 on the model's device: tokens before this forward
        self.graphs: dict = {}  # decode_graph.DecodeGraph per (batch size, has_mask); dropped on any reshape
        self.graph_pool = None
        self.graphs_disabled = False  # a capture failed: this cache decodes eagerly
        self.capture_stream = None  # the side stream the graphs are warmed up and captured on
        self.tokens_seen = 0
        self.decode_steps = 0  # one-token forwards run on this cache (the first one warms up the kernels)
        self.step_managed = False  # True while a DecodeGraph captures: it does the bookkeeping itself

    @property
    def latent_layers(self) -> list[KDAMoELatentCacheLayer]:
        return [layer for layer in self.layers if isinstance(layer, KDAMoELatentCacheLayer)]

    def __iter__(self):
        raise TypeError("KDAMoECache holds latents and recurrent states, not (key, value) pairs: it cannot be iterated")

    @property
    def batch_size(self) -> int | None:
        """Rows the cached tensors hold, or None before the first forward."""
        for layer in self.layers:
            if isinstance(layer, KDAMoELatentCacheLayer) and layer.latents is not None:
                return layer.latents.shape[0]
            if isinstance(layer, KDAMoELinearAttentionLayer):
                for states, i in layer._states():
                    return states[i].shape[0]
        return None

    def drop_graphs(self) -> None:
        """Forget the captured decode graphs (their buffers moved or changed shape); the next one-token step runs
        eagerly again, warming the kernels up for the new shapes before a graph is captured."""
        self.graphs.clear()
        self.decode_steps = 0

    def begin_forward(self, num_tokens: int, device: torch.device) -> None:
        """Before a forward of ``num_tokens`` per row: publish the current length on ``device`` and make room.

        ``fill_`` from a host integer costs no synchronisation.
        """
        if self.past_length is None or self.past_length.device != device:
            self.past_length = torch.zeros((), dtype=torch.long, device=device)
        past = self.get_seq_length() if self.latent_layers else 0
        self.past_length.fill_(past)
        for layer in self.latent_layers:
            layer.reserve(past + num_tokens)

    def end_forward(self, num_tokens: int) -> None:
        """After the forward: the host count of every MLA layer advances by ``num_tokens``."""
        for layer in self.latent_layers:
            layer.length += num_tokens
        self.tokens_seen += num_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached per row: the MLA layer ``layer_idx``'s count, or for the default ``layer_idx = 0`` on a KDA
        layer the first MLA layer's (:func:`attention_seq_length`, the same under transformers 5.24 and 5.25). Also
        answers for a model without MLA layers (transformers' ``Cache`` cannot), from the tokens the forwards
        reported — ``generate``'s chunked prefill asks.

        Raises:
            ValueError: ``layer_idx`` (not 0) names a KDA layer, which does not count tokens.
        """
        if not self.latent_layers:
            return self.tokens_seen
        if layer_idx >= len(self.layers):  # transformers' Cache answers 0 past its last layer
            return 0
        layer = self.layers[layer_idx]
        if isinstance(layer, KDAMoELatentCacheLayer):
            return int(layer.get_seq_length())
        if layer_idx != 0:
            raise ValueError(f"get_seq_length: layer {layer_idx} is a KDA layer, "
                             "which does not count the cached tokens")
        return attention_seq_length(self)

    @property
    def is_compileable(self) -> bool:
        """False: decode steps are captured by kdamoe itself (``decode_graph``); transformers' compile path would
        build 4-D masks in ``prepare_inputs_for_generation``."""
        return False

    @property
    def is_linear(self) -> list[bool]:
        """transformers' per-layer flags; all False for a model without MLA layers, because this cache still counts
        its tokens (``get_seq_length``), so ``generate`` may trim the ids it has already seen on a continuation."""
        if not self.latent_layers:
            return [False] * len(self.layers)
        return super().is_linear

    def _check_rows(self, indices: torch.Tensor, what: str) -> None:
        rows = self.batch_size
        if rows is not None and indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= rows):
            raise ValueError(f"{what} holds row indices {indices.tolist()} but the cache has {rows} rows")

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._check_rows(beam_idx, "reorder_cache")
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Refused when the model has KDA layers: their recurrent state cannot be rewound (transformers' assisted
        generation refuses stateful models for the same reason). An MLA layer alone can be cropped:
        ``cache.layers[i].crop(-n)``."""
        if not self.latent_layers or len(self.latent_layers) < len(self.layers):
            raise ValueError("KDAMoECache cannot crop: the KDA layers' recurrent state cannot be rewound to an earlier "
                             "token; keep a copy of the cache (or re-prefill) to go back")
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def activate_past_recording(self, *args, **kwargs):
        """Refused (``ValueError``): called by transformers' assisted generation (5.25 passes
        ``recurrent_states_to_keep``), whose rollback the KDA layers' recurrent state cannot follow."""
        raise ValueError("KDAMoECache does not record past states: the KDA layers' recurrent state cannot be rewound")

    def batch_repeat_interleave(self, repeats: int):
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise ValueError(f"batch_repeat_interleave needs a positive integer, got {repeats!r}")
        super().batch_repeat_interleave(repeats)
        self.drop_graphs()

    def batch_select_indices(self, indices: torch.Tensor):
        self._check_rows(torch.as_tensor(indices), "batch_select_indices")
        super().batch_select_indices(indices)
        self.drop_graphs()

    def reset(self):
        super().reset()
        self.tokens_seen = 0
        self.decode_steps = 0
