"""moe.platform.compat: one test per version / CPU patch, each able to fail without its patch.

Patches that only matter on a newer megatron-core have two tests: one that the patched path works
(runs on every version) and one that the unpatched path fails, which skips with the reason on
versions that do not need the patch. `make test` (megatron-core 0.16.1) runs the first kind;
`make test-latest` (the newest release) runs both.
"""

import math
import subprocess
import sys
import textwrap
import types
from importlib.metadata import version

import numpy as np
import pytest
import torch

import moe.model.gpt
from moe.platform import compat

MCORE_VERSION = version("megatron-core")
MCORE = tuple(int(x) for x in MCORE_VERSION.split(".")[:2])
REPO = __file__.rsplit("/tests/", 1)[0]
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches are off with CUDA")


def _run(code: str, prelude: str = "") -> subprocess.CompletedProcess:
    """Run `prelude + code` in a fresh interpreter (patches are process-wide and one-way)."""
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


# --------------------------------------------------------- grad sync without CUDA (0.19+)
def _check_grad_sync() -> float:
    """One backward and megatron's grad reduction (finalize_model_grads -> DDP finish / start
    _grad_sync) on a 1-process tiny policy; returns the grad norm. Needs `init_parallel`."""
    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.model.settings import ParallelLayout
    from tests.moe.grads import reduce_grads

    preset = get_preset("tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, optim=None)
    gen = torch.Generator().manual_seed(0)
    tokens_BT = torch.randint(0, preset.vocab_size, (2, 8), generator=gen)
    policy.zero_grad()
    policy.token_logprobs(tokens_BT, torch.ones_like(tokens_BT, dtype=torch.bool)).sum().backward()
    params = [p for p in policy.model.module.parameters() if p.requires_grad]
    before = [p.main_grad.clone() for p in params]
    norm = reduce_grads(policy)
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
        from moe.platform.parallel import init_parallel
        init_parallel(tp=1, ep=1, seed=0)  # applies moe.platform.compat's CPU patches
        torch.cuda.current_stream = original_current_stream  # undo patch 6 only
        from tests.moe.platform.test_compat import _check_grad_sync
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
    monkeypatch.setattr(moe.model.gpt, "cuda_available", lambda: True)
    monkeypatch.setattr(moe.model.gpt, "_transformer_engine_error",
                        lambda: "ModuleNotFoundError: No module named 'transformer_engine'")
    monkeypatch.setattr(moe.model.gpt, "_LOCAL_SPEC_NOTICE_SHOWN", False)
    moe.model.gpt._notice_local_spec_on_gpu()
    moe.model.gpt._notice_local_spec_on_gpu()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert "No module named 'transformer_engine'" in lines[0] and "local" in lines[0]


def test_no_local_spec_notice_on_cpu(monkeypatch, capsys):
    monkeypatch.setattr(moe.model.gpt, "cuda_available", lambda: False)
    monkeypatch.setattr(moe.model.gpt, "_LOCAL_SPEC_NOTICE_SHOWN", False)
    moe.model.gpt._notice_local_spec_on_gpu()
    assert capsys.readouterr().err == ""


def test_cpu_l2_norm_is_the_float64_norm_of_all_tensors():
    """`_local_l2_norm` (megatron's grad-norm kernel on CPU): the float64 norm of every tensor
    of every list (fp32 sums would be ~1e-7 off), a 1-element tensor; 0 for no tensors."""
    from moe.platform.compat import _local_l2_norm

    g = torch.Generator().manual_seed(0)
    lists = [[torch.randn(300, 7, generator=g) * 1e-3, torch.randn(5, generator=g)],
             [torch.randn(64, 64, generator=g) * 10]]
    want = math.sqrt(sum(float((t.double() ** 2).sum()) for tl in lists for t in tl))
    got, _ = _local_l2_norm(2048, None, lists, False)
    assert got.shape == (1,) and got.dtype == torch.float64
    assert math.isclose(float(got), want, rel_tol=1e-14)
    assert float(_local_l2_norm(2048, None, [[]], False)[0]) == 0.0


@pytest.mark.parametrize("case", ["in_place", "copy_to_bf16", "scaled_copy"])
def test_foreach_scale_equals_megatrons_per_tensor_loop(case):
    """`_local_scale` (the clip's scaling; at scale 1 the Float16 optimizer's master-to-model
    copy) gives megatron's `local_multi_tensor_scale` values bit for bit."""
    from megatron.core.utils import local_multi_tensor_scale

    from moe.platform.compat import _local_scale

    g = torch.Generator().manual_seed(0)
    src = [torch.randn(300, 7, generator=g), torch.randn(5, generator=g) * 1e-30]
    scale = {"in_place": 0.37, "copy_to_bf16": 1.0, "scaled_copy": 0.37}[case]
    dtype = torch.bfloat16 if case == "copy_to_bf16" else torch.float32
    outs = []
    for fn in (local_multi_tensor_scale, _local_scale):
        s = [t.clone() for t in src]
        d = s if case == "in_place" else [torch.zeros(t.shape, dtype=dtype) for t in s]
        fn(2048, None, [s, d], scale)
        outs.append(d)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(*outs))


def test_megatrons_per_tensor_optimizer_loops_become_foreach_ops():
    """Without TransformerEngine / Apex kernels the clip's norm and scaling and the Float16
    optimizer's copies use the `_foreach` versions, on CPU and on CUDA alike."""
    from megatron.core.optimizer import clip_grads, optimizer

    from moe.platform.compat import _local_l2_norm, _local_scale, use_foreach_optimizer_kernels

    assert use_foreach_optimizer_kernels() and use_foreach_optimizer_kernels()  # idempotent
    assert clip_grads.l2_norm_impl is _local_l2_norm
    assert clip_grads.multi_tensor_scale_impl is optimizer.multi_tensor_scale_impl is _local_scale


