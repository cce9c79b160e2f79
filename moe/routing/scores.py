"""Router scores past the top-k: how close each token came to another expert, and which one.

Shape legend: R router rows of one forward (megatron's sequence-first T*B, or a pack's
positions: `moe.routing.tokens`), N valid tokens
packed sequence by sequence (as `moe.routing.replay.RoutingReplayCache`), L MoE layers, K top-k,
J = K + 1, E experts, B sequences, T tokens.

`record_router_scores(policy)` wraps every router's top-k for the forwards inside (no-grad, on
what the router already computed) and keeps, per token and layer, its K + 1 best experts in the
router's selection order and their *router probabilities*: the softmax over all E experts of
the router logits, in float32 (Qwen3-MoE's `softmax(router_logits)` before its top-k). A
renormalising router (`norm_topk_prob`, megatron's `moe_router_pre_softmax=False`) selects on
the logits, which the softmax does not reorder; a pre-softmax router selects on those
probabilities themselves. `RouterScores.from_recorded` packs them like the replay cache:

- `margins_NL()`: p_(K) - p_(K+1), the probability the K-th choice has over the best expert
  left out: how far the token is from a flip at that layer (0 = a tie);
- `swapped(layer, rows_N)`: a replay cache (`moe.routing.replay.replay_routing`) of the same top-k,
  except that at `layer` the tokens `rows_N` take their (K+1)-th expert in place of their K-th:
  the routing flip of the smallest margin, forced through megatron's REPLAY_FORWARD (so it
  works under expert parallelism like any replay).

The wrapper delegates to whatever top-k the router has (plain, RECORD, REPLAY_*, router noise),
so it records the live scores of any forward and changes nothing it computes. Group-limited
top-k (`num_groups`) is not looked at: the (K+1)-th is the best expert outside the top-k over
all E. Needs K < E.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch

from moe.routing.replay import RoutingReplayCache, _routers, ids_dtype
from moe.routing.tokens import RouterRows


def _scored_topk(router, inner, scores_are_probs: bool, out: list, scores, topk,
                 num_groups=None, group_topk=None, default_compute_topk=None):
    """The router's own top-k (`inner`), after keeping the K + 1 best experts' probabilities."""
    with torch.no_grad():
        s_RE = scores.detach().float()
        _, ids_RJ = torch.topk(s_RE, topk + 1, dim=1)  # the router's own order (torch.topk)
        p_RE = s_RE if scores_are_probs else torch.softmax(s_RE, dim=-1)
        out.append((p_RE.gather(1, ids_RJ), ids_RJ))
    return inner(scores, topk, num_groups, group_topk, default_compute_topk)


@contextlib.contextmanager
def record_router_scores(policy):
    """Keep every router's top-(K+1) probabilities and ids in the forwards inside; yields a
    list, filled on exit with one (probs [R, J] float32, ids [R, J]) per layer of the last
    forward inside (use one forward per context)."""
    routers = _routers(policy)
    K, E = policy.preset.topk, policy.preset.num_experts
    if K >= E:
        raise ValueError(f"router scores need a (K+1)-th expert: topk={K}, num_experts={E}")
    scores_are_probs = not policy.preset.norm_topk_prob
    calls_L: list[list] = [[] for _ in routers]
    saved = [r.__dict__.get("get_replay_topk") for r in routers]
    for r, calls in zip(routers, calls_L):
        r.get_replay_topk = partial(_scored_topk, r, r.get_replay_topk, scores_are_probs, calls)
    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        yield recorded
        if any(not calls for calls in calls_L):
            raise RuntimeError("a router scored nothing: was a forward run inside "
                               "record_router_scores()?")
        recorded.extend(calls[-1] for calls in calls_L)
    finally:
        for r, own in zip(routers, saved):
            r.__dict__.pop("get_replay_topk", None)  # back to the class's method
            if own is not None:  # or to the wrapper found on entry (router noise)
                r.get_replay_topk = own


@dataclass
class RouterScores:
    """The K + 1 best experts of every valid token per MoE layer, with their probabilities."""

    probs_NLJ: torch.Tensor
    """Router probabilities (float32), best first."""
    ids_NLJ: torch.Tensor
    """Their expert ids, in the same order."""
    valid_BT: torch.Tensor
    """Which (sequence, position) of the routed shard are real tokens."""
    num_experts: int

    @property
    def topk(self) -> int:
        return self.ids_NLJ.shape[2] - 1

    @classmethod
    def from_recorded(cls, recorded_L: list, valid_BT: torch.Tensor, num_experts: int,
                      rows: RouterRows = RouterRows()) -> "RouterScores":
        """Pack `record_router_scores`' per-layer [R, J] rows (in the order `rows` of the
        forward that scored them: sequence-first [T*B] padded, the pack packed) for the valid
        tokens of `valid_BT`, this rank's routed part (`MoEPolicy.routed_valid`)."""
        valid = valid_BT.bool().cpu()

        def pack(tensors_L):
            out = []
            for layer, x_RJ in enumerate(tensors_L):
                try:
                    out.append(rows.to_tokens(x_RJ, valid).cpu())
                except ValueError as e:
                    raise ValueError(f"layer {layer}: scored: {e}") from None
            return torch.stack(out, dim=1)
        return cls(pack([p for p, _ in recorded_L]),
                   pack([i for _, i in recorded_L]).to(ids_dtype(num_experts)), valid,
                   num_experts)

    def select(self, rows: torch.Tensor | slice) -> "RouterScores":
        """The scores of some sequences, in the given row order."""
        rows = torch.arange(self.valid_BT.shape[0])[rows]
        start_B = torch.cat([torch.zeros(1, dtype=torch.long), self.valid_BT.sum(1).cumsum(0)])
        idx = torch.cat([torch.arange(int(start_B[r]), int(start_B[r + 1]))
                         for r in rows.tolist()] or [torch.zeros(0, dtype=torch.long)])
        return RouterScores(self.probs_NLJ[idx], self.ids_NLJ[idx], self.valid_BT[rows],
                            self.num_experts)

    def margins_NL(self) -> torch.Tensor:
        """p_(K) - p_(K+1) per token and layer (float32, >= 0)."""
        K = self.topk
        return self.probs_NLJ[:, :, K - 1] - self.probs_NLJ[:, :, K]

    def routing(self) -> RoutingReplayCache:
        """The top-k itself as a replay cache (what the router chose)."""
        return RoutingReplayCache(self.ids_NLJ[:, :, :self.topk].clone(), self.valid_BT,
                                  self.num_experts)

    def swapped(self, layer: int, rows_N: torch.Tensor) -> RoutingReplayCache:
        """The top-k, except that at `layer` the tokens where `rows_N` (bool [N]) is True
        route to their (K+1)-th expert instead of their K-th."""
        K = self.topk
        if rows_N.shape != (self.ids_NLJ.shape[0],) or rows_N.dtype != torch.bool:
            raise ValueError(f"rows_N must be bool [{self.ids_NLJ.shape[0]}], got "
                             f"{rows_N.dtype} {tuple(rows_N.shape)}")
        if not 0 <= layer < self.ids_NLJ.shape[1]:
            raise ValueError(f"layer={layer}: expected 0..{self.ids_NLJ.shape[1] - 1}")
        ids_NLK = self.ids_NLJ[:, :, :K].clone()
        ids_NLK[rows_N, layer, K - 1] = self.ids_NLJ[rows_N, layer, K]
        return RoutingReplayCache(ids_NLK, self.valid_BT, self.num_experts)
