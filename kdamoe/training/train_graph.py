"""A training step (forward, causal-LM loss, backward) of a fixed batch shape, captured once as a CUDA graph and
replayed (docs/pretraining.md, "CUDA-graph training step").

A training step of the e2e benchmark's model launches ~2,000 kernels; at 8K tokens per step the host needs longer to
launch them from Python than the GPU needs to run them (72 ms of GPU work in a 100-140 ms step on the H200), and even
at 32K the gaps between kernels add ~9 ms. A CUDA graph records the launches once and replays them with one call
(NVIDIA, "CUDA Graphs", CUDA C++ Programming Guide; PyTorch's ``torch.cuda.graph``, "whole-network capture").

What makes the step capturable: no op of the model's training forward or backward reads a device value on the host
(``tests/test_model_triton.py`` checks it) except the input check, which this class runs itself before each replay
(the model skips it inside this class's capture, ``kdamoe.model.validation.inputs_prevalidated``); the Triton kernels
are compiled and autotuned by the eager warm-up steps before the capture; the router statistics accumulate in place into
tensors that exist before the capture.

What it does not cover (use the eager step): Kimi Linear's unbounded KDA gate (``kda_lower_bound=None``, refused:
its KDA ops are fla's or PyTorch's, not checked for capture), packed documents (``position_ids`` with restarts: the
varlen kernels size their grids from the document lengths on the host), attention masks, gradient checkpointing, more
than one batch shape at a time (a new shape captures again, dropping the old graph), gradient accumulation across calls
(each replay writes the gradients, as ``zero_grad(set_to_none=True)`` then ``backward()`` would; nothing warns), loss
scaling (``GradScaler``: the backward runs on the unscaled loss inside the graph), DDP / FSDP wrappers, and changes
it cannot see (the autocast dtype, config fields such as ``kernel_backend`` or ``router_bias_update``): build a new
one after such a change.
"""

import torch

from ..model.modeling_kdamoe import KDAMoETopkRouter
from ..model.validation import inputs_prevalidated, validate_model_inputs


