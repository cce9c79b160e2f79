"""Truncated importance sampling (loss.tis_cap) vs a float64 loop reference."""

import math

import pytest
import torch

from megatron_gspo.algo.losses import PolicyLossConfig, policy_loss, tis_weights

D = torch.float64
EPS = {"grpo": (0.2, 0.27), "gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4)}


def batch(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=D) * 3).requires_grad_(True)
    old = logp.detach() + 0.05 * torch.randn(B, T, generator=g, dtype=D)
    sampler = old + 0.6 * torch.randn(B, T, generator=g, dtype=D)  # a large mismatch
    adv = torch.randn(B, generator=g, dtype=D)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        mask[b, 1 + b % 3:T - b % 2] = True
    return logp, old, sampler, adv, mask


def ref_clip(r, a, lo, hi):
    return min(r * a, min(max(r, 1 - lo), 1 + hi) * a)


def reference(name, logp, old, sampler, adv, mask, cap):
    """Per sequence: GRPO mean_t w_t min(r_t A, clip(r_t) A); GSPO min(s A, clip(s) A) times
    mean_t w_t; GSPO-token mean_t w_t min(s_t A, clip(s_t) A); w_t = min(exp(old - sampler), cap).
    Loss = -mean over sequences (float64 python loops)."""
    lo, hi = EPS[name]
    objs = []
    for i in range(logp.shape[0]):
        idx = [t for t in range(logp.shape[1]) if mask[i, t]]
        w = [min(math.exp(float(old[i, t] - sampler[i, t])), cap) for t in idx]
        lr = [logp[i, t] - old[i, t] for t in idx]
        a = float(adv[i])
        if name == "grpo":
            objs.append(sum(wt * ref_clip(torch.exp(x), a, lo, hi) for wt, x in zip(w, lr))
                        / len(idx))
        elif name == "gspo":
            s = torch.exp(sum(lr) / len(idx))
            objs.append(ref_clip(s, a, lo, hi) * sum(w) / len(idx))
        else:  # s_it = sg[s_i] exp(logp_it - sg[logp_it]): value s_i, gradient s_i per token
            s = torch.exp(sum(lr) / len(idx)).detach()
            s_t = [s * torch.exp(logp[i, t] - logp[i, t].detach()) for t in idx]
            objs.append(sum(wt * ref_clip(st, a, lo, hi) for wt, st in zip(w, s_t)) / len(idx))
    return -sum(objs) / len(objs)


@pytest.mark.parametrize("name", list(EPS))
@pytest.mark.parametrize("cap", [1.5, 1e9])
def test_tis_loss_and_grad_match_the_float64_reference(name, cap):
    logp, old, sampler, adv, mask = batch()
    w, stats = tis_weights(old, sampler, mask, cap)
    cfg = PolicyLossConfig(name=name, tis_cap=cap)
    loss, _ = policy_loss(logp, old, adv, mask, cfg, is_weight_BT=w)
    (grad,) = torch.autograd.grad(loss, logp)
    ref = reference(name, logp, old, sampler, adv, mask, cap)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert float(loss) == pytest.approx(float(ref), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
    # the weights matter: without them the loss differs
    plain, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig(name=name))
    assert abs(float(plain) - float(loss)) > 1e-3
    raw = [math.exp(float(old[b, t] - sampler[b, t])) for b, t in mask.nonzero().tolist()]
    assert stats["policy/tis/clip_frac"] == pytest.approx(sum(r > cap for r in raw) / len(raw))
    assert stats["policy/tis/max_raw"] == pytest.approx(max(raw))
    if cap == 1.5:
        assert 0 < stats["policy/tis/clip_frac"] < 1


def test_weights_are_one_off_the_mask_and_detached():
    logp, old, sampler, adv, mask = batch()
    w, _ = tis_weights(old.requires_grad_(True), sampler, mask, 2.0)
    assert not w.requires_grad
    assert bool((w[~mask] == 1).all()) and float(w.max()) <= 2.0


@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan")])
def test_bad_cap_is_an_error(cap):
    with pytest.raises(ValueError, match="tis_cap"):
        PolicyLossConfig(name="grpo", tis_cap=cap)


def test_tis_stats_count_masked_tokens_and_only_weights_above_the_cap():
    """Guards policy/tis/mean (the mean weight over the masked tokens, not over [B, T]) and
    policy/tis/clip_frac (raw > cap strictly: a weight equal to the cap is not truncated)."""
    old = torch.zeros(2, 3, dtype=D)
    # masked raw weights: 1 (= cap), 2 (truncated), 0.5, 1 (= cap); off the mask: 1
    sampler = torch.tensor([[0.0, -math.log(2.0), 0.0], [math.log(2.0), 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    w, stats = tis_weights(old, sampler, mask, cap=1.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [0.5, 1.0, 1.0]], dtype=D))
    assert stats["policy/tis/mean"] == pytest.approx(3.5 / 4)
    assert stats["policy/tis/clip_frac"] == pytest.approx(1 / 4)
    assert stats["policy/tis/max_raw"] == pytest.approx(2.0)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan")])
def test_tis_weights_rejects_a_bad_cap(cap):
    """Guards tis_weights' own cap check (callers other than PolicyLossConfig): cap 0 would
    zero every weight, NaN would pass `cap < 0`."""
    _, old, sampler, _, mask = batch()
    with pytest.raises(ValueError, match="tis cap="):
        tis_weights(old, sampler, mask, cap)


def test_tis_weights_edge_inputs():
    """Guards tis_weights on: a 0/1 integer mask (same as bool), float32 inputs (weights come
    back float32), an all-masked batch (weights 1, finite stats) and a huge log-ratio
    old - sampler = 1000 (weight = cap, max_raw finite: the exponent is clamped at 60)."""
    _, old, sampler, _, mask = batch()
    w_bool, s_bool = tis_weights(old, sampler, mask, 1.5)
    w_int, s_int = tis_weights(old, sampler, mask.long(), 1.5)
    assert torch.equal(w_int, w_bool) and s_int == s_bool
    w32, s32 = tis_weights(old.float(), sampler.float(), mask, 1.5)
    assert w32.dtype == torch.float32
    torch.testing.assert_close(w32, w_bool.float())
    w0, s0 = tis_weights(old, sampler, torch.zeros_like(mask), 1.5)
    assert (w0 == 1).all() and all(math.isfinite(v) for v in s0.values())
    assert s0["policy/tis/max_raw"] == 1.0 and s0["policy/tis/clip_frac"] == 0.0
    huge = sampler.clone()
    huge[0, 2] = old[0, 2] - 1000.0  # mask[0, 2] is True
    w_h, s_h = tis_weights(old, huge, mask, 1.5)
    assert w_h[0, 2] == 1.5
    assert math.isfinite(s_h["policy/tis/max_raw"]) and s_h["policy/tis/max_raw"] > 1e20
