"""The corrections in the losses vs a float64 loop reference (a masked token leaves its
sequence's token-mean, an IcePop-zeroed one stays in it, a dropped sequence adds 0 and still
counts in the mean over sequences), and in the trainer with a sampler shifted on some rows."""

import math

import pytest
import torch

from megatron_gspo.algo.corrections import correction_inputs
from megatron_gspo.algo.losses import PolicyLossConfig, policy_loss
from tests.megatron_gspo.algo.test_corrections import ratios

D = torch.float64
EPS = {"grpo": (0.2, 0.27), "gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4)}
# expected per option on test_corrections' ratios: (tokens in each sequence's mean, weights)
T5, T4, T3 = [0, 1, 2, 3, 4], [0, 1, 2, 3], [0, 1, 2]
CASES = {
    "is_mask_token": ([0.5, 2.0], [[0, 1, 3], T5, T4, T3], None),
    "is_mask_seq": ([0.8, 1.22], [T5, T5, [], T3], None),
    "icepop": ([0.5, 5.0], [T5, T5, T4, T3],
               [[1, 2, 0, 1.25, 4], [0.8, 0.5, 1, 1, 1.25], [1.25] * 4, [0.8] * 3]),
}


def policy(seed=0):
    """The current policy's log-probs near pi_old (so GRPO clips some tokens), advantages."""
    old, sampler, mask = ratios()
    g = torch.Generator().manual_seed(seed)
    logp = (old + 0.3 * torch.randn(old.shape, generator=g, dtype=D)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.7, 0.9, -1.3], dtype=D)
    return logp, old, sampler, adv, mask


def ref_clip(r, a, lo, hi):
    return torch.minimum(r * a, r.clamp(1 - lo, 1 + hi) * a)


def reference(name, logp, old, adv, keep, w):
    """-(1/B) sum_i obj_i over ALL B sequences; obj_i over the kept tokens K_i (0 if none):
    grpo mean_K w_t min(r_t A, clip(r_t) A); gspo min(s A, clip(s) A) mean_K w_t with
    s = exp(mean_K log r); gspo_token mean_K w_t min(s_t A, clip(s_t) A) with
    s_t = sg[s] r_t / sg[r_t]."""
    lo, hi = EPS[name]
    objs = []
    for i, idx in enumerate(keep):
        wi = [1.0] * len(idx) if w is None else [w[i][t] for t in idx]
        lr = [logp[i, t] - old[i, t] for t in idx]
        a = float(adv[i])
        if not idx:
            objs.append(torch.zeros((), dtype=D))
        elif name == "grpo":
            objs.append(sum(wt * ref_clip(torch.exp(x), a, lo, hi) for wt, x in zip(wi, lr))
                        / len(idx))
        elif name == "gspo":
            s = torch.exp(sum(lr) / len(idx))
            objs.append(ref_clip(s, a, lo, hi) * sum(wi) / len(idx))
        else:
            s = torch.exp(sum(lr) / len(idx)).detach()
            s_t = [s * torch.exp(logp[i, t] - logp[i, t].detach()) for t in idx]
            objs.append(sum(wt * ref_clip(st, a, lo, hi) for wt, st in zip(wi, s_t)) / len(idx))
    return -sum(objs) / len(keep)


def corrected(name, option, logp, old, sampler, adv, mask):
    cfg = PolicyLossConfig(name=name, **{option: CASES[option][0]})
    kwargs, _ = correction_inputs(old, sampler, mask, cfg)
    return policy_loss(logp, old, adv, mask, cfg, **kwargs)