# ------------------------------------------------- all-to-all split sizes on the host
def test_alltoall_split_sizes_become_numpy_at_the_dtoh_point_only():
    """On CPU the dispatcher's split sizes become host (numpy) sequences at its dtoh point, not
    before; with drop_and_pad (no splits) nothing is touched."""
    dispatcher = types.SimpleNamespace(drop_and_pad=False, cuda_dtoh_point="before_ep_alltoall",
                                       input_splits=torch.tensor([1, 2]),
                                       output_splits=torch.tensor([3, 0]), output_splits_tp=None)
    tokens_per_expert = torch.tensor([4])
    out = compat._cpu_dtoh_and_synchronize(dispatcher, "before_permutation_1", tokens_per_expert)
    assert out is tokens_per_expert and torch.is_tensor(dispatcher.input_splits)
    compat._cpu_dtoh_and_synchronize(dispatcher, "before_ep_alltoall")
    assert isinstance(dispatcher.input_splits, np.ndarray)
    assert isinstance(dispatcher.output_splits, np.ndarray)
    assert dispatcher.input_splits.tolist() == [1, 2]
    assert dispatcher.output_splits.tolist() == [3, 0]
    assert dispatcher.output_splits_tp is None
    padded = types.SimpleNamespace(drop_and_pad=True, cuda_dtoh_point="before_ep_alltoall",
                                   input_splits=torch.tensor([1]), output_splits=None,
                                   output_splits_tp=None)
    compat._cpu_dtoh_and_synchronize(padded, "before_ep_alltoall")
    assert torch.is_tensor(padded.input_splits)


@needs_cpu
def test_alltoall_dispatcher_uses_the_host_dtoh(single_process):
    from megatron.core.transformer.moe import token_dispatcher as td

    dispatcher = td.MoEAlltoAllTokenDispatcher
    assert dispatcher._maybe_dtoh_and_synchronize is compat._cpu_dtoh_and_synchronize


# --------------------------------------------------- torch norm under sequence parallel
@needs_cpu
def test_torch_norm_under_sequence_parallel_marks_its_weights(single_process):
    """The local spec's torch RMSNorm builds under sequence parallel (megatron asserts it away)
    and marks its weights `sequence_parallel` so their grads get summed over TP; without SP it
    is megatron's plain norm."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    kwargs = dict(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                  tensor_model_parallel_size=2)
    sp = WrappedTorchNorm(TransformerConfig(sequence_parallel=True, **kwargs), 8, eps=1e-6)
    plain = WrappedTorchNorm(TransformerConfig(**kwargs), 8, eps=1e-6)
    assert isinstance(sp, torch.nn.RMSNorm) and sp.eps == 1e-6
    assert [getattr(p, "sequence_parallel", False) for p in sp.parameters()] == [True]
    assert [getattr(p, "sequence_parallel", False) for p in plain.parameters()] == [False]
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sp(x), plain(x))


# ------------------------------------------------------ optimizer stack on CPU (training patches)
def test_optimizer_modules_see_factories_that_map_cuda_to_cpu():
    """`device='cuda'` / `'cuda:0'` become CPU tensors; other devices and other attributes of
    torch pass through unchanged."""
    shim = compat._CpuFactoryTorch()
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        assert shim.zeros(2, device=device).device.type == "cpu"
        assert shim.tensor([1.0], dtype=torch.float64, device=device).dtype == torch.float64
    assert shim.full((2,), 3.0, device="meta").device.type == "meta"
    assert shim.float32 is torch.float32 and shim.cat is torch.cat


def test_cuda_type_names_only_within_the_context():
    """Inside, CPU float tensors report their CUDA type names (megatron's 16-bit / fp32 checks);
    afterwards, and for `type(dtype)` casts, torch's own behaviour."""
    bf16, x = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    with compat.cuda_type_names():
        assert (bf16.type(), x.type()) == ("torch.cuda.BFloat16Tensor", "torch.cuda.FloatTensor")
        assert torch.zeros(1, dtype=torch.int64).type() == "torch.LongTensor"
        assert x.type(torch.float64).dtype == torch.float64
    assert (bf16.type(), x.type()) == ("torch.BFloat16Tensor", "torch.FloatTensor")


@needs_cpu
def test_grad_scaler_state_round_trip_on_cpu():
    """fp16 loss scaling resumes where it was: scale, growth and hysteresis trackers."""
    compat.apply_cpu_training_patches()
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    def make():
        return DynamicGradScaler(initial_scale=2.0 ** 10, min_scale=1.0, growth_factor=2.0,
                                 backoff_factor=0.5, growth_interval=4, hysteresis=2)

    saved, loaded = make(), make()
    for found_inf in (True, False, False, False):
        saved.update(found_inf)
    loaded.load_state_dict(saved.state_dict())
    state = {k: float(v) for k, v in saved.state_dict().items()}
    assert {k: float(v) for k, v in loaded.state_dict().items()} == state
    assert state == {"scale": 2.0 ** 10, "growth_tracker": 3, "hysteresis_tracker": 1}
    assert loaded.scale.device.type == "cpu"
    for found_inf in (False, True, True):  # grows at the 4th clean step, then backs off
        saved.update(found_inf)
        loaded.update(found_inf)
        assert float(loaded.scale) == float(saved.scale)
    assert float(saved.scale) == 2.0 ** 10
