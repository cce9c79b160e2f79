"""Compatibility with the supported megatron-core releases (0.16.1 to 0.19.x) on CPU and GPU.

This module and `moe.platform.import_hooks` are the one place that adapts to megatron-core versions and
to CUDA's absence; nothing else in the project patches megatron or checks its version. Two kinds
of patch:

- `moe.platform.import_hooks.install_import_hooks()` (run by `moe/__init__.py`, so before anything imports
  megatron): lets `import megatron.core` succeed without triton (megatron-core 0.18+).
- `apply_cpu_patches()` (run before building a model / parallel state) and
  `apply_cpu_training_patches()` (optimizer, recompute, checkpoint writing): patch megatron for
  CPU execution; no-ops on a GPU machine.

Each patch is idempotent and carries a comment naming the megatron version that needs it and why.
Differences that need no patch (checked on 0.19.2): `RouterReplay` only gained members;
`get_gpt_layer_{local,with_transformer_engine}_spec` became wrappers with the same parameters;
`StaticInferenceContext` is still in `megatron.core.inference.contexts`; the router's top-k is
unsorted under no_grad (`sorted=torch.is_grad_enabled()`), which is fine because the project treats
top-k rows as sets (`moe.routing.stats`) and replays ids through megatron's gather.
tests/moe/platform/test_compat.py has one test per patch.

This module imports megatron at its top, so `moe/__init__.py` does not import it: the import hook
must be in place first, and `import moe` alone (e.g. for `moe.model.presets`) stays torch-free.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler, optimizer
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer import torch_norm
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe import token_dispatcher as td

_APPLIED = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------
# CPU execution (all versions unless a comment names one)


class _HostStream:
    """`torch.cuda.current_stream()` on CPU: one in-order host stream, nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def apply_cpu_patches() -> bool:
    """Patch megatron-core for CPU execution. Returns True when patches were applied."""
    global _APPLIED
    if cuda_available():
        return False
    if _APPLIED:
        return True
    # 1. megatron allocates buffers with `device=torch.cuda.current_device()` (router buffers,
    #    DDP grad buffers, RoPE frequencies, ...). Without CUDA that call raises; "cpu" is a valid
    #    `device=` argument everywhere it is used.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

    # 2. moe_utils imports TransformerEngine's `general_gemm` for the fp32 router GEMM when TE is
    #    importable; on CPU TE is never usable, and `None` selects megatron's torch fallback.
    moe_utils.te_general_gemm = None

    # 3. The alltoall dispatcher creates a class-level `torch.cuda.Stream()` and moves split sizes
    #    to the host on it with event synchronisation. On CPU there are no streams: the split
    #    tensors already live on the host, so converting them to numpy is the whole job.
    td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()  # non-None: skip Stream()
    td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize

    # 4. Sequence parallel marks norm weights with `sequence_parallel=True` and megatron's
    #    local-spec RMSNorm path asserts TE/Apex fused norms for that; the torch norm computes the
    #    same thing (the grads of SP-marked params are all-reduced by DDP either way).
    _patch_torch_norm_sequence_parallel()

    # 5. `torch.cuda.nvtx` ranges / stream contexts appear on a few hot paths; make them no-ops.
    torch.cuda.nvtx.range_push = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.nvtx.range_pop = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]

    # 6. megatron-core 0.19: `_ParamAndGradBucketGroup.start_grad_sync` always calls
    #    `torch.cuda.current_stream()` to wait for CUDA-graph wgrad events (0.16-0.18 do so only
    #    with several distributed-optimizer instances). On CPU everything runs in order on the host.
    torch.cuda.current_stream = lambda device=None: _HostStream()  # type: ignore[assignment]

    _APPLIED = True
    return True


def _as_numpy(tensor):
    return tensor.numpy() if torch.is_tensor(tensor) else tensor


