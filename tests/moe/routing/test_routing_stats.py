"""Routing statistics against hand-worked values and a Python-set reference."""

import math
import random

import pytest
import torch

from moe.routing.stats import flip_stats, load_stats, routing_metrics, topk_mask

# K=2, E=4, 3 tokens: token 0 keeps {0, 1} (listed in another order), token 1 swaps one expert
# ({2, 3} -> {3, 1}: overlap 1, union 3), token 2 swaps both ({0, 2} -> {1, 3}).
OLD = [[0, 1], [2, 3], [0, 2]]
NEW = [[1, 0], [3, 1], [1, 3]]


def ids(rows, dtype=torch.int64):
    return torch.tensor(rows, dtype=dtype)


def test_topk_mask_hand_case():
    mask = topk_mask(ids([[2, 0], [3, 1]]), 4)
    assert mask.tolist() == [[True, False, True, False], [False, True, False, True]]
    # K = E (every expert active) is a valid routing; K > E is not
    assert topk_mask(ids([[1, 0]]), 2).tolist() == [[True, True]]
    with pytest.raises(ValueError, match="K=3"):
        topk_mask(ids([[0, 1, 2]]), 2)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.int64])
def test_identical_routing(dtype):
    out = flip_stats(ids(OLD, dtype), ids(OLD, dtype), 4)
    assert out == {"flip_rate": 0.0, "any_flip": 0.0, "jaccard": 1.0}


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int64])
def test_flip_hand_case(dtype):
    out = flip_stats(ids(OLD, dtype), ids(NEW, dtype), 4)
    assert out["flip_rate"] == pytest.approx(3 / 6)
    assert out["any_flip"] == pytest.approx(2 / 3)
    assert out["jaccard"] == pytest.approx((1 + 1 / 3 + 0) / 3)


def test_permutation_within_row_is_not_a_flip():
    old = ids([[0, 1, 2], [3, 4, 5]])
    new = ids([[2, 0, 1], [5, 3, 4]])
    assert flip_stats(old, new, 6) == {"flip_rate": 0.0, "any_flip": 0.0, "jaccard": 1.0}


def test_padding_excluded():
    valid = torch.tensor([True, True, False])  # drop the token that changed both experts
    out = flip_stats(ids(OLD), ids(NEW), 4, valid)
    assert out["flip_rate"] == pytest.approx(1 / 4)
    assert out["any_flip"] == pytest.approx(1 / 2)
    assert out["jaccard"] == pytest.approx((1 + 1 / 3) / 2)
    with pytest.raises(ValueError, match="no valid token"):
        flip_stats(ids(OLD), ids(NEW), 4, torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="valid_N"):
        flip_stats(ids(OLD), ids(NEW), 4, torch.ones(3))
    with pytest.raises(ValueError, match=r"valid_N .*\(3,\)"):  # a bool mask of the wrong length
        flip_stats(ids(OLD), ids(NEW), 4, torch.ones(4, dtype=torch.bool))


def test_random_against_python_sets():
    rng = random.Random(0)
    N, K, E = 64, 3, 8
    old = [rng.sample(range(E), K) for _ in range(N)]
    new = [row if rng.random() < 0.4 else rng.sample(range(E), K) for row in old]
    valid = [rng.random() < 0.8 for _ in range(N)]
    pairs = [(set(o), set(n)) for o, n, v in zip(old, new, valid) if v]
    ref_flip = sum(len(n - o) for o, n in pairs) / (K * len(pairs))
    ref_any = sum(o != n for o, n in pairs) / len(pairs)
    ref_jac = sum(len(o & n) / len(o | n) for o, n in pairs) / len(pairs)
    out = flip_stats(ids(old, torch.uint8), ids(new, torch.int32), E, torch.tensor(valid))
    assert out["flip_rate"] == pytest.approx(ref_flip, abs=1e-12)
    assert out["any_flip"] == pytest.approx(ref_any, abs=1e-12)
    assert out["jaccard"] == pytest.approx(ref_jac, abs=1e-12)
    assert 0 < ref_flip < 1 and 0 < ref_any < 1


def test_bad_ids_raise():
    with pytest.raises(ValueError, match="expert id 4 at token 1"):
        topk_mask(ids([[0, 1], [4, 2]], torch.uint8), 4)
    with pytest.raises(ValueError, match="expert id -1"):
        topk_mask(ids([[0, -1]]), 4)
    with pytest.raises(ValueError, match=r"token 1 repeats .*\[2, 2\]"):
        topk_mask(ids([[0, 1], [2, 2]]), 4)
    with pytest.raises(ValueError, match="integer"):
        topk_mask(torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="num_experts=0"):
        topk_mask(ids(OLD), 0)
    with pytest.raises(ValueError, match=r"\(3, 2\).*\(2, 2\)"):
        flip_stats(ids(OLD), ids(NEW[:2]), 4)
    with pytest.raises(ValueError, match="repeats"):
        flip_stats(ids(OLD), ids([[0, 1], [2, 3], [1, 1]]), 4)


