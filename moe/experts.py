"""Experts of a MoE layer as two grouped GEMMs: megatron's `SequentialMLP`, batched.

Shape legend: N tokens routed to this rank's experts (sorted by expert, as the token dispatcher
hands them over), H hidden, F expert FFN width, E local experts.

megatron-core's local layer spec runs the experts as `SequentialMLP`: a Python loop that calls
each expert's `MLP` (two megatron linears, the gated activation, the prob scaling) on its slice
of tokens, so a layer costs ~8 module calls per expert whatever the token count. Its grouped
alternatives need TransformerEngine (`TEGroupedMLP`) or the `grouped_gemm` package
(`GroupedMLP`, with a different parameter layout). `GroupedSequentialMLP` keeps `SequentialMLP`'s
modules and parameters (`local_experts.{i}.linear_fc{1,2}.weight`: checkpoints, HF import /
export, sharding and the distributed optimizer see no change) and replaces only its forward by
torch's `_grouped_mm` over the stacked expert weights: fc1 of all experts in one call, the gated
activation and the prob scaling once over all N tokens, fc2 in one call. The per-expert
arithmetic is the same (tests/moe/test_experts.py: equal to `SequentialMLP` to fp32 rounding,
forward and grads, also under EP=2). Training forwards go through `GroupedLinear`, which stacks
the weights for the GEMM and again in its backward rather than keeping the stacked copy alive
in between; it hands each expert weight its own grad (megatron DDP's grad hooks run as usual)
or, under DDP without overlapped reduction (`grads_into_main_grad`), adds the grads into the
weights' `main_grad` itself with no per-weight hook; no-grad forwards stack once per forward
(once per rollout in the sampler, `moe.decode`, where the weights cannot change).

Falls back to `SequentialMLP.forward` where the batched path does not apply: a device and dtype
where the installed torch's `_grouped_mm` does not run (`grouped_mm_runs` probes it once: CUDA's
kernel wants bf16 on sm90+ in torch 2.8-2.11), biases, fp8/fp4, probs applied on the input,
expert tensor parallelism, row strides that `_grouped_mm` rejects (not a multiple of 16 bytes).
With TransformerEngine installed the layer spec is TE's and this class is not used.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's `_grouped_mm` runs forward and backward on this device type and dtype,
    with the weight layout `stacked_weights` gives: one tiny probe call (on the current device
    of that type), cached per process. Out-of-memory and CUDA errors propagate uncached."""
    if not hasattr(torch, "_grouped_mm") or (device_type == "cuda"
                                             and not torch.cuda.is_available()):
        return False
    try:  # the first caller is usually the sampler, under inference mode: probe with grad
        with torch.inference_mode(False), torch.enable_grad():
            return _probe_grouped_mm(device_type, dtype)
    except torch.OutOfMemoryError:  # not an answer about kernels: not cached
        raise
    except (RuntimeError, NotImplementedError) as e:  # no kernel for this device, dtype or arch
        message = str(e)
        if "CUDA error" in message and "no kernel image" not in message:
            raise  # a broken CUDA context, not a missing kernel
        return False


def _probe_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    x = torch.ones(16, 16, dtype=dtype, device=device_type, requires_grad=True)
    w = torch.ones(2, 16, 16, dtype=dtype, device=device_type, requires_grad=True)
    offs = torch.tensor([8, 16], dtype=torch.int32, device=device_type)
    out = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    out.backward(torch.ones_like(out))  # a dense grad (`GroupedLinear.backward`)
    return True