class TrainStepGraph:
    """``model(input_ids, labels=labels).loss.backward()`` as a captured CUDA graph.

    Call it like the eager step: ``loss = step(input_ids, labels)`` leaves the gradients in ``p.grad`` (written, not
    accumulated) and the router statistics counted, and returns the loss. Then step the optimizer as usual: it updates
    the parameters in place, which the graph reads at the next replay.

    The first call for a batch shape runs ``warmup_steps`` eager steps on a side stream (they compile and tune the
    kernels; their gradients are overwritten and their router counts removed again), captures the step, then replays
    it. Later calls with that shape copy the batch into the graph's input buffers and replay. The graph is captured
    again when the shape changes, a parameter or buffer was moved or replaced (also by a module replaced or added,
    e.g. an adapter), a parameter's ``requires_grad`` changed, or autocast was turned on or off.

    Args:
        model: a ``KDAMoEForCausalLM`` on a CUDA device, in training mode.
        warmup_steps: eager steps before a capture (≥ 1).

    Raises:
        ValueError: a model without parameters or not on CUDA, a model with the unbounded KDA gate
            (``kda_lower_bound=None``: its KDA ops are not kdamoe's kernels), a ``warmup_steps`` that is not an
            int >= 1; at a call, inputs that the eager forward would refuse (see ``validate_model_inputs``), labels of
            another shape, inputs off the model's device, grad mode / training mode off, or gradient checkpointing on.
    """

    def __init__(self, model, warmup_steps: int = 2):
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an int >= 1, got {warmup_steps!r}")
        self.model, self.warmup_steps = model, warmup_steps
        config = getattr(model, "config", None)
        layer_types = getattr(config, "layer_types", ())
        if getattr(config, "kda_lower_bound", -5.0) is None and "linear_attention" in layer_types:
            # The unbounded gate runs fla's or PyTorch's KDA ops, never kdamoe's (kernel_dispatch): neither is checked
            # to read no device value on the host, which a capture needs.
            raise ValueError("TrainStepGraph does not capture a model with Kimi Linear's unbounded KDA gate "
                             "(kda_lower_bound=None): its KDA layers run fla's or PyTorch's ops, which are not checked "
                             "for CUDA-graph capture (only kdamoe's kernels are); use the eager training step")
        self._device()  # raises for a model without parameters or off CUDA
        self.graph = self.loss = None
        self.grads, self.tensors, self.signature = [], [], None
        self.captures = 0  # how many times a graph was captured (for tests and benchmarks)

    # ------------------------------------------------------------------------------------------ public

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """One training step on ``input_ids [B, T]`` (int64) with ``labels [B, T]`` (−100 = ignored; None: the ids).

        Returns the loss, a 0-d float32 tensor of its own (not overwritten by the next replay).
        """
        model = self.model
        if not (model.training and torch.is_grad_enabled()):
            raise ValueError("TrainStepGraph runs a training step: the model must be in train() mode with grad enabled")
        if getattr(model, "is_gradient_checkpointing", False):
            raise ValueError("TrainStepGraph does not capture gradient checkpointing (its recomputation runs inside "
                             "the backward); call model.gradient_checkpointing_disable() or use the eager step")
        device = self._device()
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [B, T] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
        labels = input_ids if labels is None else labels
        if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
            raise ValueError(f"labels must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{getattr(labels, 'shape', type(labels))}")
        if input_ids.device != device or labels.device != device:
            raise ValueError(f"input_ids and labels must be on the model's device {device}, got "
                             f"{input_ids.device} and {labels.device}")
        # the walk over the parameters runs before the input check's host sync, while the GPU still replays the
        # previous step: after it, every host microsecond is one the GPU waits
        recapture = self.graph is None or self.shape != tuple(input_ids.shape) or self._changed()
        # the eager forward's value checks (ids and targets in range), one host sync, before anything is replayed
        validate_model_inputs(model.config, input_ids, None, None, None, None, labels[..., 1:])
        if recapture:
            self._capture(input_ids, labels)
        self.input_ids.copy_(input_ids)
        self.labels.copy_(labels)
        self.graph.replay()
        for p, g in self.grads:  # a zero_grad(set_to_none=True) in between would have detached them
            p.grad = g
        return self.loss.detach().clone()

    # ------------------------------------------------------------------------------------------ capture

    def _device(self) -> torch.device:
        first = next(self.model.parameters(), None)
        if first is None or first.device.type != "cuda":
            where = "has no parameters" if first is None else f"is on {first.device}"
            raise ValueError(f"TrainStepGraph needs a model with parameters on a CUDA device; this one {where}")
        return first.device

    def _signature(self) -> list:
        """What the captured graph depends on outside its inputs: every parameter (the object, its address, whether
        it is trained), every buffer (object and address), and whether autocast is on. Walked each call (~0.6 ms on a
        2-core CPU for the 1.68 B model), so a replaced or added module (e.g. an adapter) is seen too; the walk
        precedes the call's host sync, so it overlaps the previous replay on the GPU."""
        model = self.model
        return ([(id(p), p.data_ptr(), p.requires_grad) for p in model.parameters()]
                + [(id(b), b.data_ptr()) for b in model.buffers()] + [torch.is_autocast_enabled("cuda")])

    def _changed(self) -> bool:
        return self._signature() != self.signature

    def _step(self):
        loss = self.model(input_ids=self.input_ids, labels=self.labels, use_cache=False).loss
        loss.backward()
        return loss

    def _capture(self, input_ids, labels):
        model = self.model
        # everything that points into the previous graph's memory pool goes first, so the pool is freed before the
        # warm-up and the new capture allocate
        self.graph = self.loss = None
        self.grads = []
        model.zero_grad(set_to_none=True)
        self.shape = tuple(input_ids.shape)
        self.input_ids, self.labels = input_ids.clone(), labels.clone()
        routers = [m for m in model.modules() if isinstance(m, KDAMoETopkRouter)]
        saved = [(r.tokens_per_expert, r.qb_counts) for r in routers]
        saved = [tuple(None if t is None else t.clone() for t in pair) for pair in saved]
        device = input_ids.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # eager warm-up: compiles, tunes, allocates the router statistics
            for _ in range(self.warmup_steps):
                model.zero_grad(set_to_none=True)
                self._step()
        torch.cuda.current_stream(device).wait_stream(side)
        # the warm-up steps' counts out again, in place
        for router, (tokens, counts) in zip(routers, saved, strict=True):
            for now, before in ((router.tokens_per_expert, tokens), (router.qb_counts, counts)):
                if now is not None and before is not None:
                    now.copy_(before)
                elif now is not None:
                    now.zero_()
        model.zero_grad(set_to_none=True)  # the captured backward allocates the gradients in the graph's pool
        graph = torch.cuda.CUDAGraph()
        with inputs_prevalidated(), torch.cuda.graph(graph):  # each batch is checked before its replay instead
            loss = self._step()
        # detached: the loss's autograd graph (with the AccumulateGrad nodes recorded on the capture stream) must not
        # outlive the capture, or a later eager backward reuses those nodes across streams (PyTorch warns about it)
        self.graph, self.loss, self.captures = graph, loss.detach(), self.captures + 1
        self.grads = [(p, p.grad) for p in model.parameters() if p.grad is not None]
        self.tensors = list(model.parameters()) + list(model.buffers())  # held: their ids stay theirs
        self.signature = self._signature()
