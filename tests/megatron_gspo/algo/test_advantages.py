"""Group advantages: hand-worked groups, population std, zero-variance groups, bad input."""

import math

import pytest
import torch

from megatron_gspo.algo.advantages import group_advantages


def test_hand_worked_groups_and_metrics():
    # Group 0: r = 0,1,2,3 -> mean 1.5, population std sqrt(1.25). Group 1: all 2 -> zeros.
    rewards = torch.tensor([0.0, 1.0, 2.0, 3.0, 2.0, 2.0, 2.0, 2.0])
    adv, m = group_advantages(rewards, group_size=4, eps=1e-6)
    std = math.sqrt(1.25)
    expected = [x / (std + 1e-6) for x in (-1.5, -0.5, 0.5, 1.5)] + [0.0] * 4
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=0)
    assert (adv[4:] == 0).all()  # exactly zero, not 0 / eps noise
    assert m["adv/zero_std_frac"] == 0.5
    assert m["adv/mean"] == pytest.approx(0.0, abs=1e-12)
    # population std over 8: sum of squares = (2.25+.25+.25+2.25)/1.25 = 4 -> sqrt(4/8)
    assert m["adv/std"] == pytest.approx(math.sqrt(0.5), rel=1e-5)
    assert m["reward/group_std/mean"] == pytest.approx(std / 2)


def test_population_std_not_bessel():
    adv, _ = group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), 2, eps=0.0)
    # population std 0.5 -> +-1 (Bessel would give +-0.7071)
    assert adv.tolist() == [-1.0, 1.0]


def test_group_major_layout():
    # G=2: groups (0, 1) and (10, 30); an interleaved layout would pair 0 with 10.
    adv, m = group_advantages(torch.tensor([0.0, 1.0, 10.0, 30.0], dtype=torch.float64), 2, 0.0)
    assert adv.tolist() == [-1.0, 1.0, -1.0, 1.0]
    assert m["reward/group_std/mean"] == pytest.approx((0.5 + 10.0) / 2)
    assert m["adv/zero_std_frac"] == 0.0


def test_all_groups_zero_variance_and_dtypes():
    rewards = torch.tensor([0.3, 0.3, 0.3, -1.0, -1.0, -1.0], dtype=torch.float16)
    adv, m = group_advantages(rewards, 3)
    assert adv.dtype == torch.float16 and (adv == 0).all()
    assert m["adv/zero_std_frac"] == 1.0 and m["adv/std"] == 0.0
    # rounding-level spread (std 5e-16 < 1e-12) is zero variance too, even with eps=0
    adv_tiny, m_tiny = group_advantages(torch.tensor([1.0, 1.0 + 1e-15], dtype=torch.float64),
                                        2, eps=0.0)
    assert adv_tiny.tolist() == [0.0, 0.0] and m_tiny["adv/zero_std_frac"] == 1.0
    adv_int, _ = group_advantages(torch.tensor([0, 1, 1, 1]), 2)  # integer rewards -> float32
    assert adv_int.dtype == torch.float32
    assert adv_int.tolist() == pytest.approx([-0.5 / (0.5 + 1e-6), 0.5 / (0.5 + 1e-6), 0.0, 0.0])


def test_float64_internal_precision():
    # float32 rewards 2^24 and 2^24 + 2: their mean 2^24 + 1 is not a float32, so a float32
    # computation gives deviations (0, 2) or (-2, 0); float64 gives exactly -1, +1.
    rewards = torch.tensor([2.0**24, 2.0**24 + 2], dtype=torch.float32)
    assert rewards.mean().item() != 2.0**24 + 1
    adv, m = group_advantages(rewards, 2, eps=0.0)
    assert adv.tolist() == [-1.0, 1.0] and m["reward/group_std/mean"] == 1.0


@pytest.mark.parametrize("rewards,group_size,match", [
    (torch.zeros(8), 1, "group_size=1"),
    (torch.zeros(8), 0, "group_size=0"),
    (torch.zeros(8), True, "group_size=True"),
    (torch.zeros(8), 3, "8 entries.*group_size=3"),
    (torch.zeros(0), 2, "0 entries"),
    (torch.zeros(2, 4), 2, "1-D"),
    (torch.tensor([0.0, float("nan"), 1.0, 1.0]), 2, r"not finite at indices \[1\]"),
    (torch.tensor([0.0, 1.0, 1.0, -float("inf")]), 2, r"not finite at indices \[3\]"),
    (torch.zeros(8), 2.0, "group_size=2.0"),
])
def test_bad_input_raises(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size)


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), "1e-6", None])
def test_bad_eps_raises(eps):
    """Guards the eps check: a negative eps can make std + eps vanish (a division by ~0)."""
    with pytest.raises(ValueError, match="eps="):
        group_advantages(torch.tensor([0.0, 1.0]), 2, eps=eps)


def test_group_at_exactly_the_zero_std_tolerance_has_signal():
    """Guards the strict `std < ZERO_STD_TOL`: population std exactly 1e-12 is a group with
    signal, as filters.group_has_signal (`>=`) keeps it; otherwise dynamic sampling keeps a
    group whose advantages are all 0."""
    from megatron_gspo.algo.advantages import ZERO_STD_TOL
    from megatron_gspo.rollout.filters import group_has_signal

    r = torch.tensor([0.0, 2e-12], dtype=torch.float64)
    assert r.std(unbiased=False).item() == ZERO_STD_TOL == 1e-12
    adv, m = group_advantages(r, 2, eps=0.0)
    assert adv.tolist() == [-1.0, 1.0] and m["adv/zero_std_frac"] == 0.0
    assert group_has_signal(r, 2).tolist() == [True]


def test_advantages_carry_no_gradient():
    """Guards the detach(): rewards with autograd history (a learned reward) give constant
    advantages."""
    rewards = torch.tensor([0.0, 1.0, 3.0, 2.0], requires_grad=True)
    adv, _ = group_advantages(rewards, 2)
    assert not adv.requires_grad
