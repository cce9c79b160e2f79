"""Field types of the config dataclasses: reading a YAML value into a field's type (the loader's
job, before a dataclass is built) and checking the values a dataclass holds (its `__post_init__`'s
job, which never changes a value).

Reading (`coerce`): YAML values and override text become the annotated type: int, float, bool,
str, dict, list, Optional, Literal words, `bool | Literal["force"]`. Strict where it matters: a
bool is no number, 2.5 is no int, 1 is no bool (the words true / false / yes / no / on / off /
1 / 0 are). A field annotated `Annotated[T, fn]` (`Path`, `Band` below) then goes through `fn`.

Checking (`validate`, `check`): every field has its annotated type (an int passes for a float),
then ranges and rules, each a one-line `ConfigError` "dotted.key=value: what is wrong". So a
dataclass built in Python holds the values it was given, and the saved config equals the one the
run used; values derived from others are properties.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
from typing import Annotated, Any, Literal, Optional, Sequence, Union, get_args, get_type_hints
from typing import get_origin as _typing_origin

from megatron_gspo.errors import ConfigError


# ----------------------------------------------------------------------------- field typing


@functools.lru_cache(maxsize=None)
def field_types(cls) -> dict[str, Any]:
    """{field name: resolved annotation, `Annotated` stripped} in declaration order."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@functools.lru_cache(maxsize=None)
def field_readers(cls) -> dict[str, Any]:
    """{field name: fn} for the fields annotated `Annotated[T, fn]`: what the loader applies
    after reading the value as T."""
    hints = get_type_hints(cls, include_extras=True)
    out = {}
    for f in dataclasses.fields(cls):
        extra = [a for a in getattr(hints[f.name], "__metadata__", ()) if callable(a)]
        if extra:
            out[f.name] = extra[0]
    return out


def get_origin(tp):
    """typing.get_origin, with PEP 604 unions (`float | None`) reported as typing.Union."""
    origin = _typing_origin(tp)
    return Union if origin is types.UnionType else origin


def type_name(tp) -> str:
    """How a type reads in messages and `megatron-gspo config`: `float | null`, `'off' | 'r2'`."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Union:
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def accepts_str(tp) -> bool:
    """Whether a value of type `tp` may be a str (str, a Literal word, or a union with one)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Union:
        return any(accepts_str(a) for a in args)
    return tp is str or origin is Literal


# ----------------------------------------------------------------------------- reading values


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
    def read(v):
        if not isinstance(v, t):
            raise ValueError(v)
        return dict(v) if t is dict else v  # a copy: the config shares nothing with its input
    return read


def _to_list(v):  # a YAML list, or one string as a one-element list
    if isinstance(v, str):
        return [v]
    if not isinstance(v, (list, tuple)):
        raise ValueError(v)
    return list(v)


_READERS = {bool: _to_bool, int: _to_int, float: _to_float, str: _of_type(str),
            dict: _of_type(dict), list: _to_list}


def coerce(value, tp, key: str):
    """`value` read as annotation `tp` (int, float, bool, str, dict, list, Optional, Literal,
    a dataclass instance); ConfigError `key=value: expected <type>` otherwise."""
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
                return coerce(value, inner[0], key)
            except ConfigError:
                raise ConfigError(f"{key}={value}: expected {type_name(tp)}") from None
    base = get_origin(inner[0]) or inner[0]
    read = _of_type(base) if dataclasses.is_dataclass(base) else _READERS.get(base)
    if len(inner) != 1 or read is None:
        raise TypeError(f"{key}: unsupported annotation {tp}")
    try:
        return read(value)
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{key}={value}: expected {type_name(tp)}") from None


def expand_user(value):
    """`~` in a path (a str, or each str of a list) is the home directory: the shell leaves
    `key=~/x` alone, and a YAML value `~/x` is that string."""
    if isinstance(value, list):
        return [os.path.expanduser(v) if isinstance(v, str) else v for v in value]
    return os.path.expanduser(value) if isinstance(value, str) else value