def test_topk_mask_rejects_malformed_shapes_and_expert_counts():
    """Guards topk_mask's own checks: ids that are not [N, K] with K >= 1, and an expert count
    that is not a positive int (a bool or float), raise a ValueError naming the problem; an
    empty [0, K] routing (a rank holding no token) is an empty [0, E] mask."""
    with pytest.raises(ValueError, match=r"2-D integer tensor \[N, K\], got shape \(2,\)"):
        topk_mask(ids([0, 1]), 4)
    with pytest.raises(ValueError, match=r"got shape \(1, 2, 1\)"):
        topk_mask(ids([[[0], [1]]]), 4)
    with pytest.raises(ValueError, match="K=0"):
        topk_mask(torch.zeros(3, 0, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="num_experts=True"):
        topk_mask(ids([[0]]), True)
    with pytest.raises(ValueError, match="num_experts=4.0"):
        topk_mask(ids([[0, 1]]), 4.0)
    empty = topk_mask(torch.zeros(0, 2, dtype=torch.uint8), 4)
    assert empty.shape == (0, 4) and empty.dtype == torch.bool


def test_bad_id_error_names_the_first_bad_slot():
    """With several out-of-range ids the error points at the first one in row-major order."""
    with pytest.raises(ValueError, match=r"expert id 5 at token 1, slot 1 "):
        topk_mask(ids([[0, 1], [2, 5], [7, 1]]), 4)


def test_load_stats_hand_case():
    # loads per expert: [3, 2, 1, 0], mean 1.5 -> max/mean 2, population std sqrt(1.25)
    skewed = ids([[0, 1], [0, 2], [0, 1]])
    out = load_stats(skewed, 4)
    assert out["load_imbalance"] == pytest.approx(2.0)
    assert out["load_cv"] == pytest.approx(math.sqrt(1.25) / 1.5)
    # without the last token: loads [2, 1, 1, 0], mean 1
    out = load_stats(skewed, 4, torch.tensor([True, True, False]))
    assert out["load_imbalance"] == pytest.approx(2.0)
    assert out["load_cv"] == pytest.approx(math.sqrt(0.5))
    assert load_stats(ids([[0, 1], [3, 2]], torch.uint8), 4) == {"load_imbalance": 1.0,
                                                                  "load_cv": 0.0}


def test_routing_metrics_two_layers():
    old = [ids(OLD, torch.uint8), ids(OLD, torch.uint8)]
    new = [ids(NEW, torch.uint8), ids(OLD, torch.uint8)]
    out = routing_metrics(old, new, 4)
    per_layer = [f"moe/{k}/layer_{l:02d}" for k in ("flip_rate", "any_flip", "jaccard",
                                                    "load_imbalance") for l in range(2)]
    summary = ["moe/flip_rate/mean", "moe/flip_rate/max", "moe/any_flip/mean",
               "moe/jaccard/mean", "moe/load_imbalance/mean"]
    assert set(out) == set(per_layer + summary)
    expected = {
        "moe/flip_rate/layer_00": 0.5, "moe/flip_rate/layer_01": 0.0,
        "moe/any_flip/layer_00": 2 / 3, "moe/any_flip/layer_01": 0.0,
        "moe/jaccard/layer_00": 4 / 9, "moe/jaccard/layer_01": 1.0,
        # new layer 0 loads [1, 3, 0, 2] -> 3 / 1.5; new layer 1 loads [2, 1, 2, 1] -> 2 / 1.5
        "moe/load_imbalance/layer_00": 2.0, "moe/load_imbalance/layer_01": 4 / 3,
        "moe/flip_rate/mean": 0.25, "moe/flip_rate/max": 0.5, "moe/any_flip/mean": 1 / 3,
        "moe/jaccard/mean": (4 / 9 + 1) / 2, "moe/load_imbalance/mean": (2 + 4 / 3) / 2}
    for key, value in expected.items():
        assert out[key] == pytest.approx(value), key
    valid = torch.tensor([True, True, False])
    masked = routing_metrics(old, new, 4, valid)
    assert masked["moe/flip_rate/layer_00"] == pytest.approx(0.25)
    # the loads skip the invalid token too: new layer 1 on tokens 0, 1 is [1, 1, 1, 1]
    assert masked["moe/load_imbalance/layer_01"] == pytest.approx(1.0)


def test_routing_metrics_layer_count_mismatch():
    with pytest.raises(ValueError, match="old_LNK has 2 layers but new_LNK has 1"):
        routing_metrics([ids(OLD), ids(OLD)], [ids(OLD)], 4)
    with pytest.raises(ValueError, match="at least one layer"):
        routing_metrics([], [], 4)
