"""Tokens grouped by expert on one rank, without a host-device synchronization.

Shape legend: N tokens, E experts, K top-k, M = N * K routed rows, H hidden.

megatron-core's `moe_utils.permute` (what the all-gather and all-to-all dispatchers run on one
expert-parallel rank) finds the routed rows with `masked_select` over the [E, N] routing map,
twice (token ids, probs), and the all-gather dispatcher copies the tokens per expert to the host
(`.cpu()`) for the experts' split sizes. Each is a host-device synchronization on a GPU: the
host waits for the router's kernels before it can queue the rest of the layer, three times per
MoE layer and forward (twice per layer in the sampler's lean decode step, which knew the row
count and had no `.cpu()`). Under dropless top-k routing every
token has exactly K experts (also when Routing Replay forces them), so M = N * K is known
without looking at the data: `permute_by_expert` sorts the N * K (token, expert) pairs by
expert, stably, which is megatron's order (expert-major, tokens ascending within an expert),
and returns the same three tensors as `permute` without leaving the device. The experts take
the tokens per expert as a device tensor (`moe.model.experts.StackedExperts` turns it into the
grouped GEMM's offsets there). The layer is then free of host syncs only where the grouped GEMM
runs (`moe.model.experts.grouped_mm_runs`); the per-expert loop, its fallback, reads the counts
on the host (`.tolist()`). The exactly-K premise is checked on the device
(`torch._assert_async`) in forwards that record grads, where replayed routing enters training
(no-grad forwards route by the router's own top-k, or replay what a training forward then
checks; decode steps on a GPU are launch-bound, and the check is 4 more kernels per layer).
On CPU it raises at once with its message; on a GPU it is a device-side assert that surfaces
at a later kernel launch without the message and leaves the CUDA context unusable.

`SyncFreeDispatcher` is megatron's all-gather dispatcher with this permutation, installed by
`moe.model.gpt.build_gpt_moe` on the MoE layers `lean_moe_ok` accepts (one rank, no
expert TP, no capacity / padding, no TE permute fusion, no shared experts) whose experts run
grouped; the sampler's lean decode step (`lean_moe`) uses `permute_by_expert` too.
Departure from megatron: none in the numbers (the same rows in the same order; tests/moe/
test_dispatch.py compares bitwise, and counts the synchronizing calls).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import unpermute
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from moe.model.experts import StackedExperts


def permute_by_expert(x_NH: torch.Tensor, probs_NE: torch.Tensor, routing_map_NE: torch.Tensor,
                      topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron `permute(x, routing_map, probs)` for exactly `topk` experts per token: (rows
    grouped by expert [M, H], their probs [M], their token ids [M]), computed on the device.
    A token with another number of experts (capacity drops, a malformed replayed routing) fails
    the device-side assertion (see the module docstring for where it runs)."""
    if torch.is_grad_enabled():
        torch._assert_async((routing_map_NE.sum(dim=1) == topk).all(),
                            f"permute_by_expert: a token's routing map row does not hold "
                            f"exactly topk={topk} experts")
    # the K chosen expert ids of each token (any order within a row: they are distinct)
    ids_NK = torch.sort(routing_map_NE.to(torch.uint8), dim=1, descending=True,
                        stable=True).indices[:, :topk]
    order_M = ids_NK.reshape(-1).argsort(stable=True)  # by expert; ties keep token order
    token_M = torch.div(order_M, topk, rounding_mode="floor")
    probs_M = probs_NE.gather(1, ids_NK).reshape(-1).index_select(0, order_M)
    return x_NH.index_select(0, token_M), probs_M, token_M


class SyncFreeDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's all-gather dispatcher on one rank with `permute_by_expert`: the tokens per
    expert stay on the device. Only for layers `lean_moe_ok` accepts."""

    def dispatch_postprocess(self, hidden_states, probs):
        self.hidden_shape_before_permute = hidden_states.shape
        self.local_map = self.routing_map  # one rank: every expert is local
        x_MH, self.local_probs, self.reversed_local_input_permutation_mapping = \
            permute_by_expert(hidden_states, probs, self.routing_map, self.router_topk)
        tokens_per_expert_E = self.routing_map.sum(dim=0).long()
        self.routing_map = None
        return x_MH, tokens_per_expert_E, self.local_probs


def install_sync_free_dispatch(model) -> int:
    """Give every MoE layer of `model` that qualifies a `SyncFreeDispatcher`; returns how many.
    A layer qualifies under `lean_moe_ok` with megatron's all-gather dispatcher and
    grouped experts (whose forward takes the device tensor; megatron's expert loop would copy it
    to the host anyway)."""
    count = 0
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if (type(dispatcher) is MoEAllGatherTokenDispatcher and lean_moe_ok(module)
                and isinstance(module.experts, StackedExperts)
                and dispatcher.local_expert_indices == list(range(module.config.num_moe_experts))):
            dispatcher.__class__ = SyncFreeDispatcher  # same state, one method differs
            count += 1
    return count


def lean_moe_ok(mlp) -> bool:
    """Whether `lean_moe` computes this MoE layer: one expert-parallel rank and no expert TP
    (the dispatcher's collectives are identities there), no token dropping or padding, no
    latent projection, no fused (TE) permutation, no shared experts."""
    if not isinstance(mlp, MoELayer):
        return False
    cfg, expert_tp = mlp.config, getattr(mlp.experts, "tp_group", None)
    return (mlp.ep_group.size() == 1 and mlp.tp_group.size() == 1
            and expert_tp is not None and expert_tp.size() == 1
            and cfg.moe_expert_capacity_factor is None
            and not cfg.moe_router_padding_for_quantization and not cfg.moe_latent_size
            and not cfg.moe_permute_fusion and not mlp.use_shared_expert)


def lean_moe(mlp, x_SBH):
    """megatron `MoELayer.forward` on one rank, without the token dispatcher's machinery: the
    router module (top-k, gate probs, RouterReplay record / replay), megatron's permutation
    (tokens grouped by expert; `moe.model.dispatch.permute_by_expert`: the same rows, without host
    syncs), the experts module, megatron's `unpermute` (scatter-add back to token order): the
    ops the all-to-all / all-gather dispatchers run at world size 1.
    Returns (output [S, B, H], None)."""
    x_NH = x_SBH.reshape(-1, x_SBH.shape[-1])
    probs_NE, routing_map_NE = mlp.router(x_SBH)
    tokens_per_expert_E = routing_map_NE.sum(dim=0).long()
    x_MH, probs_M, sorted_M = permute_by_expert(x_NH, probs_NE, routing_map_NE,
                                                mlp.config.moe_router_topk)
    out_MH, _ = mlp.experts(x_MH, tokens_per_expert_E, probs_M)
    out_NH = unpermute(out_MH, sorted_M, restore_shape=x_NH.shape, routing_map=routing_map_NE)
    return out_NH.view(x_SBH.shape), None
