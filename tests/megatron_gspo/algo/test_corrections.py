"""Train-inference corrections (loss.is_mask_token, is_mask_seq, icepop): which tokens each
keeps and weights on hand-built ratios with known answers, their metrics and their config."""

import math

import pytest
import torch

from megatron_gspo.algo.corrections import correction_inputs, tis_weights
from megatron_gspo.algo.losses import PolicyLossConfig
from megatron_gspo.config.schema import ConfigError, load_config

D = torch.float64
# (pi_old, pi_sampler) per token; rho = pi_old / pi_sampler. Rows 0-2 have 5 tokens, row 3 has
# 3 and row 2's last token is off the mask. The products of 2, 0.5, 1.25 and 0.8 are exact.
PROBS = [[(0.5, 0.5), (0.5, 0.25), (0.125, 0.5), (0.5, 0.4), (0.5, 0.125)],  # 1 2 .25 1.25 4
         [(0.4, 0.5), (0.25, 0.5), (0.3, 0.3), (0.7, 0.7), (0.5, 0.4)],     # .8 .5 1 1 1.25
         [(0.5, 0.4), (0.5, 0.4), (0.5, 0.4), (0.5, 0.4), (0.25, 0.5)],     # 1.25 x4 | .5
         [(0.4, 0.5), (0.4, 0.5), (0.4, 0.5), (0.9, 0.1), (0.9, 0.1)]]      # .8 x3 | 9 9
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]],
                    dtype=torch.bool)


def ratios():
    old = torch.tensor([[math.log(p) for p, _ in row] for row in PROBS], dtype=D)
    sampler = torch.tensor([[math.log(q) for _, q in row] for row in PROBS], dtype=D)
    return old, sampler, MASK.clone()


def inputs(**options):
    old, sampler, mask = ratios()
    return correction_inputs(old, sampler, mask, PolicyLossConfig(name="grpo", **options))


def test_nothing_on_gives_nothing_and_tis_alone_is_tis_weights():
    """Guards the default: no correction, no keyword for the loss (the golden run's path)."""
    assert inputs() == ({}, {})
    old, sampler, mask = ratios()
    kwargs, metrics = inputs(tis_cap=1.5)
    w, stats = tis_weights(old, sampler, mask, 1.5)
    assert set(kwargs) == {"is_weight_BT"} and torch.equal(kwargs["is_weight_BT"], w)
    assert metrics == stats


def test_token_mask_keeps_the_closed_band_of_pi_old_over_pi_sampler():
    """rho = 2 and 0.5 sit on the band's edges and stay; 0.25 and 4 leave. (The inverse ratio
    pi_sampler / pi_old, or an open band, would keep other tokens.)"""
    kwargs, metrics = inputs(is_mask_token=[0.5, 2.0])
    assert set(kwargs) == {"keep_BT"}
    assert kwargs["keep_BT"].tolist() == [[True, True, False, True, False], [True] * 5,
                                          [True] * 4 + [False], [True] * 3 + [False] * 2]
    assert metrics["policy/is_masked_frac/token"] == pytest.approx(2 / 17, abs=1e-15)
    assert metrics["policy/is_masked_frac/seq"] == pytest.approx((2 / 5) / 4, abs=1e-15)


def test_an_asymmetric_band_tells_the_ratios_direction():
    """[0.3, 5]: rho = 4 stays and rho = 0.25 leaves; read as pi_sampler / pi_old (0.25 and 4)
    they would swap."""
    kwargs, _ = inputs(is_mask_token=[0.3, 5.0])
    assert kwargs["keep_BT"][0].tolist() == [True, True, False, True, True]
    assert kwargs["keep_BT"][1].tolist() == [True] * 5