def _cpu_dtoh_and_synchronize(self, point, tokens_per_expert=None):
    """CPU version of MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize.

    megatron's `maybe_move_tensor_to_cpu(as_numpy=True)` converts only CUDA tensors; the
    all-to-all split sizes must reach `all_to_all_single` as host sequences, not CPU tensors.
    """
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = _as_numpy(self.input_splits)
        self.output_splits = _as_numpy(self.output_splits)
        self.output_splits_tp = _as_numpy(self.output_splits_tp)
    return tokens_per_expert


def _patch_torch_norm_sequence_parallel() -> None:
    """Let megatron's `WrappedTorchNorm` (the local spec's RMSNorm) run under sequence parallel.

    megatron asserts `not config.sequence_parallel` there, although a norm is elementwise over the
    hidden dim and computes the same thing on a sequence shard. What SP does need is that the
    norm weights' partial grads get summed over the TP group; TE's norms mark their weights
    `sequence_parallel=True` so that `finalize_model_grads` does it, and we mark them the same way.
    """
    original_new = torch_norm.WrappedTorchNorm.__new__
    if getattr(original_new, "_megatron_gspo_patched", False):
        return

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        norm = original_new(cls, dataclasses.replace(config, sequence_parallel=False),
                            hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    __new__._megatron_gspo_patched = True
    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)


# ============================================================================ training: optimizer, recompute
# The mixed-precision training patches, kept apart from the model patches above.
# `apply_cpu_training_patches()` (called by `moe.model.optim` and by recompute-enabled models):
#
# megatron-core's optimizer stack (`get_megatron_optimizer`: the FP32 / Float16 / Distributed
# optimizers, the grad scalers and `clip_grads`) is device-agnostic except for two habits:
#   a. it allocates its small state tensors (loss scale, found-inf flag, norm accumulators)
#      with a literal `device='cuda'`;
#   b. it tells fp32 from 16-bit parameters by `param.type()` strings such as
#      'torch.cuda.BFloat16Tensor', which a CPU tensor never matches.
# It fixes both without touching the math: (a) the optimizer modules see a `torch` whose tensor
# factories map device 'cuda' to 'cpu'; (b) the few functions that compare type strings run while
# `Tensor.type()` reports a CPU tensor under its CUDA name.
# Activation recompute (`tensor_parallel.checkpoint`) saves and restores the CUDA RNG state around
# the recomputed forward; without CUDA there is none (c): those two calls become no-ops (the CPU
# generator is still saved and restored by megatron itself).
# dist_checkpointing's torch_dist writer stages tensors to the host with `non_blocking=True` and
# then calls `torch.cuda.synchronize()` (d): on CPU the staging is a no-op and the sync is skipped.

_TRAINING_APPLIED = False
_CUDA_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
               "torch.HalfTensor": "torch.cuda.HalfTensor",
               "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


