"""YAML configuration shared by the jobs: a dataclass tree built from YAML data, ``--set dotted.key=value`` overrides.

The pretraining (:mod:`kdamoe.training.config`) and post-training (:mod:`kdamoe.posttraining.config`) configs are
dataclass trees; both read their YAML, apply the command line's overrides with :func:`apply_override` and build
and type-check the tree with :func:`build_dataclass`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml


def build_dataclass(tp, value, name: str):
    """Turn YAML data into the annotated type ``tp`` (a dataclass tree), checking every field.

    Args:
        tp: a dataclass, ``list[...]``, ``dict[...]``, ``X | None`` or a plain type.
        value: the YAML data for it.
        name: the dotted field path, for the errors (``""`` at the root).

    Raises:
        ValueError: naming the field: an unknown or missing field, or a value of the wrong type.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"config field {name or '<root>'}: expected a mapping, got {value!r}")
        hints = typing.get_type_hints(tp)
        known = {f.name for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"config field {name + '.' if name else ''}{unknown[0]}: unknown field")
        kwargs = {k: build_dataclass(hints[k], v, f"{name}.{k}" if name else k) for k, v in value.items()}
        missing = [f.name for f in dataclasses.fields(tp) if f.name not in kwargs
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"config field {name + '.' if name else ''}{missing[0]}: required")
        return tp(**kwargs)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return build_dataclass(next(a for a in args if a is not type(None)), value, name)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"config field {name}: expected a list, got {value!r}")
        return [build_dataclass(args[0], v, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"config field {name}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)  # YAML reads 3e-4 as a string
        except ValueError:
            pass
    if tp is Any or (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        return value
    raise ValueError(f"config field {name}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def apply_override(data: dict, assignment: str) -> None:
    """Apply one ``--set`` assignment ``dotted.key=value`` to the YAML data ``data`` in place: the value is parsed as
    YAML, list items are addressed by index (``train.stages.0.steps=10``), missing mappings are created.

    Raises:
        ValueError: naming the assignment: no ``=``, an index past a list's end, or a key under a scalar.
    """
    if "=" not in assignment:
        raise ValueError(f"override {assignment!r}: expected key=value")
    key, raw = assignment.split("=", 1)
    parts, node = key.strip().split("."), data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ValueError(f"override {key}: no list item {part}")
            part = int(part)
        elif not isinstance(node, dict):
            raise ValueError(f"override {key}: {'.'.join(parts[:i])} is not a mapping")
        if last:
            node[part] = _parse(raw, f"override {assignment!r}: its value")
        else:
            if isinstance(node, dict) and part not in node:
                node[part] = {}
            node = node[part]


def _parse(text: str, what: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{what} is not valid YAML{at}: {problem} (check the indentation; quote a string that "
                         "holds : [ ] { } or #)") from None


def read_yaml(path: str | Path) -> dict:
    """The mapping a YAML config file holds (``{}`` for an empty file).

    Raises:
        ValueError: naming the file: not valid YAML (with the line and column), or not a mapping at the top.
    """
    data = _parse(Path(path).read_text(), f"config {path}") or {}
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: expected a mapping of fields at the top, got a {type(data).__name__}")
    return data

