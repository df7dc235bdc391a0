"""One-token decode steps replayed from a captured CUDA graph (docs/long-context.md, "Decoding").

A decode step of the 1.68 B preset is ~1,700 small kernels: launched one by one from Python its wall time is the
host's, not the GPU's (150 ms of wall for 5 ms of GPU work before this module). A CUDA graph records the launches
once and replays them with one call (NVIDIA, "CUDA Graphs", CUDA C++ Programming Guide §3.2.8.7).

What makes the step capturable: every tensor it writes has a fixed address (the cache writes in place, see
``cache_kdamoe``), the only values that change between steps live in device tensors (the token ids, the cache length
``KDAMoECache.past_length``, the padding mask copied into :attr:`DecodeGraph.key_mask`), and no op in the step reads
a device value on the host. The graph belongs to one cache and one batch size; it is dropped when the cache changes
shape and re-captured when the model's parameters move (a new ``data_ptr``) or are replaced (a new ``Parameter`` in a
module's slot). The check reads the slots recorded at capture, so it costs ~300 attribute reads per step instead of a
walk of the module tree (``model.parameters()`` took 1.4 ms per call on a 2-core CPU for the 1.68 B preset, a quarter
of the decode step); modules added after the capture (e.g. a newly injected adapter) are not seen: call
``cache.drop_graphs()`` after changing the model's structure.

The first one-token step on a cache runs eagerly (it autotunes the kernels and initialises every state); the second
captures the graph, and every later step replays it.
"""

import weakref

import torch


class DecodeGraph:
    """A captured ``model(input_ids [B, 1], cache=cache)`` returning logits ``[B, 1, vocab]``.

    Args:
        model: the ``KDAMoEForCausalLM`` (eval mode, no grad).
        cache: the ``KDAMoECache`` whose buffers the graph writes.
        batch_size: ``B``.
        has_mask: whether steps pass a 2-D ``attention_mask`` (its first ``past + 1`` columns are copied into
            :attr:`key_mask` before each replay; the MLA layers read it, the KDA layers need none for one token).
    """

    def __init__(self, model, cache, batch_size: int, has_mask: bool):
        self.cache = cache
        self.has_mask = has_mask
        self.watch_parameters(model)
        device = model.device
        self.input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        capacity = max((layer.capacity for layer in cache.latent_layers), default=0)
        self.key_mask = torch.ones(batch_size, max(capacity, 1), dtype=torch.int8, device=device) if has_mask else None
        if cache.graph_pool is None:
            cache.graph_pool = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        cache.begin_forward(1, device)  # the length tensor and the room the step writes into (not recorded)
        cache.step_managed = True
        try:
            with torch.cuda.graph(self.graph, pool=cache.graph_pool, stream=cache.capture_stream):
                self.logits = model._decode_step(self.input_ids, cache, self.key_mask)
        finally:
            cache.step_managed = False

    def watch_parameters(self, model) -> None:
        """Record the model (weakly: the cache holds its graphs) and its parameter slots and their addresses."""
        self.watch = ParameterWatch(model)

    def valid_for(self, model) -> bool:
        """Whether ``model`` is the captured one and every parameter slot still holds storage at the same address."""
        return self.watch.valid_for(model)

    def replay(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Run one step: ``input_ids [B, 1]`` int64, ``attention_mask [B, past + 1]`` (or None) → logits (a copy)."""
        cache = self.cache
        past = cache.get_seq_length() if cache.latent_layers else 0
        cache.begin_forward(1, input_ids.device)
        self.input_ids.copy_(input_ids)
        if self.has_mask:
            self.key_mask[:, : past + 1].copy_(attention_mask[:, : past + 1])
        self.graph.replay()
        cache.end_forward(1)
        return self.logits.clone()


class ParameterWatch:
    """What a captured graph read its weights from: a model's parameter slots (module, name), the ``Parameter`` each
    held and its storage address, recorded once at capture.

    A CUDA graph reads every weight at the address it had during the capture. In-place updates (an optimizer step,
    ``load_state_dict``, an FSDP2 all-gather into the same buffer) keep it valid; a slot that now holds another
    ``Parameter`` or storage at another address (``param.data = ...``, a re-gather into a new buffer, a replaced
    module weight) makes it stale. Checking the recorded slots costs one attribute read per parameter instead of a walk
    of the module tree; modules added after the recording (a newly injected adapter) are not seen.

    Used by :class:`DecodeGraph` and by the rollout engine's step graphs (``kdamoe.posttraining.engine``).
    """

    def __init__(self, model):
        self.model = weakref.ref(model)  # weak: the owner of the graph may be held by the model (a cache)
        self.param_slots = [(module, name) for module in model.modules() for name, p in module._parameters.items()
                            if p is not None]
        self.params = self._params()

    def _params(self) -> list[tuple[int, int]]:
        """``(id(parameter), data_ptr)`` of every recorded slot (``(0, -1)`` for a slot emptied since)."""
        params = (module._parameters.get(name) for module, name in self.param_slots)
        return [(0, -1) if p is None else (id(p), p.data_ptr()) for p in params]

    def valid_for(self, model) -> bool:
        """Whether ``model`` is the recorded one and every slot still holds the same ``Parameter`` at the same
        address."""
        return model is self.model() and self.params == self._params()
