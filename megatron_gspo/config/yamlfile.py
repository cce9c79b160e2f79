"""Config files: YAML 1.2-style reading with line:column errors and duplicate keys refused,
`base:` inheritance, mappings as overrides, and an atomic write for the resolved config.

Departure from plain `yaml.safe_load`: files and override values are read with `YamlLoader`, so
`3e-4` is a float (YAML 1.1 reads it as a string) and only true / false are booleans (`off`,
`yes`, `no` stay strings, e.g. `train.routing_replay=off`); a key given twice in one mapping is an
error (PyYAML keeps the last one silently).
"""

from __future__ import annotations

import json
import os
import re

import yaml

from megatron_gspo.errors import ConfigError, UserError
from megatron_gspo.files import write_atomically


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
    file, line and column, a file that is not UTF-8 text one naming the file and the byte."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text: byte 0x{data[e.start]:02x} at offset "
                          f"{e.start} ({e.reason}); save the file as UTF-8") from None
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


def load_layered(path: str, _chain: tuple[str, ...] = (), normalize=None,
                 origins: dict | None = None) -> dict:
    """A YAML mapping with inheritance: a top-level `base: other.yaml` (a path relative to this
    file) is loaded first, recursively, and this file's other keys are deep-merged on top
    (`deep_merge`). A cycle, a missing base file or a non-mapping file is a one-line
    ConfigError naming the files. One base per file; no interpolation. `normalize(mapping)`,
    if given, rewrites each file's mapping before the merge (older key names as the keys they
    became, so a file may override its base under either name). `origins`, if given, gets
    {dotted key: the file that set it last} of every value the files set."""
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
    base = raw.pop("base", None)
    raw = normalize(raw) if normalize else raw
    merged = raw
    if base is not None:
        if not isinstance(base, str) or not base:
            raise ConfigError(f"{path}: base={base!r}: expected the path of a YAML file")
        base_path = os.path.join(os.path.dirname(path), base)
        merged = deep_merge(load_layered(base_path, (*_chain, real), normalize, origins), raw)
    if origins is not None:  # after the base's: this file's values win
        origins.update((key.partition("=")[0], path) for key in mapping_to_overrides(raw))
    return merged


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


def atomic_write(path: str, text: str) -> None:
    """`text` into a tmp file next to `path` (`.NAME.*.tmp`, which a run dir's clean-up
    removes), fsync, then os.replace: a reader sees the old file or the new one, never half of
    it (`megatron_gspo.files.write_atomically`). A failed write is one UserError naming `path`
    and leaves no tmp file."""
    try:
        write_atomically(path, lambda f: f.write(text.encode("utf-8")))
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}; files already written are "
                        "unchanged") from e
