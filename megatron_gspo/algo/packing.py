"""Which rows of a batch share a forward: token-budgeted microbatches.

Shape legend: B sequences, T tokens (the batch's padded width).

A batch is row-aligned ([B, T] tensors, one routing cache row per sequence); the policy forwards
the rows it is given, padded to the batch's width (`train.pack=false`) or packed: their real
tokens concatenated into one sequence (`moe.model.packed`). This module decides which rows go
together, as lists of row indices, and nothing else:

- packed (`pack_rows`): first-fit decreasing on the rows' real lengths into bins of at most
  `budget` real tokens (rows longest first, each into the first bin it fits, a new bin
  otherwise; a row longer than the budget gets a bin of its own); each bin's rows ascending, so
  one bin of every row is the batch in its own order;
- padded (`row_slices`): consecutive row slices of at most `budget` positions (rows x padded
  width, at least one row), the step as it ran before packing.

Ranks whose forwards meet in collectives (TP all-gathers, EP all-to-alls) must run the same
number of forwards (docs/pitfalls.md#collectives), so `microbatches` agrees on the largest count
over the world and every rank with fewer splits its bins (`split_to`: the bin of most tokens that
holds two rows or more, in two) until it has that many. Every rank holds the same number of rows
(`megatron_gspo.config.schema.local_prompts`), so no rank ever needs more bins than rows.
Across data-parallel ranks (`balance_groups`), whole groups (a prompt's G responses, which
share its advantage's mean and std) are swapped between ranks until their real tokens are near
equal, each rank keeping its count of groups and so of rows: verl's and NeMo-RL's dynamic
batching balance single rows instead; a group moves whole here so its advantages stay local.
"""

from __future__ import annotations

import torch

from megatron_gspo.dist import max_over_ranks
from moe.routing.replay import chunk_count, row_chunks


def pack_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing bins (lists of row indices, each ascending) of at most `budget`
    real tokens; a row longer than `budget` alone in its bin; budget 0: one bin of every row.
    Ties keep the lower row first, so the bins are a pure function of the lengths."""
    if budget < 0 or any(n < 0 for n in lengths):
        raise ValueError(f"budget={budget} and row lengths must be >= 0")
    if not budget:
        return [list(range(len(lengths)))] if lengths else []
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        n = lengths[row]
        slot = next((i for i, free in enumerate(room) if n <= free), None)
        if slot is None:
            bins.append([row])
            room.append(budget - n)
        else:
            bins[slot].append(row)
            room[slot] -= n
    return [sorted(b) for b in bins]


def split_to(bins: list[list[int]], lengths: list[int], n: int) -> list[list[int]]:
    """`bins` split until there are `n` of them: each time the bin of most tokens among those
    of two rows or more goes in two (its rows dealt alternately, longest first). ValueError
    when `n` is below the bin count or above the row count."""
    rows = sum(len(b) for b in bins)
    if not len(bins) <= n <= max(rows, len(bins)):
        raise ValueError(f"cannot make {n} microbatches of {len(bins)} bins holding {rows} rows")
    out = [list(b) for b in bins]
    while len(out) < n:
        i = max((i for i, b in enumerate(out) if len(b) > 1),
                key=lambda i: sum(lengths[r] for r in out[i]))
        order = sorted(out[i], key=lambda r: (-lengths[r], r))
        out[i:i + 1] = [sorted(order[0::2]), sorted(order[1::2])]
    return out


def row_slices(B: int, T: int, budget: int, n: int | None = None) -> list[slice]:
    """The padded step's consecutive row slices: `n` of them, or as many as keep each within
    `budget` positions (B x T; `moe.routing.replay.chunk_count`)."""
    return row_chunks(B, n or chunk_count(B, T, budget))


def microbatches(valid_BT: torch.Tensor, budget: int, packed: bool) -> list:
    """The row selectors of a batch's forwards, as many on every rank (collective): packed, a
    list of row-index tensors (`pack_rows`, `split_to`); padded, consecutive row slices
    (`row_slices`)."""
    B, T = valid_BT.shape
    if not packed:
        return row_slices(B, T, budget, max_over_ranks(chunk_count(B, T, budget)))
    lengths = valid_BT.sum(1).tolist()
    bins = pack_rows(lengths, budget)
    bins = split_to(bins, lengths, max_over_ranks(len(bins)))
    return [torch.tensor(b, dtype=torch.long) for b in bins]


def is_whole(rows, B: int) -> bool:
    """`rows` selects every row of a B-row batch in order (one forward of the whole batch)."""
    if isinstance(rows, slice):
        return rows.indices(B) == (0, B, 1)
    return len(rows) == B and bool((rows == torch.arange(B)).all())


def balance_groups(tokens_RG: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Which groups each data-parallel rank trains on so that the ranks' real tokens are near
    equal, each rank keeping its count of groups: `tokens_RG[r][g]` the real tokens of group g
    sampled on rank r. Returns, per rank, the (rank, group) pairs it holds: its own kept groups
    first in their order, then those it receives, in (rank, group) order. Greedy swaps: while
    some group of the most loaded rank and a smaller one of the least loaded would narrow their
    gap, swap the pair that brings the two closest (the sum of squared loads falls at each
    swap, so it ends); groups move only where a swap needs them."""
    hold = [[(r, g) for g in range(len(t))] for r, t in enumerate(tokens_RG)]
    load = [sum(t) for t in tokens_RG]

    def size(rg):
        return tokens_RG[rg[0]][rg[1]]

    for _ in range(sum(len(h) for h in hold)):
        hi, lo = load.index(max(load)), load.index(min(load))
        gap = load[hi] - load[lo]
        pairs = [(abs(gap - 2 * (size(a) - size(b))), i, j)
                 for i, a in enumerate(hold[hi]) for j, b in enumerate(hold[lo])
                 if 0 < size(a) - size(b) < gap]
        if not pairs:
            break
        _, i, j = min(pairs)
        d = size(hold[hi][i]) - size(hold[lo][j])
        hold[hi][i], hold[lo][j] = hold[lo][j], hold[hi][i]
        load[hi], load[lo] = load[hi] - d, load[lo] + d
    return [sorted(h, key=lambda rg: (rg[0] != r, rg)) for r, h in enumerate(hold)]
