"""Strict frozen-dataclass configs: field typing and coercion, validation, YAML loading, dotted
overrides and field docstrings. Generic: it walks dataclass fields and knows no section by name;
`megatron_gspo.config.schema` defines the schema on top of it.

Departure from plain `yaml.safe_load`: files and override values are read with a YAML 1.2-style
resolver (`YamlLoader`), so `3e-4` is a float (YAML 1.1 reads it as a string) and only
true/false are booleans (`off`, `yes`, `no` stay strings, e.g. `train.routing_replay=off`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import os
import re
import textwrap
import types
from typing import Any, Literal, Sequence, Union, get_args, get_type_hints
from typing import get_origin as _typing_origin

import yaml

from megatron_gspo.errors import ConfigError


# ----------------------------------------------------------------------------- field typing


@functools.lru_cache(maxsize=None)
def field_types(cls) -> dict[str, Any]:
    """{field name: resolved annotation} in declaration order (ClassVars excluded)."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def get_origin(tp):
    """typing.get_origin, with PEP 604 unions (`float | None`) reported as typing.Union."""
    origin = _typing_origin(tp)
    return Union if origin is types.UnionType else origin


def type_name(tp) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Union:
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _accepts_str(tp) -> bool:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Union:
        return any(_accepts_str(a) for a in args)
    return tp is str or origin is Literal


_BOOLS = {"true": True, "yes": True, "on": True, "1": True,
          "false": False, "no": False, "off": False, "0": False}


def _to_bool(v):
    if isinstance(v, bool):
        return v
    return _BOOLS[v.strip().lower()] if isinstance(v, str) else _BOOLS[None]


def _to_int(v):
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(v)
    if isinstance(v, float) and not v.is_integer():
        raise ValueError(v)
    return int(v.strip()) if isinstance(v, str) else int(v)


def _to_float(v):  # strings too: YAML 1.1 reads 3e-4 as a string
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(v)
    return float(v)


def _of_type(t):
    def check(v):
        if not isinstance(v, t):
            raise ValueError(v)
        return dict(v) if t is dict else v
    return check


def _to_list(v):  # a YAML list, or one string as a one-element list
    if isinstance(v, str):
        return [v]
    if not isinstance(v, (list, tuple)):
        raise ValueError(v)
    return list(v)


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _of_type(str),
            dict: _of_type(dict), list: _to_list}


def _coerce(value, tp, key: str):
    """`value` as annotation `tp` (int, float, bool, str, dict, Optional, Literal, dataclass)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Union and value is None and type(None) in args:
        return None
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise ConfigError(f"{key}={value}: expected one of {', '.join(map(repr, args))}")
    inner = [a for a in args if a is not type(None)] if origin is Union else [tp]
    words = [a for a in inner if get_origin(a) is Literal]
    if words:  # e.g. bool | Literal["force"]: the words first, then the one other type
        if isinstance(value, str) and any(value in get_args(w) for w in words):
            return value
        inner = [a for a in inner if a not in words]
        if len(inner) == 1:
            try:
                return _coerce(value, inner[0], key)
            except ConfigError:
                raise ConfigError(f"{key}={value}: expected {type_name(tp)}") from None
    base = get_origin(inner[0]) or inner[0]
    convert = _of_type(base) if dataclasses.is_dataclass(base) else _SCALARS.get(base)
    if len(inner) != 1 or convert is None:
        raise TypeError(f"{key}: unsupported annotation {tp}")
    try:
        return convert(value)
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{key}={value}: expected {type_name(tp)}") from None


def _key(obj, name: str) -> str:
    return f"{obj._section}.{name}" if obj._section else name


def _coerce_fields(obj) -> None:
    """Normalise every field of a frozen dataclass to its annotated type (or raise)."""
    for name, tp in field_types(type(obj)).items():
        value = _coerce(getattr(obj, name), tp, _key(obj, name))
        object.__setattr__(obj, name, value)


def check(obj, name: str, ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{_key(obj, name)}={getattr(obj, name)}: {msg}")


def validate(obj, nonempty: Sequence[str] = (), ge: dict | None = None,
              gt: dict | None = None) -> None:
    """Coerce every field to its type, then range checks (None passes; NaN fails), then every
    float finite (`optim.lr=.inf` is no learning rate)."""
    _coerce_fields(obj)
    for name in nonempty:
        check(obj, name, getattr(obj, name) != "", "must be non-empty")
    for name, lo in (ge or {}).items():
        v = getattr(obj, name)
        check(obj, name, v is None or v >= lo, f"must be >= {lo}")
    for name, lo in (gt or {}).items():
        v = getattr(obj, name)
        check(obj, name, v is None or v > lo, f"must be > {lo}")
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        check(obj, f.name, not isinstance(v, float) or math.isfinite(v), "must be finite")


# ----------------------------------------------------------------------------- loading


class YamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (`3e-4`) and booleans (only true / false), and duplicate
    keys as errors (plain PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str):
    """Parse a YAML file with `YamlLoader`; any YAML error is a one-line ConfigError naming the
    file, line and column."""
    with open(path) as f:
        text = f.read()
    try:
        return yaml.load(text, Loader=YamlLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        what = " ".join(str(x) for x in (e.context, e.problem) if x)
        raise ConfigError(f"{where}: invalid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {' '.join(str(e).split())}") from None



def deep_merge(base: dict, top: dict) -> dict:
    """`top` on `base`: mappings merge key by key (recursively), anything else in `top`
    (scalars, lists, null) replaces. Neither input is modified."""
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            else v
    return out


def load_layered(path: str, _chain: tuple[str, ...] = ()) -> dict:
    """A YAML mapping with inheritance: a top-level `base: other.yaml` (a path relative to this
    file) is loaded first, recursively, and this file's other keys are deep-merged on top
    (`deep_merge`). A cycle, a missing base file or a non-mapping file is a one-line
    ConfigError naming the files. One base per file; no interpolation."""
    real = os.path.realpath(path)
    if real in _chain:
        names = " -> ".join(os.path.relpath(p) for p in (*_chain, real))
        raise ConfigError(f"config base cycle: {names}")
    if not os.path.isfile(path) and _chain:
        raise ConfigError(f"base config not found: {path} (the base of {_chain[-1]})")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    raw = load_yaml(path)
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, "
                          f"got {type(raw).__name__}")
    if "base" not in raw:
        return raw
    base = raw.pop("base")
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base={base!r}: expected the path of a YAML file")
    base_path = os.path.join(os.path.dirname(path), base)
    return deep_merge(load_layered(base_path, (*_chain, real)), raw)



def mapping_to_overrides(mapping: dict, prefix: str = "") -> list[str]:
    """A (nested or dotted-key) YAML mapping as `a.b=c` overrides, in file order, so it can be
    laid over any config like a file over its base (`apply_override` checks every key). Strings
    are written as-is, other values as JSON (a YAML 1.2 subset: `null`, `true`, `3e-05`, `[1]`)."""
    out = []
    for k, v in mapping.items():
        if isinstance(v, dict) and v:
            out += mapping_to_overrides(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={v if isinstance(v, str) else json.dumps(v)}")
    return out


_BOOL, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
YamlLoader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag not in (_BOOL, _FLOAT)]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
YamlLoader.add_implicit_resolver(_FLOAT, re.compile(
    r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"
    r"|[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _unknown(prefix: str, name, cls) -> ConfigError:
    section = prefix.rstrip(".") or "top level"
    return ConfigError(f"unknown config key '{prefix}{name}'; valid keys of {section}: "
                       f"{', '.join(field_types(cls))}")


def build(cls, data, prefix: str = ""):
    """Strictly construct dataclass `cls` from a nested mapping (None = all defaults)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, "
                          f"got {type(data).__name__} {data!r}")
    types = field_types(cls)
    kwargs = {}
    for name, value in data.items():
        if name not in types:
            raise _unknown(prefix, name, cls)
        tp = types[name]
        kwargs[name] = build(tp, value, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) \
            else value
    return cls(**kwargs)