@pytest.mark.parametrize("name", list(EPS))
@pytest.mark.parametrize("option", list(CASES))
def test_loss_and_grad_match_the_float64_reference(name, option):
    logp, old, sampler, adv, mask = policy()
    loss, metrics = corrected(name, option, logp, old, sampler, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    _, keep, w = CASES[option]
    ref = reference(name, logp, old, adv, keep, w)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert float(loss) == pytest.approx(float(ref), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
    kept = torch.zeros_like(mask)
    for i, idx in enumerate(keep):
        kept[i, idx] = True
    assert not grad[~kept].any()  # no gradient reaches a dropped or padded token
    plain = reference(name, logp, old, adv, [T5, T5, T4, T3], None)
    assert abs(float(plain) - float(loss)) > 1e-5  # the correction changed the loss
    assert metrics["policy/loss"] == pytest.approx(float(loss), rel=1e-12)


@pytest.mark.parametrize("name", list(EPS))
def test_keep_all_is_the_uncorrected_loss_bit_for_bit(name):
    """A keep mask that keeps every token changes nothing, to the bit (as the defaults must)."""
    logp, old, _, adv, mask = policy()
    cfg = PolicyLossConfig(name=name)
    plain, m_plain = policy_loss(logp, old, adv, mask, cfg)
    kept, m_kept = policy_loss(logp, old, adv, mask, cfg, keep_BT=torch.ones_like(mask))
    assert torch.equal(plain, kept) and m_plain == m_kept


@pytest.mark.parametrize("name", list(EPS))
def test_a_batch_with_every_token_dropped_is_a_zero_loss(name):
    """Every sequence dropped: loss 0 with a zero gradient (not NaN), ratio stats NaN (there are
    none), clip fractions 0."""
    logp, old, _, adv, mask = policy()
    loss, m = policy_loss(logp, old, adv, mask, PolicyLossConfig(name=name),
                          keep_BT=torch.zeros_like(mask))
    (grad,) = torch.autograd.grad(loss, logp)
    assert float(loss) == 0.0 and not grad.any()
    assert math.isnan(m["policy/ratio/mean"]) and m["policy/clip_frac/token"] == 0.0


def test_clip_fraction_and_ratio_stats_count_the_kept_tokens_only():
    """GRPO's clip fraction is over the kept tokens; GSPO's sequence ratios over the sequences
    that keep a token."""
    logp, old, sampler, adv, mask = policy()
    _, m = corrected("grpo", "is_mask_token", logp, old, sampler, adv, mask)
    lo, hi = EPS["grpo"]
    keep = CASES["is_mask_token"][1]
    r = [(float(torch.exp(logp[i, t] - old[i, t])), float(adv[i])) for i, idx in enumerate(keep)
         for t in idx]
    clipped = [(a < 0 and x < 1 - lo) or (a > 0 and x > 1 + hi) for x, a in r]
    assert 0 < sum(clipped) < len(r)
    assert m["policy/clip_frac/token"] == pytest.approx(sum(clipped) / len(r), rel=1e-12)
    assert m["policy/ratio/max"] == pytest.approx(max(x for x, _ in r), rel=1e-12)
    _, m = corrected("grpo", "is_mask_seq", logp, old, sampler, adv, mask)  # row 2 dropped
    r = [(float(torch.exp(logp[i, t] - old[i, t])), float(adv[i]))
         for i, idx in enumerate(CASES["is_mask_seq"][1]) for t in idx]
    clipped = [(a < 0 and x < 1 - lo) or (a > 0 and x > 1 + hi) for x, a in r]
    assert m["policy/clip_frac/token"] == pytest.approx(sum(clipped) / len(r), rel=1e-12)
    _, m = corrected("gspo", "is_mask_seq", logp, old, sampler, adv, mask)
    s = [math.exp(sum(float(logp[i, t] - old[i, t]) for t in idx) / len(idx))
         for i, idx in enumerate(CASES["is_mask_seq"][1]) if idx]
    assert m["policy/ratio/mean"] == pytest.approx(sum(s) / len(s), rel=1e-12)


def test_keep_shape_is_checked():
    logp, old, _, adv, mask = policy()
    with pytest.raises(ValueError, match=r"keep_BT must have shape \(4, 5\)"):
        policy_loss(logp, old, adv, mask, PolicyLossConfig(name="grpo"),
                    keep_BT=torch.ones(4, 4, dtype=torch.bool))


# ----------------------------------------------------------------------------- in the trainer


def shift_two_rows(s, prompts=None, params=None):
    """The sampler reports rows 1 and 6 one nat less likely than it sampled them (rho = e)."""
    s.logp_BT[[1, 6]] -= s.response_BT[[1, 6]].to(s.logp_BT.dtype)


@pytest.fixture(scope="module")
def shifted_run(tmp_path_factory):
    """One trainer (lr 0, one minibatch) and its first rollout batch, pi_old's pass done."""
    from tests.megatron_gspo.samplers import backend
    from tests.megatron_gspo.jobs.trainers import make_trainer

    trainer = make_trainer(tmp_path_factory.mktemp("corr"), "train.steps=1", "optim.lr=0.0",
                           "train.num_minibatches=1", backend("shift_two_rows", shift_two_rows))
    batch = trainer.rollout(0)
    full, _ = trainer.prepare(batch)
    yield trainer, trainer.cfg, batch, full
    trainer.rt.close()


@pytest.mark.parametrize("option, band, drops", [
    ("is_mask_seq", [0.5, 2], True), ("is_mask_token", [0.5, 2], True),
    ("icepop", [0.5, 2], True), ("is_mask_seq", [0.3, 3], False)])
def test_the_trainer_drops_only_the_rows_whose_ratio_leaves_the_band(shifted_run, option, band,
                                                                     drops):
    """pi == pi_old on the first minibatch, so each kept sequence's GRPO objective is its
    advantage and the loss is -(1/B) * (sum of the kept rows' advantages); the shifted rows
    (rho = e, outside [0.5, 2], inside [0.3, 3]) add nothing but still count in B."""
    from dataclasses import replace

    trainer, cfg, batch, full = shifted_run
    trainer.cfg = replace(cfg, loss=replace(cfg.loss, **{option: band}))
    resp = full.response_BT.bool()
    gap_B = ((full.old_logp_BT - batch.sampler_logp_BT).abs() * resp).amax(-1)
    off = gap_B > 0.5
    assert int(off.sum()) == 2 and float(gap_B[~off].max()) < 1e-4
    adv = full.adv_B.double()
    assert abs(float(adv[off].sum())) > 0.1  # dropping the shifted rows moves the loss
    m = trainer.train_step(full, first=True)
    kept = ~off if drops else torch.ones_like(off)
    assert m["policy/loss"] == pytest.approx(-float(adv[kept].sum()) / len(adv), abs=1e-5)
    assert m["policy/is_masked_frac/seq"] == pytest.approx(float(off.sum()) / len(adv) * drops)
    assert m["policy/is_masked_frac/token"] == pytest.approx(
        float(resp[off].sum() / resp.sum()) * drops)