def band_values(value):
    """An accuracy band's two bounds as floats where they read as numbers (`[0, '0.5']` is
    [0.0, 0.5]); anything else is left for `check_band` to refuse by name."""
    def number(x):
        if isinstance(x, bool):
            return x  # float(False) is 0, but a bool is no accuracy
        try:
            return float(x)
        except (TypeError, ValueError):
            return x
    return [number(x) for x in value] if isinstance(value, list) else value


Path = Annotated[str, expand_user]
"""A path field: `~` is the home directory."""
OptionalPath = Annotated[Optional[str], expand_user]
Paths = Annotated[list, expand_user]
"""A list of paths (one string is a list of one)."""
Band = Annotated[Optional[list], band_values]
"""An accuracy band [low, high] (`check_band`), or None."""


# ----------------------------------------------------------------------------- resume metadata


MAY_CHANGE = "may_change"
"""The field metadata key `may_change` sets."""


def may_change(default=dataclasses.MISSING, *, factory=dataclasses.MISSING):
    """A field (a value, or a whole section) that a resume may change: it changes nothing the
    run computes (how long, how often to eval, save and log, where logs go, memory knobs with
    the same gradients, where an inference engine runs). `dataclasses.field` with metadata
    `{MAY_CHANGE: True}`; `megatron_gspo.config.schema.resume_may_change` lists the keys so
    marked, which a run's fingerprint leaves out (`megatron_gspo.run.rundir`)."""
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={MAY_CHANGE: True})


# ----------------------------------------------------------------------------- checking values


def _conforms(value, tp) -> bool:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Union:
        return any(_conforms(value, a) for a in args)
    if origin is Literal:
        return isinstance(value, str) and value in args
    if tp is type(None):
        return value is None
    if tp in (int, float, bool) and isinstance(value, bool):
        return tp is bool
    if tp is float:
        return isinstance(value, (int, float))  # an int is a float value (PEP 484)
    return isinstance(value, origin or tp)


def key_of(obj, name: str) -> str:
    """The dotted key of field `name` of section `obj` (`_section` is its key prefix)."""
    return f"{obj._section}.{name}" if obj._section else name


def check(obj, name: str, ok: bool, msg: str) -> None:
    """ConfigError `section.name=value: msg` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key_of(obj, name)}={getattr(obj, name)}: {msg}")


def validate(obj, nonempty: Sequence[str] = (), ge: dict | None = None,
             gt: dict | None = None) -> None:
    """Every field of the annotated type, then the range checks (None passes; NaN fails), then
    every float finite (`optim.lr=.inf` is no learning rate). Changes nothing."""
    for name, tp in field_types(type(obj)).items():
        value = getattr(obj, name)
        if not _conforms(value, tp):
            if get_origin(tp) is Literal:
                check(obj, name, False, f"expected one of {', '.join(map(repr, get_args(tp)))}")
            check(obj, name, False, f"expected {type_name(tp)}")
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


def check_ratio_band(obj, name: str) -> None:
    """Field `name` is None or an importance-ratio band [low, high]: two finite numbers with
    0 < low <= 1 <= high and low < high (`megatron_gspo.algo.corrections`)."""
    band = getattr(obj, name)
    if band is None:
        return
    numbers = isinstance(band, list) and len(band) == 2 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in band)
    check(obj, name, numbers and math.isfinite(band[1]) and 0 < band[0] <= 1 <= band[1]
          and band[0] < band[1],
          "expected [low, high], two ratios with 0 < low <= 1 <= high, low < high")


def check_band(obj, name: str) -> None:
    """Field `name` is None or an accuracy band [low, high]: two numbers with
    0 <= low < high <= 1."""
    band = getattr(obj, name)
    if band is None:
        return
    numbers = isinstance(band, list) and len(band) == 2 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in band)
    check(obj, name, numbers, "expected [low, high], two accuracies in [0, 1]")
    check(obj, name, 0 <= band[0] < band[1] <= 1,
          "expected [low, high] with 0 <= low < high <= 1")