class _CpuFactoryTorch:
    """`torch` as a megatron optimizer module sees it on CPU: factories ignore device='cuda'."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "empty_like")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in self._FACTORIES:
            return attr

        def factory(*args, device=None, **kwargs):
            if device is not None and str(device).startswith("cuda"):
                device = "cpu"
            return attr(*args, device=device, **kwargs)
        return factory


_ORIGINAL_TENSOR_TYPE = torch.Tensor.type  # before any patch


def _cuda_named_type(self, *args, **kwargs):
    name = _ORIGINAL_TENSOR_TYPE(self, *args, **kwargs)
    return _CUDA_NAMES.get(name, name) if not args and not kwargs else name


@contextlib.contextmanager
def cuda_type_names():
    """Within: `tensor.type()` names CPU float tensors as their CUDA types."""
    previous = torch.Tensor.type
    torch.Tensor.type = _cuda_named_type  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = previous  # type: ignore[method-assign]


def _with_cuda_type_names(fn):
    if getattr(fn, "_megatron_gspo_patched", False):
        return fn

    def wrapped(*args, **kwargs):
        with cuda_type_names():
            return fn(*args, **kwargs)
    wrapped._megatron_gspo_patched = True
    return wrapped


def _scaler_load_state_dict(self, state_dict):
    """DynamicGradScaler.load_state_dict without `.cuda()` (megatron moves 'scale' to CUDA)."""
    self._scale = state_dict["scale"].to(self._scale.device)
    self._growth_tracker = state_dict["growth_tracker"]
    self._hysteresis_tracker = state_dict["hysteresis_tracker"]


def _local_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron.core.utils.local_multi_tensor_l2_norm (the torch stand-in for the fused l2-norm
    kernel): the same norm, on the tensors' device (megatron's goes through one host sync per
    tensor), from one `_foreach_norm` summed in float64 as the float64 reference of
    `tests/moe/grads.py` does. On CPU it stays float64, so fp32 CPU runs keep their
    pre-megatron-optimizer numbers (megatron's fallback sums in fp32: ~1e-7 relative apart);
    on CUDA it is float32, as megatron's (and the fused kernels') is, since megatron all-reduces
    it with the float32 zeros a rank without grads keeps (mixed dtypes fail the collective)."""
    device = "cuda" if cuda_available() else "cpu"
    tensors = [tensor.detach() for tl in tensor_lists for tensor in tl]
    if not tensors:
        norm = torch.zeros(1, dtype=torch.float64, device=device)
    else:
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
        norm = torch.stack(norms).pow(2).sum().sqrt().reshape(1)
    return (norm.float() if norm.is_cuda else norm), None


def _local_scale(chunk_size, noop_flag, tensor_lists, scale):
    """megatron.core.utils.local_multi_tensor_scale (`dst.copy_(src * scale)` per tensor: the
    clip's scaling and, at scale 1, the Float16 optimizer's master-to-model copy) as
    `_foreach` ops, a few launches instead of two per tensor; the same values."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not dst:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_optimizer_kernels() -> bool:
    """Where megatron-core falls back to its per-tensor torch loops for the multi-tensor kernels
    (neither TransformerEngine nor Apex installed: every CPU, and the GPU machine this project
    measures on), use `_local_l2_norm` and `_local_scale` instead: per step that is thousands
    of small launches fewer at 128 experts a layer (experiments/gpu's profile). Idempotent;
    False where megatron has fused kernels."""
    if clip_grads.l2_norm_impl.__module__ not in ("megatron.core.utils", __name__):
        return False
    clip_grads.l2_norm_impl = _local_l2_norm
    clip_grads.multi_tensor_scale_impl = _local_scale
    if optimizer.multi_tensor_scale_impl.__module__ == "megatron.core.utils":
        optimizer.multi_tensor_scale_impl = _local_scale
    return True


def apply_cpu_training_patches() -> bool:
    """Let megatron-core's optimizers and activation recompute run on CPU. No-op with CUDA;
    idempotent."""
    global _TRAINING_APPLIED
    if cuda_available():
        return False
    apply_cpu_patches()
    if _TRAINING_APPLIED:
        return True
    shim = _CpuFactoryTorch()
    for module in (optimizer, clip_grads, grad_scaler, distrib_optimizer):  # (a)
        module.torch = shim
    # (b) type-string checks: 16-bit params get fp32 main copies; clipping asserts fp32 grads.
    fp16 = optimizer.Float16OptimizerWithFloat16Params
    fp16.__init__ = _with_cuda_type_names(fp16.__init__)
    dist_opt = distrib_optimizer.DistributedOptimizer
    dist_opt.__init__ = _with_cuda_type_names(dist_opt.__init__)
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer.clip_grad_by_total_norm_fp32 = clip
    grad_scaler.DynamicGradScaler.load_state_dict = _scaler_load_state_dict
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: None  # (c)
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    stage = FileSystemWriterAsync.preload_tensors  # (d)
    FileSystemWriterAsync.preload_tensors = staticmethod(
        lambda write_buckets, non_blocking=True: stage(write_buckets, non_blocking=False))
    _TRAINING_APPLIED = True
    return True
