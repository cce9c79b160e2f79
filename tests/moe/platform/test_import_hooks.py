"""moe.platform.import_hooks: `import megatron.core` without triton (megatron-core 0.18+).

The patched path is tested on every version; the unpatched path (that it fails without the hook)
skips with the reason on versions that do not import triton (`make test-latest` runs it).
"""

import importlib
import inspect
import subprocess
import sys
import textwrap
from importlib.metadata import version

import pytest

from moe.platform import import_hooks

MCORE_VERSION = version("megatron-core")
MCORE = tuple(int(x) for x in MCORE_VERSION.split(".")[:2])
REPO = __file__.rsplit("/tests/", 1)[0]


def _run(code: str, prelude: str = "") -> subprocess.CompletedProcess:
    """Run `prelude + code` in a fresh interpreter (the hook is process-wide)."""
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------- import without triton (0.18+)
_BLOCK_TRITON = "import sys; sys.modules['triton'] = None  # import triton -> ImportError\n"


def test_megatron_imports_without_triton_through_moe():
    """With the hook (`import moe` first), megatron imports with triton absent; no megatron module
    believes triton is present, and a stubbed kernel refuses to launch."""
    result = _run("""
        import moe, megatron.core
        from moe.platform import import_hooks
        from megatron.core.transformer.moe import moe_layer
        from megatron.core.models.gpt import gpt_layer_specs
        believers = sorted(n for n, m in list(sys.modules.items())
                           if n.startswith("megatron") and getattr(m, "HAVE_TRITON", False))
        assert not believers, believers
        stubs = [sys.modules[n] for n in import_hooks.TRITON_ONLY_MODULES if n in sys.modules]
        kernels = {id(v): v for m in stubs for v in vars(m).values()  # 0.19: 2 modules hold them
                   if isinstance(v, import_hooks._NeedsTriton) and not v._name.startswith("triton")}
        for kernel in kernels.values():
            try:
                kernel[(1,)]
            except RuntimeError as e:
                assert "needs triton" in str(e), e
            else:
                raise AssertionError(f"{kernel._name} launched without triton")
        print("stubbed", len(kernels), "kernels")
    """, prelude=_BLOCK_TRITON)
    assert result.returncode == 0, result.stderr[-3000:]
    # 0.18 and 0.19 define two paged-stash kernels (copy, pop); 0.16-0.17 none
    assert f"stubbed {2 if MCORE >= (0, 18) else 0} kernels" in result.stdout, result.stdout


@pytest.mark.skipif(MCORE < (0, 18), reason=f"megatron-core {MCORE_VERSION} does not import "
                    f"triton unconditionally (paged_stash came in 0.18)")
def test_megatron_without_the_hook_needs_triton():
    """Without the hook, megatron-core 0.18+ fails at `import megatron.core` when triton is
    absent (pipeline_parallel.schedules -> transformer.moe.paged_stash -> triton)."""
    result = _run("import megatron.core\n", prelude=_BLOCK_TRITON)
    assert result.returncode != 0
    assert "triton" in result.stderr.splitlines()[-1], result.stderr[-2000:]


def test_import_hook_is_a_noop_when_triton_is_importable(monkeypatch):
    monkeypatch.setattr(import_hooks, "triton_available", lambda: True)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if not isinstance(f, import_hooks._TritonStubFinder)])
    assert import_hooks.install_import_hooks() is False
    assert not any(isinstance(f, import_hooks._TritonStubFinder) for f in sys.meta_path)


def test_triton_stub_import_hands_out_stubs_for_triton_only():
    imp = import_hooks._triton_stub_import(__import__)
    assert isinstance(imp("triton"), import_hooks._NeedsTriton)
    assert imp("triton.language", fromlist=("constexpr",))._name == "triton.language"
    assert imp("math") is __import__("math")
    kernel = imp("triton").jit(test_triton_stub_import_hands_out_stubs_for_triton_only)
    with pytest.raises(RuntimeError, match="test_triton_stub_import_hands_out_stubs_for_triton"):
        kernel[(4,)]


def test_stub_finder_gives_triton_to_listed_modules_only(tmp_path, monkeypatch):
    """A TRITON_ONLY_MODULES module imports with triton absent (the hook goes before the normal
    path finder) and its kernels refuse to launch; another module's `import triton` still fails."""
    pkg = tmp_path / "fake_mcore"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels.py").write_text("import triton\nimport triton.language as tl\n\n\n"
                                    "@triton.jit\ndef copy_kernel(n: tl.constexpr):\n    pass\n")
    (pkg / "other.py").write_text("try:\n    import triton\n    HAVE_TRITON = True\n"
                                  "except ImportError:\n    HAVE_TRITON = False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setattr(import_hooks, "TRITON_ONLY_MODULES", ("fake_mcore.kernels",))
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if not isinstance(f, import_hooks._TritonStubFinder)])
    try:
        assert import_hooks.install_import_hooks() is True
        kernels = importlib.import_module("fake_mcore.kernels")
        assert importlib.import_module("fake_mcore.other").HAVE_TRITON is False
    finally:
        for name in [n for n in sys.modules if n.startswith("fake_mcore")]:
            del sys.modules[name]
    with pytest.raises(RuntimeError, match="copy_kernel: this megatron-core kernel needs triton"):
        kernels.copy_kernel[(1,)]


def test_triton_available_sees_an_importable_triton(tmp_path, monkeypatch):
    """An importable `triton` package counts as available (the hook then stays out); a blocked
    import does not."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    assert import_hooks.triton_available() is True
    monkeypatch.setitem(sys.modules, "triton", None)
    assert import_hooks.triton_available() is False


def test_triton_stub_has_no_dunder_attributes():
    """A stub is not a wrapper, a context manager or a pickle hook: tools that probe module
    globals (`inspect.unwrap`, `hasattr(x, "__enter__")`) see a plain object."""
    stub = import_hooks._NeedsTriton("triton")
    assert inspect.unwrap(stub) is stub
    assert not hasattr(stub, "__enter__")
    with pytest.raises(ModuleNotFoundError):  # only `triton` and `triton.*` are stubbed
        import_hooks._triton_stub_import(__import__)("triton_not_a_module")
