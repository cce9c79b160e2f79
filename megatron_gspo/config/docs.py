"""Field docstrings (a string literal right under each field, as in megatron-core's
TransformerConfig) read with `ast`, and the key listing of `megatron-gspo config`."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap

from megatron_gspo.config.fields import MAY_CHANGE, field_types, type_name

PART = "part_settings"
"""Field metadata key of a host section's `settings` field (`megatron_gspo.config.parts`), which
the listing leaves to the parts' own."""

REQUIRED = type("Required", (), {"__repr__": lambda self: "(required)"})()
"""The default shown of a field that has none."""
RESUMABLE = "  (a resume may change it)"
"""After a key (or section) marked `fields.may_change` in the listing."""


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


def describe_fields(cls, prefix: str, lines: list[str], given: dict | None = None,
                    parts=None) -> None:
    """Append `prefix.key: type = default` and its docstring for every field of `cls` (its
    default: `given`'s, else as declared; "required" without one), then each section (a
    dataclass field) under a `[section]` header, to `lines`; then, for a section that hosts
    parts' settings, `parts(cls, prefix, lines)` (`megatron_gspo.config.parts.describe_parts`)."""
    docs = field_docs(cls)
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING
                else f.default_factory() if f.default_factory is not dataclasses.MISSING
                else REQUIRED for f in dataclasses.fields(cls) if not f.metadata.get(PART)}
    defaults.update(given or {})
    resumable = {f.name: RESUMABLE if f.metadata.get(MAY_CHANGE) else ""
                 for f in dataclasses.fields(cls)}
    sections = []
    for name, tp in field_types(cls).items():
        if name not in defaults:  # a host's settings: listed per part after the sections
            continue
        if dataclasses.is_dataclass(tp):
            sections.append((name, tp))
            continue
        lines.append(f"{prefix}{name}: {type_name(tp)} = {defaults[name]!r}{resumable[name]}")
        lines.extend("    " + ln for ln in docs.get(name, "(undocumented)").splitlines())
    for name, tp in sections:
        doc = " ".join((tp.__doc__ or "").split())  # one line per section header
        lines.append(f"\n[{prefix}{name}] {doc}{resumable[name]}")
        describe_fields(tp, f"{prefix}{name}.", lines, parts=parts)
    if parts is not None and hasattr(cls, "_parts"):
        parts(cls, prefix, lines)
