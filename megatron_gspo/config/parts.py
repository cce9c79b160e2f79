"""Settings owned by their part: a registered loss, backend (and any registry that declares a
kind here) brings a frozen dataclass of its own settings, which the config reads, checks, lists,
saves and compares on resume like a section's fields.

A *host* section says which kind of part it selects and where the part's settings sit: its
class attribute `_parts = (kind, selector, nested)`, e.g. `("loss", "name", False)`: the
selected loss's settings are keys of `loss:` itself, beside `loss.name`; `("backend",
"backend", True)`: a backend's settings are the section `rollout.<backend name>:`. The host's
`settings` field (`part_field`) holds them as the loader built them: the selected part's
settings object (flat), or {part name: settings object} of the sections given (nested); None /
missing = the part's defaults, derived at use (`settings_of`), as a None clip range was.

    register_settings("loss", "gspo_soft", SoftNegatives, defaults={"eps_low": 3e-4})
    settings_of(cfg.loss).negative_scale

A settings class is a frozen dataclass, every field with a docstring (the string literal under
it, as in every section); a field marked `fields.may_change` may change on resume. Registries
of higher rooms call `register_settings` (`algo.losses.register_policy_loss(settings=)`,
`rollout.sampler.Backend(settings=)`); the built-in parts' settings are declared in this room so
that `megatron-gspo config` lists them without importing torch. A new kind (the instruments of
a run, say) is a host section with `_parts` and a registry calling `register_settings` with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_gspo.config.docs import PART, describe_fields, field_docs
from megatron_gspo.config.fields import MAY_CHANGE
from megatron_gspo.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Registered:
    """One part's settings: its class and the defaults its registration gives (over the
    class's own)."""

    cls: type
    defaults: dict


SETTINGS: dict[str, dict[str, Registered]] = {}
"""kind -> part name -> its registered settings."""


def part_field(nested: bool):
    """The `settings` field of a host section: not a config key of its own (the loader reads the
    part's keys into it, `build_part`; `megatron-gspo config` lists them per part)."""
    if nested:
        return dataclasses.field(default_factory=dict, metadata={PART: True})
    return dataclasses.field(default=None, metadata={PART: True})


def host_fields(cls) -> list[str]:
    """The names of `cls`'s fields that are config keys (all but its `part_field`)."""
    return [f.name for f in dataclasses.fields(cls) if not f.metadata.get(PART)]


