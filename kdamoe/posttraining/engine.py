"""A rollout engine that plays many multi-turn episodes together on a fixed pool of per-episode cache slots.

Why (docs/post-training.md, "The batched rollout engine"): the cached rollout (:mod:`.rollout`, ``grpo.rollout:
cached``) plays GRPO's episodes one at a time at batch 1, and TRL's own loop batches the rows of a turn but
re-prefills every conversation from scratch each turn. This engine keeps one cache *slot* per running episode and,
at every step, runs **one** forward over what every runnable slot has not seen yet — a chunk of its prompt, the
tool-result turn, or its one sampled token — so the prefills of some slots and the decodes of others share a step.
A finished episode frees its slot and the next queued one takes it; a slot waiting on a tool call sits out the
steps until its worker returns.

State of a slot (the layout agreed with the Kimi Linear work, issue #36):

* per KDA layer the recurrent state ``[H, K, V]`` (float32) and the short-conv window ``[3·H·K, W]`` (the model's
  dtype), in two pool tensors ``[num_slots, …]`` allocated once (fixed addresses);
* per MLA layer the cached rows ``[L, kv_lora_rank + qk_rope_head_dim]`` — the normed latent then the key part
  shared by every head (width 0 on models without it) — kept **ragged**: each episode owns a buffer of its own rows
  (grown by doubling), and the rows of a prompt prefilled once for a GRPO group live in one **prefix** buffer that
  the group's episodes reference, never copy.

GRPO groups share their prompt: episodes whose ``prompt_ids`` are equal (up to ``num_slots`` of them) are admitted
together; the first prefills the prompt, then the group *forks*: the KDA and conv states are copied to the other
slots, the MLA rows become the group's prefix, and every episode samples its first token from the one set of
prompt logits with its own generator. At each later step the MLA layers read a group's prefix once for all its
episodes' queries (one product for the scores, one for the values) and each episode's own rows separately.

The step forward composes the model: :meth:`KDAMoEModel.forward` runs over the step's tokens flattened into one
row (embeddings, every decoder layer's norms, residuals / Block AttnRes and MLP, the final norm — the model's own
code), while each decoder layer's token mixer is replaced for that call by the engine's ragged one
(:meth:`RolloutEngine._kda_mix`, :meth:`RolloutEngine._mla_mix`), which reads and writes the slots' states. The
mixers call the model's own projections and the ops of ``kernel_dispatch`` (``causal_conv1d_parts``, ``chunk_kda``
over ``cu_seqlens`` with one initial state per sequence, ``fused_recurrent_kda`` for one-token sequences — the ops
``generate`` runs for a prefill and a decode step). The MLA layers attend in the latent space ("absorbed"
projections, DeepSeek-V2 §2.1.2: ``q·k = (W_ukᵀ q_nope)·c + q_shared·k_shared``, ``Σ p v = W_uv Σ p c``), as the
model's decode path does. Where ``kernel_backend`` resolves to the kdamoe kernels (CUDA), a step's sequences skip the
gather → op → scatter and run the slot kernels of ``kdamoe.kernels`` instead (:meth:`RolloutEngine._slot_kernels`):
the conv and KDA states updated in place in the pools — one-token sequences by ``causal_conv1d_update_slots`` and
``fused_recurrent_kda_slots``, the prompt chunks and tool turns of the same step by ``causal_conv1d_varlen_slots``
(``cache_indices``) and ``chunk_kda`` (``initial_state_indices``) over their packed rows —, and the one-token MLA
queries read their group's prefix once and their own rows where they are. Weights are read from the modules at every
step, so the engine always decodes with the current weights (after an optimizer step, with PEFT adapters). The step
enters the model at its top module (the causal LM's own ``forward``, keeping only the rows whose logits are needed), as
``generate`` does, so a model sharded by FSDP2 gathers its top-level weights (embeddings, final norm, head) in that
module's hooks.

Several processes (``lockstep_group``): a model sharded over processes (FSDP2, expert parallelism) makes every
forward a collective (an all-gather per sharded module, an all-to-all per expert-parallel MoE layer), so every rank
must run the same number of forwards while each runs its own engine on its own episodes. Each step then begins with
one all-reduce (max) of two flags: "this rank has tokens to feed" and "this rank has episodes left". No rank has
episodes left: every rank stops. Some rank has tokens to feed: every rank runs one forward — its own step, or, with
nothing to feed (its episodes finished, or all waiting on tool calls), an *idle step*: the model's plain forward of
one token, thrown away, which issues the same collectives (``stats["idle_steps"]``). No rank has tokens to feed but
some wait on tools: the waiting ranks block on their tools as alone and nobody runs a forward. A rank's episodes
therefore play exactly as they would alone (the idle steps touch no slot), and a rank with more tool rounds only
makes the others idle longer. The same all-reduce carries a third number, the failed rank (plus one; 0: none): a
rank whose ``run`` raises (bad input, a tool-turn or processor error, an error of its step before the step's
forward, in which case it first joins the others' forward with an idle step) announces it there before raising
its own error, and every other rank raises a ``RuntimeError`` naming it at that all-reduce, within one step, instead
of waiting in it until the process group times out. A rank that fails inside a forward (after the forward's first
collective) or inside the all-reduce cannot announce it: the others are then inside a collective it has left.

What an episode is (the rules of :mod:`.rollout`, which follow TRL 1.16's ``_tool_call_loop``): a first turn of at
most ``min(max_completion_length, generation_config.max_new_tokens)`` tokens; while the last turn called a tool and
fewer than ``max_tool_calling_iterations`` rounds ran: run the calls (a raised error becomes ``{"error": str(err)}``,
an unknown name ``"Tool <name> not found."``, async tools are awaited after the sync ones, as in TRL), append the
tool-turn ids (``tool_suffix_ids``) unless that would pass ``max_completion_length`` or reach
``max_position_embeddings`` (then the episode ends there), and generate the next turn within what is left of the
budget. A turn ends at an eos id, its token cap or a stop string. A tool call that runs past ``tool_timeout_s`` ends
its episode at once (``ended = "tool_timeout"``; ``EpisodeSpec.on_timeout`` is called, e.g. to retire the
environment): Python cannot stop a thread, so the call keeps running on its abandoned worker, but no slot waits
for it.

Host work of a step (on a GPU the host, not the kernels, set a decode step's time: docs/post-training.md, "Host
work of a step"): the ids the engine feeds are checked on the host, so the model's forward skips its own check (a
device read), and sampling reads the device once per step, for every episode's token and log-prob together.

* A step of one-token sequences whose every layer runs the slot kernels (the decode-only steps on a GPU) runs on the
  *static inputs* of its batch-size bucket ``B`` (the next power of two of its sequence count, at most
  ``num_slots``; :class:`_StaticStep`): one device buffer holding the token ids, the slot ids, and per MLA layer the
  tables of a ``kdamoe.kernels.SharedPrefixPlan`` and the addresses of the step's new rows, filled from the host
  as one tensor and copied once. Padding rows feed token 0 on a scratch slot (the pools have ``num_slots + 1``
  rows), have no MLA keys and write no row; their logits are never read, and no op mixes rows. The forward then
  reads only fixed addresses: on CUDA (``cuda_graphs=True``, not under ``lockstep_group``) the bucket's first such
  step runs eagerly, the next captures a CUDA graph of the forward and every later one replays it
  (:class:`_StepGraphs`: captured again when a parameter is replaced or moved, or the pools' or buffers' addresses
  change). The same static path runs eagerly on every other device, so the CPU tests run what a GPU captures.
* Any other step builds its layout (token ids, lengths, starts, rows to keep, slots, row / column of every token) on
  the host and copies it to the device as one tensor; the decode / prefill split likewise; the decodes' new MLA
  rows go to their buffers in one ``torch._foreach_copy_``.

Sampling per episode, as ``generate`` does it: the logits processors ``generate`` builds from the generation config
(repetition penalty, temperature, top-k, top-p, min-p, …; plus any ``logits_processor`` passed) on the episode's
whole sequence so far, then ``argmax`` or ``torch.multinomial`` with the episode's own ``torch.Generator`` seeded
from ``EpisodeSpec.seed`` — the same draws a one-at-a-time ``generate`` makes after ``torch.manual_seed(seed)``, so
an episode's tokens do not depend on which other episodes shared its steps. Where every processor of the episodes
only transforms scores row by row (temperature, top-k, top-p, min-p; greedy has none) one call covers the rows of
all of a step's episodes, then one ``argmax``, or one ``softmax`` and a ``multinomial`` per episode with its own
generator (a single draw over ``[N, V]`` would take every row's numbers from one generator). Log-probabilities:
``log_softmax(raw logits / logprob_temperature)`` at the sampled token, float32, 0.0 on tool-turn tokens.

This module imports no TRL: :mod:`.rollout` plugs it into ``GRPOTrainer`` (``grpo.rollout: batched``).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import math
import numbers
import threading
import time
import types
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import StopStringCriteria

from ..model.decode_graph import ParameterWatch
from ..model.kernel_dispatch import (
    causal_conv1d_parts,
    chunk_kda,
    decode_graphs_supported,
    fused_recurrent_kda,
    kdamoe_kernels,
    resolve,
)
from ..model.modeling_kdamoe import fused_linear
from ..model.validation import inputs_prevalidated

_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 64 - 1  # what torch.Generator.manual_seed accepts


def _is_int(value) -> bool:
    """A Python or NumPy integer, not a bool (``True`` would pass as 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A real number, not a bool, not NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


def episode_seed(*parts: int) -> int:
    """A 63-bit seed from integers (e.g. the run's seed, the rollout call, the process, the episode), the same on
    every machine and Python process (SHA-256 of their decimal text; Python's ``hash`` is salted per process)."""
    digest = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class EpisodeSpec:
    """One episode to play.

    Attributes:
        prompt_ids: the prompt's token ids (non-empty).
        tools: ``{name: callable}`` the episode's tool calls run on (sync functions, or ``async`` ones, which are
            awaited); ``None`` plays a single turn with no tool loop.
        schemas: what ``parse_turn`` receives for this episode (TRL: the tool schemas the prompt was rendered with).
        seed: the episode's sampling seed (needed when the generation config samples).
        on_timeout: called (no arguments) when one of the episode's tool calls passes the time limit.
    """

    prompt_ids: list[int]
    tools: dict[str, Callable] | None = None
    schemas: Any = None
    seed: int | None = None
    on_timeout: Callable[[], None] | None = None


class _ToolJob:
    """One tool round of one episode, run on its own daemon thread (module docstring: why a thread per round)."""

    def __init__(self, calls: list[dict], tools: dict, wake: threading.Event):
        self.calls, self.tools, self.wake = calls, tools, wake
        self.messages: list[dict] = []
        self.failures = 0
        self.error: BaseException | None = None  # raised by the worker outside a tool's own error handling
        self.started = time.monotonic()  # start of the call (or the async gather) now running
        self.done = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.messages, self.failures = self._play()
        except BaseException as err:  # noqa: BLE001  handed to the engine's thread, which raises it (_tool_results)
            self.error = err
        finally:
            self.done = True
            self.wake.set()

    def _play(self) -> tuple[list[dict], int]:
        # TRL's order: the sync calls' results in call order, then the async calls' (gathered), each as a message
        results, coroutines, failures = [], [], 0
        for call in self.calls:
            if call.get("type") != "function":
                failures += 1
                error = {"error": f"Unsupported tool call type: {call.get('type')}"}
                results.append((call.get("name", "unknown"), error))
                continue
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            self.started = time.monotonic()
            try:
                if name not in self.tools:
                    raise ValueError(f"Tool {name} not found.")
                if inspect.iscoroutinefunction(self.tools[name]):
                    coroutines.append((name, self.tools[name](**arguments)))
                else:
                    results.append((name, self.tools[name](**arguments)))
            except Exception as err:  # the model reads the error as the tool's result, as in TRL's loop
                failures += 1
                results.append((name, {"error": str(err)}))
        if coroutines:
            self.started = time.monotonic()

            async def gather():
                return await asyncio.gather(*(c for _, c in coroutines), return_exceptions=True)

            for (name, _), result in zip(coroutines, asyncio.run(gather()), strict=True):
                if isinstance(result, BaseException) and not isinstance(result, Exception):
                    raise result  # an interrupt / cancellation, not a tool's error: the run stops, as TRL's would
                if isinstance(result, Exception):
                    failures += 1
                    result = {"error": str(result)}
                results.append((name, result))
        return [{"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
                for name, result in results], failures


class _Rows:
    """A growing ``[capacity, width]`` buffer of MLA rows with ``length`` valid (doubling: amortised O(1) append)."""

    def __init__(self, width: int, like: torch.Tensor):
        self.data = like.new_empty(16, width)
        self.length = 0

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """Write ``rows [t, width]`` after the valid ones; returns the valid rows (a view)."""
        self.extend(rows.shape[0])[...] = rows
        return self.data[: self.length]

    def extend(self, t: int) -> torch.Tensor:
        """Make room for ``t`` more rows and count them valid; returns them, ``[t, width]`` (a view, unwritten), for
        the caller to fill (e.g. many buffers in one ``torch._foreach_copy_``)."""
        need = self.length + t
        if need > self.data.shape[0]:
            grown = self.data.new_empty(max(need, 2 * self.data.shape[0]), self.data.shape[1])
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        start, self.length = self.length, need
        return self.data[start:need]

    def valid(self) -> torch.Tensor:
        return self.data[: self.length]


class _Episode:
    """The engine's record of one episode (its spec, sequence, sampling state, cache rows and outcome)."""

    def __init__(self, index: int, spec: EpisodeSpec):
        self.index, self.spec = index, spec
        self.ids = list(spec.prompt_ids)  # prompt + completion so far
        self.prompt_len = len(spec.prompt_ids)
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.messages: list[dict] = []
        self.calls = self.failures = self.rounds = 0
        self.turn: list[int] = []  # this turn's sampled tokens
        self.turn_start = self.prompt_len  # len(ids) when the turn began
        self.turn_cap = 0
        self.turn_index = 0
        self.pending: list[int] = []  # tokens the slot's cache has not seen yet
        self.slot: int | None = None
        self.prefix: dict | None = None  # the group's shared MLA rows per layer, after the fork
        self.own: dict[int, _Rows] = {}
        self.followers: list[_Episode] = []  # set on a group's leader until the fork
        self.waiting_fork = False
        self.job: _ToolJob | None = None
        self.ended: str | None = None
        self.generator: torch.Generator | None = None
        self.processors: LogitsProcessorList | None = None
        self.stop: StopStringCriteria | None = None
        # ids as a [1, capacity] device tensor, the first _ids_synced valid
        self._ids_buffer: torch.Tensor | None = None
        self._ids_synced = 0

    def ids_tensor(self, device: torch.device) -> torch.Tensor:
        """``ids`` as a ``[1, len(ids)]`` int64 tensor on ``device``, for the logits processors.

        Kept in a buffer that grows by doubling and takes only the ids appended since the last call, so a step costs
        host work in the new tokens, not in the context: rebuilding the tensor from the whole Python list each step
        took 17 ms for a 128K-token episode (seen on this project's 2-core CPU), per episode and step."""
        n = len(self.ids)
        if self._ids_buffer is None or self._ids_buffer.shape[1] < n:
            grown = torch.empty(1, max(2 * n, 1024), dtype=torch.long, device=device)
            if self._ids_buffer is not None:
                grown[:, : self._ids_synced] = self._ids_buffer[:, : self._ids_synced]
            self._ids_buffer = grown
        if self._ids_synced < n:
            new = torch.tensor(self.ids[self._ids_synced:], dtype=torch.long)
            self._ids_buffer[0, self._ids_synced: n] = new.to(device)
            self._ids_synced = n
        return self._ids_buffer[:, :n]


class _StaticStep:
    """The static inputs of the engine's decode steps of one batch-size bucket ``B`` (module docstring, "Host work of a
    step"): one int64 device buffer allocated once, whose sections every such step refills from the host in one copy
    (through a pinned buffer on CUDA) and which a CUDA graph of the step reads at fixed addresses.

    Sections (each starting on a 128-byte boundary, Triton's pointer alignment): the token ids ``[B]`` (padding rows:
    id 0), the slot ids ``[B]`` (padding rows: the scratch slot ``num_slots``), then per MLA layer the tables of its
    :class:`kdamoe.kernels.SharedPrefixPlan` (capacity ``B`` sequences and ``B`` groups; padding rows have no keys,
    so their output is 0) and the addresses ``[B]`` its new rows go to (``write_rows_at``; padding rows: 0, nothing
    written). The padding rows' logits are computed and never read; no op of the step mixes rows, so they change
    neither a real row's logits nor a real slot's state.
    """

    _ALIGN = 16  # int64 elements per section boundary (128 bytes)

    def __init__(self, engine: RolloutEngine, B: int):
        kernels = kdamoe_kernels()
        self.B, self.device = B, engine.device
        self.mla = [layer.self_attn for layer in engine.backbone.layers if layer.layer_type == "full_attention"]
        table = kernels.SharedPrefixPlan.table_size(B, B)
        sizes = [B, B] + [table, B] * len(self.mla)
        padded = [-(-n // self._ALIGN) * self._ALIGN for n in sizes]
        self.gaps = [[0] * (p - n) for n, p in zip(sizes, padded, strict=True)]
        self.buffer = torch.zeros(sum(padded), dtype=torch.long, device=self.device)
        self.pinned = self.device.type == "cuda"
        self.host = torch.zeros(sum(padded), dtype=torch.long, pin_memory=self.pinned)
        self.copied = torch.cuda.Event() if self.pinned else None  # the last copy out of the pinned buffer
        views = [v[:n] for v, n in zip(self.buffer.split(padded), sizes, strict=True)]
        self.ids = views[0]
        self.decode = types.SimpleNamespace(tokens=None, slots=views[1])  # what _kda_decode reads
        self.width = engine._row_width()
        self.row_like = torch.empty(0, dtype=engine._dtype, device=self.device)  # the own buffers' dtype and device
        self.plans, self.new_rows = {}, {}
        for i, attn in enumerate(self.mla):
            self.plans[attn.layer_idx] = kernels.SharedPrefixPlan(
                max_sequences=B, max_groups=B, num_heads=attn.num_heads, key_dim=self.width,
                value_dim=attn.config.kv_lora_rank, dtype=engine._dtype, device=self.device, tables=views[2 + 2 * i])
            self.new_rows[attn.layer_idx] = views[3 + 2 * i]

    def fill(self, engine: RolloutEngine, feeds: list[tuple[_Episode, list[int]]]) -> None:
        """Write the step's inputs for ``feeds`` (one token each, at most ``B``): every episode's MLA buffers get
        room for the new row here (a buffer that grows moves: its new address is in the tables), then one host
        tensor, one copy."""
        pad = self.B - len(feeds)
        episodes = [episode for episode, _ in feeds]
        values = [tokens[0] for _, tokens in feeds] + [0] * pad + self.gaps[0]
        values += [e.slot for e in episodes] + [engine.num_slots] * pad + self.gaps[1]
        for i, attn in enumerate(self.mla):
            layer = attn.layer_idx
            prefixes, index, group, own, new = [], {}, [], [], []
            for episode in episodes:
                buffer = episode.own.get(layer)
                if buffer is None:
                    buffer = episode.own[layer] = _Rows(self.width, self.row_like)
                new.append(buffer.extend(1).data_ptr())
                own.append(buffer.valid())  # a view of the buffer: contiguous rows, the new one included
                if episode.prefix is None:
                    group.append(-1)
                    continue
                if id(episode.prefix) not in index:
                    index[id(episode.prefix)] = len(prefixes)
                    prefixes.append(episode.prefix[layer])
                group.append(index[id(episode.prefix)])
            values += self.plans[layer].host_tables(prefixes, group, own) + self.gaps[2 + 2 * i]
            values += new + [0] * pad + self.gaps[3 + 2 * i]
        host = torch.tensor(values, dtype=torch.long)
        if not self.pinned:
            self.buffer.copy_(host)
            return
        self.copied.synchronize()  # the previous step's copy out of the pinned buffer has run
        self.host.copy_(host)
        self.buffer.copy_(self.host, non_blocking=True)
        self.copied.record()

    def mla_decode(self, attn, q_lat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """An MLA layer's decode on the static inputs: ``rows [B, D]`` appended at the addresses of the step's
        table, then the plan's launch over ``q_lat [B, H, D]``; returns ``o_lat [B, H, R]`` (the model's dtype)."""
        kernels = kdamoe_kernels()
        plan = self.plans[attn.layer_idx]
        kernels.write_rows_at(rows.to(plan.dtype), self.new_rows[attn.layer_idx])
        return plan.launch(q_lat.to(plan.dtype), attn.scaling)

    def addresses(self) -> list[int]:
        """The addresses a graph of this step reads besides the model's parameters and the pools."""
        plans = self.plans.values()
        return [self.buffer.data_ptr()] + [t.data_ptr() for p in plans for t in (p.acc_ws, p.m_ws, p.l_ws, p.out)]


class _StepGraphs:
    """CUDA graphs of the engine's static decode steps, one per batch-size bucket, in one graph memory pool.

    The first step of a bucket runs eagerly (on the capture stream: it autotunes and compiles the kernels and
    initialises cuBLAS there, as PyTorch's warm-up before a capture wants); the next captures the step's forward and
    replays it; later ones replay. A graph is captured again when the model's parameters moved or were replaced
    (:class:`kdamoe.model.decode_graph.ParameterWatch`: a slot holding another ``Parameter`` or storage at another
    address) or the other addresses it read changed (the pools, the bucket's buffers and plan workspaces).
    :meth:`action` is the decision alone (host state only, no CUDA needed).
    """

    def __init__(self):
        self.entries: dict[int, types.SimpleNamespace] = {}  # bucket → graph, logits, watch, addresses
        self.warm: set[int] = set()
        self.pool = self.stream = None
        self.disabled = False  # a capture failed: the static steps run eagerly from then on

    def action(self, key: int, model, addresses: list[int]) -> str:
        """``"warm_up"`` (run eagerly), ``"capture"`` (no valid graph: capture one, then replay it) or
        ``"replay"`` for a step of bucket ``key`` on ``model`` reading ``addresses``."""
        if key not in self.warm:
            return "warm_up"
        entry = self.entries.get(key)
        if entry is None or entry.addresses != addresses or not entry.watch.valid_for(model):
            return "capture"
        return "replay"

    def run(self, key: int, model, addresses: list[int], forward: Callable[[], torch.Tensor],
            stats: dict) -> torch.Tensor | None:
        """The logits of ``forward()`` (the step, its inputs already in the static buffers): eagerly, or from the
        bucket's graph (the graph's output buffer, overwritten by its next replay). None when a capture failed
        (warned once; the caller runs the step eagerly)."""
        action = self.action(key, model, addresses)
        if self.stream is None:
            self.stream, self.pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
        if action == "warm_up":
            self.stream.wait_stream(torch.cuda.current_stream())  # after the inputs' copy
            with torch.cuda.stream(self.stream):
                logits = forward()
            # the sampling reads the logits on the current stream (and the step ends with a host read, before the
            # capture stream allocates again)
            torch.cuda.current_stream().wait_stream(self.stream)
            self.warm.add(key)
            return logits
        if action == "capture":
            self.entries.pop(key, None)  # its old graph's memory goes back to the pool first
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: the tool calls run on worker threads, whose CUDA calls (if any) must not break the
                # capture (PyTorch's default, "global", refuses unsafe calls from every thread while capturing)
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                    logits = forward()
            except RuntimeError as error:  # an op that cannot be captured: say so once, run the steps eagerly
                warnings.warn(f"RolloutEngine: capturing a decode step failed ({error}); decoding without CUDA graphs",
                              stacklevel=2)
                self.disabled = True
                self.entries.clear()
                return None
            self.entries[key] = types.SimpleNamespace(graph=graph, logits=logits, watch=ParameterWatch(model),
                                                      addresses=list(addresses))
            stats["graph_captures"] += 1
        entry = self.entries[key]
        entry.graph.replay()  # a capture records the step without running it: this replay runs it
        stats["graph_replays"] += 1
        return entry.logits


class RolloutEngine:
    """Plays :class:`EpisodeSpec` episodes on ``num_slots`` cache slots (module docstring).

    Args:
        model: a ``KDAMoEForCausalLM`` (the package's or the remote-code class), or a PEFT model wrapping one.
        generation_config: how to pick tokens (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
            ``repetition_penalty``, ``max_new_tokens`` = tokens per turn, ``stop_strings``; the rest as ``generate``
            reads it). Not modified.
        num_slots: cache slots (episodes decoded together), ≥ 1.
        eos_token_ids: ids that end a turn (TRL's ``trainer.eos_token_ids``).
        max_completion_length: tokens per episode after the prompt (tool turns included), ≥ 1.
        logprob_temperature: the temperature of the returned log-probs (TRL: ``args.temperature``), > 0.
        max_tool_calling_iterations: tool rounds per episode (None: no limit).
        max_position_embeddings: a tool turn that would bring the sequence to this length ends the episode
            (default ``model.config.max_position_embeddings``).
        parse_turn: ``(turn ids, prefix ids, schemas) -> message dict`` (TRL's ``parse_response``); needed for tools.
        tool_suffix_ids: ``(tool messages) -> ids`` of the tool turn plus the next assistant header (TRL's
            ``_get_tool_suffix_ids``); needed for tools.
        tool_timeout_s: seconds one tool call may run (None: no limit).
        prefill_chunk_size: most tokens one slot feeds in one step (a longer prompt takes several steps).
        max_step_tokens: most tokens of one step over all slots (bounds the step's activations); one-token decodes
            go first, then prefill pieces in slot order until it is reached (the rest wait for the next step).
        tokenizer: needed only for ``stop_strings``.
        logits_processor: extra processors applied after the generation config's (as ``generate``'s argument).
        lockstep_group: a ``torch.distributed`` process group (e.g. ``torch.distributed.group.WORLD``) over whose
            ranks the model's forwards are collectives (FSDP2, expert parallelism); every rank of it must call
            :meth:`run` at the same time, and each step runs one forward on every rank (module docstring). None:
            this process steps alone (one process, or DDP, where every rank holds the whole model).
        cuda_graphs: on CUDA without ``lockstep_group``, replay the static decode steps from a CUDA graph per
            batch-size bucket (module docstring, "Host work of a step"; ``stats["graph_captures"]``,
            ``stats["graph_replays"]``); False runs the same static steps eagerly. Ignored elsewhere (on the CPU, and
            under ``lockstep_group``, whose FSDP2 hooks gather weights inside the forward).
    Raises:
        ValueError: a bad argument (named), a model without KDAMoE decoder layers, beam search / assisted
            generation in the config, or a ``lockstep_group`` given while ``torch.distributed`` is not initialized.
    """

    # Run the one-token sequences of a step on the slot-pool kernels where :meth:`_slot_kernels` allows it (CUDA with
    # the kdamoe kernels); False keeps the gather → op → scatter path for every sequence (for a comparison).
    use_slot_kernels = True

    def __init__(self, model, generation_config: GenerationConfig, *, num_slots: int, eos_token_ids,
                 max_completion_length: int, logprob_temperature: float = 1.0,
                 max_tool_calling_iterations: int | None = None, max_position_embeddings: int | None = None,
                 parse_turn: Callable | None = None, tool_suffix_ids: Callable | None = None,
                 tool_timeout_s: float | None = None, prefill_chunk_size: int = 512, max_step_tokens: int = 8192,
                 tokenizer=None, logits_processor: LogitsProcessorList | None = None, lockstep_group=None,
                 cuda_graphs: bool = True):
        for name, value in (("num_slots", num_slots), ("max_completion_length", max_completion_length),
                            ("prefill_chunk_size", prefill_chunk_size), ("max_step_tokens", max_step_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (_is_real(logprob_temperature) and 0 < logprob_temperature < math.inf):
            raise ValueError(f"logprob_temperature must be a finite number > 0, got {logprob_temperature!r}")
        if tool_timeout_s is not None and not (_is_real(tool_timeout_s) and tool_timeout_s > 0):
            raise ValueError(f"tool_timeout_s must be None or a number of seconds > 0, got {tool_timeout_s!r}")
        if max_tool_calling_iterations is not None and not (_is_int(max_tool_calling_iterations)
                                                            and max_tool_calling_iterations >= 0):
            raise ValueError(f"max_tool_calling_iterations must be None or an integer >= 0, got "
                             f"{max_tool_calling_iterations!r}")
        if max_position_embeddings is not None and not (_is_int(max_position_embeddings)
                                                        and max_position_embeddings >= 1):
            raise ValueError(f"max_position_embeddings must be None or a positive integer, got "
                             f"{max_position_embeddings!r}")
        for name, value in (("parse_turn", parse_turn), ("tool_suffix_ids", tool_suffix_ids)):
            if value is not None and not callable(value):
                raise ValueError(f"{name} must be None or callable, got {value!r}")
        if logits_processor is not None and not (isinstance(logits_processor, list)
                                                 and all(callable(p) for p in logits_processor)):
            raise ValueError(f"logits_processor must be None or a LogitsProcessorList of processors, got "
                             f"{logits_processor!r}")
        if not isinstance(generation_config, GenerationConfig):
            raise ValueError(f"generation_config must be a transformers GenerationConfig, got "
                             f"{type(generation_config).__name__}")
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be a bool, got {cuda_graphs!r}")
        if lockstep_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"lockstep_group={lockstep_group!r} but torch.distributed is not initialized (the ranks "
                             "that step together need a process group)")
        causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        backbone = getattr(causal_lm, "model", None)
        layers = getattr(backbone, "layers", None)
        if layers is None or not hasattr(causal_lm, "lm_head") or not all(
                getattr(layer, "layer_type", None) in ("linear_attention", "full_attention") for layer in layers):
            raise ValueError(f"RolloutEngine needs a KDAMoE causal LM (decoder layers with a layer_type), got "
                             f"{type(model).__name__}")
        config = copy.deepcopy(generation_config)
        if (config.num_beams or 1) > 1 or getattr(config, "assistant_model", None) is not None:
            raise ValueError(f"RolloutEngine samples one sequence per episode; num_beams={config.num_beams} and "
                             "assisted generation are not supported")
        if config.stop_strings and tokenizer is None:
            raise ValueError(f"stop_strings={config.stop_strings!r} needs the tokenizer (tokenizer=...)")
        self.causal_lm, self.backbone, self.config = causal_lm, backbone, causal_lm.config
        self.num_slots = num_slots
        if isinstance(eos_token_ids, (str, bytes)) or not hasattr(eos_token_ids, "__iter__"):
            raise ValueError(f"eos_token_ids must be a list of token ids, got {eos_token_ids!r}")
        eos = [t.item() if isinstance(t, torch.Tensor) and t.numel() == 1 else t for t in eos_token_ids]
        bad = next((t for t in eos if not (_is_int(t) and 0 <= t < causal_lm.config.vocab_size)), None)
        if bad is not None:  # an id the model never samples would leave every turn to its token cap
            raise ValueError(f"eos_token_ids: {bad!r} is not a token id in [0, vocab_size="
                             f"{causal_lm.config.vocab_size})")
        self.eos = set(eos)
        if not self.eos:
            raise ValueError("eos_token_ids is empty: a turn would only end at its token cap")
        self.budget = max_completion_length
        self.logprob_temperature = float(logprob_temperature)
        self.max_rounds = max_tool_calling_iterations
        self.max_model_len = (self.config.max_position_embeddings if max_position_embeddings is None
                              else max_position_embeddings)
        self.parse_turn, self.tool_suffix_ids = parse_turn, tool_suffix_ids
        self.tool_timeout_s = tool_timeout_s
        self.chunk = prefill_chunk_size
        self.step_tokens = max_step_tokens
        self.tokenizer = tokenizer
        self.extra_processors = logits_processor
        self.device = next(causal_lm.parameters()).device
        self.generation_config, _ = causal_lm._prepare_generation_config(config)
        causal_lm._prepare_special_tokens(self.generation_config, True, device=self.device)
        try:  # the processors a turn builds, built once here: a value transformers' processors refuse (e.g.
            # temperature=0 while sampling, a negative top_k) is refused now, not at an episode's first token
            self.causal_lm._get_logits_processor(
                generation_config=self.generation_config, input_ids_seq_length=1, encoder_input_ids=None,
                prefix_allowed_tokens_fn=None, logits_processor=self.extra_processors or LogitsProcessorList(),
                device=self.device, model_kwargs={})
        except ValueError as err:
            raise ValueError(f"generation_config: {err}") from err
        self.per_turn = self.generation_config.max_new_tokens or max_completion_length
        self.do_sample = bool(self.generation_config.do_sample)
        # counters of the cost model (docs/post-training.md): forwards, the sequences and tokens they carried,
        # group forks, tool rounds, seconds idle on tools (nothing else could run) and seconds in forwards
        # idle_steps: forwards run only to keep in step with the other ranks of lockstep_group (module docstring)
        # graph_captures / graph_replays: static decode steps captured into / replayed from a CUDA graph
        self.stats = dict(steps=0, sequences=0, tokens=0, prefill_tokens=0, decode_tokens=0, forks=0, tool_rounds=0,
                          tool_wait_s=0.0, forward_s=0.0, idle_steps=0, graph_captures=0, graph_replays=0)
        self.lockstep_group = lockstep_group
        self.cuda_graphs = cuda_graphs
        self._graphs = _StepGraphs()
        self._static_steps: dict[int, _StaticStep] = {}  # per batch-size bucket
        self._static: _StaticStep | None = None  # the static step whose forward runs now (its mixers read it)
        self._layout = None
        self._probe = torch.empty(0, device=self.device)  # a tensor on the model's device for _slot_kernels
        self._wake = threading.Event()
        self._allocate()

    # ------------------------------------------------------------------------------------------ slot pool
    def _allocate(self) -> None:
        """The KDA pools (recurrent ``[S + 1, H, K, V]`` float32, conv ``[S + 1, 3·H·K, W]`` model dtype) per KDA
        layer, ``S = num_slots``: row ``S`` is the scratch slot the padding rows of a static decode step update (a
        real slot's state never sees them)."""
        dtype = next(self.causal_lm.parameters()).dtype
        self._dtype = dtype
        self.recurrent, self.conv = {}, {}
        for layer in self.backbone.layers:
            if layer.layer_type != "linear_attention":
                continue
            attn = layer.self_attn
            H, K = attn.num_heads, attn.head_dim
            self.recurrent[attn.layer_idx] = torch.zeros(self.num_slots + 1, H, K, K, dtype=torch.float32,
                                                         device=self.device)
            self.conv[attn.layer_idx] = torch.zeros(self.num_slots + 1, attn.conv1d.weight.shape[0],
                                                    attn.conv1d.weight.shape[-1], dtype=dtype, device=self.device)

    def slot_bytes(self, own_tokens: int = 0) -> int:
        """Bytes of one slot: its KDA and conv states plus ``own_tokens`` MLA rows per MLA layer (its group's
        prompt rows are counted once per group, not here)."""
        kda = sum(t[0].numel() * t.element_size() for t in (*self.recurrent.values(), *self.conv.values()))
        return kda + own_tokens * self._row_width() * self._mla_layers() * self._row_bytes()

    def _row_width(self) -> int:
        return self.config.kv_lora_rank + (getattr(self.config, "qk_rope_head_dim", 0) or 0)

    def _mla_layers(self) -> int:
        return sum(layer.layer_type == "full_attention" for layer in self.backbone.layers)

    def _row_bytes(self) -> int:
        return next(self.causal_lm.parameters()).element_size()

    # ------------------------------------------------------------------------------------------ public entry
    @torch.no_grad()
    def run(self, specs: list[EpisodeSpec]) -> list[dict]:
        """Play ``specs``; returns one dict per spec, in order: ``completion_ids``, ``logprobs`` (floats, 0.0 on
        tool-turn tokens), ``tool_mask`` (1 on sampled tokens, 0 on tool-turn tokens), ``completion`` (the parsed
        messages; ``[]`` without tools), ``tool_calls``, ``tool_failures``, ``ended`` (``"eos"`` / ``"turn_cap"`` /
        ``"stop_string"`` (the last turn's end, no tool call after it), ``"budget"`` (a tool turn would pass the
        completion budget or the context), ``"iterations"``, ``"no_reply"`` (no tokens left for a turn after a
        tool turn) or ``"tool_timeout"``).

        Raises:
            ValueError: ``specs`` not a list of :class:`EpisodeSpec`; an empty prompt, one that leaves no room
                below ``max_position_embeddings``, or a token id that is not an integer in ``[0, vocab_size)`` (in a
                prompt or a tool turn; a 1-D integer tensor of prompt ids is taken as its list); a seed outside
                ``torch.Generator.manual_seed``'s range, or none while sampling; tools without ``parse_turn`` /
                ``tool_suffix_ids``.
            BaseException: what a tool round raised outside a tool's own ``Exception`` (which becomes the tool's
                result, as in TRL): a ``KeyboardInterrupt`` from a tool, a malformed call dict — raised here, as TRL's
                loop, which runs the calls on the main thread, raises it.
            RuntimeError: under ``lockstep_group``, another rank of the group failed in its ``run`` (naming it);
                this rank raises it at the step the failure is announced, within one step (module docstring).
        """
        self._phase = None
        try:
            return self._run(specs)
        except Exception:
            if self.lockstep_group is not None:
                self._announce_failure()
            raise

    def _announce_failure(self) -> None:
        """This rank's ``run`` raised: tell the other ranks of ``lockstep_group`` in the all-reduce they wait in,
        so they raise too instead of waiting until the process group times out (module docstring)."""
        phase, self._phase = self._phase, None
        if phase in ("agree", "forward", "peer"):
            return  # the all-reduce itself failed, a forward's collectives broke off, or another rank failed first
        try:
            if phase == "step":  # the others run this step's forward (its collectives): join it first
                self._idle_step()
            self._agree(False, False, failed=True)
        except Exception:  # noqa: BLE001  the rank's own error is the one to raise; the announcement is best effort
            pass

    def _run(self, specs: list[EpisodeSpec]) -> list[dict]:
        if isinstance(specs, EpisodeSpec) or not isinstance(specs, (list, tuple)):
            raise ValueError(f"specs must be a list of EpisodeSpec, got {type(specs).__name__}")
        episodes = []
        for i, spec in enumerate(specs):
            if not isinstance(spec, EpisodeSpec):
                raise ValueError(f"episode {i}: expected an EpisodeSpec, got {type(spec).__name__}")
            if isinstance(spec.prompt_ids, torch.Tensor):  # what a transformers user holds: a 1-D tensor of ids
                if spec.prompt_ids.dim() != 1 or spec.prompt_ids.is_floating_point():
                    raise ValueError(f"episode {i}: prompt_ids as a tensor must be 1-D integer ids, got "
                                     f"{spec.prompt_ids.dtype} of shape {tuple(spec.prompt_ids.shape)}")
                spec.prompt_ids = spec.prompt_ids.tolist()
            if not isinstance(spec.prompt_ids, (list, tuple)) or not spec.prompt_ids:
                raise ValueError(f"episode {i}: prompt_ids must be a non-empty list of token ids, got "
                                 f"{spec.prompt_ids!r}")
            self._check_ids(spec.prompt_ids, f"episode {i}: prompt_ids")
            if len(spec.prompt_ids) >= self.max_model_len:
                raise ValueError(f"episode {i}: the prompt has {len(spec.prompt_ids)} tokens, no room for a reply "
                                 f"within max_position_embeddings={self.max_model_len}")
            if spec.seed is not None and not (_is_int(spec.seed) and _SEED_MIN <= spec.seed <= _SEED_MAX):
                raise ValueError(f"episode {i}: seed must be None or an integer in [{_SEED_MIN}, {_SEED_MAX}] "
                                 f"(torch.Generator.manual_seed's range), got {spec.seed!r}")
            if self.do_sample and spec.seed is None:
                raise ValueError(f"episode {i}: the generation config samples (do_sample=True) but the episode has "
                                 "no seed")
            if spec.tools is not None and not (isinstance(spec.tools, dict) and all(
                    isinstance(name, str) and callable(tool) for name, tool in spec.tools.items())):
                raise ValueError(f"episode {i}: tools must be None or a dict of name -> callable, got {spec.tools!r}")
            if spec.on_timeout is not None and not callable(spec.on_timeout):
                raise ValueError(f"episode {i}: on_timeout must be None or callable, got {spec.on_timeout!r}")
            if spec.tools is not None and (self.parse_turn is None or self.tool_suffix_ids is None):
                raise ValueError(f"episode {i} has tools but the engine has no parse_turn / tool_suffix_ids")
            episodes.append(_Episode(i, spec))
        queue = deque(self._groups(episodes))
        free = list(range(self.num_slots))
        running: list[_Episode] = []
        while queue or running or self.lockstep_group is not None:  # in lockstep, until no rank has episodes left
            while queue and len(queue[0]) <= len(free):  # FIFO: a group waits for all its slots
                group = queue.popleft()
                for episode in group:
                    episode.slot = free.pop(0)
                    running.append(episode)
                self._admit(group)
            self._phase = None
            self._poll_tools(running)
            runnable = [e for e in running if e.pending and e.ended is None]
            if self.lockstep_group is None:
                if runnable:
                    self._step(runnable)
                elif any(e.job is not None for e in running):
                    self._wait_for_tools(running)
            else:
                anyone_feeds, anyone_left = self._agree(bool(runnable), bool(queue or running))
                if not anyone_left:
                    break
                if runnable:
                    self._phase = "step"  # until the forward starts, a failure can still join the others' forward
                    self._step(runnable)
                elif anyone_feeds:
                    self._idle_step()  # another rank steps: join its collectives with a forward of our own
                elif any(e.job is not None for e in running):
                    self._wait_for_tools(running)
            for episode in [e for e in running if e.ended is not None]:
                running.remove(episode)
                free.append(episode.slot)
                free.sort()
                episode.own, episode.prefix = {}, None  # the rows go; a shared prefix goes with its last episode
            if not runnable and not any(e.job is not None for e in running) and running:
                raise RuntimeError("RolloutEngine: episodes are running but none can step")  # a bug, not bad input
        return [self._result(e) for e in episodes]

    def _check_ids(self, ids: list[int], what: str) -> None:
        """Token ids in ``[0, vocab_size)`` or a ValueError naming ``what`` and the first bad id: the engine checks
        every id it feeds on the host (prompts here, tool turns when they come; sampled ids are in range by
        construction), so the model's forward can skip its own check, a device sync per step."""
        vocab = self.config.vocab_size
        bad = next((t for t in ids if not (_is_int(t) and 0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"{what}: token id {bad!r} is not an integer in [0, vocab_size={vocab})")

    def _agree(self, feeds: bool, left: bool, failed: bool = False) -> tuple[bool, bool]:
        """One all-reduce (max) over ``lockstep_group``: whether any rank has tokens to feed this step, whether any
        rank has episodes left (running or queued), and which rank (if any) failed (``failed``: this one did; its
        ``1 + rank``, 0 for none, so the max names a failed rank).

        Raises:
            RuntimeError: another rank announced a failure (naming the highest such rank of the group).
        """
        group = self.lockstep_group
        # NCCL reduces CUDA tensors only; gloo (and the others) host tensors
        device = self.device if dist.get_backend(group) == "nccl" else "cpu"
        rank = dist.get_rank(group)
        flags = torch.tensor([int(feeds), int(left), rank + 1 if failed else 0], dtype=torch.int64, device=device)
        phase, self._phase = self._phase, "agree"
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        feeds_any, left_any, failed_rank = flags.tolist()  # one host read for the three
        self._phase = phase
        if failed_rank and not failed:
            self._phase = "peer"
            raise RuntimeError(f"RolloutEngine: rank {failed_rank - 1} of lockstep_group failed in run() (its own "
                               f"error is in its log); rank {rank} stops with it")
        return bool(feeds_any), bool(left_any)

    def _idle_step(self) -> None:
        """A forward that keeps this rank in step with the others of ``lockstep_group`` while it has nothing to feed:
        the model's plain forward (its own token mixers, no cache) of one token, whose output is thrown away. It
        runs every module the engine's step runs, so it issues the same collectives, and touches no slot."""
        token = torch.tensor([[min(self.eos)]], dtype=torch.long, device=self.device)
        start = time.perf_counter()
        phase, self._phase = self._phase, "forward"
        self.causal_lm(input_ids=token, use_cache=False, prefill_chunk_size=0, output_router_logits=False,
                       logits_to_keep=1)
        self._phase = phase
        self.stats["forward_s"] += time.perf_counter() - start
        self.stats["idle_steps"] += 1

    def _groups(self, episodes: list[_Episode]) -> list[list[_Episode]]:
        """Episodes with equal prompts, in first-seen order, in groups of at most ``num_slots``."""
        by_prompt: dict[tuple, list[_Episode]] = {}
        for episode in episodes:
            by_prompt.setdefault(tuple(episode.spec.prompt_ids), []).append(episode)
        groups = []
        for members in by_prompt.values():
            groups += [members[i:i + self.num_slots] for i in range(0, len(members), self.num_slots)]
        return sorted(groups, key=lambda g: g[0].index)

    def _admit(self, group: list[_Episode]) -> None:
        leader = group[0]
        for episode in group:
            self.recurrent_zero(episode.slot)
            episode.generator = None
            if self.do_sample:
                episode.generator = torch.Generator(device=self.device).manual_seed(int(episode.spec.seed))
            episode.turn_cap = min(self.budget, self.per_turn)
            episode.waiting_fork = episode is not leader
        leader.pending = list(leader.spec.prompt_ids)
        leader.followers = group[1:]

    def recurrent_zero(self, slot: int) -> None:
        """Clear a slot's KDA and conv states (a new episode starts from zeros)."""
        for pool in (*self.recurrent.values(), *self.conv.values()):
            pool[slot].zero_()

    # ------------------------------------------------------------------------------------------ one step
    def _step(self, runnable: list[_Episode]) -> None:
        feeds, room = [], self.step_tokens
        for episode in sorted(runnable, key=lambda e: len(e.pending) > 1):  # decodes first, then slot order (stable)
            n = min(len(episode.pending), self.chunk, room)
            if n == 0:
                break
            feeds.append((episode, episode.pending[:n]))
            episode.pending = episode.pending[n:]
            room -= n
        lengths = [len(tokens) for _, tokens in feeds]
        start = time.perf_counter()
        logits = self._forward(feeds)
        self.stats["forward_s"] += time.perf_counter() - start
        self.stats["steps"] += 1
        self.stats["sequences"] += len(feeds)
        self.stats["tokens"] += sum(lengths)
        self.stats["decode_tokens"] += sum(n for n in lengths if n == 1)
        self.stats["prefill_tokens"] += sum(n for n in lengths if n > 1)
        picks = []  # (episode, its row of logits): who samples a token this step
        for row, (episode, _) in enumerate(feeds):
            if episode.pending:
                continue  # more of its prompt / tool turn to feed
            if episode.followers or (episode.turn_index == 0 and not episode.turn and episode.prefix is None):
                self._fork(episode)
            picks += [(member, row) for member in [episode, *episode.followers]]
            episode.followers = []
        if picks:
            self._sample(picks, logits)

    def _fork(self, leader: _Episode) -> None:
        """The leader has prefilled the group's prompt: its MLA rows become the group's prefix, its KDA and conv
        states are copied to the followers' slots."""
        prefix = {layer: rows.valid().clone() for layer, rows in leader.own.items()}
        for member in [leader, *leader.followers]:
            member.prefix, member.own, member.waiting_fork = prefix, {}, False
            if member is not leader:
                for pool in (*self.recurrent.values(), *self.conv.values()):
                    pool[member.slot].copy_(pool[leader.slot])
        self.stats["forks"] += 1

    # Logits processors that read only the scores (never the ids) and hold no per-sequence state: built from the one
    # generation config, they are the same for every episode, so one call on the rows of every such episode of a
    # step gives each row what its own call gives (each works row by row).
    _ROW_WISE = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)

    def _sample(self, picks: list[tuple[_Episode, int]], logits: torch.Tensor) -> None:
        """Pick the next token of every episode of ``picks`` (``(episode, row)``: its raw logits are ``logits[row]``,
        ``logits [F, V]``; a group's members share their leader's row) as the module docstring says, and advance
        their turns. One batched op per stage where the processors allow it (module docstring): the log-softmax of
        every row, the row-wise processors on every row that has only those, one ``argmax`` (greedy) or one
        ``softmax`` and a ``multinomial`` per episode with its own generator (one batched draw cannot reproduce
        per-episode generator streams); then one host sync for every token and log-prob of the step."""
        for episode, _ in picks:
            if episode.processors is None or not episode.turn:  # a new turn: generate builds its processors per call
                episode.processors = self.causal_lm._get_logits_processor(
                    generation_config=self.generation_config, input_ids_seq_length=len(episode.ids),
                    encoder_input_ids=None, prefix_allowed_tokens_fn=None,
                    logits_processor=self.extra_processors or LogitsProcessorList(), device=self.device,
                    model_kwargs={})
                if self.generation_config.stop_strings:
                    episode.stop = StopStringCriteria(self.tokenizer, self.generation_config.stop_strings)
        rows = [row for _, row in picks]
        raw = logits.float()
        if rows != list(range(logits.shape[0])):  # a fork's members share a row, a prefilling feed samples nothing
            raw = torch.stack([raw[row] for row in rows])  # views, one copy
        logprobs = torch.log_softmax(raw / self.logprob_temperature, dim=-1)  # [M, V]
        # the processors are built from one config (plus the same extra ones), so in practice either every episode
        # of the step has row-wise ones only (greedy: none) or none has; both kinds side by side still work
        row_wise = [i for i, (e, _) in enumerate(picks) if all(type(p) in self._ROW_WISE for p in e.processors)]
        others = sorted(set(range(len(picks))) - set(row_wise))
        scores = raw
        if row_wise and len(picks[row_wise[0]][0].processors):
            processors = picks[row_wise[0]][0].processors
            no_ids = raw.new_zeros(len(row_wise), 0, dtype=torch.long)  # they read no ids
            if not others:  # the row-wise processors return new tensors (none writes its input)
                scores = processors(no_ids, raw)
            else:
                scores = raw.clone()
                scores[row_wise] = processors(no_ids, raw[row_wise])
        if others:
            scores = scores.clone() if scores is raw else scores
            for i in others:
                episode = picks[i][0]
                scores[i] = episode.processors(episode.ids_tensor(self.device), raw[i:i + 1].clone())[0]
        if self.do_sample:
            probs = F.softmax(scores, dim=-1)
            tokens = torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=e.generator)[0]
                                for i, (e, _) in enumerate(picks)])
        else:
            tokens = scores.argmax(-1)
        picked = logprobs.gather(1, tokens[:, None])[:, 0]
        # the step's one host sync: every token and log-prob (float32 and ids below 2**53 are exact in float64)
        tokens_host, logprobs_host = torch.stack([tokens.double(), picked.double()]).tolist()
        for (episode, _), token, logprob in zip(picks, tokens_host, logprobs_host, strict=True):
            self._advance(episode, int(token), logprob)

    def _advance(self, episode: _Episode, token: int, logprob: float) -> None:
        """Append the episode's sampled ``token`` (its log-prob ``logprob``) and end its turn where it ends."""
        episode.logprobs.append(logprob)
        episode.ids.append(token)
        episode.mask.append(1)
        episode.turn.append(token)
        ended = "eos" if token in self.eos else "turn_cap" if len(episode.turn) >= episode.turn_cap else None
        if ended is None and episode.stop is not None and bool(
                episode.stop(episode.ids_tensor(self.device), None)[0]):
            ended = "stop_string"
        if ended is None:
            episode.pending = [token]
            return
        self._end_turn(episode, ended)

    # ------------------------------------------------------------------------------------------ turns and tools
    def _end_turn(self, episode: _Episode, how: str) -> None:
        turn, prefix = episode.turn, episode.ids[: episode.turn_start]
        episode.turn, episode.turn_index = [], episode.turn_index + 1
        if episode.spec.tools is None:
            episode.ended = how
            return
        if episode.turn_index == 1:
            episode.messages = [self.parse_turn(turn, prefix, episode.spec.schemas)]
        else:
            reply = self.parse_turn(turn, prefix, episode.spec.schemas) if turn else {}
            if reply:
                episode.messages.append(reply)
            episode.rounds += 1
            if not reply:
                episode.ended = "no_reply"
                return
        self._next_round(episode, how)

    def _next_round(self, episode: _Episode, how: str) -> None:
        calls = episode.messages[-1].get("tool_calls")
        if not calls:
            episode.ended = how
            return
        if self.max_rounds is not None and episode.rounds >= self.max_rounds:
            episode.ended = "iterations"
            return
        episode.calls += len(calls)
        episode.job = _ToolJob(calls, episode.spec.tools, self._wake)
        self.stats["tool_rounds"] += 1

    def _poll_tools(self, running: list[_Episode]) -> None:
        now = time.monotonic()
        for episode in running:
            job = episode.job
            if job is None:
                continue
            if job.done:
                episode.job = None
                self._tool_results(episode, job)
            elif self.tool_timeout_s is not None and now - job.started > self.tool_timeout_s:
                episode.job, episode.ended = None, "tool_timeout"  # the worker thread is abandoned, not awaited
                if episode.spec.on_timeout is not None:
                    episode.spec.on_timeout()

    def _wait_for_tools(self, running: list[_Episode]) -> None:
        """Block until a tool job finishes or the earliest time limit passes (no slot can step meanwhile)."""
        timeout = 0.05
        if self.tool_timeout_s is not None:
            deadlines = [e.job.started + self.tool_timeout_s for e in running if e.job is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) + 1e-3
        start = time.perf_counter()
        self._wake.wait(timeout)
        self._wake.clear()
        self.stats["tool_wait_s"] += time.perf_counter() - start

    def _tool_results(self, episode: _Episode, job: _ToolJob) -> None:
        if job.error is not None:
            # TRL's loop runs the calls on the main thread: a KeyboardInterrupt from a tool, or a call dict without
            # "function", stops the run there; here the worker hands it over and the engine's thread raises it
            raise job.error
        episode.failures += job.failures
        suffix = self.tool_suffix_ids(job.messages)
        if isinstance(suffix, torch.Tensor) and suffix.dim() == 1 and not suffix.is_floating_point():
            suffix = suffix.tolist()
        if not isinstance(suffix, (list, tuple)):
            raise ValueError(f"episode {episode.index}: tool_suffix_ids(...) must return a list of token ids (or a 1-D "
                             f"integer tensor), got {type(suffix).__name__}")
        suffix = list(suffix)
        self._check_ids(suffix, f"episode {episode.index}: tool_suffix_ids(...)")
        completion_len = len(episode.ids) - episode.prompt_len
        if completion_len + len(suffix) > self.budget or len(episode.ids) + len(suffix) >= self.max_model_len:
            episode.ended = "budget"  # TRL drops this tool result; the episode ends with its completion as it is
            return
        episode.messages += job.messages
        last = episode.ids[-1]
        episode.ids += suffix
        episode.mask += [0] * len(suffix)
        episode.logprobs += [0.0] * len(suffix)
        left = self.budget - completion_len - len(suffix)
        if left <= 0:
            episode.rounds += 1
            episode.ended = "no_reply"
            return
        episode.turn_start, episode.turn_cap = len(episode.ids), min(left, self.per_turn)
        episode.pending = [last, *suffix]  # the previous turn's last token was never fed

    def _result(self, episode: _Episode) -> dict:
        completion = episode.ids[episode.prompt_len:]
        return dict(completion_ids=completion, logprobs=episode.logprobs, tool_mask=episode.mask,
                    completion=episode.messages, tool_calls=episode.calls, tool_failures=episode.failures,
                    ended=episode.ended)

    # ------------------------------------------------------------------------------------------ the forward
    def _forward(self, feeds: list[tuple[_Episode, list[int]]]) -> torch.Tensor:
        """One forward of the model over every feed's tokens (flattened into one row); returns the raw logits at
        each feed's last token, ``[len(feeds), V]``. A step of one-token feeds whose every layer runs the slot kernels
        takes the static path (:meth:`_static_forward`), every other step the ragged layout below."""
        if all(len(tokens) == 1 for _, tokens in feeds) and self._static_applies():
            return self._static_forward(feeds)
        # the step's layout built on the host and copied in one transfer (a handful of small tensors each copied
        # alone cost a host→device copy and a launch apiece per step); the host lists stay for the host's own use
        lengths = [len(t) for _, t in feeds]
        starts, total = [], 0
        for n in lengths:
            starts.append(total)
            total += n
        S = len(feeds)
        decode_only = total == S  # every sequence one token: row is 0 … S − 1 and col is 0
        row = list(range(S)) if decode_only else [i for i, n in enumerate(lengths) for _ in range(n)]
        col = [0] * S if decode_only else [c for n in lengths for c in range(n)]
        keep = [a + n - 1 for a, n in zip(starts, lengths, strict=True)]
        host = torch.tensor([t for _, tokens in feeds for t in tokens] + lengths + starts + keep
                            + [e.slot for e, _ in feeds] + row + col, dtype=torch.long)
        on_device = host.to(self.device, non_blocking=True)
        input_ids, lengths_d, starts_d, last, slots, row_d, col_d = on_device.split([total, S, S, S, S, total, total])
        self._layout = types.SimpleNamespace(
            episodes=[e for e, _ in feeds], lengths=lengths_d, starts=starts_d, row=row_d, col=col_d, slots=slots,
            t_max=max(lengths), host_lengths=lengths, host_starts=starts,
            host_slots=[e.slot for e, _ in feeds])
        try:
            return self._run_model(input_ids[None], last)
        finally:
            self._layout = None

    def _run_model(self, input_ids: torch.Tensor, keep) -> torch.Tensor:
        """The model's forward over ``input_ids [1, T]`` with every decoder layer's token mixer replaced by the
        engine's (reading :attr:`_layout` or :attr:`_static`); logits ``[kept rows, V]`` (``keep``: the forward's
        ``logits_to_keep``)."""
        layers = self.backbone.layers
        for layer in layers:
            mix = self._kda_mix if layer.layer_type == "linear_attention" else self._mla_mix
            # the decoder layer's norms / residuals / MLP run as they are; only its token mixer reads the slots
            layer._mix = types.MethodType(lambda lay, hidden, *args, _mix=mix, **kwargs: _mix(lay.self_attn, hidden),
                                          layer)
        try:
            # through the top module, as generate does: under FSDP2 its hooks gather the embeddings, final norm and
            # head (the decoder layers gather their own); only the feeds' last rows reach the head
            # every fed id was checked on the host (_check_ids): the model's own check would read the ids back
            with inputs_prevalidated():
                if self._phase == "step":
                    self._phase = "forward"  # from here the forward's collectives may have started
                logits = self.causal_lm(input_ids=input_ids, use_cache=False, prefill_chunk_size=0,
                                        output_router_logits=False, logits_to_keep=keep).logits
                if self._phase == "forward":
                    self._phase = "after"  # the others are past this forward: a failure now meets their next agree
        finally:
            for layer in layers:
                del layer._mix
        return logits[0]

    # ------------------------------------------------------------------------------------------ static decode steps
    def _static_applies(self) -> bool:
        """Whether every layer runs the slot kernels (:meth:`_slot_kernels`): the condition of the static path."""
        return all(self._slot_kernels(layer.self_attn, self._probe) for layer in self.backbone.layers)

    def _bucket(self, n: int) -> int:
        """The batch-size bucket of a static step of ``n`` sequences: the next power of two, at most ``num_slots``."""
        return min(1 << (n - 1).bit_length(), self.num_slots)

    def _static_forward(self, feeds: list[tuple[_Episode, list[int]]]) -> torch.Tensor:
        """A step of one-token feeds on the static inputs of its bucket ``B`` (:class:`_StaticStep`): the host fills
        them (token ids, slots — padding rows on the scratch slot —, each MLA layer's plan tables and new-row
        addresses) and copies them in one transfer; then the forward runs eagerly or a CUDA graph of it replays
        (:class:`_StepGraphs`). Returns the real rows' logits ``[len(feeds), V]``."""
        n = len(feeds)
        B = self._bucket(n)
        step = self._static_steps.get(B)
        if step is None:
            step = self._static_steps[B] = _StaticStep(self, B)
        step.fill(self, feeds)

        def forward() -> torch.Tensor:
            self._static = step
            try:  # every row's logits (the bucket's rows are the feeds', in order, then padding)
                return self._run_model(step.ids[None], 0)
            finally:
                self._static = None

        if not self._graphs_apply():
            return forward()[:n]
        logits = self._graphs.run(B, self.causal_lm, self._graph_addresses(step), forward, self.stats)
        if logits is None:  # the capture failed: the graphs are off for this engine, the step runs eagerly
            logits = forward()
        return logits[:n]

    def _graphs_apply(self) -> bool:
        """CUDA graphs for the static steps: asked for (``cuda_graphs``), on CUDA, not under ``lockstep_group`` (its
        FSDP2 hooks gather the weights inside the forward), every op of the step a kdamoe kernel, no failed
        capture."""
        return (self.cuda_graphs and self.device.type == "cuda" and self.lockstep_group is None
                and not self._graphs.disabled
                and decode_graphs_supported(self.config.kernel_backend, self.device,
                                            bounded_gate=self.config.kda_lower_bound is not None))

    def _graph_addresses(self, step: _StaticStep) -> list[int]:
        """The addresses a graph of ``step`` bakes in besides the parameters: the pools and the step's buffers."""
        return [t.data_ptr() for t in (*self.recurrent.values(), *self.conv.values())] + step.addresses()

    def _kda_mix(self, attn, x: torch.Tensor) -> torch.Tensor:
        """The KDA token mixer over the step's ragged sequences, each continuing its slot's states (the math of
        ``KDAMoEDeltaAttention.forward``; the conv and the recurrence start from each sequence's own state).

        With the slot kernels (:meth:`_slot_kernels`), the one-token sequences run the conv and the recurrence on
        the pools in place (:meth:`_kda_decode`) and the longer ones too (:meth:`_kda_chunks`); otherwise every
        sequence takes :meth:`_kda_sequences`' gather → op → scatter."""
        lay = self._layout
        N = x.shape[1]
        H, K = attn.num_heads, attn.head_dim
        qkv, f, beta, gate = fused_linear(
            x, ((attn.q_proj, attn.k_proj, attn.v_proj), attn.f_a_proj, attn.b_proj, attn.g_a_proj))
        f = attn.f_b_proj(f).view(1, N, H, K)
        beta = torch.sigmoid(beta.float())
        rest, o = lay, None
        if self._static is not None:  # a static step: every row one token, on the static slot ids
            rest = None
            o = self._kda_decode(attn, qkv[0], f[0], beta[0], self._static.decode, N)
        elif self._slot_kernels(attn, x):
            decode, rest = self._decode_split()
            if decode is not None:
                o = self._kda_decode(attn, qkv[0], f[0], beta[0], decode, N)
            if rest is not None:
                o = self._kda_chunks(attn, qkv[0], f[0], beta[0], rest, o)
                rest = None
        if rest is not None:
            o = self._kda_sequences(attn, qkv, f, beta, rest, o)
        gate = attn.g_b_proj(gate).view(1, N, H, K)
        return attn.o_proj(attn.o_norm(o[None], gate).reshape(1, N, H * K))

    def _slot_kernels(self, attn, x: torch.Tensor) -> bool:
        """Whether this step's sequences run the slot kernels in ``attn``'s layer: for a KDA layer
        ``causal_conv1d_update_slots`` and ``fused_recurrent_kda_slots`` (one-token sequences),
        ``causal_conv1d_varlen_slots`` and ``chunk_kda`` with ``initial_state_indices`` (longer ones; the states read
        and written in place in the pools, no gather / scatter), for an MLA layer (its one-token sequences)
        ``latent_attention_shared_prefix`` (a group's prefix read once for its members, every row where it is).
        Needs :attr:`use_slot_kernels`, ``kernel_backend`` resolving to the kdamoe kernels on ``x``'s device for
        those ops (CUDA; CPU only under ``TRITON_INTERPRET=1`` with ``"triton"``, for the tests), as every other op
        of the model resolves, and the kernels' sizes: the bounded KDA gate (they refuse Kimi Linear's unbounded
        one); a power-of-two ``kv_lora_rank`` in [16, 512] and a shared key part of at most 256 columns."""
        if not self.use_slot_kernels:
            return False
        if hasattr(attn, "conv1d"):  # a KDA layer
            if attn.lower_bound is None:
                return False
            ops = ("causal_conv1d_update_slots", "fused_recurrent_kda_slots", "causal_conv1d_varlen_slots",
                   "chunk_kda")
        else:
            R, shared = attn.config.kv_lora_rank, getattr(attn.config, "qk_rope_head_dim", 0) or 0
            if not (16 <= R <= 512 and R & (R - 1) == 0 and shared <= 256):
                return False
            ops = ("latent_attention_shared_prefix",)
        try:
            return all(resolve(attn.config.kernel_backend, x.device, op) == "kdamoe" for op in ops)
        except RuntimeError:  # a forced backend that cannot run here: the op path raises its own error
            return False

    def _decode_split(self) -> tuple[types.SimpleNamespace | None, types.SimpleNamespace | None]:
        """``(decode, rest)`` of this step, computed once per forward (every KDA layer reads it): ``decode`` the
        one-token sequences (``tokens`` their flat positions, a slice when they are the first rows, None when every
        sequence is one; ``slots`` int32),
        ``rest`` the longer ones as a layout of their own (``lengths``, ``slots``, ``row``, ``col``, ``t_max``,
        ``tokens``, their flat positions, ``cu_seqlens`` int32 over those tokens, and ``span``, the slice of the
        step's rows they fill when they come after the decodes, as the engine orders a step, else None); None where
        there are none."""
        lay = self._layout
        if getattr(lay, "split", None) is None:
            # the host's lists of the step (a layout built elsewhere, e.g. by a test, has only the tensors)
            lengths = getattr(lay, "host_lengths", None) or lay.lengths.tolist()
            starts = getattr(lay, "host_starts", None) or lay.starts.tolist()
            one = [i for i, n in enumerate(lengths) if n == 1]
            many = [i for i, n in enumerate(lengths) if n != 1]
            device = lay.lengths.device
            decode = rest = None
            if one and not many:  # every sequence is one token: all the rows, in order, every slot
                decode = types.SimpleNamespace(tokens=None, slots=lay.slots.to(torch.int32))
            else:
                # every index either side needs, built on the host as one tensor and copied once
                contiguous = bool(one) and one[-1] == len(one) - 1  # the decodes first (the step's order): a view
                d_tokens = [] if contiguous else [starts[i] for i in one]
                r_row = [j for j, i in enumerate(many) for _ in range(lengths[i])]
                r_col = [c for i in many for c in range(lengths[i])]
                r_tokens = [starts[i] + c for i in many for c in range(lengths[i])]
                slots_host = getattr(lay, "host_slots", None) or lay.slots.tolist()
                r_cu = [0]
                for i in many:
                    r_cu.append(r_cu[-1] + lengths[i])
                parts = [d_tokens, [slots_host[i] for i in one], [lengths[i] for i in many],
                         [slots_host[i] for i in many], r_row, r_col, r_tokens, r_cu]
                pieces = torch.tensor([v for part in parts for v in part], dtype=torch.long).to(
                    device, non_blocking=True).split([len(p) for p in parts])
                if one:
                    tokens = slice(0, len(one)) if contiguous else pieces[0]
                    decode = types.SimpleNamespace(tokens=tokens, slots=pieces[1].to(torch.int32))
                rest = types.SimpleNamespace(lengths=pieces[2], slots=pieces[3], row=pieces[4], col=pieces[5],
                                             t_max=max(lengths[i] for i in many), tokens=pieces[6],
                                             cu_seqlens=pieces[7].to(torch.int32),
                                             span=slice(len(one), len(r_tokens) + len(one))
                                             if contiguous or not one else None,
                                             host_lengths=[lengths[i] for i in many])
            lay.split = (decode, rest)
        return lay.split

    def _kda_decode(self, attn, qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, decode, N: int):
        """One token on each slot of ``decode`` (:meth:`_decode_split`): the short conv and the recurrence on the
        pools in place. ``qkv [N, 3·H·K]``, ``f [N, H, K]``, ``beta [N, H]`` are the step's rows; returns ``o
        [N, H, K]`` with the decode rows written (all of it when every sequence is one token)."""
        kernels = kdamoe_kernels()
        H, K = attn.num_heads, attn.head_dim
        if decode.tokens is not None:
            qkv, f, beta = qkv[decode.tokens], f[decode.tokens], beta[decode.tokens]
        n = qkv.shape[0]
        y = kernels.causal_conv1d_update_slots(qkv, self.conv[attn.layer_idx], decode.slots,
                                               attn.conv1d.weight.squeeze(1), check_slot_ids_values=False)
        q, k, v = (y[:, i * H * K:(i + 1) * H * K].view(n, H, K) for i in range(3))  # read in place by the kernel
        out = kernels.fused_recurrent_kda_slots(
            q, k, v, f, beta, self.recurrent[attn.layer_idx], decode.slots, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, A_log=attn.A_log, dt_bias=attn.dt_bias, lower_bound=attn.lower_bound,
            check_slot_ids_values=False)
        if decode.tokens is None:
            return out
        o = out.new_empty(N, H, K)
        o[decode.tokens] = out
        return o

    def _kda_chunks(self, attn, qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, rest, o: torch.Tensor | None):
        """The multi-token sequences of ``rest`` (:meth:`_decode_split`: prompt chunks, tool-result turns) on the
        pools in place: ``causal_conv1d_varlen_slots`` reads each sequence's conv window from ``conv_pool[slot]``
        over the packed rows (``cu_seqlens``) and writes its new one back, ``chunk_kda`` with
        ``initial_state_indices`` starts each from ``rec_pool[slot]`` and writes its final state there; no gather,
        no scatter, no padded copy. ``qkv [N, 3·H·K]``, ``f [N, H, K]``, ``beta [N, H]`` are the step's rows; writes
        the sequences' rows of ``o [N, H, K]`` (allocated when None) and returns it."""
        kernels = kdamoe_kernels()
        H, K = attn.num_heads, attn.head_dim
        N = qkv.shape[0]
        # the sequences' rows, packed: a view where they follow the decodes (the conv reads x through its row stride)
        rows = rest.span if rest.span is not None else rest.tokens
        qkv, f, beta = qkv[rows], f[rows], beta[rows]
        n = qkv.shape[0]
        # the engine's slots are distinct and in range, and cu_seqlens is built from the host's lengths
        ys = kernels.causal_conv1d_varlen_slots(qkv, attn.conv1d.weight.squeeze(1), self.conv[attn.layer_idx],
                                                rest.slots, rest.cu_seqlens, parts=3,
                                                check_cache_indices_values=False)
        q, k, v = (y.view(1, n, H, K) for y in ys)
        out, _ = kernels.chunk_kda(
            q, k, v, f[None], beta[None], initial_state=self.recurrent[attn.layer_idx],
            initial_state_indices=rest.slots, output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=rest.cu_seqlens, use_gate_in_kernel=True, A_log=attn.A_log, dt_bias=attn.dt_bias,
            lower_bound=attn.lower_bound, check_initial_state_indices_values=False)
        if o is None:
            o = out.new_empty(N, H, K)
        o[rows] = out[0]
        return o

    def _kda_sequences(self, attn, qkv: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, lay,
                       o: torch.Tensor | None) -> torch.Tensor:
        """The conv and the recurrence of the sequences of ``lay`` (the step's layout, or :meth:`_decode_split`'s
        ``rest``, whose ``tokens`` pick their rows of the step's ``qkv [1, N, 3·H·K]``, ``f``, ``beta``): their
        slots' states gathered from the pools, the ops of ``kernel_dispatch``, the new states scattered back.
        Writes their rows of ``o [N, H, K]`` (allocated when None) and returns it."""
        rows = getattr(lay, "tokens", None)  # None: every row of the step, in order
        if rows is not None:
            qkv, f, beta = qkv[:, rows], f[:, rows], beta[:, rows]
        S, N, total = len(lay.lengths), qkv.shape[1], self._layout.row.shape[0]
        H, K = attn.num_heads, attn.head_dim
        backend = attn.config.kernel_backend
        conv_pool, rec_pool = self.conv[attn.layer_idx], self.recurrent[attn.layer_idx]
        conv_state = conv_pool[lay.slots].to(qkv.dtype)  # [S, 3HK, W]
        padded = qkv.new_zeros(S, lay.t_max, qkv.shape[-1])  # right padding: a causal conv never reads it
        padded[lay.row, lay.col] = qkv[0]
        ys, _ = causal_conv1d_parts(padded, attn.conv1d.weight.squeeze(1), conv_state, None, parts=3,
                                    output_final_state=False, backend=backend)
        q, k, v = (y[lay.row, lay.col].view(1, N, H, K) for y in ys)
        # the new window: the last W inputs of (old window ++ the sequence's tokens)
        window = torch.cat([conv_state.transpose(1, 2), padded], 1)
        W = conv_state.shape[-1]
        at = (lay.lengths[:, None] + torch.arange(W, device=qkv.device))[..., None].expand(S, W, padded.shape[-1])
        conv_pool[lay.slots] = window.gather(1, at).transpose(1, 2).to(conv_pool.dtype)

        kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      A_log=attn.A_log, dt_bias=attn.dt_bias, lower_bound=attn.lower_bound, backend=backend)
        initial = rec_pool[lay.slots]
        host = getattr(lay, "host_lengths", None)
        if host is not None and (min(host) > 1 or max(host) == 1):
            # one kind of sequence only (known on the host): all of them, no nonzero (a device read each)
            every = slice(None)
            splits = [(every, every, max(host) == 1)]
        else:
            one = lay.lengths == 1
            splits = []
            for select, recurrent in ((one, True), (~one, False)):
                seqs = select.nonzero().flatten()
                if seqs.numel():  # positions of these sequences' tokens among lay's
                    splits.append((seqs, select[lay.row].nonzero().flatten(), recurrent))
        for seqs, tokens, recurrent in splits:
            parts = [t[0, tokens] for t in (q, k, v, f, beta)]
            if recurrent:  # one token on a state: generate's decode-step op
                out, final = fused_recurrent_kda(*(p[:, None] for p in parts), initial_state=initial[seqs], **kwargs)
                out = out[:, 0]
            else:
                cu = F.pad(lay.lengths[seqs].cumsum(0), (1, 0)).to(torch.int32)
                out, final = chunk_kda(*(p[None] for p in parts), initial_state=initial[seqs], cu_seqlens=cu,
                                       chunk_size=attn.config.kda_chunk_size, **kwargs)
                out = out[0]
            if o is None:
                o = out.new_empty(total, *out.shape[1:])
            if rows is None:
                o[tokens] = out
            else:
                o[rows if isinstance(tokens, slice) else rows[tokens]] = out
            rec_pool[lay.slots[seqs]] = final.float()
        return o

    def _mla_mix(self, attn, x: torch.Tensor) -> torch.Tensor:
        """The MLA token mixer over the step's sequences in the latent space: each sequence attends to its
        group's prefix rows (read once per group), its own earlier rows and, causally, its new ones."""
        lay = self._layout
        N, H, Dv = x.shape[1], attn.num_heads, attn.v_head_dim
        R = attn.config.kv_lora_rank
        q_lat, rows, w_uv = self._mla_latent(attn, x)
        if self._static is not None:
            o_lat = self._static.mla_decode(attn, q_lat, rows)
            out = torch.einsum("nhr,rhv->nhv", o_lat.to(w_uv.dtype), w_uv)
            return attn.o_proj(out.reshape(1, N, H * Dv))
        o_lat = q_lat.new_zeros(N, H, R, dtype=torch.float32)
        starts = getattr(lay, "host_starts", None) or lay.starts.tolist()
        lengths = getattr(lay, "host_lengths", None) or lay.lengths.tolist()
        decoded = set()
        if rows.dtype == q_lat.dtype and self._slot_kernels(attn, x):
            decoded = self._mla_decode(attn, q_lat, rows, o_lat, starts, lengths)
        groups: dict[int, list[int]] = {}
        for s, episode in enumerate(lay.episodes):
            if s not in decoded:
                groups.setdefault(id(episode.prefix) if episode.prefix is not None else -1 - s, []).append(s)
        for members in groups.values():
            self._mla_group(attn, members, q_lat, rows, o_lat, starts, lengths)
        out = torch.einsum("nhr,rhv->nhv", o_lat.to(w_uv.dtype), w_uv)
        return attn.o_proj(out.reshape(1, N, H * Dv))

    def _mla_latent(self, attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's MLA projections in the latent space: ``q_lat [N, H, R + Dr]`` (absorbed queries), ``rows
        [N, R + Dr]`` (the new cache rows: the normed latent then the shared key part) and ``w_uv [R, H, Dv]``."""
        config = attn.config
        N, H, Dv = x.shape[1], attn.num_heads, attn.v_head_dim
        R = config.kv_lora_rank
        shared = getattr(config, "qk_rope_head_dim", 0) or 0  # key part shared by every head (none on older configs)
        if config.q_lora_rank is None:
            q, kv = fused_linear(x, (attn.q_proj, attn.kv_a_proj))
        else:
            q, kv = fused_linear(x, (attn.q_a_proj, attn.kv_a_proj))
            q = attn.q_b_proj(attn.q_a_layernorm(q))
        q = q[0].view(N, H, attn.qk_head_dim)
        rows = attn.kv_a_layernorm(kv[..., :R])[0]
        if shared:
            rows = torch.cat([rows, kv[0, :, R:]], -1)  # [N, R + shared]
        eye = torch.eye(R, dtype=q.dtype, device=q.device)
        w = attn.kv_b_proj(eye).view(R, H, -1)  # the effective weight, a PEFT delta included
        nope = w.shape[-1] - Dv
        w_uk, w_uv = w[..., :nope], w[..., nope:]
        q_lat = torch.einsum("nhd,rhd->nhr", q[..., :nope], w_uk)
        if shared:
            q_lat = torch.cat([q_lat, q[..., nope:]], -1)  # [N, H, R + shared]
        return q_lat, rows, w_uv

    def _mla_group(self, attn, members: list[int], q_lat: torch.Tensor, rows: torch.Tensor, o_lat: torch.Tensor,
                   starts: list[int], lengths: list[int]) -> None:
        """The sequences ``members`` of the step's layout (one group, or one sequence alone) in PyTorch: each
        appends its new rows to its own, attends to the group's prefix (read once for the members) and its own rows
        (causally over the new ones); writes their rows of ``o_lat [N, H, R]`` (float32)."""
        lay = self._layout
        R = attn.config.kv_lora_rank
        x_device = q_lat.device
        prefix = lay.episodes[members[0]].prefix
        prefix = prefix[attn.layer_idx] if prefix is not None else rows.new_zeros(0, rows.shape[-1])
        spans = [range(starts[s], starts[s] + lengths[s]) for s in members]
        if len(spans) == 1:  # one sequence (no group, or one member in the step): a view, no host data
            tokens = slice(spans[0].start, spans[0].stop)
        else:
            tokens = torch.tensor([i for span in spans for i in span], device=x_device)
        queries = q_lat[tokens].float()
        # the group's prefix: read once for every query of the group (scores, then values)
        s_prefix = torch.einsum("nhr,lr->nhl", queries, prefix.float()) * attn.scaling
        p_prefix, offset = [], 0
        for s, span in zip(members, spans, strict=True):
            episode = lay.episodes[s]
            own = episode.own.get(attn.layer_idx)
            if own is None:
                own = episode.own[attn.layer_idx] = _Rows(rows.shape[-1], rows)
            keys = own.append(rows[span.start:span.stop]).float()  # [L_own + t, width]
            t = len(span)
            mine = queries[offset:offset + t]
            s_own = torch.einsum("thr,lr->thl", mine, keys) * attn.scaling
            visible = torch.arange(keys.shape[0], device=x_device)[None] <= (
                keys.shape[0] - t + torch.arange(t, device=x_device))[:, None]
            s_own = s_own.masked_fill(~visible[:, None, :], float("-inf"))
            p = torch.softmax(torch.cat([s_prefix[offset:offset + t], s_own], -1), dim=-1)
            p_prefix.append(p[..., : prefix.shape[0]])
            o_lat[span.start:span.stop] = torch.einsum("thl,lr->thr", p[..., prefix.shape[0]:], keys[:, :R])
            offset += t
        if prefix.shape[0]:
            o_lat[tokens] += torch.einsum("nhl,lr->nhr", torch.cat(p_prefix), prefix[:, :R].float())

    def _mla_decode(self, attn, q_lat: torch.Tensor, rows: torch.Tensor, o_lat: torch.Tensor, starts: list[int],
                    lengths: list[int]) -> set[int]:
        """The one-token sequences of the step on ``latent_attention_shared_prefix``: each appends its new row to
        its own rows, then one launch attends every such query to its group's prefix (read once for the group's
        members in the step) and its own rows, where they are. Writes their rows of ``o_lat [N, H, R]`` (float32);
        returns the sequences it ran."""
        lay = self._layout
        picked = [s for s, n in enumerate(lengths) if n == 1]
        if not picked:
            return set()
        prefixes, index, group, own, new = [], {}, [], [], []
        for s in picked:
            episode = lay.episodes[s]
            buffer = episode.own.get(attn.layer_idx)
            if buffer is None:
                buffer = episode.own[attn.layer_idx] = _Rows(rows.shape[-1], rows)
            new.append(buffer.extend(1)[0])
            own.append(buffer.valid())  # a view of the buffer: contiguous rows
            if episode.prefix is None:
                group.append(-1)
                continue
            if id(episode.prefix) not in index:
                index[id(episode.prefix)] = len(prefixes)
                prefixes.append(episode.prefix[attn.layer_idx])
            group.append(index[id(episode.prefix)])
        # the decodes first (the step's order): a view; else their flat positions, copied once per step
        tokens = slice(0, len(picked)) if picked[-1] == len(picked) - 1 else self._decode_split()[0].tokens
        # every decode's new row into its own buffer in one op (a copy per episode was a launch per episode)
        torch._foreach_copy_(new, list(rows[tokens].unbind(0)))
        out = kdamoe_kernels().latent_attention_shared_prefix(q_lat[tokens], prefixes, group, own, attn.scaling,
                                                                value_dim=o_lat.shape[-1])
        o_lat[tokens] = out.float()
        return set(picked)