def _parse_override(item: str) -> tuple[list[str], str]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(p == "" for p in key.split(".")):
        raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
    return key.split("."), text


def _override_value(key: str, text: str, tp):
    try:
        value = yaml.load(text, Loader=YamlLoader) if text.strip() else ""
    except yaml.YAMLError as e:  # one line: e.g. "key: value" inside an unquoted string
        mark = getattr(e, "problem_mark", None)
        what = getattr(e, "problem", None) or " ".join(str(e).split())
        at = f" at column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{key}={text}: not a YAML value ({what}{at}); quote a string in "
                          f"double quotes, e.g. {key}='\"...\"'") from None
    if tp is not Any and _accepts_str(tp) and isinstance(value, (bool, int, float)):
        return text.strip()  # wandb.name=2024 is the string "2024"
    return value


def apply_override(root, raw: dict, item: str) -> None:
    """Set one `a.b=c` into the nested raw dict, checking the path against `root`'s schema."""
    parts, text = _parse_override(item)
    key = ".".join(parts)
    cls, node = root, raw
    for i, name in enumerate(parts):
        prefix = "".join(p + "." for p in parts[:i])
        types = field_types(cls)
        if name not in types:
            raise _unknown(prefix, name, cls)
        tp, last = types[name], i == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            if last:
                raise ConfigError(f"{key} is a section; set one of its keys, e.g. "
                                  f"{key}.{next(iter(field_types(tp)))}=...")
            if node.get(name) is None:
                node[name] = {}
            if not isinstance(node[name], dict):
                raise ConfigError(f"{prefix}{name}: expected a mapping, got {node[name]!r}")
            cls, node = tp, node[name]
        elif last:
            node[name] = _override_value(key, text, tp)
        elif tp is dict or get_origin(tp) is dict:  # task.kwargs.num_digits=3
            default = {f.name: f for f in dataclasses.fields(cls)}[name].default_factory()
            sub = node.get(name, default)
            node[name] = sub = dict(sub) if isinstance(sub, dict) else {}
            for p in parts[i + 1:-1]:
                sub[p] = dict(sub[p]) if isinstance(sub.get(p), dict) else {}
                sub = sub[p]
            sub[parts[-1]] = _override_value(key, text, Any)
            return
        else:
            raise ConfigError(f"{key}: {prefix}{name} is a value of type {type_name(tp)}, "
                              "not a section")


# ----------------------------------------------------------------------------- docs


@functools.lru_cache(maxsize=None)
def field_docs(cls) -> dict[str, str]:
    """{field: docstring} from the string literal right under each annotated field (ast), in
    `cls` and its dataclass bases (a section may subclass a settings class defined elsewhere)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return {name: docs[name] for name in field_types(cls) if name in docs}


def describe_fields(cls, prefix: str, lines: list[str]) -> None:
    docs = field_docs(cls)
    defaults = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                for f in dataclasses.fields(cls)}  # as declared (loss.eps_* resolve at load)
    sections = []
    for name, tp in field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            sections.append((name, tp))
            continue
        lines.append(f"{prefix}{name}: {type_name(tp)} = {defaults[name]!r}")
        lines.extend("    " + ln for ln in docs.get(name, "(undocumented)").splitlines())
    for name, tp in sections:
        doc = " ".join((tp.__doc__ or "").split())  # one line per section header
        lines.append(f"\n[{prefix}{name}] {doc}")
        describe_fields(tp, f"{prefix}{name}.", lines)
