"""Per-expert load (megatron_gspo.algo.expert_load): counts of a constructed routing's real
tokens (padding left out), summed over ranks and divided by the ranks holding the same tokens,
and the two statistics per layer against hand-computed values."""

import math

import pytest
import torch

from megatron_gspo import dist as dist_utils
from megatron_gspo.algo.expert_load import cache_copies, expert_load, load_metrics
from tests.megatron_gspo.test_dist_utils import peer  # noqa: F401 (a fixture)
from tests.moe.grads import dense_cache

E = 4


def constructed():
    """2 sequences x 3 columns (one padded position, routed to expert 3, which must not
    count), 2 layers, top-2 of 4: layer 0 sends every token to {0, 1}; layer 1 to {0, 1},
    {1, 2}, {2, 0}, {0, 1}, {1, 2}."""
    valid_BT = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    ids_BTLK = torch.tensor([3, 2]).expand(2, 3, 2, 2).clone()  # the padded position's
    layer1 = [[0, 1], [1, 2], [2, 0], [0, 1], [1, 2]]
    for n, (b, t) in enumerate(valid_BT.nonzero().tolist()):
        ids_BTLK[b, t, 0] = torch.tensor([0, 1])
        ids_BTLK[b, t, 1] = torch.tensor(layer1[n])
    return dense_cache(ids_BTLK, valid_BT, E)


def test_load_counts_every_real_token_once_per_expert_it_activates():
    load_LE = expert_load(constructed())
    assert load_LE.tolist() == [[5, 5, 0, 0], [3, 4, 3, 0]]
    assert load_LE.dtype == torch.float64


def test_load_is_summed_over_ranks_and_divided_by_the_copies(peer):  # noqa: F811
    """Rank 0 of 2 holds the constructed tokens, the other rank [1, 0, 0, 3] per layer: the
    sum; with copies=2 (two tensor-parallel ranks holding the same rows) half of it."""
    peer.append([[1, 0, 0, 3], [1, 0, 0, 3]])
    assert expert_load(constructed()).tolist() == [[6, 5, 0, 3], [4, 4, 3, 3]]
    peer.append([[5, 5, 0, 0], [3, 4, 3, 0]])  # the same tokens on the other rank
    assert expert_load(constructed(), copies=2).tolist() == [[5, 5, 0, 0], [3, 4, 3, 0]]
    assert dist_utils.world_size() == 2


def test_a_cache_of_whole_rows_is_on_every_tensor_parallel_rank():
    """Whole rows (packed, or tp=1): `tp` copies; a padded sequence-parallel shard: one."""
    cache = constructed()
    assert cache_copies(cache, torch.ones(2, 3, dtype=torch.bool), tp=2) == 2
    assert cache_copies(cache, torch.ones(2, 3, dtype=torch.bool), tp=1) == 1
    assert cache_copies(cache, torch.ones(2, 6, dtype=torch.bool), tp=2) == 1


def test_max_over_mean_and_cv_per_layer_and_their_mean():
    """Layer 0 [5, 5, 0, 0]: mean 2.5, max / mean 2, std 2.5, cv 1; layer 1 balanced: 1, 0;
    a layer without a token is NaN (not a division error) and left out of the mean."""
    out = load_metrics(torch.tensor([[5.0, 5, 0, 0], [3.0, 3, 3, 3], [0.0, 0, 0, 0]]))
    assert out["moe/expert_load/layer_00/max_over_mean"] == pytest.approx(2.0)
    assert out["moe/expert_load/layer_00/cv"] == pytest.approx(1.0)
    assert out["moe/expert_load/layer_01/max_over_mean"] == pytest.approx(1.0)
    assert out["moe/expert_load/layer_01/cv"] == pytest.approx(0.0)
    assert math.isnan(out["moe/expert_load/layer_02/cv"])
    assert out["moe/expert_load/mean/max_over_mean"] == pytest.approx(1.5)
    assert out["moe/expert_load/mean/cv"] == pytest.approx(0.5)