class GroupedSequentialMLP(SequentialMLP):
    """`SequentialMLP` with a grouped-GEMM forward (same parameters, same math).

    `grads_into_main_grad` (set by `moe.policy.MoEPolicy.build` under megatron DDP without
    overlapped grad reduction): the training backward adds the expert weight grads into their
    `main_grad` buffers itself, in one multi-tensor add, where DDP's per-parameter hook would
    (one autograd accumulation node and one Python hook per expert weight: 128 of
    qwen3-moe-tiny's 159 parameters). Same sums; the weights are then not autograd inputs of
    the layer (`.grad` never set, no hooks), so `torch.autograd.grad` on them needs it False."""

    grads_into_main_grad: bool = False

    def _grouped_ok(self, hidden_NH: torch.Tensor) -> bool:
        cfg = self.config
        fc1 = self.local_experts[0].linear_fc1.weight
        align = 16 // hidden_NH.element_size()
        return (self.num_local_experts > 1 and not cfg.add_bias_linear
                and not (cfg.fp8 or cfg.fp4) and not cfg.moe_apply_probs_on_input
                and self.tp_group.size() == 1 and hidden_NH.dim() == 2
                and hidden_NH.dtype == fc1.dtype
                and all(d % align == 0 for d in (*fc1.shape, hidden_NH.shape[1]))
                and grouped_mm_runs(hidden_NH.device.type, hidden_NH.dtype))

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(fc1 [E, H, F'], fc2 [E, F, H]): the expert weights stacked for `_grouped_mm` (a
        copy; under autograd the stack's backward hands each expert its grad)."""
        experts = self.local_experts
        return (torch.stack([e.linear_fc1.weight for e in experts]).transpose(1, 2),
                torch.stack([e.linear_fc2.weight for e in experts]).transpose(1, 2))

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor,
                stacked: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`stacked`: `stacked_weights()` taken earlier at the same weights (the sampler stacks
        once per rollout, `moe.decode`); None stacks them now."""
        x_NH = permuted_local_hidden_states
        if not self._grouped_ok(x_NH):
            return super().forward(permuted_local_hidden_states, tokens_per_expert,
                                   permuted_probs)
        offs_E = torch.as_tensor(tokens_per_expert).to(x_NH.device, torch.int64).cumsum(0)
        offs_E = offs_E.to(torch.int32)
        if stacked is None and torch.is_grad_enabled():  # training: no stacked copy saved
            fc1 = [e.linear_fc1.weight for e in self.local_experts]
            fc2 = [e.linear_fc2.weight for e in self.local_experts]
            if self.grads_into_main_grad and x_NH.requires_grad and all(
                    w.requires_grad and hasattr(w, "main_grad")
                    for w in fc1 + fc2):  # no autograd node per weight
                h_NF = GroupedLinear.apply(x_NH.contiguous(), offs_E, tuple(fc1))
                h_NF = self._activation(h_NF, permuted_probs)
                return GroupedLinear.apply(h_NF, offs_E, tuple(fc2)), None
            h_NF = GroupedLinear.apply(x_NH.contiguous(), offs_E, None, *fc1)
            h_NF = self._activation(h_NF, permuted_probs)
            return GroupedLinear.apply(h_NF, offs_E, None, *fc2), None
        w1_EHF, w2_EFH = stacked if stacked is not None else self.stacked_weights()
        h_NF = torch._grouped_mm(x_NH.contiguous(), w1_EHF, offs=offs_E)
        h_NF = self._activation(h_NF, permuted_probs)
        return torch._grouped_mm(h_NF, w2_EFH, offs=offs_E), None

    def _activation(self, h_NF: torch.Tensor, probs_N: torch.Tensor) -> torch.Tensor:
        """megatron `MLP.forward`'s unfused activation: (gated) activation, then the per-token
        prob scale computed in the probs' dtype and cast back."""
        cfg = self.config
        if cfg.gated_linear_unit:
            glu_NF, linear_NF = torch.chunk(h_NF, 2, dim=-1)
            if (val := cfg.activation_func_clamp_value) is not None:
                glu_NF = glu_NF.clamp(min=None, max=val)
                linear_NF = linear_NF.clamp(min=-val, max=val)
            if cfg.glu_linear_offset:  # megatron adds it unconditionally: a copy for + 0.0
                linear_NF = linear_NF + cfg.glu_linear_offset
            h_NF = cfg.activation_func(glu_NF) * linear_NF
        else:
            h_NF = cfg.activation_func(h_NF)
        dtype = h_NF.dtype
        return (h_NF * probs_N.unsqueeze(-1)).to(dtype).contiguous()


class GroupedLinear(torch.autograd.Function):
    """`_grouped_mm(x, stack(W_e)^T)` over the experts' own weights (megatron's [out, in] each),
    the stack rebuilt in the backward instead of saved: autograd through `torch.stack` would
    keep an E x in x out copy of every layer's expert weights alive until the backward (for
    Qwen3-30B-A3B: all 128 experts' weights again, per layer), on top of the weights
    themselves. Saved here: the input, the group offsets and references to the weights. Same
    arithmetic as autograd's `_grouped_mm` formulas (tests/moe/test_experts.py). Incoming grads
    are made dense first: `_grouped_mm` rejects stride-0 (expanded) ones.

    Call as `apply(x, offs, None, *weights)` (weight grads through autograd) or
    `apply(x, offs, weights)`: the weights (a tuple, untracked by autograd) get their grads
    added into their `main_grad` (megatron DDP's buffers, in their dtype, as DDP's hook adds
    them) and autograd runs no node or hook for them; the output then needs `x` to need grad."""

    @staticmethod
    def forward(ctx, x_NI: torch.Tensor, offs_E: torch.Tensor,
                untracked_OI: tuple | None, *weights_OI: torch.Tensor):
        ctx.untracked = untracked_OI
        if untracked_OI is not None:  # autograd's saved-tensor version check, by hand
            ctx.versions = [w._version for w in untracked_OI]
        ctx.save_for_backward(x_NI, offs_E, *weights_OI)
        weights_OI = untracked_OI or weights_OI
        return torch._grouped_mm(x_NI, torch.stack(weights_OI).transpose(1, 2), offs=offs_E)

    @staticmethod
    def backward(ctx, grad_NO: torch.Tensor):
        x_NI, offs_E, *weights_OI = ctx.saved_tensors
        into_main_grad = ctx.untracked is not None
        if into_main_grad and [w._version for w in ctx.untracked] != ctx.versions:
            raise RuntimeError("GroupedLinear: an expert weight needed for gradient computation "
                               "has been modified by an inplace operation since the forward")
        weights_OI = ctx.untracked or weights_OI
        grad_NO = grad_NO.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad_NO, torch.stack(weights_OI), offs=offs_E)
        grads_w: list = [None] * len(weights_OI)
        if into_main_grad or any(ctx.needs_input_grad[3:]):
            grad_EIO = torch._grouped_mm(x_NI.t(), grad_NO, offs=offs_E)  # x_e^T @ grad_e
            grads_w = list(grad_EIO.transpose(1, 2).unbind(0))
        if into_main_grad:
            main_grads = [w.main_grad for w in weights_OI]
            torch._foreach_add_(main_grads, [g.to(m.dtype) for g, m in zip(grads_w, main_grads)])
            return grad_x, None, None
        return grad_x, None, None, *grads_w