def test_seq_mask_uses_the_geometric_mean_over_the_response_tokens():
    """Geometric means: row 0 2.5^(1/5) = 1.2011, row 1 0.5^(1/5) = 0.8706, row 2 1.25 (its
    off-mask 0.5 excluded; with it 1.0407), row 3 exactly 0.8 (its off-mask 9s excluded). Band
    [0.8, 1.22]: rows 0, 1, 3 stay (3 on the edge), row 2 leaves; the product ratio (2.5, 0.5,
    2.44, 0.512) would drop rows 0-3."""
    log_rho = torch.tensor([math.log(0.4) - math.log(0.5)] * 3, dtype=D)
    assert float(torch.exp(log_rho.sum() / 3)) == 0.8  # row 3's edge case is exact
    kwargs, metrics = inputs(is_mask_seq=[0.8, 1.22])
    assert set(kwargs) == {"keep_BT"}
    keep = kwargs["keep_BT"]
    assert keep.tolist() == [[True] * 5, [True] * 5, [False] * 5, [True] * 3 + [False] * 2]
    assert metrics["policy/is_masked_frac/token"] == pytest.approx(4 / 17, abs=1e-15)
    assert metrics["policy/is_masked_frac/seq"] == pytest.approx(1 / 4, abs=1e-15)


def test_icepop_weight_is_the_ratio_inside_alpha_beta_and_zero_outside():
    """IcePop's M(rho; 0.5, 5): rho itself inside (not 1, not truncated), 0 outside, 1 off the
    mask; the band is [alpha, beta], not [1/beta, beta] (which would keep rho = 0.25)."""
    kwargs, metrics = inputs(icepop=[0.5, 5.0])
    assert set(kwargs) == {"is_weight_BT"}
    expected = torch.tensor([[1, 2, 0, 1.25, 4], [0.8, 0.5, 1, 1, 1.25], [1.25] * 4 + [1],
                             [0.8] * 3 + [1, 1]], dtype=D)
    torch.testing.assert_close(kwargs["is_weight_BT"], expected, rtol=1e-15, atol=0)
    assert metrics["policy/is_masked_frac/token"] == pytest.approx(1 / 17, abs=1e-15)
    assert metrics["policy/is_masked_frac/seq"] == pytest.approx((1 / 5) / 4, abs=1e-15)


def test_masks_combine_by_and_and_icepop_weighs_what_they_keep():
    """All three on: keep = token band AND sequence band; weights are IcePop's; a token
    dropped by any of them counts once in is_masked_frac."""
    kwargs, metrics = inputs(is_mask_token=[0.5, 2.0], is_mask_seq=[0.8, 1.22],
                             icepop=[0.5, 5.0])
    assert kwargs["keep_BT"].tolist() == [[True, True, False, True, False], [True] * 5,
                                          [False] * 5, [True] * 3 + [False] * 2]
    assert float(kwargs["is_weight_BT"][0, 4]) == pytest.approx(4.0)  # weight, not the mask
    assert metrics["policy/is_masked_frac/token"] == pytest.approx(6 / 17, abs=1e-15)
    assert metrics["policy/is_masked_frac/seq"] == pytest.approx((2 / 5 + 1) / 4, abs=1e-15)


def test_float32_inputs_give_float32_weights_and_the_same_keep():
    """(Off the edges: float32 log-probs round rho = 2 to either side of a band at 2.)"""
    old, sampler, mask = ratios()
    cfg = PolicyLossConfig(name="grpo", is_mask_token=[0.45, 2.2], icepop=[0.45, 5.0])
    k64, _ = correction_inputs(old, sampler, mask, cfg)
    k32, _ = correction_inputs(old.float(), sampler.float(), mask.long(), cfg)
    assert k32["is_weight_BT"].dtype == torch.float32 and k32["keep_BT"].dtype == torch.bool
    assert torch.equal(k32["keep_BT"], k64["keep_BT"])
    torch.testing.assert_close(k32["is_weight_BT"], k64["is_weight_BT"].float())


