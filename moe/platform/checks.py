"""Value checks shared by `moe` and `megatron_gspo` (plain Python: no torch, no megatron)."""

import inspect
import os


def is_int(value) -> bool:
    """A Python int that is not a bool (`isinstance(True, int)` is True)."""
    return isinstance(value, int) and not isinstance(value, bool)


class MissingDependency(ImportError):
    """An optional package a setting needs is not installed; the message names the setting and
    the install command (the CLI prints it as one line and exits with status 2)."""


class DuplicateName(ValueError):
    """A registry (losses, rewards, tasks, samplers, Hugging Face families) already holds the
    name: a second definition would silently replace the first, in every run. The message names
    both definitions (the CLI prints it as one line and exits with status 2)."""


def defined_at(obj) -> str:
    """Where `obj` is defined, for a message: "module.name (file:line)" of a function or class,
    the text of a "module:attribute" path (a factory registered by path)."""
    if isinstance(obj, str):
        return obj
    name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
    try:
        path, line = inspect.getsourcefile(obj), inspect.getsourcelines(obj)[1]
    except (OSError, TypeError):  # defined in a string, or a built-in: its name only
        return name
    shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return f"{name} ({shown}:{line})"


def refuse_duplicate(kind: str, name: str, registered, new) -> None:
    """DuplicateName naming the `registered` definition of `name` and the `new` one."""
    raise DuplicateName(f"{kind} {name!r} is already registered by {defined_at(registered)}; "
                        f"{defined_at(new)} registers it again: give it another name")
