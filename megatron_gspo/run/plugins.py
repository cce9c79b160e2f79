"""User code that plugs in without editing the project: the config's `plugins:` (and the CLI's
`--plugin`), imported before the config's names are checked.

An entry is a module name importable here (an installed package, a module on `sys.path`) or a
path to a `.py` file or a package folder (relative to the working directory); importing it runs
its `@register_*` decorators, so the loss, reward, task or sampler it registers is a valid name
(docs/extending.md). `megatron_gspo.run.names.check_names` loads them first, so every rank of a
run imports them, once per process. A file is imported under its own name (its stem, or the
folder's), so it can import the modules beside it when its folder is on `sys.path`.

An entry that names no module or file is a ConfigError naming it (one line, exit 2); a name
a registry already holds (a built-in one too) is refused naming both definitions
(`moe.platform.checks.DuplicateName`, one line); any other error raised by the plugin's own code
reaches the user with its traceback, as their code's. A run records the contents of the files
it imported (`plugin_files`, `megatron_gspo.run.inputs`): a resume whose plugin code changed is
refused naming the file, as a changed data file is.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

from megatron_gspo.errors import ConfigError

_HINT = "(a module name importable here, or a path to a .py file or a package folder)"


def load_plugins(entries) -> list[ModuleType]:
    """Import each of `entries` (module names or paths) once per process; their modules."""
    return [_load(entry) for entry in entries]


def plugin_files(entries) -> dict[str, str]:
    """{shown name: real path} of the source of every module of `entries` (imported here, once
    per process): a module's file, or every .py file under a package's folder, shown relative to
    the folder its top-level module is found in ("my_plugin.py", "plugin_pkg/helper.py"), so a
    moved plugin keeps its names. A resume compares their contents (`megatron_gspo.run.inputs`)."""
    out = {}
    for module in load_plugins(entries):
        levels = module.__name__.count(".") + 1
        folders = [os.path.realpath(f) for f in getattr(module, "__path__", None) or []]
        if folders:  # a package: every .py file under its folder(s)
            files = [os.path.join(d, f) for folder in folders for d, _, names in os.walk(folder)
                     for f in names if f.endswith(".py")]
        elif getattr(module, "__file__", None):
            files = [os.path.realpath(module.__file__)]
        else:  # a built-in module: no source
            continue
        root = (folders or files)[0]
        for _ in range(levels):
            root = os.path.dirname(root)
        out.update((os.path.relpath(path, root), path) for path in sorted(files))
    return out


def _is_path(entry: str) -> bool:
    return entry.endswith(".py") or "/" in entry or os.sep in entry or entry.startswith(".")


def _load(entry: str) -> ModuleType:
    try:
        return _load_path(entry) if _is_path(entry) else importlib.import_module(entry)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if not _is_path(entry) and (entry == missing or entry.startswith(missing + ".")):
            raise ConfigError(f"plugins: {entry!r}: no such module {_HINT}") from None
        raise ConfigError(f"plugins: {entry!r} imports {missing!r}, which is not installed") \
            from None


def _load_path(entry: str) -> ModuleType:
    path = os.path.realpath(os.path.expanduser(entry))
    if os.path.isdir(path):
        init, name = os.path.join(path, "__init__.py"), os.path.basename(path)
        if not os.path.isfile(init):
            raise ConfigError(f"plugins: {entry!r}: a folder without __init__.py {_HINT}")
        spec = importlib.util.spec_from_file_location(name, init,
                                                      submodule_search_locations=[path])
    elif os.path.isfile(path) and path.endswith(".py"):
        name = os.path.basename(path)[:-3]
        spec = importlib.util.spec_from_file_location(name, path)
    else:
        raise ConfigError(f"plugins: {entry!r}: no such file or folder {_HINT}")
    loaded = sys.modules.get(name)
    if loaded is not None:
        if os.path.realpath(getattr(loaded, "__file__", "") or "") == os.path.realpath(
                spec.origin):
            return loaded  # imported before (another check of the names, a second job)
        raise ConfigError(f"plugins: {entry!r}: its module name {name!r} is already taken by "
                          f"{getattr(loaded, '__file__', None) or 'a built-in module'}; rename it")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a fixed file imports afresh
        raise
    return module
