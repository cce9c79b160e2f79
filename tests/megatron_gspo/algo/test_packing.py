"""The microbatch planner (megatron_gspo.algo.packing): first-fit decreasing bins of real tokens,
split to the count every rank agrees on."""

import pytest
import torch

from megatron_gspo.algo.packing import (balance_groups, is_whole, microbatches, pack_rows, row_slices,
                                        split_to)


def _tokens(bins, lengths):
    return [sum(lengths[r] for r in b) for b in bins]


def test_first_fit_decreasing_by_hand():
    """Rows longest first into the first bin with room; a row over the budget alone."""
    lengths = [3, 9, 2, 5, 12, 4]
    bins = pack_rows(lengths, 10)
    # 12 (row 4) alone; 9 (row 1) + ... 5 -> new; 4 -> bin of 5; 3 -> ... ; 2 -> ...
    assert bins == [[4], [1], [3, 5], [0, 2]]
    assert all(t <= 10 for t in _tokens(bins[1:], lengths))
    assert sorted(r for b in bins for r in b) == list(range(len(lengths)))


def test_no_budget_is_one_bin_of_every_row_in_order():
    assert pack_rows([5, 1, 7], 0) == [[0, 1, 2]]
    assert pack_rows([], 0) == [] and pack_rows([], 8) == []
    with pytest.raises(ValueError, match="budget=-1"):
        pack_rows([1], -1)


@pytest.mark.parametrize("seed", range(5))
def test_bins_cover_every_row_once_within_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 50, (40,), generator=g).tolist()
    bins = pack_rows(lengths, 64)
    assert sorted(r for b in bins for r in b) == list(range(40))
    assert all(t <= 64 for t in _tokens(bins, lengths))
    assert all(b == sorted(b) for b in bins)
    # first-fit decreasing is within 11/9 OPT + 1 bins; the volume bound is a lower bound on OPT
    assert len(bins) <= 11 / 9 * -(-sum(lengths) // 64) + 1


def test_split_to_splits_the_fullest_bin_of_several_rows():
    lengths = [10, 1, 1, 8, 8]
    bins = [[0], [1, 2], [3, 4]]
    assert split_to(bins, lengths, 3) == bins
    assert split_to(bins, lengths, 4) == [[0], [1, 2], [3], [4]]
    assert split_to(bins, lengths, 5) == [[0], [1], [2], [3], [4]]
    with pytest.raises(ValueError, match="cannot make 6 microbatches"):
        split_to(bins, lengths, 6)
    with pytest.raises(ValueError, match="cannot make 2 microbatches"):
        split_to(bins, lengths, 2)


def test_microbatches_one_process(single_process):
    valid_BT = torch.zeros(4, 10, dtype=torch.bool)
    for b, n in enumerate((6, 2, 9, 3)):
        valid_BT[b, :n] = True
    packed = microbatches(valid_BT, 10, packed=True)
    assert [r.tolist() for r in packed] == [[2], [0, 3], [1]]
    assert microbatches(valid_BT, 20, packed=False) == row_slices(4, 10, 20) == \
        [slice(0, 2), slice(2, 4)]
    whole = microbatches(valid_BT, 0, packed=True)
    assert len(whole) == 1 and is_whole(whole[0], 4)
    assert is_whole(slice(None), 4) and not is_whole(slice(0, 2), 4)
    assert not is_whole(torch.tensor([1, 0, 2, 3]), 4)


def test_balance_groups_evens_the_ranks_tokens_keeping_their_group_counts():
    """Every group once, each rank its count of groups, its own kept groups first; the ranks'
    tokens within one group's size of the best equal-count split (brute force)."""
    from itertools import combinations

    tokens = [[50, 40, 45, 60, 30], [5, 8, 3, 6, 4], [20, 22, 18, 25, 21]]
    plan = balance_groups(tokens)
    flat = [(r, g) for r in range(3) for g in range(5)]
    assert [len(h) for h in plan] == [5, 5, 5] and sorted(x for h in plan for x in h) == flat
    for r, held in enumerate(plan):
        own = [x for x in held if x[0] == r]
        assert held[:len(own)] == own == sorted(own) and held[len(own):] == sorted(held[len(own):])
    loads = [sum(tokens[r][g] for r, g in h) for h in plan]
    size = {x: tokens[x[0]][x[1]] for x in flat}
    best = min(max(sum(size[x] for x in a), sum(size[x] for x in b),
                   sum(size[x] for x in flat if x not in a + b))
               for a in combinations(flat, 5)
               for b in combinations([x for x in flat if x not in a], 5))
    assert max(loads) <= best + max(size.values()) and max(loads) < 0.6 * sum(tokens[0])


def test_balanced_ranks_move_no_group():
    assert balance_groups([[5, 7], [7, 5]]) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    assert balance_groups([[3]]) == [[(0, 0)]]
