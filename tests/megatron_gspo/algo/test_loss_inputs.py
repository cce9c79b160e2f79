"""Policy losses: config defaults and validation, the registry, input validation, what gets no
gradient and the clamp's both sides (the math is in test_losses.py)."""

import math

import pytest
import torch

from megatron_gspo.algo import losses
from megatron_gspo.algo.losses import (POLICY_LOSSES, PolicyLossConfig, clip_range,
                                       get_policy_loss, policy_loss, register_policy_loss)
from megatron_gspo.config import parts
from megatron_gspo.config.loss import ClipRange
from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import ConfigError, UnknownName
from megatron_gspo.run.names import check_names
from tests.megatron_gspo.algo.test_losses import random_batch

NAMES = ("gspo", "gspo_token", "grpo")
D = torch.float64


def small_batch():
    """B=2, T=3; row 1 has one masked position (column 2)."""
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]], dtype=D)
    old = logp + torch.tensor([[1e-4, -2e-4, 3e-4], [2e-4, 1e-4, 0.0]], dtype=D)
    adv = torch.tensor([0.5, -1.5], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return logp, old, adv, mask


# ----------------------------------------------------------------------------- config / registry


def test_config_defaults_validation_and_registry():
    assert sorted(POLICY_LOSSES) == ["grpo", "gspo", "gspo_token"]
    for name, lo, hi in (("gspo", 3e-4, 4e-4), ("gspo_token", 3e-4, 4e-4), ("grpo", 0.2, 0.27)):
        cfg = PolicyLossConfig(name)
        assert (*clip_range(cfg), cfg.kl_coef, cfg.max_log_ratio) == (lo, hi, 0.0, 20.0)
        assert cfg.settings is None  # the loss's own defaults, derived at use
        assert (cfg.eps_low, cfg.eps_high) == (lo, hi)  # read as their keys are
    assert PolicyLossConfig().name == "gspo"
    cfg = PolicyLossConfig("grpo", settings=ClipRange(eps_low=0.1, eps_high=0.0))
    assert (cfg.eps_low, cfg.eps_high) == (0.1, 0.0) == clip_range(cfg)
    for field, value in (("eps_low", -0.1), ("eps_low", 1.0), ("eps_high", -1e-3),
                         ("eps_high", math.inf)):
        with pytest.raises(ValueError, match=f"^loss.{field}="):
            ClipRange(**{"eps_low": 0.1, "eps_high": 0.1, field: value})
    for field, value in (("kl_coef", -1.0), ("max_log_ratio", 0.0), ("max_log_ratio", math.nan)):
        with pytest.raises(ValueError, match=f"^loss.{field}="):
            PolicyLossConfig("gspo", **{field: value})
    for call in (lambda: get_policy_loss("ppo"), lambda: clip_range(PolicyLossConfig("ppo"))):
        with pytest.raises(KeyError, match=r"'ppo'.*\['grpo', 'gspo', 'gspo_token'\]"):
            call()
    with pytest.raises(AttributeError):
        cfg.eps_low = 0.5  # frozen


def test_policy_loss_dispatches_on_name():
    logp, old, adv, mask = random_batch(6, scale=0.05)
    for name in NAMES:
        cfg = PolicyLossConfig(name)
        a, ma = policy_loss(logp, old, adv, mask, cfg)
        b, mb = get_policy_loss(name)(logp, old, adv, mask, cfg)
        assert a.item() == b.item() and ma == mb
    assert policy_loss(logp, old, adv, mask, PolicyLossConfig("grpo"))[0].item() != \
        policy_loss(logp, old, adv, mask, PolicyLossConfig("gspo"))[0].item()


def test_config_accepts_zero_eps_low_and_rejects_non_numbers():
    """Guards the loss section's checks: eps_low = 0 is in [0, 1); a bool, a string or a tiny
    negative kl_coef is a ConfigError (a ValueError) naming the key (not a TypeError or
    silently accepted)."""
    cfg = PolicyLossConfig("grpo", settings=ClipRange(eps_low=0.0, eps_high=0.1))
    assert (cfg.eps_low, cfg.eps_high) == (0.0, 0.1)
    for field, value in (("eps_high", True), ("eps_low", "0.1")):
        with pytest.raises(ConfigError, match=f"^loss.{field}="):
            ClipRange(**{"eps_low": 0.1, "eps_high": 0.1, field: value})
    for field, value in (("kl_coef", -1e-3), ("max_log_ratio", None), ("tis_cap", False)):
        with pytest.raises(ConfigError, match=f"^loss.{field}="):
            PolicyLossConfig("gspo", **{field: value})


def test_unknown_loss_error_is_a_value_error_with_a_plain_message():
    """Guards UnknownName: config loaders catch ValueError, and str() is the message itself,
    not KeyError's repr() of it (quoted, with escaped quotes). A config naming the loss is
    refused by the set-up check, naming the key."""
    with pytest.raises(ValueError) as info:
        clip_range(PolicyLossConfig("ppo"))
    assert isinstance(info.value, KeyError) and isinstance(info.value, UnknownName)
    assert str(info.value).startswith("unknown policy loss 'ppo'")
    with pytest.raises(ValueError) as info:
        get_policy_loss("ppo")
    assert str(info.value) == ("unknown policy loss 'ppo'; valid names: "
                               "['grpo', 'gspo', 'gspo_token']")
    with pytest.raises(ConfigError) as info:
        check_names(load_config(None, ["loss.name=ppo"]))
    assert str(info.value) == ("loss.name=ppo: unknown policy loss; valid: "
                               "['grpo', 'gspo', 'gspo_token']")


def test_register_refuses_a_duplicate_name_and_a_loss_without_eps_needs_them(monkeypatch):
    """Guards register_policy_loss's duplicate check (a second "grpo" would silently replace
    the real one) and the "no default" error for a loss registered without eps."""
    monkeypatch.setattr(losses, "POLICY_LOSSES", dict(losses.POLICY_LOSSES))
    monkeypatch.setitem(parts.SETTINGS, "loss", dict(parts.SETTINGS["loss"]))
    grpo = losses.POLICY_LOSSES["grpo"]
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_policy_loss("grpo")(lambda *a, **k: None)
    assert losses.POLICY_LOSSES["grpo"] is grpo
    register_policy_loss("no_eps")(grpo)
    with pytest.raises(ValueError, match=r"^loss.eps_low: loss 'no_eps' has no default for it"):
        clip_range(PolicyLossConfig("no_eps"))
    with pytest.raises(ConfigError, match=r"^loss.eps_low: loss 'no_eps' has no default"):
        check_names(load_config(None, ["loss.name=no_eps"]))
    cfg = PolicyLossConfig("no_eps", settings=ClipRange(eps_low=0.1, eps_high=0.2))
    assert (cfg.eps_low, cfg.eps_high) == (0.1, 0.2) == clip_range(cfg)


# ----------------------------------------------------------------------------- input validation


@pytest.mark.parametrize("name", NAMES)
def test_bad_logp_mask_and_optional_input_shapes_raise(name):
    """Guards _prepare's checks on logp_BT (2-D float), mask_BT (required) and the shapes of
    the optional ref_logp_BT / is_weight_BT: each is a ValueError naming the input."""
    logp, old, adv, mask = small_batch()
    cfg = PolicyLossConfig(name)
    with pytest.raises(ValueError, match=r"logp_BT must be a float tensor \[B, T\]"):
        policy_loss(logp[0], old[0], adv[:1], mask[0], cfg)
    with pytest.raises(ValueError, match=r"logp_BT must be a float tensor .*torch.int64"):
        policy_loss(logp.long(), old, adv, mask, cfg)
    with pytest.raises(ValueError, match="mask_BT must have shape"):
        policy_loss(logp, old, adv, None, cfg)
    with pytest.raises(ValueError, match="ref_logp_BT must have shape"):
        policy_loss(logp, old, adv, mask, cfg, ref_logp_BT=old[:, :2])
    with pytest.raises(ValueError, match="is_weight_BT must have shape"):
        policy_loss(logp, old, adv, mask, cfg, is_weight_BT=torch.ones(2, 1, dtype=D))


@pytest.mark.parametrize("name", NAMES)
def test_minus_inf_minus_minus_inf_on_a_response_token_raises(name):
    """Guards the NaN check on logp - old: both -inf on an unmasked token is inf - inf = NaN,
    an error naming the row (each input alone is not NaN)."""
    logp, old, adv, mask = small_batch()
    logp[1, 0] = old[1, 0] = -float("inf")
    with pytest.raises(ValueError, match=r"logp_BT - old_logp_BT .*rows \[1\]"):
        policy_loss(logp, old, adv, mask, PolicyLossConfig(name))


@pytest.mark.parametrize("name", NAMES)
def test_nan_in_a_constant_input_names_that_input_and_its_rows(name):
    """Guards the per-input NaN checks: NaN on response tokens of old_logp / ref_logp /
    is_weight is reported under that input's name with every bad row (not as logp - old)."""
    logp, old, adv, mask = small_batch()
    cfg = PolicyLossConfig(name)
    bad = torch.zeros(2, 3, dtype=D)
    bad[0, 1] = bad[1, 0] = float("nan")
    ones = torch.ones(2, 3, dtype=D)
    for key, kwargs in (("old_logp_BT", {}), ("ref_logp_BT", {"ref_logp_BT": old + bad}),
                        ("is_weight_BT", {"is_weight_BT": ones + bad})):
        o = old + bad if key == "old_logp_BT" else old
        with pytest.raises(ValueError, match=rf"^{key} is NaN .*rows \[0, 1\]$"):
            policy_loss(logp, o, adv, mask, cfg, **kwargs)


def test_token_advantages_are_ignored_at_masked_positions():
    """Guards gspo_token's token advantages: NaN / inf at masked positions is neither an error
    nor leaks into the loss or its gradient (padding can hold anything)."""
    logp, old, adv, mask = small_batch()
    adv_BT = adv[:, None].expand(-1, 3).clone()
    junk = adv_BT.clone()
    junk[1, 2] = float("nan")
    outs = []
    for a in (adv_BT, junk):
        lp = logp.clone().requires_grad_(True)
        loss, m = policy_loss(lp, old, a, mask, PolicyLossConfig("gspo_token"))
        loss.backward()
        outs.append((loss.item(), lp.grad, m))
    assert outs[1][0] == outs[0][0] and outs[1][2] == outs[0][2]
    assert torch.equal(outs[1][1], outs[0][1])
    junk[0, 1] = float("nan")  # unmasked: an error
    with pytest.raises(ValueError, match="advantages contain NaN"):
        policy_loss(logp, old, junk, mask, PolicyLossConfig("gspo_token"))


@pytest.mark.parametrize("name", NAMES)
def test_is_weights_are_ignored_at_masked_positions(name):
    """Guards the masking of is_weight_BT: NaN / inf weights on padding change neither the loss
    nor the gradient (torch.where would still pass NaN * 0 into the gradient)."""
    logp, old, adv, mask = small_batch()
    w = torch.tensor([[0.5, 1.0, 2.0], [1.5, 0.25, 1.0]], dtype=D)
    junk = w.clone()
    junk[1, 2] = float("nan")
    outs = []
    for weights in (w, junk):
        lp = logp.clone().requires_grad_(True)
        loss, _ = policy_loss(lp, old, adv, mask, PolicyLossConfig(name), is_weight_BT=weights)
        loss.backward()
        outs.append((loss.item(), lp.grad))
    assert outs[1][0] == outs[0][0]
    assert torch.equal(outs[1][1], outs[0][1]) and torch.isfinite(outs[1][1]).all()


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("name", NAMES)
def test_only_logp_gets_a_gradient(name):
    """Guards the detach() of old_logp, ref_logp, advantages and IS weights: they are constants
    of the objective even when they carry autograd history."""
    logp, old, adv, mask = small_batch()
    lp = logp.clone().requires_grad_(True)
    consts = [old.clone().requires_grad_(True), adv.clone().requires_grad_(True),
              (old - 0.3).requires_grad_(True), torch.full((2, 3), 0.8, dtype=D,
                                                           requires_grad=True)]
    loss, _ = policy_loss(lp, *consts[:2], mask, PolicyLossConfig(name, kl_coef=0.1),
                          ref_logp_BT=consts[2], is_weight_BT=consts[3])
    loss.backward()
    assert lp.grad.abs().sum() > 0
    assert [c.grad for c in consts] == [None] * 4


@pytest.mark.parametrize("name", NAMES)
def test_old_logp_that_is_logp_itself_is_a_constant(name):
    """Guards old_logp's detach(): passing the policy's own logp as pi_old (on-policy, one
    update) gives ratio 1 and the policy gradient -A_i / (B |y_i|), not log-ratio 0 with zero
    gradient."""
    logp, _, adv, mask = small_batch()
    lp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, lp, adv, mask, PolicyLossConfig(name))
    loss.backward()
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-15)
    n = mask.sum(1, keepdim=True).to(D)
    torch.testing.assert_close(lp.grad, -(adv[:, None] / (2 * n)) * mask, rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------- clamp, dispatch


@pytest.mark.parametrize("name", NAMES)
def test_log_ratio_clamp_is_two_sided(name):
    """Guards the lower side of the log-ratio clamp: a log-ratio of -1000 gives ratio
    exp(-max_log_ratio) (min metric), as +1000 gives exp(+max_log_ratio)."""
    logp, old, adv, mask = small_batch()
    logp[0] = old[0] - 1000.0
    logp[1] = old[1] + 1000.0
    _, m = policy_loss(logp, old, adv, mask, PolicyLossConfig(name, max_log_ratio=5.0))
    assert m["policy/ratio/min"] == pytest.approx(math.exp(-5.0), rel=1e-12)
    assert m["policy/ratio/max"] == pytest.approx(math.exp(5.0), rel=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_kl_exponent_clamp_is_two_sided(name):
    """Guards both sides of the clamp on d = ref - logp in the k3 KL: at d = -1000 the token's
    k3 is e^-c + c - 1 (c = max_log_ratio), not 999, and its gradient is zero; at d = +1000
    it is e^c - c - 1."""
    c = 5.0
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], dtype=D)
    ref = logp + torch.tensor([[-1000.0, 1000.0], [0.0, 0.0]], dtype=D)
    mask = torch.ones(2, 2)
    adv = torch.tensor([1.0, -1.0], dtype=D)
    lp = logp.clone().requires_grad_(True)
    loss, m = policy_loss(lp, logp, adv, mask, PolicyLossConfig(name, kl_coef=0.1,
                                                                max_log_ratio=c),
                          ref_logp_BT=ref)
    loss.backward()
    kl = ((math.exp(-c) + c - 1) + (math.exp(c) - c - 1)) / 2 / 2  # row 1 has d = 0
    assert m["policy/kl"] == pytest.approx(kl, rel=1e-12)
    assert loss.item() == pytest.approx(0.0 + 0.1 * kl, rel=1e-12)  # -mean(A) = 0
    # the clamp zeroes the KL gradient of row 0; what is left is the policy term -A/(B |y|)
    torch.testing.assert_close(lp.grad, -(adv[:, None] / 4).expand(2, 2), rtol=1e-12, atol=0)


def test_policy_loss_forwards_ref_and_is_weights():
    """Guards the dispatcher: policy_loss passes ref_logp_BT and is_weight_BT on to the loss
    (dropping the reference would silently turn the KL penalty off)."""
    logp, old, adv, mask = small_batch()
    ref = old - 0.2
    w = torch.tensor([[0.5, 1.0, 2.0], [1.5, 0.25, 1.0]], dtype=D)
    for name in NAMES:
        cfg = PolicyLossConfig(name, kl_coef=0.5)
        got, mg = policy_loss(logp, old, adv, mask, cfg, ref_logp_BT=ref, is_weight_BT=w)
        want, mw = get_policy_loss(name)(logp, old, adv, mask, cfg, ref_logp_BT=ref,
                                         is_weight_BT=w)
        assert got.item() == want.item() and mg == mw and mg["policy/kl"] > 0