def register_settings(kind: str, name: str, cls: type, defaults: dict | None = None) -> None:
    """Part `name` of `kind` ("loss", "backend", ...) reads its settings into `cls` (a frozen
    dataclass whose every field has a docstring), `defaults` over the class's own. TypeError for
    a class that is none, an undocumented field or a default that names no field; a name that
    already holds settings is refused (its registry refuses it first)."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)
            and cls.__dataclass_params__.frozen):
        raise TypeError(f"{kind} {name!r}: settings={cls!r} is not a frozen dataclass")
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in field_docs(cls)]
    unknown = sorted(set(defaults or {}) - set(names))
    if missing or unknown:
        raise TypeError(f"{kind} {name!r}: settings {cls.__name__}: " + (
            f"fields without a docstring under them: {missing}" if missing
            else f"defaults name no field: {unknown}"))
    if name in SETTINGS.setdefault(kind, {}):
        raise TypeError(f"{kind} {name!r} already declares settings "
                        f"({SETTINGS[kind][name].cls.__name__})")
    SETTINGS[kind][name] = Registered(cls, dict(defaults or {}))


def registered(kind: str, name: str) -> Registered | None:
    return SETTINGS.get(kind, {}).get(name)


def build_part(host: list, kind: str, name: str, given: dict, prefix: str, build) -> Any:
    """Part `name`'s settings object from the keys `given` (under `prefix`), its registered
    defaults for the rest, read by `build` (the loader's, for a dataclass); None when that is
    its defaults (one spelling of one run: a saved config spells them out). ConfigError naming
    the key for an unknown one (listing the host's keys `host` too) or a required one missing."""
    entry = registered(kind, name)
    if entry is None:
        key = next(iter(given))
        raise ConfigError(f"unknown config key '{prefix}{key}'; {kind} {name!r} declares no "
                          f"settings (a plugin's: is it imported?); valid keys of "
                          f"{prefix.rstrip('.') or 'top level'}: {', '.join(host)}")
    fields = [f.name for f in dataclasses.fields(entry.cls)]
    bad = [k for k in given if k not in fields]
    if bad:
        raise ConfigError(f"unknown config key '{prefix}{bad[0]}'; valid keys of "
                          f"{prefix.rstrip('.') or 'top level'}: {', '.join(host + fields)} "
                          f"(the last {len(fields)} are {kind} {name!r}'s own)")
    value = _complete(entry, kind, name, lambda: build(entry.cls, {**entry.defaults, **given},
                                                       prefix), prefix, given)
    try:
        default = entry.cls(**entry.defaults)
    except TypeError:  # a setting without a default: what was given is never "the defaults"
        default = None
    return None if value == default else value


def _complete(entry: Registered, kind: str, name: str, make, prefix: str, given=()):
    try:
        return make()
    except TypeError as e:  # a field without a default that nobody gave
        required = [f.name for f in dataclasses.fields(entry.cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                    and f.name not in entry.defaults and f.name not in given]
        raise ConfigError(f"{prefix}{required[0] if required else '?'}: {kind} {name!r} has no "
                          "default for it: set it") from e


def default_settings(kind: str, name: str, prefix: str = "") -> Any:
    """Part `name`'s settings at its defaults, or None if it declares none; ConfigError naming
    `prefix` + the key for a setting it has no default for."""
    entry = registered(kind, name)
    if entry is None:
        return None
    return _complete(entry, kind, name, lambda: entry.cls(**entry.defaults), prefix)


def selected(host) -> tuple[str, str, bool]:
    """(kind, selected part name, nested) of a host section."""
    kind, selector, nested = host._parts
    return kind, getattr(host, selector), nested


def settings_of(host, name: str | None = None) -> Any:
    """The settings of the part a host section selects (or of part `name`, nested hosts): as
    given, else its defaults; None if it declares none."""
    kind, chosen, nested = selected(host)
    name = name or chosen
    given = host.settings.get(name) if nested else host.settings
    prefix = f"{host._section}.{name}." if nested else f"{host._section}."
    return given if given is not None else default_settings(kind, name, prefix)


def check_host(host) -> None:
    """A host's settings are of the class its part registered (a section built in Python, or a
    name replaced after the settings were built: `dataclasses.replace`)."""
    kind, name, nested = selected(host)
    given = host.settings if nested else {name: host.settings}
    for part, value in given.items():
        entry = registered(kind, part)
        if value is not None and entry is not None and not isinstance(value, entry.cls):
            raise ConfigError(f"{host._section}: settings {type(value).__name__} are not "
                              f"{kind} {part!r}'s ({entry.cls.__name__})")


def settings_dict(host) -> dict:
    """The keys a host's settings add to its mapping in a saved config, defaults spelled out:
    the selected part's fields (flat), or {part name: its fields} of the selected part and the
    sections given (nested); none for a part that declares no settings."""
    _, name, nested = selected(host)
    chosen = settings_of(host)
    if not nested:
        return dataclasses.asdict(chosen) if chosen is not None else {}
    out = {part: dataclasses.asdict(value) for part, value in host.settings.items()}
    return {**out, name: dataclasses.asdict(chosen)} if chosen is not None else out


def may_change_keys(cls, mapping: dict, prefix: str) -> list[str]:
    """The dotted keys, in a saved config's `mapping` of host section `cls`, of the part
    settings marked `fields.may_change`: the selected part's (flat), or of each part section
    (nested)."""
    kind, selector, nested = cls._parts
    parts = [k for k in mapping if registered(kind, k)] if nested else [mapping.get(selector)]
    out = []
    for part in parts:
        entry = registered(kind, part)
        where = f"{prefix}{part}." if nested else prefix
        out += [where + f.name for f in dataclasses.fields(entry.cls)
                if f.metadata.get(MAY_CHANGE)] if entry else []
    return out


def describe_parts(host_cls, prefix: str, lines: list[str], describe) -> None:
    """Append, for each part of `host_cls`'s kind that declares settings, a header and its keys
    (`describe(cls, prefix, lines, defaults)`, the listing's own)."""
    kind, selector, nested = host_cls._parts
    for name, entry in sorted(SETTINGS.get(kind, {}).items()):
        where = f"{prefix}{name}." if nested else prefix
        doc = " ".join((entry.cls.__doc__ or "").split())
        lines.append(f"\n[{where.rstrip('.')}, {prefix}{selector}={name}] the {kind}'s own "
                     f"settings: {doc}")
        describe(entry.cls, where, lines, entry.defaults)


def describe_all(host_cls, prefix: str, lines: list[str]) -> None:
    """`describe_parts` with the listing's `docs.describe_fields`."""
    describe_parts(host_cls, prefix, lines, describe_fields)
