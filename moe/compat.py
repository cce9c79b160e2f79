"""CPU compatibility for megatron-core 0.16.1: the few patches it needs to run without CUDA.

Every patch is applied only when CUDA is absent (`apply_cpu_patches()` is a no-op on a GPU
machine), is idempotent, and carries a comment saying why megatron needs it. Nothing else in
the project patches megatron; `moe.model` calls `apply_cpu_patches()` before building a model.
"""

from __future__ import annotations

import contextlib

import torch

_APPLIED = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


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
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None

    # 3. The alltoall dispatcher creates a class-level `torch.cuda.Stream()` and moves split sizes
    #    to the host on it with event synchronisation. On CPU there are no streams: the split
    #    tensors already live on the host, so converting them to numpy is the whole job.
    from megatron.core.transformer.moe import token_dispatcher as td

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
    import dataclasses

    from megatron.core.transformer import torch_norm

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
