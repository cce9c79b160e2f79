"""Experts of a MoE layer: one stacked parameter per weight, multiplied by grouped GEMMs.

Shape legend: N tokens routed to this rank's experts (sorted by expert, as the token dispatcher
hands them over), H hidden, F expert FFN width, F' fc1's output width (2F gated, else F),
E local experts, I / O a GEMM's input / output width.

`StackedExperts` holds each MoE layer's expert weights as two parameters, whatever the expert
count: `linear_fc1.weight` [E, F', H] and `linear_fc2.weight` [E, H, F], each expert's slice
laid out as megatron's own linear weight ([out, in]; fc1's rows are [gate; up]), the layout of
torchtitan's grouped-mm experts. torch's `_grouped_mm` reads them in place, forward and
backward (`ExpertMM`): fc1 of all experts in one call, the gated activation and the prob
scaling once over all N tokens, fc2 in one call; the weight grads come out stacked, one [E, O, I]
GEMM per weight, so megatron DDP sees two expert grads per layer (one hook, one add into
`main_grad` each). Nothing is stacked or copied per step. The per-expert arithmetic is megatron
`SequentialMLP`'s (tests/moe/model/test_experts.py: a train step of the model equals one with
megatron's per-expert modules, to fp32 rounding).

Initialisation: each expert's weights are drawn as megatron's CPU initialisation draws a
`SequentialMLP`'s (expert by expert, fc1 then fc2, each its own fp32 master), so a seed gives the
same weights as before. Dist checkpoints: `sharded_state_dict` describes each parameter as
experts [r * E, (r + 1) * E) (r the EP rank) of a global [E_global, ...] tensor under the key
megatron's `SequentialMLP` used (`decoder.layers.mlp.experts.experts.linear_fc1.weight`, global
shape [layers, E_global, F', H]): checkpoints reshard across EP and read the same either side
of the layout change (docs/checkpoints.md).

Under autocast both GEMM operands run in autocast's dtype, as megatron's linears do. Where
`_grouped_mm` does not run (`grouped_mm_runs` probes it once per device type and dtype: CUDA's
kernel wants bf16 on sm90+ in torch 2.8-2.11) or rejects the row strides (not a multiple of 16
bytes), or the input is not a 2-D tensor in the weights' dtype, `ExpertMM` loops over the
experts on the same stacked parameters (one `mm` per expert into slices of one output / one
stacked grad). Not supported (refused at construction): biases, fp8 / fp4, expert tensor
parallelism.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's `_grouped_mm` runs forward and backward on this device type and dtype,
    with the weight layout `StackedExperts` uses: one tiny probe call (on the current device
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
    out = ExpertMM.apply(x, w, offs, None)
    out.backward(torch.ones_like(out))  # both GEMMs of `ExpertMM.backward`
    return True


class StackedWeight(torch.nn.Module):
    """One stacked expert weight [E, O, I] (a module so that its name reads
    `experts.linear_fcX.weight`, as megatron's per-expert modules' did)."""

    def __init__(self, weight: torch.nn.Parameter):
        super().__init__()
        self.weight = weight


class StackedExperts(MegatronModule):
    """A MoE layer's experts as two stacked weights (see the module docstring). Built by
    megatron's `MoELayer` in `SequentialMLP`'s place: same constructor and forward signature."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None):
        super().__init__(config=config)
        problems = [k for k in ("add_bias_linear", "fp8", "fp4") if getattr(config, k, None)]
        if pg_collection.expt_tp.size() != 1:
            problems.append("expert tensor parallelism")
        if problems:
            raise ValueError(f"StackedExperts does not support {', '.join(problems)}")
        self.num_local_experts = E = num_local_experts
        self.ep_group, self.tp_group = pg_collection.ep, pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        F, H = config.moe_ffn_hidden_size, config.hidden_size
        F1 = 2 * F if config.gated_linear_unit else F
        w1_EFH, w2_EHF = _init_weights(config, E, F1, H, F)
        self.linear_fc1, self.linear_fc2 = StackedWeight(w1_EFH), StackedWeight(w2_EHF)
        # megatron's attributes of the per-expert linears: a column- and a row-parallel weight
        # (each rank counts its expert grads in the grad norm), their dims shifted by the E axis
        set_tensor_model_parallel_attributes(w1_EFH, True, 1, 1)
        set_tensor_model_parallel_attributes(w2_EHF, True, 2, 1)
        for w in (w1_EFH, w2_EHF):
            w.allreduce = not (config.expert_model_parallel_size > 1)

    def _grouped_ok(self, hidden_NH: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
        """Whether `_grouped_mm` computes this input with the weights in `dtype` (default:
        theirs); else `ExpertMM` loops over the experts."""
        w1 = self.linear_fc1.weight
        align = 16 // hidden_NH.element_size()
        return (hidden_NH.dim() == 2 and hidden_NH.dtype == (dtype or w1.dtype)
                and all(d % align == 0 for d in (*w1.shape[1:], self.linear_fc2.weight.shape[2],
                                                 hidden_NH.shape[-1]))
                and grouped_mm_runs(hidden_NH.device.type, hidden_NH.dtype))

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        """(output [N, H], None): expert e's MLP on its rows, scaled by the rows' probs."""
        x_NH, probs_N = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # megatron's: scale the input, probs 1
            x_NH = (probs_N.unsqueeze(-1) * x_NH).to(x_NH.dtype)
            probs_N = torch.ones_like(probs_N)
        w1_EFH, w2_EHF = self.linear_fc1.weight, self.linear_fc2.weight
        if torch.is_autocast_enabled(x_NH.device.type):  # as megatron's linears: both operands
            dtype = torch.get_autocast_dtype(x_NH.device.type)  # in autocast's dtype
            x_NH, w1_EFH, w2_EHF = x_NH.to(dtype), w1_EFH.to(dtype), w2_EHF.to(dtype)
        if self._grouped_ok(x_NH, w1_EFH.dtype):
            offs_E = torch.as_tensor(tokens_per_expert).to(x_NH.device, torch.int64).cumsum(0)
            offs_E, counts = offs_E.to(torch.int32), None
        else:  # the loop slices rows on the host
            offs_E, counts = None, [int(c) for c in torch.as_tensor(tokens_per_expert).tolist()]
        h_NF = ExpertMM.apply(x_NH.contiguous(), w1_EFH, offs_E, counts)
        h_NF = self._activation(h_NF, probs_N)
        return ExpertMM.apply(h_NF, w2_EHF, offs_E, counts), None

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

    def backward_dw(self):
        """megatron's delayed weight-grad hook: the weight grads are computed in the backward."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Each weight as EP rank r's rows [r * E, (r + 1) * E) of the global [E_global, ...]
        tensor, after the layer axis megatron's block prepends; one DP replica writes it."""
        axis = len(sharded_offsets)
        out = {}
        for name in ("linear_fc1", "linear_fc2"):  # megatron's key: `experts.` once more
            out[f"{prefix}{name}.weight"] = ShardedTensor.from_rank_offsets(
                f"{prefix}experts.{name}.weight", getattr(self, name).weight, *sharded_offsets,
                (axis, self.ep_group.rank(), self.ep_group.size()),
                replica_id=(0, 0, self.dp_group.rank()), prepend_axis_num=axis)
        return out


def _init_weights(config, E: int, F1: int, H: int, F: int):
    """(fc1 [E, F', H], fc2 [E, H, F]) drawn as megatron's CPU initialisation draws a
    `SequentialMLP`'s experts: per expert, fc1 then fc2, each an fp32 master of its own (the
    init methods of megatron's `MLP`), cast to the parameter dtype."""
    w1_EFH = torch.empty(E, F1, H, dtype=config.params_dtype)
    w2_EHF = torch.empty(E, H, F, dtype=config.params_dtype)
    if config.perform_initialization:
        for e in range(E):
            for w, init in ((w1_EFH, config.init_method), (w2_EHF, config.output_layer_init_method)):
                master = torch.empty(w.shape[1:], dtype=torch.float)
                init(master)
                w[e].copy_(master.to(config.params_dtype))
    return torch.nn.Parameter(w1_EFH), torch.nn.Parameter(w2_EHF)


class ExpertMM(torch.autograd.Function):
    """out[rows of e] = x[rows of e] @ W[e]^T for a stacked weight W [E, O, I] (rows grouped by
    expert). `offs_E` (int32 ends of each expert's rows, on the device): torch's `_grouped_mm`
    on W as it is stored, forward and backward; `counts` (host ints) instead: a loop of `mm`s
    over the experts' slices. Backward: dx = grad @ W[e] per group, dW[e] = grad_e^T @ x_e into
    one [E, O, I] tensor (zero for an expert without rows), as autograd's formulas for
    `_grouped_mm`; incoming grads made dense first (`_grouped_mm` rejects stride-0 ones).
    Saves x and W (the parameter itself, no copy)."""

    @staticmethod
    def forward(ctx, x_NI, w_EOI, offs_E, counts):
        ctx.save_for_backward(x_NI, w_EOI, offs_E)
        ctx.counts = counts
        if counts is None:
            return torch._grouped_mm(x_NI, w_EOI.transpose(1, 2), offs=offs_E)
        out_NO = x_NI.new_empty(x_NI.shape[0], w_EOI.shape[1])
        for e, rows in enumerate(_row_slices(counts)):
            torch.mm(x_NI[rows], w_EOI[e].t(), out=out_NO[rows])
        return out_NO

    @staticmethod
    def backward(ctx, grad_NO):
        x_NI, w_EOI, offs_E = ctx.saved_tensors
        grad_NO, counts = grad_NO.contiguous(), ctx.counts
        grad_x = grad_w = None
        if counts is None:
            if ctx.needs_input_grad[0]:
                grad_x = torch._grouped_mm(grad_NO, w_EOI, offs=offs_E)
            if ctx.needs_input_grad[1]:
                grad_w = torch._grouped_mm(grad_NO.t(), x_NI, offs=offs_E)
            return grad_x, grad_w, None, None
        if ctx.needs_input_grad[0]:
            grad_x = x_NI.new_empty(x_NI.shape)
        if ctx.needs_input_grad[1]:
            grad_w = torch.empty_like(w_EOI)
        for e, rows in enumerate(_row_slices(counts)):
            if grad_x is not None:
                torch.mm(grad_NO[rows], w_EOI[e], out=grad_x[rows])
            if grad_w is not None:
                torch.mm(grad_NO[rows].t(), x_NI[rows], out=grad_w[e])
        return grad_x, grad_w, None, None


def _row_slices(counts: list[int]) -> list[slice]:
    """Each expert's rows of the grouped input, from the row counts."""
    out, start = [], 0
    for c in counts:
        out.append(slice(start, start + c))
        start += c
    return out
