"""Routing Replay (R2 / R3) on megatron-core's `RouterReplay`.

Shape legend: B sequences, T tokens per sequence (this rank's shard under sequence parallel),
N valid (non-padding) tokens packed sequence by sequence, L MoE layers, K top-k, E experts.

GSPO paper (arXiv 2507.18071, sec. 5.3): to stabilise GRPO on MoE models, cache the experts
activated in pi_old and "replay" them when computing the importance ratio under pi_theta, so both
likelihoods use the same sub-network. Here:

- `record_routing(policy)` sets megatron's RECORD action on the policy's routers for one forward;
  `RoutingReplayCache.from_recorded` packs what they saw into `ids_NLK` (uint8 for <= 256
  experts, int16 above), keeping only valid tokens (padding is excluded, docs/pitfalls.md#replay-padding).
- `replay_routing(policy, cache)` sets REPLAY_FORWARD for one forward: megatron gathers the gate
  probabilities from the live router logits at the cached ids (then softmax over the K of them),
  so gradients still reach the router for every replayed expert (docs/pitfalls.md#replay-gradients).

Layout (docs/pitfalls.md#replay-layout): the cache stores sequences batch-first, valid tokens
only (so a minibatch is a row selection) and converts to the order of the forward that replays it
when it hands ids to megatron (`moe.routing.tokens.RouterRows`): sequence-first, [S, B] flattened
as s*B + b, for a padded forward; the rows' real tokens one after another for a packed one
(`moe.model.packed`). Positions it holds no token for (padding, a pack's alignment tail), which
megatron still routes, get a balanced, duplicate-free filler (row n -> experts (n*K + j) mod E)
rather than expert 0.

Activation recompute (`moe.model.settings.Recompute` with the routers inside: 'full', or 'selective'
with 'moe') runs each router again in the backward, after `replay_routing` has exited. The
replayed ids are then queued on the policy and `MoEPolicy.backward` replays them with megatron's
REPLAY_BACKWARD action (`replay_backward`), so the recomputed forward routes as the forward did
(docs/pitfalls.md#replay-gradients still holds: probs are re-gathered from live logits).

Everything is per data-parallel rank: each rank caches the tokens of its own rows, and nothing
is broadcast (docs/pitfalls.md#replay-payload). Padded, each rank caches exactly the tokens its
routers saw (under sequence parallelism its shard); packed, the TP ranks of a replica each hold
the replica's whole sequences (gathered over the TP group, so any packing of the rows replays).
Replay state is set only inside
the context managers and cleared on exit, also on error, so eval / reference / rollout forwards
never replay by accident (`assert_routing_idle`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from moe.routing.stats import topk_mask
from moe.routing.tokens import RouterRows


def ids_dtype(num_experts: int) -> torch.dtype:
    """Smallest integer dtype holding expert ids: uint8 up to 256 experts, else int16."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"num_experts={num_experts} too large for the replay cache")


