"""What the foreign checkpoint formats (:mod:`.kimi_linear_format`, :mod:`.kimi_k3_format`) share: reading a folder or
Hub id, the pieces of their streaming tensor maps, and the ``from_pretrained`` pipeline that loads one into kdamoe.

A format module brings its own config translation (``config.json`` dict → ``KDAMoEConfig`` keyword arguments) and
tensor map (``(name, tensor)`` pairs in its names → kdamoe's); this module does the rest, the same for every format:

1. :func:`parse_load_kwargs` sorts ``from_pretrained``'s keyword arguments into a :class:`LoadRequest`, refusing
   (``ValueError`` naming the format) what a foreign format cannot honour (``use_kernels=True``, a ``device_map``
   other than None / ``"cpu"``);
2. :func:`build_config` applies the caller's ``KDAMoEConfig`` overrides and dtype to the translated keyword arguments,
   refusing any other keyword argument;
3. :func:`load_streamed` builds the model on the ``meta`` device, streams the shards one tensor at a time through the
   format's tensor map strictly against the model's names and shapes, casts each tensor as it comes
   (:func:`cast_loaded`) and assigns them (no second copy);
4. :func:`check_folder` runs the same map over the safetensors headers alone (names, shapes; nothing loaded).

Imports only torch, transformers (and safetensors, a transformers dependency) and this folder: it ships next to the
weights as remote code.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from .configuration_kdamoe import KDAMoEConfig

# The router rule a loaded release gets unless the caller asks for another: frozen biases. Kimi Linear / K3 were
# trained with their own balancing rule; starting Quantile Balancing (kdamoe's default) on their biases would move them
# from the first optimizer step on, which nobody asked for (docs/checkpoints.md).
LOADED_ROUTER_BIAS_UPDATE = "none"
# Tensors a foreign checkpoint loads in float32 whatever `dtype` asks for: those of kdamoe's
# `_keep_in_fp32_modules_strict` (the router's bias, the gate's dt_bias and A_log) and the router weight, which
# transformers' KimiLinearForCausalLM keeps in float32 too (its `_keep_in_fp32_modules_strict` names `gate.weight`),
# so a float32-stored router routes as it does there.
FP32_TENSOR_SUFFIXES = ("e_score_correction_bias", "dt_bias", "A_log", ".mlp.gate.weight")
# `from_pretrained` keyword arguments that locate files (passed to transformers' hub utilities).
HUB_ARGUMENTS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
# The three pieces of kdamoe's fused KDA short conv, in the order of its channels (and fla's): q, k, v.
CONV_PARTS = ("q", "k", "v")

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FUSED_EXPERT = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)")

# A format's tensor map: (tensors, config, expected_shapes, optional) -> kdamoe (name, tensor) pairs.
TensorMap = Callable[..., Iterator[tuple[str, torch.Tensor]]]


# ----------------------------------------------------------------------------------------------------
# Reading a folder or Hub id
# ----------------------------------------------------------------------------------------------------
def _hub_kwargs(hub_kwargs: dict | None) -> dict:
    return {k: v for k, v in (hub_kwargs or {}).items() if k in HUB_ARGUMENTS and v is not None}


def read_config_dict(pretrained, hub_kwargs: dict | None = None) -> dict | None:
    """The parsed ``config.json`` of a folder or Hub id, or None when there is none (or ``pretrained`` is not a
    path / id).

    Raises:
        ValueError: naming the file, when ``config.json`` is not valid JSON.
    """
    if not isinstance(pretrained, (str, os.PathLike)):
        return None
    from transformers.utils import cached_file  # noqa: PLC0415 (transformers' hub utilities, needed only here)

    try:
        path = cached_file(pretrained, "config.json", _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **_hub_kwargs(hub_kwargs))
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
        ValueError: when neither ``model.safetensors`` nor ``model.safetensors.index.json`` exists; an index that is
            not valid JSON or whose shards cannot be read, naming it.
    """
    from transformers.utils import cached_file  # noqa: PLC0415
    from transformers.utils.hub import get_checkpoint_shard_files  # noqa: PLC0415

    hub_kwargs = _hub_kwargs(hub_kwargs)
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


