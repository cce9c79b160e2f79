"""Building a config dataclass from YAML data: strict keys, values read into their field's type
before the dataclass exists, and dotted `a.b=c` overrides. Generic: it walks dataclass fields
and knows no section by name (`megatron_gspo.config.schema` is the schema).

    raw = load_layered("exp.yaml")            # megatron_gspo.config.yamlfile
    apply_override(RunConfig, raw, "loss.eps_low=3e-4")
    cfg = build(RunConfig, raw)

An unknown key at any level is an error naming the dotted key and listing the section's valid
keys. Override values are YAML (`1e-5`, `true`, `[1,2]`, `null`), read into the field's type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from megatron_gspo.config.fields import (accepts_str, coerce, field_readers, field_types,
                                         get_origin, type_name)
from megatron_gspo.config.parts import build_part, host_fields, registered
from megatron_gspo.config.yamlfile import YamlLoader
from megatron_gspo.errors import ConfigError


def _unknown(prefix: str, name, cls, hint: str = "") -> ConfigError:
    section = prefix.rstrip(".") or "top level"
    return ConfigError(f"unknown config key '{prefix}{name}'{hint}; valid keys of {section}: "
                       f"{', '.join(host_fields(cls))}")


def renamed(cls) -> dict[str, str]:
    """{older name: key now} of the keys section `cls` still reads under a name it had before
    (its `_renamed` class attribute; the key now may be dotted, a key of a section nested in
    `cls` that it moved into): old configs and run records keep loading. A key whose older
    value needs reading, not only renaming, is one of the section's `_older_keys`: an override
    sets it as given, and the section's `_read_older(mapping) -> mapping` reads it before the
    renames (`RolloutConfig`'s `decoder`)."""
    return getattr(cls, "_renamed", {})


def _current_names(cls, data: dict, prefix: str) -> dict:
    """`data` with `cls`'s older key names (`renamed`) as the keys they became (a dotted one
    placed in its nested section, the input's mappings copied, not changed); ConfigError when
    a mapping gives one key under both names."""
    data = getattr(cls, "_read_older", lambda d: d)(data)
    old = renamed(cls)
    out = {name: value for name, value in data.items() if name not in old}
    for name, value in data.items():
        if name not in old:
            continue
        *path, last = old[name].split(".")
        node = out
        for i, part in enumerate(path):
            sub = node.get(part)
            if sub is not None and not isinstance(sub, dict):
                raise ConfigError(f"{prefix}{'.'.join(path[:i + 1])}: expected a mapping of "
                                  f"keys, got {type(sub).__name__} {sub!r}")
            node[part] = node = dict(sub or {})
        if last in node:
            raise ConfigError(f"{prefix}{name} and {prefix}{old[name]} are one key ({prefix}"
                              f"{name} is its older name): give it once, as {prefix}{old[name]}")
        node[last] = value
    return out


def current_names(cls, data, prefix: str = ""):
    """`data` (a nested mapping for dataclass `cls`) with older key names as the keys they
    became in every section (`renamed`); unknown keys and values are left for `build` to
    judge. ConfigError when a mapping gives one key under both names."""
    if not isinstance(data, dict):
        return data
    data, types = _current_names(cls, data, prefix), field_types(cls)
    return {name: current_names(types[name], value, f"{prefix}{name}.")
            if name in types and dataclasses.is_dataclass(types[name]) else value
            for name, value in data.items()}


def build(cls, data, prefix: str = ""):
    """Dataclass `cls` from a nested mapping (None = all defaults): every key known (older names
    read as their fields, `renamed`), every value read into its field's type (`fields.coerce`,
    then the field's `Annotated` reader), then the dataclass checks them. ConfigError naming the
    dotted key otherwise."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, "
                          f"got {type(data).__name__} {data!r}")
    data = _current_names(cls, data, prefix)
    types, readers, keys = field_types(cls), field_readers(cls), host_fields(cls)
    kwargs, extra = {}, {}
    for name, value in data.items():
        if name not in keys and hasattr(cls, "_parts"):
            extra[name] = value  # the selected part's settings (`megatron_gspo.config.parts`)
            continue
        if name not in keys:
            raise _unknown(prefix, name, cls)
        tp = types[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, value, f"{prefix}{name}.")
            continue
        value = coerce(value, tp, f"{prefix}{name}")
        kwargs[name] = readers[name](value) if name in readers else value
    if hasattr(cls, "_parts"):
        kwargs["settings"] = _part_settings(cls, kwargs, extra, prefix)
    return cls(**kwargs)


def _part_settings(cls, kwargs: dict, extra: dict, prefix: str):
    """A host section's `settings` (`megatron_gspo.config.parts`) from its keys that are not its
    own fields: the selected part's settings (flat), or {part: settings} of each `part:`
    section given (nested)."""
    kind, selector, nested = cls._parts
    chosen = kwargs.get(selector, {f.name: f for f in dataclasses.fields(cls)}[selector].default)
    keys = host_fields(cls)
    if not nested:
        return build_part(keys, kind, chosen, extra, prefix, build) if extra else None
    out = {}
    for part, mapping in extra.items():
        if registered(kind, part) is None:
            raise _unknown(prefix, part, cls, f" (not a {kind} that declares settings: is its "
                                              "plugin imported?)")
        if mapping is not None and not isinstance(mapping, dict):
            raise ConfigError(f"{prefix}{part}: expected a mapping of keys, got "
                              f"{type(mapping).__name__} {mapping!r}")
        value = build_part(keys, kind, part, mapping or {}, f"{prefix}{part}.", build)
        if value is not None:
            out[part] = value
    return out


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
    if tp is not Any and accepts_str(tp) and isinstance(value, (bool, int, float)):
        return text.strip()  # wandb.name=2024 is the string "2024"
    return value


def _drop_older(cls, node: dict, rest: list[str]) -> None:
    """Remove from `node` (section `cls`'s raw mapping) the values given under an older name of
    the key `rest` leads to: an override replaces them."""
    for old, new in renamed(cls).items():
        if rest[:len(new.split("."))] == new.split("."):
            node.pop(old, None)


def _set_part_key(cls, node: dict, parts: list[str], i: int, text: str, key: str) -> str:
    """Set a key of a part's settings (`megatron_gspo.config.parts`) into the raw mapping of
    host section `cls`: `loss.eps_low=0.1` (flat), `rollout.my_backend.every=2` (nested); the
    build checks it against the part's settings."""
    nested = cls._parts[2]
    path = parts[i:]
    if nested and len(path) == 1:
        raise ConfigError(f"{key} is a section; set one of its keys, e.g. {key}.<key>=...")
    if len(path) != (2 if nested else 1):
        raise ConfigError(f"{key}: not a key of {'.'.join(parts[:i])} or its part's settings")
    for part in path[:-1]:
        sub = node.get(part)
        if sub is not None and not isinstance(sub, dict):
            raise ConfigError(f"{'.'.join(parts[:i + 1])}: expected a mapping, got {sub!r}")
        node[part] = node = dict(sub or {})
    node[path[-1]] = _override_value(key, text, Any)
    return ".".join(parts)


def apply_override(root, raw: dict, item: str) -> str:
    """Set one `a.b=c` into the nested raw dict, checking the path against `root`'s schema
    (an older key name, `renamed`, read as the key it became); returns the dotted key set (its
    name now)."""
    parts, text = _parse_override(item)
    key = ".".join(parts)
    cls, node, i = root, raw, 0
    while i < len(parts):
        prefix = "".join(p + "." for p in parts[:i])
        types = field_types(cls)
        parts[i:i + 1] = renamed(cls).get(parts[i], parts[i]).split(".")
        name = parts[i]
        if name not in types and name in getattr(cls, "_older_keys", ()) and i == len(parts) - 1:
            node[name] = _override_value(key, text, str)  # read at build (`renamed`)
            return key
        if name not in host_fields(cls) and hasattr(cls, "_parts"):
            return _set_part_key(cls, node, parts, i, text, key)
        if name not in types:
            raise _unknown(prefix, name, cls)
        _drop_older(cls, node, parts[i:])
        tp, last = types[name], i == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            if last:
                raise ConfigError(f"{key} is a section; set one of its keys, e.g. "
                                  f"{key}.{next(iter(field_types(tp)))}=...")
            if node.get(name) is None:
                node[name] = {}
            if not isinstance(node[name], dict):
                raise ConfigError(f"{prefix}{name}: expected a mapping, got {node[name]!r}")
            cls, node, i = tp, node[name], i + 1
        elif last:
            node[name] = _override_value(key, text, tp)
            return ".".join(parts)
        elif tp is dict or get_origin(tp) is dict:  # task.kwargs.num_digits=3
            default = {f.name: f for f in dataclasses.fields(cls)}[name].default_factory()
            sub = node.get(name, default)
            node[name] = sub = dict(sub) if isinstance(sub, dict) else {}
            for p in parts[i + 1:-1]:
                sub[p] = dict(sub[p]) if isinstance(sub.get(p), dict) else {}
                sub = sub[p]
            sub[parts[-1]] = _override_value(key, text, Any)
            return ".".join(parts)
        else:
            raise ConfigError(f"{key}: {prefix}{name} is a value of type {type_name(tp)}, "
                              "not a section")