def test_nan_ratio_on_the_mask_is_an_error_off_the_mask_ignored():
    """A NaN log-prob would fail every band silently (NaN compares false): an error naming the
    row instead; off the mask it is ignored."""
    old, sampler, mask = ratios()
    sampler[2, 4] = float("nan")  # off the mask
    cfg = PolicyLossConfig(name="grpo", is_mask_seq=[0.8, 1.22])
    correction_inputs(old, sampler, mask, cfg)
    sampler[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"NaN at response tokens of rows \[1\]"):
        correction_inputs(old, sampler, mask, cfg)


def test_an_infinite_ratio_leaves_every_band():
    old, sampler, mask = ratios()
    sampler[1, 2] = -float("inf")  # pi_sampler = 0: rho = inf
    kwargs, _ = correction_inputs(old, sampler, mask, PolicyLossConfig(
        name="grpo", is_mask_token=[0.5, 2.0], is_mask_seq=[0.1, 10.0]))
    assert not kwargs["keep_BT"][1].any()
    w, _ = correction_inputs(old, sampler, mask, PolicyLossConfig(name="grpo", icepop=[0.5, 5]))
    assert float(w["is_weight_BT"][1, 2]) == 0.0 and torch.isfinite(w["is_weight_BT"]).all()


# ----------------------------------------------------------------------------- config

BANDS = ["is_mask_token", "is_mask_seq", "icepop"]


@pytest.mark.parametrize("key", BANDS)
@pytest.mark.parametrize("value", ["[0,2]", "[1.2,2]", "[0.5,0.9]", "[1,1]", "[0.5]",
                                   "[0.5,2,3]", "[true,2]", "[0.5,.inf]", "[.nan,2]", "abc"])
def test_a_bad_band_is_a_config_error_naming_the_key(key, value):
    """Guards the band check: two finite ratios with 0 < low <= 1 <= high, low < high (a band
    without 1 would drop the tokens where the sampler and the trainer agree)."""
    with pytest.raises(ConfigError, match=rf"^loss\.{key}=.*0 < low <= 1 <= high"):
        load_config(None, [f"loss.{key}={value}"])
    with pytest.raises(ConfigError, match=rf"^loss\.{key}="):  # built in Python too
        PolicyLossConfig(name="grpo", **{key: [1.2, 2]})


@pytest.mark.parametrize("key", BANDS)
def test_band_edges_load_as_two_floats_and_round_trip(key):
    from megatron_gspo.config.schema import config_from_dict, config_to_dict

    cfg = load_config(None, [f"loss.{key}=[1,3]"])
    assert getattr(cfg.loss, key) == [1.0, 3.0]
    assert getattr(load_config(None, [f"loss.{key}=[0.25,1]"]).loss, key) == [0.25, 1.0]
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert getattr(PolicyLossConfig(name="gspo", **{key: [0.5, 2.0]}), key) == [0.5, 2.0]
    assert getattr(load_config(None).loss, key) is None


def test_icepop_with_tis_cap_is_refused():
    with pytest.raises(ConfigError, match=r"^loss\.icepop=\[0\.5, 5\.0\]: and loss\.tis_cap=2\.0"):
        load_config(None, ["loss.icepop=[0.5,5]", "loss.tis_cap=2"])
    cfg = load_config(None, ["loss.is_mask_seq=[0.5,2]", "loss.is_mask_token=[0.5,2]",
                             "loss.tis_cap=2"])
    assert cfg.loss.tis_cap == 2.0


@pytest.mark.parametrize("key", BANDS)
def test_a_band_with_the_samplers_logprobs_is_refused(key):
    """Guards RunConfig's rule as for tis_cap: with rollout.use_sampler_logprobs pi_old is the
    sampler's, so every ratio would be 1 and no band could act."""
    with pytest.raises(ConfigError, match=rf"^loss\.{key}=\[0\.5, 2\.0\] reads pi_old / pi_s"):
        load_config(None, [f"loss.{key}=[0.5,2]", "rollout.use_sampler_logprobs=true"])
