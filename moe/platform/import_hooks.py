"""Let `import megatron.core` succeed without triton (megatron-core 0.18+; triton comes with PyPI's
CUDA torch wheels but not with the CPU wheel).

`install_import_hooks()` runs in `moe/__init__.py`, so before anything imports megatron; this
module therefore imports neither torch nor megatron (and `import moe`, e.g. for `moe.model.presets`,
stays light). The CPU patches that run after megatron is imported live in `moe.platform.compat`.
tests/moe/platform/test_import_hooks.py tests the hook.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import sys

# megatron modules that `import triton` unconditionally and lie on the `import megatron.core` path
# (via pipeline_parallel.schedules -> transformer.moe.paged_stash). They only define paged-stash
# kernels (a CUDA-graph MoE memory feature this project does not use).
TRITON_ONLY_MODULES = (
    "megatron.core.transformer.moe.paged_stash",      # megatron-core 0.18.x: kernels inline
    "megatron.core.transformer.moe.ops.paged_stash",  # megatron-core 0.19.x: kernels moved here
)


def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # sys.modules["triton"] = None: import blocked
        return False


class _NeedsTriton:
    """Stands in for anything a TRITON_ONLY_MODULES module takes from triton: decorating and
    annotating work (module import), launching a kernel raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "_NeedsTriton":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _NeedsTriton(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs) -> "_NeedsTriton":
        if len(args) == 1 and not kwargs and callable(args[0]):  # @triton.jit on a kernel
            return _NeedsTriton(getattr(args[0], "__qualname__", self._name))
        return self  # triton.jit(**options), triton.Config(...), ...

    def __getitem__(self, grid):
        raise RuntimeError(f"{self._name}: this megatron-core kernel needs triton, which is not "
                           f"installed (pip install triton, or use a CUDA build of torch)")


def _triton_stub_import(real_import):
    """An `__import__` that hands out a stub for `triton` / `triton.*` and imports the rest."""

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and (name == "triton" or name.startswith("triton.")):
            stub = _NeedsTriton("triton")
            return getattr(stub, name.split(".", 1)[1]) if fromlist and "." in name else stub
        return real_import(name, globals, locals, fromlist, level)

    return _import


class _TritonStubLoader(importlib.abc.Loader):
    """Runs a TRITON_ONLY_MODULES module with the stub visible to that module alone (its own
    `__builtins__.__import__`), so other megatron modules' `try: import triton` still fail and
    their HAVE_TRITON flags stay False."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module_builtins = dict(vars(builtins))
        module_builtins["__import__"] = _triton_stub_import(builtins.__import__)
        module.__builtins__ = module_builtins
        self._loader.exec_module(module)


class _TritonStubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in TRITON_ONLY_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None  # an older megatron-core without this module
        spec.loader = _TritonStubLoader(spec.loader)
        return spec


def install_import_hooks() -> bool:
    """Let megatron-core 0.18+ import without triton. Returns True when the hook is (already)
    installed; a no-op (False) when triton is importable."""
    if any(isinstance(f, _TritonStubFinder) for f in sys.meta_path):
        return True
    if triton_available():
        return False
    sys.meta_path.insert(0, _TritonStubFinder())
    return True