def _open_safetensors(file):
    """``safe_open(file)``; a file that is absent or that safetensors cannot read (truncated, not safetensors) is a
    ``ValueError`` naming it."""
    from safetensors import safe_open  # noqa: PLC0415 (a transformers dependency)

    if not os.path.isfile(file):
        raise ValueError(f"{file}: no such file (a shard the checkpoint's index lists)")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as err:  # safetensors' SafetensorError (not an OSError) says what, not which file
        raise ValueError(f"{file}: not a readable safetensors file (truncated or corrupt?): {err}") from err


def iter_safetensors(files: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor of the files, one file open at a time, one tensor read at a time.

    Raises:
        ValueError: naming a file that is absent or not readable safetensors.
    """
    for file in files:
        with _open_safetensors(file) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def iter_safetensors_shapes(files: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, meta tensor)`` of every tensor of the files: the stored shape and dtype, read from the headers only
    (nothing is loaded); fed to a format's tensor map it checks a checkpoint strictly for free.

    Raises:
        ValueError: naming a file that is absent or not readable safetensors.
    """
    for file in files:
        with _open_safetensors(file) as f:
            for name in f.keys():
                part = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(part.get_dtype(), torch.float32)
                yield name, torch.empty(part.get_shape(), dtype=dtype, device="meta")


# ----------------------------------------------------------------------------------------------------
# Pieces of the tensor maps
# ----------------------------------------------------------------------------------------------------
def shape_list(shape) -> list[int]:
    """A ``torch.Size`` / tuple as a list of ints (what the maps' messages print)."""
    return [int(s) for s in shape]


def check_expected_shape(expected_shapes: dict | None, name: str, sources: str, shape: list[int]) -> None:
    """Check one produced kdamoe tensor against ``{kdamoe name: shape}`` of the model being filled (no check when
    ``expected_shapes`` is None).

    Raises:
        ValueError: naming ``sources`` (the stored name(s) it came from), when ``name`` is not in ``expected_shapes``
            or has another shape there.
    """
    if expected_shapes is None:
        return
    if name not in expected_shapes:
        raise ValueError(f"unexpected tensor {sources} {shape}: the kdamoe model of this config has no {name}")
    want = shape_list(expected_shapes[name])
    if shape != want:
        raise ValueError(f"{sources}: shape {shape}, expected {want} ({name} of the kdamoe model of this config)")


def incomplete_error(what: str, problems: list[str]) -> ValueError:
    """The one ``ValueError`` that ends a strict map with missing tensors: ``"{what} is incomplete: "`` and the first
    six problems, then how many more."""
    return ValueError(f"{what} is incomplete: " + "; ".join(problems[:6])
                      + (f"; and {len(problems) - 6} more" if len(problems) > 6 else ""))


class FusedTensor:
    """One fused kdamoe tensor being assembled from its stored pieces (the KDA short conv, or an expert weight).

    Allocated once, at its full size, when the first piece arrives; each piece is copied into its slice by ``place``
    and dropped, so at most the fused tensor is held.

    Args:
        target: the kdamoe name (for messages).
        keys: every piece's key; the tensor is :attr:`complete` when each has come once.
        piece_shape: the shape every piece must have.
        place: ``place(full, key, piece)`` copies a piece into its slice of the full tensor.
    """

    def __init__(self, target: str, keys: list, piece_shape: list[int], place):
        self.target, self.keys, self.piece_shape, self.place = target, keys, piece_shape, place
        self.tensor = None
        self.sources: dict = {}

    def add(self, key, source: str, piece: torch.Tensor, full_shape: list[int]) -> None:
        """Copy one piece in.

        Raises:
            ValueError: naming ``source``: a key that came before, a shape other than ``piece_shape``, a dtype other
                than the pieces before.
        """
        if key in self.sources:
            raise ValueError(f"{source}: stored twice (also as {self.sources[key]})")
        if shape_list(piece.shape) != self.piece_shape:
            raise ValueError(f"{source}: shape {shape_list(piece.shape)}, expected {self.piece_shape} (a piece of "
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

    def missing(self) -> list:
        """The keys of the pieces that have not come."""
        return [k for k in self.keys if k not in self.sources]


def place_conv(full: torch.Tensor, part: int, piece: torch.Tensor) -> None:
    """Piece ``part`` (0, 1, 2: q, k, v) of the fused short conv ``[3·H·K, 1, W]``."""
    width = piece.shape[0]  # q, k, v in this order: the order the fused conv's channels (and fla's) are in
    full[part * width:(part + 1) * width].copy_(piece)


def place_down(full: torch.Tensor, j: int, piece: torch.Tensor) -> None:
    """Expert ``j``'s down projection into the experts' ``down_proj [E, d, I]``."""
    full[j].copy_(piece)


def place_gate_up(full: torch.Tensor, key: tuple, piece: torch.Tensor) -> None:
    """Expert ``key[1]``'s gate (``key[0] == "w1"``) or up (``"w3"``) projection into ``gate_up_proj [E, 2I, d]``."""
    which, j = key
    inter = piece.shape[0]
    # gate (w1) rows first, then up (w3): the order the experts' `chunk(2)` reads in both models
    rows = slice(0, inter) if which == "w1" else slice(inter, 2 * inter)
    full[j, rows].copy_(piece)


class PieceAssembler:
    """The kdamoe side of a strict streaming map into kdamoe (Kimi Linear's and K3's share it): every produced tensor
    is checked once against the model's names and shapes, and the fused tensors (the KDA short conv, the experts'
    3-D weights) are assembled from their stored pieces in whatever order they come, only those still waiting for a
    piece being held.

    Args:
        config: the kdamoe config being filled.
        expected_shapes: ``{kdamoe name: shape}`` of the model (its meta-device ``state_dict()``), or None (no check).
        expert_width: the experts' outer width: ``hidden_size`` for full-width experts, ``moe_latent_size`` for the
            latent MoE.
    """

    def __init__(self, config: KDAMoEConfig, expected_shapes: dict | None, expert_width: int):
        self.config, self.expected_shapes, self.expert_width = config, expected_shapes, expert_width
        self.pending: dict[str, FusedTensor] = {}
        self.produced: set[str] = set()

    def emit(self, name: str, tensor: torch.Tensor, sources: str) -> tuple[str, torch.Tensor]:
        """``(name, tensor)``, once checked.

        Raises:
            ValueError: naming ``sources``: ``name`` produced before (e.g. a dense MLP stored under both its names), or
                not in the model / of another shape (:func:`check_expected_shape`).
        """
        if name in self.produced:
            raise ValueError(f"{sources}: {name} is stored twice")
        check_expected_shape(self.expected_shapes, name, sources, shape_list(tensor.shape))
        self.produced.add(name)
        return name, tensor

    def _fused(self, target: str, keys_fn, piece_shape: list[int], place) -> FusedTensor:
        fused = self.pending.get(target)
        if fused is None:
            fused = self.pending[target] = FusedTensor(target, keys_fn(), piece_shape, place)
        return fused

    def add_conv(self, target: str, part: int, source: str, piece: torch.Tensor) -> FusedTensor:
        """Piece ``part`` (0, 1, 2: q, k, v; each ``[H·K, 1, W]``) of the fused short conv ``target``."""
        width, W = self.config.kda_num_heads * self.config.kda_head_dim, self.config.kda_short_conv_kernel_size
        fused = self._fused(target, lambda: list(range(3)), [width, 1, W], place_conv)
        fused.add(part, source, piece, [3 * width, 1, W])
        return fused

    def add_expert(self, layer: int, which: str, j: int, source: str, piece: torch.Tensor) -> FusedTensor:
        """Expert ``j``'s ``w1`` (gate) / ``w3`` (up) ``[I, width]`` or ``w2`` (down) ``[width, I]`` projection of
        layer ``layer``, into ``mlp.experts.gate_up_proj [E, 2I, width]`` or ``mlp.experts.down_proj [E, width, I]``."""
        E, inter, width = self.config.num_experts, self.config.moe_intermediate_size, self.expert_width
        p = f"model.layers.{layer}.mlp.experts."
        if which == "w2":
            fused = self._fused(p + "down_proj", lambda: list(range(E)), [width, inter], place_down)
            fused.add(j, source, piece, [E, width, inter])
        else:
            fused = self._fused(p + "gate_up_proj", lambda: [(w, e) for w in ("w1", "w3") for e in range(E)],
                                [inter, width], place_gate_up)
            fused.add((which, j), source, piece, [E, 2 * inter, width])
        return fused

    def emit_fused(self, fused: FusedTensor, sources_shown: int | None = None) -> tuple[str, torch.Tensor]:
        """:meth:`emit` a complete fused tensor and drop it from the pending ones; its sources are named all, or the
        first ``sources_shown`` then ``...``."""
        del self.pending[fused.target]
        sources = [str(s) for s in fused.sources.values()]
        label = ", ".join(sources) if sources_shown is None else ", ".join(sources[:sources_shown]) + ", ..."
        return self.emit(fused.target, fused.tensor, label)

    def problems(self, optional: Iterable[str], piece_name, source_name) -> list[str]:
        """What never came: every pending fused tensor (``piece_name(target, key)``: the stored name of its first
        missing piece) and, when strict, every name of the model neither produced, pending nor ``optional``
        (``source_name(name)``: the stored name(s) it comes from)."""
        problems = []
        for target, fused in self.pending.items():
            missing = fused.missing()
            problems.append(f"{target} lacks {len(missing)} of its {len(fused.keys)} pieces "
                            f"(first: {piece_name(target, missing[0])})")
        if self.expected_shapes is not None:
            for name in sorted(set(self.expected_shapes) - self.produced - set(self.pending) - set(optional)):
                problems.append(f"missing {source_name(name)} (→ {name} {shape_list(self.expected_shapes[name])})")
        return problems


def kda_layer_rules(prefix: str, gate_projections: tuple[str, ...]) -> dict[str, tuple]:
    """The stored-name rules of one KDA layer's attention, ``prefix`` being ``model.layers.{i}.self_attn.``: the
    ``q/k/v``, ``f_a/f_b``, ``b`` and ``o`` projections, the output gate's ``gate_projections`` (Kimi Linear's low-rank
    ``g_a_proj`` / ``g_b_proj``, K3's ``g_proj``), ``dt_bias`` and ``o_norm`` under kdamoe's own names (``"same"``),
    ``A_log`` (``"A_log"``: reshaped or unpadded by the format) and the three ``{q,k,v}_conv1d`` pieces of kdamoe's
    fused ``conv1d`` (``("conv", target, part)``)."""
    rules: dict[str, tuple] = {}
    for proj in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", *gate_projections, "o_proj"):
        rules[f"{prefix}{proj}.weight"] = ("same", f"{prefix}{proj}.weight")
    for name in ("dt_bias", "o_norm.weight"):
        rules[prefix + name] = ("same", prefix + name)
    rules[prefix + "A_log"] = ("A_log", prefix + "A_log")
    for j, part in enumerate(CONV_PARTS):
        rules[f"{prefix}{part}_conv1d.weight"] = ("conv", prefix + "conv1d.weight", j)
    return rules


def stored_piece_name(target: str, key, suffix: str) -> str:
    """The stored (Kimi-style) name of one piece of a fused kdamoe tensor: ``…{q,k,v}_conv1d.weight`` of the conv (key
    0, 1, 2), ``…block_sparse_moe.experts.{j}.{w1,w3,w2}.{suffix}`` of the experts (key ``(w, j)`` or ``j``)."""
    if target.endswith("conv1d.weight"):
        return target.replace("conv1d.weight", f"{CONV_PARTS[key]}_conv1d.weight")
    base = target.replace(".mlp.experts.", ".block_sparse_moe.experts.").rsplit(".", 1)[0]
    if isinstance(key, tuple):
        return f"{base}.{key[1]}.{key[0]}.{suffix}"
    return f"{base}.{key}.w2.{suffix}"


def fused_source_pattern(name: str, suffix: str) -> str | None:
    """The stored names a fused kdamoe tensor comes from, as a pattern for messages (``…{q,k,v}_conv1d.weight``,
    ``…experts.{j}.{w1,w3}.{suffix}``), or None for a tensor that is not fused."""
    if name.endswith("self_attn.conv1d.weight"):
        return name.replace("conv1d.weight", "{q,k,v}_conv1d.weight")
    expert = _FUSED_EXPERT.search(name)
    if expert:
        base = name[: expert.start()] + "block_sparse_moe.experts.{j}."
        return base + ("{w1,w3}." if expert.group(1) == "gate_up_proj" else "w2.") + suffix
    return None


def split_fused(name: str, tensor: torch.Tensor, config: KDAMoEConfig, sparse_layers: set[int], expert,
                prefix: str = "") -> Iterator[tuple[str, torch.Tensor]] | None:
    """The stored pieces of a fused kdamoe tensor, for a map out of kdamoe; None when ``name`` is not one.

    Args:
        name: the kdamoe name.
        tensor: the fused tensor: a KDA layer's short conv ``self_attn.conv1d.weight [3·H·K, 1, W]``, or a sparse
            layer's ``mlp.experts.down_proj [E, width, I]`` / ``mlp.experts.gate_up_proj [E, 2I, width]``.
        config: the kdamoe config (layer types, KDA heads).
        sparse_layers: the indices of the MoE layers.
        expert: ``expert(stored base name, weight)`` → the ``(name, tensor)`` pairs one expert projection is stored as
            (the base name ends in ``….experts.{j}.{w1,w3,w2}``; ``weight`` is a view, the callback copies or encodes).
        prefix: put before every stored name (K3's ``language_model.``).

    Returns:
        ``(stored name, tensor)`` pairs, lazily: the conv's ``…{q,k,v}_conv1d.weight [H·K, 1, W]``, each its own
        contiguous copy; per expert ``j`` the pairs of ``expert`` for ``w2`` (down), or ``w1`` (gate rows) then ``w3``
        (up rows).
    """
    match = _LAYER.fullmatch(name)
    if match is None:
        return None
    layer, rest = int(match.group(1)), match.group(2)
    if (rest == "self_attn.conv1d.weight" and layer < config.num_hidden_layers
            and config.layer_types[layer] == "linear_attention"):
        pieces = tensor.split(config.kda_num_heads * config.kda_head_dim, dim=0)
        return ((f"{prefix}model.layers.{layer}.self_attn.{part}_conv1d.weight", piece.clone())
                for part, piece in zip(CONV_PARTS, pieces, strict=True))
    fused = _FUSED_EXPERT.fullmatch(rest)
    if fused is None or layer not in sparse_layers:
        return None
    return _split_experts(fused.group(1), tensor, f"{prefix}model.layers.{layer}.block_sparse_moe.experts.", expert)


def _split_experts(kind: str, tensor: torch.Tensor, base: str, expert) -> Iterator[tuple[str, torch.Tensor]]:
    if kind == "down_proj":
        for j in range(tensor.shape[0]):
            yield from expert(f"{base}{j}.w2", tensor[j])
        return
    gate, up = tensor.chunk(2, dim=1)  # gate (w1) rows first, then up (w3): the order the experts' `chunk(2)` reads
    for j in range(tensor.shape[0]):
        yield from expert(f"{base}{j}.w1", gate[j])
        yield from expert(f"{base}{j}.w3", up[j])


def check_all_seen(expected_shapes: dict | None, seen: set[str], optional: Iterable[str]) -> None:
    """The end of a strict map out of kdamoe.

    Raises:
        ValueError: naming (up to six of) the names of ``expected_shapes`` that were not ``seen`` and are not
            ``optional``.
    """
    if expected_shapes is None:
        return
    missing = sorted(set(expected_shapes) - seen - set(optional))
    if missing:
        raise ValueError("the kdamoe weights are incomplete: missing "
                         + ", ".join(f"{k} {shape_list(expected_shapes[k])}" for k in missing[:6])
                         + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))


# ----------------------------------------------------------------------------------------------------
# The from_pretrained pipeline
# ----------------------------------------------------------------------------------------------------
def resolve_dtype(dtype) -> torch.dtype | None:
    """``dtype=`` of ``from_pretrained`` → a ``torch.dtype``, or None for ``"auto"`` / None (as stored).

    Raises:
        ValueError: naming the value, for anything but a floating-point dtype, its name or ``"auto"``.
    """
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


@dataclass
class LoadRequest:
    """``from_pretrained``'s keyword arguments, sorted by :func:`parse_load_kwargs`.

    Attributes:
        format_name: the format, for messages (``"Kimi Linear"``, ``"Kimi K3"``).
        hub: the Hub arguments of :data:`HUB_ARGUMENTS` that were given.
        dtype: the requested dtype, or None for as stored.
        attn_implementation / experts_implementation: set on the model after loading when not None.
        rest: every other keyword argument (each must be a ``KDAMoEConfig`` field: :func:`build_config`).
    """

    format_name: str
    hub: dict
    dtype: torch.dtype | None
    attn_implementation: str | None = None
    experts_implementation: str | None = None
    rest: dict = field(default_factory=dict)


def parse_load_kwargs(cls, format_name: str, kwargs: dict) -> LoadRequest:
    """Sort ``from_pretrained``'s keyword arguments for loading a ``format_name`` checkpoint as ``cls``.

    Taken: ``dtype`` / ``torch_dtype`` (:func:`resolve_dtype`), ``device_map`` (None or ``"cpu"``), the Hub arguments,
    ``trust_remote_code`` (dropped: not needed), ``attn_implementation``, ``experts_implementation``, ``use_kernels``
    (off only); the others are left in :attr:`LoadRequest.rest`.

    Raises:
        ValueError: naming the format: a ``cls`` that is not a ``KDAMoEForCausalLM`` (the checkpoint has an LM head);
            ``use_kernels=True``; a ``device_map`` other than None / ``"cpu"``; a bad dtype.
    """
    if not any(base.__name__ == "KDAMoEForCausalLM" for base in cls.__mro__):
        raise ValueError(f"{cls.__name__} cannot load a {format_name} checkpoint (it holds a causal LM): use "
                         "KDAMoEForCausalLM")
    kwargs = dict(kwargs)
    hub = {k: kwargs.pop(k) for k in HUB_ARGUMENTS if k in kwargs}
    kwargs.pop("trust_remote_code", None)
    attn_implementation = kwargs.pop("attn_implementation", None)
    experts_implementation = kwargs.pop("experts_implementation", None)
    if kwargs.pop("use_kernels", None):
        raise ValueError(f"use_kernels=True: loading a {format_name} checkpoint does not kernelize; convert it first "
                         "(`kdamoe-convert SRC DST --to kda_moe`) and load DST")
    dtype = kwargs.pop("dtype", None)
    torch_dtype = kwargs.pop("torch_dtype", None)
    dtype = resolve_dtype(dtype if dtype is not None else torch_dtype)
    device_map = kwargs.pop("device_map", None)
    if device_map not in (None, "cpu"):
        raise ValueError(f"device_map={device_map!r}: loading a {format_name} checkpoint takes device_map=None or "
                         "'cpu' (convert it first with `kdamoe-convert SRC DST --to kda_moe`, then load DST with any "
                         "device_map), or move the model with .to() after loading")
    return LoadRequest(format_name, hub, dtype, attn_implementation, experts_implementation, kwargs)


def build_config(request: LoadRequest, config_kwargs: dict, pretrained) -> KDAMoEConfig:
    """The ``KDAMoEConfig`` to load into: the format's translated ``config_kwargs``, overridden by the caller's
    ``KDAMoEConfig`` fields of ``request.rest``, with ``request.dtype`` (when given) as its dtype.

    Raises:
        ValueError: naming the format and every keyword argument of ``request.rest`` that is not a ``KDAMoEConfig``
            field; what ``KDAMoEConfig`` refuses.
    """
    own_fields = set(KDAMoEConfig().to_dict()) | set(config_kwargs)
    overrides = {k: v for k, v in request.rest.items() if k in own_fields}
    unknown = sorted(set(request.rest) - set(overrides))
    if unknown:
        raise ValueError(f"from_pretrained of a {request.format_name} checkpoint does not take {unknown}; it takes "
                         f"dtype, device_map=None, {', '.join(HUB_ARGUMENTS)}, attn_implementation, "
                         "experts_implementation and KDAMoEConfig fields")
    config_kwargs = {**config_kwargs, **overrides}
    if request.dtype is not None:
        config_kwargs["dtype"] = str(request.dtype).removeprefix("torch.")
    config = KDAMoEConfig(**config_kwargs)
    config._name_or_path = str(pretrained)
    return config


def meta_model(cls, config: KDAMoEConfig):
    """``(model on the meta device, {name: shape} of its state dict, the names that may be absent)``: what a strict
    map checks against; the optional names are the LM head of a model with tied embeddings."""
    with torch.device("meta"):
        model = cls(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    return model, expected, tied


def cast_loaded(name: str, tensor: torch.Tensor, dtype: torch.dtype | None, upcast_as_stored: bool = True):
    """One loaded kdamoe tensor in the dtype it gets: the tensors of :data:`FP32_TENSOR_SUFFIXES` float32, the other
    floating-point ones ``dtype``; with ``dtype`` None (as stored) the others keep their stored dtype, and the float32
    ones are upcast only when ``upcast_as_stored`` (transformers' class upcasts them from a bf16 shard too)."""
    if not tensor.is_floating_point() or (dtype is None and not upcast_as_stored):
        return tensor
    if name.endswith(FP32_TENSOR_SUFFIXES):
        return tensor.to(torch.float32)
    return tensor if dtype is None else tensor.to(dtype)


def load_streamed(cls, config: KDAMoEConfig, request: LoadRequest, pretrained, tensor_map: TensorMap,
                  upcast_as_stored: bool = True):
    """Build ``cls(config)`` on the meta device and fill it from the checkpoint's shards, streamed one tensor at a time
    through ``tensor_map(tensors, config, expected_shapes, optional)`` (strict: every name and shape checked), each
    tensor cast by :func:`cast_loaded` as it comes and then made the model's own (``load_state_dict(..., assign=True)``:
    no second copy). The tied head is tied again; the request's attention / experts implementation is set; the folder's
    ``generation_config.json``, when it has one, replaces the one built from the config.

    Returns:
        the model on the CPU, in eval mode.

    Raises:
        ValueError: what ``tensor_map`` raises (a missing, extra or wrongly shaped tensor); an unreadable shard.
    """
    model, expected, tied = meta_model(cls, config)
    state_dict = {}
    for name, tensor in tensor_map(iter_safetensors(checkpoint_files(pretrained, request.hub)), config, expected,
                                   tied):
        state_dict[name] = cast_loaded(name, tensor, request.dtype, upcast_as_stored)
    # Every name and shape was checked by the map; `strict` only leaves out a tied head, tied again below.
    model.load_state_dict(state_dict, strict=not (tied - set(state_dict)), assign=True)
    del state_dict
    if tied:
        model.tie_weights()
    if request.attn_implementation is not None:
        model.set_attn_implementation(request.attn_implementation)
    if request.experts_implementation is not None:
        model.set_experts_implementation(request.experts_implementation)
    _load_generation_config(model, pretrained, request.hub)
    return model.eval()


def _load_generation_config(model, pretrained, hub: dict) -> None:
    """The folder's ``generation_config.json``, when it has one, replaces the one built from the config."""
    from transformers import GenerationConfig  # noqa: PLC0415

    try:
        model.generation_config = GenerationConfig.from_pretrained(pretrained, **hub)
    except OSError:  # none in the folder: keep the default built from the config
        pass


def check_folder(folder, cls, to_config: Callable[[dict], dict], tensor_map: TensorMap) -> None:
    """Check a folder's tensor names and shapes against the ``cls`` model its ``config.json`` translates to
    (``to_config``), running ``tensor_map`` over the safetensors headers only (what :func:`load_streamed` checks while
    it loads).

    Raises:
        ValueError: what ``to_config`` and ``tensor_map`` raise, naming the field or the tensor.
    """
    config = KDAMoEConfig(**to_config(read_config_dict(str(folder))))
    _, expected, tied = meta_model(cls, config)
    for _ in tensor_map(iter_safetensors_shapes(checkpoint_files(str(folder))), config, expected, tied):
        pass


__all__ = [
    "CONV_PARTS",
    "FP32_TENSOR_SUFFIXES",
    "HUB_ARGUMENTS",
    "LOADED_ROUTER_BIAS_UPDATE",
    "FusedTensor",
    "LoadRequest",
    "PieceAssembler",
    "build_config",
    "cast_loaded",
    "check_all_seen",
    "check_expected_shape",
    "check_folder",
    "checkpoint_files",
    "fused_source_pattern",
    "incomplete_error",
    "kda_layer_rules",
    "iter_safetensors",
    "iter_safetensors_shapes",
    "load_streamed",
    "meta_model",
    "parse_load_kwargs",
    "place_conv",
    "place_down",
    "place_gate_up",
    "read_config_dict",
    "resolve_dtype",
    "shape_list",
    "split_fused",
    "stored_piece_name",
]


def check_dtype_name(dtype, field: str) -> None:
    """``ValueError`` unless ``dtype`` (a config's ``dtype`` / ``torch_dtype`` value, named ``field`` in the message)
    names a floating-point torch dtype (``"bfloat16"``, ``"torch.float32"``): transformers' config resolves the name
    with ``getattr(torch, name)``, an ``AttributeError`` deep inside for a ``"bf16"``."""
    resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not (isinstance(resolved, torch.dtype) and resolved.is_floating_point):
        raise ValueError(f"{field} is {dtype!r}: expected the name of a floating-point torch dtype (e.g. 'bfloat16')")
