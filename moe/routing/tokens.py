"""How one forward's routers see a batch's tokens: the orders a routing cache converts between.

Shape legend: B sequences, T tokens per sequence, N valid tokens in (sequence, position) order,
R router rows of one forward on this rank, J values per token (K expert ids, K + 1 scores),
L the positions of a packed forward (N and its alignment padding), E experts.

A `moe.routing.replay.RoutingReplayCache` (and `moe.routing.scores.RouterScores`) keeps the
valid tokens of its rows in (sequence, position) order, whatever forward recorded them; megatron's
routers see R rows in the order of the forward that runs. `RouterRows` is that forward's order:

- padded (`RouterRows()`, `shards` = TP under sequence parallel): the routers see [T, B]
  sequence-first, flattened as t * B + b (docs/pitfalls.md#replay-layout), under sequence
  parallelism only this rank's column shard of every row (T padded to a multiple of `shards`).
  A cache then holds that shard: `routed_valid` cuts the columns, and nothing crosses ranks
  (docs/pitfalls.md#replay-payload).
- packed (`packed=True`; `moe.model.packed`): the routers see the pack, the rows' real tokens
  row by row (the cache's own order) then the alignment padding, and under sequence parallelism
  each TP rank routes its 1 / `shards` of it. A cache then holds whole sequences on every TP
  rank: `to_tokens` all-gathers what this rank recorded over the TP group `group`, and
  `to_router` hands each rank its own slice of the pack, so a cache recorded in one packing
  replays in any other (each minibatch packs its rows anew). The payload stays per
  data-parallel rank; under TP it is on every TP rank of a replica.

Positions a cache does not hold (padding of a padded row, the pack's alignment tail) get a
balanced, duplicate-free filler (position r -> experts (r * K + j) mod E), never expert 0 for
all (docs/pitfalls.md#replay-padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


def filler(rows: torch.Tensor, K: int, E: int) -> torch.Tensor:
    """[len(rows), K] int64: position r routes to experts (r * K + j) mod E, j < K."""
    return (rows[:, None] * K + torch.arange(K)) % E


@dataclass(frozen=True)
class RouterRows:
    """The order of one forward's router rows on this rank (module docstring)."""

    packed: bool = False
    shards: int = 1
    """Sequence-parallel ranks the sequence is split over (1: none)."""
    shard: int = 0
    """This rank's shard."""
    group: object = None
    """The TP process group a packed recording is gathered over (shards > 1)."""

    def routed_valid(self, mask_BT: torch.Tensor) -> torch.Tensor:
        """The part of a [B, T] mask a cache of this forward holds (host bool): the rank's
        column shard (padded under sequence parallelism), else all of it."""
        mask_BT = mask_BT.bool()
        if self.packed or self.shards == 1:
            return mask_BT.cpu()
        mask_BT = F.pad(mask_BT, (0, (-mask_BT.shape[1]) % self.shards))
        chunk = mask_BT.shape[1] // self.shards
        return mask_BT[:, self.shard * chunk:(self.shard + 1) * chunk].cpu()

    def length(self, n: int) -> int:
        """Positions of a packed forward of `n` real tokens (a multiple of `shards`)."""
        return n + (-n) % self.shards

    def to_tokens(self, x_RJ: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
        """A router's per-row values [R, J] of one forward as [N, J] for the valid tokens of
        `valid_BT` (the cache's, `routed_valid`), in (sequence, position) order. Packed under
        sequence parallelism: a collective over the TP group."""
        B, T = valid_BT.shape
        if not self.packed:
            if x_RJ.shape[0] != T * B:
                raise ValueError(f"recorded {x_RJ.shape[0]} tokens, expected T*B = {T}*{B} "
                                 "(is valid_BT this rank's routed shard?)")
            return x_RJ.reshape(T, B, -1).transpose(0, 1)[valid_BT.to(x_RJ.device)]
        n = int(valid_BT.sum())
        if x_RJ.shape[0] * self.shards != self.length(n):
            raise ValueError(f"recorded {x_RJ.shape[0]} tokens of a pack of {n} real tokens "
                             f"over {self.shards} shard(s): expected {self.length(n)} in all")
        if self.shards > 1:
            parts = [torch.empty_like(x_RJ) for _ in range(self.shards)]
            dist.all_gather(parts, x_RJ.contiguous(), group=self.group)
            x_RJ = torch.cat(parts)
        return x_RJ[:n]

    def to_router(self, ids_NK: torch.Tensor, valid_BT: torch.Tensor,
                  num_experts: int) -> torch.Tensor:
        """int64 [R, K] ids for this rank's routers from a cache's [N, K] (`valid_BT` its
        tokens), filler where the cache holds no token."""
        K = ids_NK.shape[1]
        if not self.packed:
            B, T = valid_BT.shape
            n_TB = torch.arange(T * B).reshape(T, B).T  # flat sequence-first index of (b, t)
            ids_BTK = filler(n_TB.reshape(-1), K, num_experts).reshape(B, T, K)
            ids_BTK[valid_BT] = ids_NK.long()
            return ids_BTK.transpose(0, 1).reshape(T * B, K)
        n = ids_NK.shape[0]
        L = self.length(n)
        ids_LK = torch.cat([ids_NK.long(), filler(torch.arange(n, L), K, num_experts)])
        per = L // self.shards
        return ids_LK[self.shard * per:(self.shard + 1) * per]
