"""moe.compat: one test per version / CPU patch, each able to fail without its patch.

Patches that only matter on a newer megatron-core have two tests: one that the patched path works
(runs on every version) and one that the unpatched path fails, which skips with the reason on
versions that do not need the patch. `make test` (megatron-core 0.16.1) runs the first kind;
`make test-latest` (the newest release) runs both.
"""

import math
import subprocess
import sys
import textwrap
from importlib.metadata import version

import pytest
import torch

import moe.model
from moe import compat

MCORE_VERSION = version("megatron-core")
MCORE = tuple(int(x) for x in MCORE_VERSION.split(".")[:2])
REPO = __file__.rsplit("/tests/", 1)[0]
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches are off with CUDA")


def _run(code: str, prelude: str = "") -> subprocess.CompletedProcess:
    """Run `prelude + code` in a fresh interpreter (patches are process-wide and one-way)."""
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------- import without triton (0.18+)
_BLOCK_TRITON = "import sys; sys.modules['triton'] = None  # import triton -> ImportError\n"


def test_megatron_imports_without_triton_through_moe():
    """With the hook (`import moe` first), megatron imports with triton absent; no megatron module
    believes triton is present, and a stubbed kernel refuses to launch."""
    result = _run("""
        import moe, megatron.core
        from moe import compat
        from megatron.core.transformer.moe import moe_layer
        from megatron.core.models.gpt import gpt_layer_specs
        believers = sorted(n for n, m in list(sys.modules.items())
                           if n.startswith("megatron") and getattr(m, "HAVE_TRITON", False))
        assert not believers, believers
        stubs = [sys.modules[n] for n in compat.TRITON_ONLY_MODULES if n in sys.modules]
        kernels = {id(v): v for m in stubs for v in vars(m).values()  # 0.19: 2 modules hold them
                   if isinstance(v, compat._NeedsTriton) and not v._name.startswith("triton")}
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
    monkeypatch.setattr(compat, "triton_available", lambda: True)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if not isinstance(f, compat._TritonStubFinder)])
    assert compat.install_import_hooks() is False
    assert not any(isinstance(f, compat._TritonStubFinder) for f in sys.meta_path)


def test_triton_stub_import_hands_out_stubs_for_triton_only():
    imp = compat._triton_stub_import(__import__)
    assert isinstance(imp("triton"), compat._NeedsTriton)
    assert imp("triton.language", fromlist=("constexpr",))._name == "triton.language"
    assert imp("math") is __import__("math")
    kernel = imp("triton").jit(test_triton_stub_import_hands_out_stubs_for_triton_only)
    with pytest.raises(RuntimeError, match="test_triton_stub_import_hands_out_stubs_for_triton"):
        kernel[(4,)]


# --------------------------------------------------------- grad sync without CUDA (0.19+)
def _check_grad_sync() -> float:
    """One backward and megatron's grad reduction (finalize_model_grads -> DDP finish / start
    _grad_sync) on a 1-process tiny policy; returns the grad norm. Needs `init_parallel`."""
    from moe.model import ParallelLayout
    from moe.policy import MoEPolicy
    from moe.presets import get_preset

    preset = get_preset("tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, optim=None)
    gen = torch.Generator().manual_seed(0)
    tokens_BT = torch.randint(0, preset.vocab_size, (2, 8), generator=gen)
    policy.zero_grad()
    policy.token_logprobs(tokens_BT, torch.ones_like(tokens_BT, dtype=torch.bool)).sum().backward()
    params = [p for p in policy.model.module.parameters() if p.requires_grad]
    before = [p.main_grad.clone() for p in params]
    norm = policy.reduce_grads()
    # one process: the reduction leaves every grad as backward made it
    assert all(torch.equal(b, p.main_grad) for b, p in zip(before, params))
    assert norm == pytest.approx(math.sqrt(sum(float(b.double().square().sum()) for b in before)),
                                 rel=1e-6)
    return norm


@needs_cpu
def test_grad_sync_runs_without_cuda(single_process):
    assert _check_grad_sync() > 0


@needs_cpu
@pytest.mark.skipif(MCORE < (0, 19), reason=f"megatron-core {MCORE_VERSION}: start_grad_sync "
                    f"calls torch.cuda.current_stream() only from 0.19")
def test_grad_sync_without_the_patch_needs_cuda():
    result = _run("""
        import torch
        original_current_stream = torch.cuda.current_stream
        from moe.parallel import init_parallel
        init_parallel(tp=1, ep=1, seed=0)  # applies moe.compat's CPU patches
        torch.cuda.current_stream = original_current_stream  # undo patch 6 only
        from tests.moe.test_compat import _check_grad_sync
        _check_grad_sync()
    """)
    assert result.returncode != 0
    assert "current_stream" in result.stderr, result.stderr[-3000:]


@needs_cpu
def test_host_stream_stands_in_for_current_stream(single_process):
    stream = torch.cuda.current_stream()
    assert isinstance(stream, compat._HostStream)
    stream.wait_event(None), stream.wait_stream(stream), stream.synchronize()


# ------------------------------------------------------- local spec on CUDA without TE
def test_local_spec_notice_once_per_process(monkeypatch, capsys):
    monkeypatch.setattr(moe.model, "cuda_available", lambda: True)
    monkeypatch.setattr(moe.model, "_transformer_engine_error",
                        lambda: "ModuleNotFoundError: No module named 'transformer_engine'")
    monkeypatch.setattr(moe.model, "_LOCAL_SPEC_NOTICE_SHOWN", False)
    moe.model._notice_local_spec_on_gpu()
    moe.model._notice_local_spec_on_gpu()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert "No module named 'transformer_engine'" in lines[0] and "local" in lines[0]


def test_no_local_spec_notice_on_cpu(monkeypatch, capsys):
    monkeypatch.setattr(moe.model, "cuda_available", lambda: False)
    monkeypatch.setattr(moe.model, "_LOCAL_SPEC_NOTICE_SHOWN", False)
    moe.model._notice_local_spec_on_gpu()
    assert capsys.readouterr().err == ""


def test_cpu_l2_norm_is_the_float64_norm_of_all_tensors():
    """`_local_l2_norm` (megatron's grad-norm kernel on CPU): the float64 norm of every tensor
    of every list (fp32 sums would be ~1e-7 off), a 1-element tensor; 0 for no tensors."""
    from moe.compat import _local_l2_norm

    g = torch.Generator().manual_seed(0)
    lists = [[torch.randn(300, 7, generator=g) * 1e-3, torch.randn(5, generator=g)],
             [torch.randn(64, 64, generator=g) * 10]]
    want = math.sqrt(sum(float((t.double() ** 2).sum()) for tl in lists for t in tl))
    got, _ = _local_l2_norm(2048, None, lists, False)
    assert got.shape == (1,) and got.dtype == torch.float64
    assert math.isclose(float(got), want, rel_tol=1e-14)
    assert float(_local_l2_norm(2048, None, [[]], False)[0]) == 0.0