@dataclass
class RoutingReplayCache:
    """Packed top-k expert ids of every valid token, per MoE layer."""

    ids_NLK: torch.Tensor
    """Expert ids, packed valid tokens in (sequence, position) order."""
    valid_BT: torch.Tensor
    """Which (sequence, position) of the routed shard are real tokens."""
    num_experts: int

    def __post_init__(self) -> None:
        n_valid = int(self.valid_BT.sum())
        if self.ids_NLK.dim() != 3 or self.ids_NLK.shape[0] != n_valid:
            raise ValueError(f"ids_NLK {tuple(self.ids_NLK.shape)} must be [N={n_valid}, L, K]")

    @property
    def num_layers(self) -> int:
        return self.ids_NLK.shape[1]

    @property
    def topk(self) -> int:
        return self.ids_NLK.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the id payload: tokens x layers x K x itemsize."""
        return self.ids_NLK.numel() * self.ids_NLK.element_size()

    @classmethod
    def from_recorded(cls, recorded_L: list[torch.Tensor], valid_BT: torch.Tensor,
                      num_experts: int, rows: RouterRows = RouterRows()) -> "RoutingReplayCache":
        """Pack megatron's recorded ids (per layer [R, K] in the order `rows` of the forward
        that recorded them: sequence-first [T*B] padded, the pack packed) for the valid tokens
        of `valid_BT` (this rank's routed part, `RouterRows.routed_valid`)."""
        if any(r is None for r in recorded_L):
            raise RuntimeError("a router recorded nothing: was the forward run inside "
                               "record_routing()?")
        valid_BT = valid_BT.cpu().bool()
        per_layer = []
        for layer, ids in enumerate(recorded_L):
            try:
                per_layer.append(rows.to_tokens(ids, valid_BT))
            except ValueError as e:
                raise ValueError(f"layer {layer}: {e}") from None
        ids_NLK = torch.stack(per_layer, dim=1)
        return cls(ids_NLK.to(ids_dtype(num_experts)).cpu(), valid_BT, num_experts)

    @classmethod
    def cat(cls, caches: list["RoutingReplayCache"]) -> "RoutingReplayCache":
        """The caches of consecutive row blocks as one (sequence order kept)."""
        if len(caches) == 1:
            return caches[0]
        return cls(torch.cat([c.ids_NLK for c in caches]),
                   torch.cat([c.valid_BT for c in caches]), caches[0].num_experts)

    def shifted(self, left: int, width: int) -> "RoutingReplayCache":
        """The same routes with `left` more padding columns before each row, the rows padded on
        the right to `width` columns (a batch re-aligned to another's prompt column): the ids,
        real tokens in (sequence, position) order, do not change."""
        if left < 0 or width < left + self.valid_BT.shape[1]:
            raise ValueError(f"cannot shift {self.valid_BT.shape[1]} columns by {left} into "
                             f"{width}")
        valid_BT = torch.zeros(self.valid_BT.shape[0], width, dtype=torch.bool)
        valid_BT[:, left:left + self.valid_BT.shape[1]] = self.valid_BT
        return RoutingReplayCache(self.ids_NLK, valid_BT, self.num_experts)

    def select(self, rows: torch.Tensor | slice) -> "RoutingReplayCache":
        """The cache restricted to some sequences (a minibatch), in the given row order."""
        rows = torch.arange(self.valid_BT.shape[0])[rows]
        start_B = torch.cat([torch.zeros(1, dtype=torch.long),
                             self.valid_BT.sum(1).cumsum(0)])
        pieces = [self.ids_NLK[start_B[r]:start_B[r + 1]] for r in rows.tolist()]
        ids_NLK = torch.cat(pieces) if pieces else self.ids_NLK[:0]
        return RoutingReplayCache(ids_NLK, self.valid_BT[rows], self.num_experts)

    def dense_layers(self, device: torch.device | str = "cpu",
                     rows: RouterRows = RouterRows()) -> list[torch.Tensor]:
        """Per layer int64 [R, K] ids in the order `rows` of the forward that replays them:
        sequence-first [T*B] padded (docs/pitfalls.md#replay-layout), this rank's slice of the
        pack packed; filler where the cache holds no token (`moe.routing.tokens`)."""
        return [rows.to_router(self.ids_NLK[:, layer], self.valid_BT, self.num_experts).to(device)
                for layer in range(self.num_layers)]

    def layer_ids(self, layer: int) -> torch.Tensor:
        """[N, K] ids of the valid tokens at one layer (for routing statistics)."""
        return self.ids_NLK[:, layer]

    def validate(self) -> None:
        """Ids in range and unique per token (docs/pitfalls.md#replay-ids: duplicates break alltoall splits)."""
        for layer in range(self.num_layers):
            topk_mask(self.layer_ids(layer), self.num_experts)


def _routers(policy) -> list:
    routers = policy.router_replays
    if not routers:
        raise RuntimeError("the policy was built without moe_enable_routing_replay")
    return routers


def assert_routing_idle(policy) -> None:
    """Raise if any router of this policy is still set to record or replay."""
    busy = [i for i, r in enumerate(_routers(policy)) if r.router_replay_action is not None]
    if busy:
        raise RuntimeError(f"routing replay state leaked: layers {busy} still have an action")


@contextlib.contextmanager
def record_routing(policy):
    """Record every layer's top-k during the forwards inside; yields a list filled on exit."""
    routers = _routers(policy)
    assert_routing_idle(policy)
    recorded: list[torch.Tensor] = []
    for r in routers:
        r.clear_indices()
        r.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield recorded
        recorded.extend(r.get_recorded_indices() for r in routers)
    finally:
        _release(routers)


@contextlib.contextmanager
def replay_routing(policy, cache: RoutingReplayCache | None, check: dict | None = None):
    """Force the cached routing in the forwards inside (no-op when `cache` is None). With
    `check` (a dict), also count what each router actually used against the cache
    (`watch_replayed`): check["differ"] routes (token, layer) that were not the cache's, of
    check["routes"] (device tensors, summed over the forwards inside)."""
    if cache is None:
        yield
        return
    routers = _routers(policy)
    assert_routing_idle(policy)
    if cache.num_layers != len(routers):
        raise ValueError(f"cache has {cache.num_layers} layers, policy has {len(routers)} routers")
    cache.validate()
    ids_L = cache.dense_layers(policy.device, policy.router_rows)
    for r, ids in zip(routers, ids_L):
        r.clear_indices()
        r.set_target_indices(ids)
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    handles = [] if check is None else watch_replayed(policy, ids_L, check)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        _release(routers)
    if policy.recompute.routing and torch.is_grad_enabled():
        policy.backward_replays.append(ids_L)


def watch_replayed(policy, ids_L: list[torch.Tensor], check: dict) -> list:
    """Forward hooks on the policy's routers comparing the routing each one outputs (its
    routing map [tokens, E]) with the ids it was told to replay (`ids_L[layer]`, [tokens, K]),
    summed into check["differ"] (routes whose expert set differs) and check["routes"]: the
    replayed-vs-used check (0 when replay works). Returns the hook handles."""
    layer_of = {id(r): i for i, r in enumerate(policy.router_replays)}
    gpt = policy.model.module if hasattr(policy.model, "module") else policy.model
    handles = []
    for module in gpt.modules():
        layer = layer_of.get(id(getattr(module, "router_replay", None)))
        if layer is None:
            continue

        def hook(mod, args, output, layer=layer):
            routing_map_NE = output[1]
            want_NE = torch.zeros_like(routing_map_NE, dtype=torch.bool).scatter_(
                1, ids_L[layer].to(routing_map_NE.device), True)
            check["differ"] = check.get("differ", 0) + (routing_map_NE.bool() != want_NE).any(
                1).sum()
            check["routes"] = check.get("routes", 0) + routing_map_NE.shape[0]
        handles.append(module.register_forward_hook(hook))
    return handles


def _release(routers) -> None:
    """Routers back to plain routing, their replay targets dropped."""
    for r in routers:
        r.clear_router_replay_action()
        r.clear_indices()


@contextlib.contextmanager
def replay_backward(policy, replays: list[list[torch.Tensor]]):
    """During a backward: recomputed routers replay `replays` (per replayed forward, per layer
    ids, in forward order) with megatron's REPLAY_BACKWARD (no-op when empty). One backward
    through several forwards recomputes the last forward first (autograd runs later nodes
    first) and megatron pops its queue from the front, so the queue is set last forward first."""
    if not replays:
        yield
        return
    routers = _routers(policy)
    assert_routing_idle(policy)
    for layer, r in enumerate(routers):
        r.clear_indices()
        for ids_L in reversed(replays):
            r.set_target_indices(ids_L[layer])
        r.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    try:
        yield
    finally:
        _release(routers)


def chunk_count(B: int, T: int, max_tokens: int) -> int:
    """Forwards needed for a [B, T] batch at most `max_tokens` tokens each (at least one row
    each; 0 = no limit: 1). Ranks whose forwards meet in collectives (TP, EP) must run the same
    number: agree on the largest count first (`megatron_gspo.dist.max_over_ranks`), as
    their prompts, and so T, differ."""
    return -(-B // max(1, max_tokens // max(T, 1))) if max_tokens and B else 1


def row_chunks(B: int, n_chunks: int) -> list[slice]:
    """`n_chunks` (1..B) consecutive row slices of near-equal size covering B rows."""
    if not 1 <= n_chunks <= max(B, 1):
        raise ValueError(f"n_chunks={n_chunks}: expected 1..{B} for {B} rows")
    step, extra = divmod(B, n_chunks)
    bounds = [0]
    for i in range(n_chunks):
        bounds.append(bounds[-1] + step + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def restore_order(chunks: list, B: int) -> torch.Tensor | None:
    """The permutation that puts the rows of `chunks` (row selectors of a B-row batch:
    slices or index tensors, covering every row once), concatenated chunk by chunk, back in
    batch order; None when they already are (consecutive slices)."""
    order = torch.cat([torch.arange(B)[rows] for rows in chunks]) if chunks else \
        torch.arange(0)
    if torch.equal(order, torch.arange(B)):
        return None
    if not torch.equal(order.sort().values, torch.arange(B)):
        raise ValueError(f"chunks must select each of the {B} rows once")
    return torch.argsort(order)


@torch.no_grad()
def current_routing(policy, tokens_BT: torch.Tensor, valid_BT: torch.Tensor,
                    temperature: float = 1.0, start: int = 1, n_chunks: int = 1,
                    chunks: list | None = None):
    """No-grad forwards that record routing: (token log-probs [B, T] from column `start` on,
    routing cache of every token), both in batch row order. The forwards: `chunks` (row
    selectors: slices or index tensors, each row once, e.g. a token budget's bins), else
    `n_chunks` consecutive row slices (`row_chunks`)."""
    B = tokens_BT.shape[0]
    chunks = row_chunks(B, n_chunks) if chunks is None else chunks
    logps, caches = [], []
    for rows in chunks:
        with record_routing(policy) as recorded:
            logps.append(policy.token_logprobs(tokens_BT[rows], valid_BT[rows],
                                               temperature=temperature, start=start))
        caches.append(RoutingReplayCache.from_recorded(
            recorded, policy.routed_valid(valid_BT[rows]), policy.preset.num_experts,
            policy.router_rows))
    logp_BT, cache = torch.cat(logps), RoutingReplayCache.cat(caches)
    back = restore_order(chunks, B)
    if back is None:
        return logp_BT, cache
    return logp_BT[back.to(logp_BT.device)], cache.select(back)
