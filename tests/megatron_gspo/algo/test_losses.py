"""GSPO / GSPO-token / GRPO losses vs a float64 loop reference and hand-worked numbers."""

import math

import pytest
import torch

from megatron_gspo.config.loss import ClipRange
from megatron_gspo.algo.losses import (PolicyLossConfig, clip_range, clipped_surrogate,
                                       get_policy_loss, policy_loss)

NAMES = ("gspo", "gspo_token", "grpo")
D = torch.float64


# ----------------------------------------------------------------------------- reference


def _ref_clip(w, a, eps_low, eps_high):
    """Paper's min(w A, clip(w) A) with explicit branches; returns (term, low, high)."""
    wv = float(w)
    if wv > 1 + eps_high:
        c = torch.tensor(1 + eps_high, dtype=D)
    elif wv < 1 - eps_low:
        c = torch.tensor(1 - eps_low, dtype=D)
    else:
        c = w
    unclipped, clipped = w * a, c * a
    use_clipped = float(clipped) < float(unclipped)
    return (clipped if use_clipped else unclipped), use_clipped and a < 0, use_clipped and a > 0


def reference_loss(name, logp, old, adv, mask, eps_low, eps_high):
    """Float64 loss and token/seq clip fractions written from the paper with python loops."""
    B, T = logp.shape
    seq_objs, clipped_tokens, seq_fracs = [], 0, []
    n_tokens = 0
    for i in range(B):
        idx = [t for t in range(T) if mask[i][t]]
        a = float(adv[i])
        n_tokens += len(idx)
        if name == "grpo":
            terms, n_clip = [], 0
            for t in idx:
                term, lo, hi = _ref_clip(torch.exp(logp[i, t] - old[i, t]), a, eps_low, eps_high)
                terms.append(term)
                n_clip += lo or hi
            seq_objs.append(sum(terms) / len(idx))
        else:
            s = torch.exp(sum(logp[i, t] - old[i, t] for t in idx) / len(idx))
            if name == "gspo":
                term, lo, hi = _ref_clip(s, a, eps_low, eps_high)
                seq_objs.append(term)
            else:  # gspo_token
                terms = []
                for t in idx:
                    s_it = s.detach() * torch.exp(logp[i, t] - logp[i, t].detach())
                    term, lo, hi = _ref_clip(s_it, a, eps_low, eps_high)
                    terms.append(term)
                seq_objs.append(sum(terms) / len(idx))
            n_clip = len(idx) if (lo or hi) else 0
        clipped_tokens += n_clip
        seq_fracs.append(n_clip / len(idx))
    loss = -sum(seq_objs) / B
    return loss, clipped_tokens / n_tokens, sum(seq_fracs) / B


def random_batch(seed, B=5, T=8, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = [8, 3, 5, 1, 6][:B]
    starts = [0, 2, 1, 4, 2][:B]
    mask = torch.zeros(B, T)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        mask[i, s:s + n] = 1
    old = -torch.rand(B, T, generator=g, dtype=D) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=D) * scale
    adv = torch.tensor([1.0, -0.7, 0.4, -1.3, 2.0][:B], dtype=D)
    return logp, old, adv, mask


def run(name, logp, old, adv, mask, ref=None, eps_low=None, eps_high=None, **cfg_kwargs):
    logp = logp.detach().clone().requires_grad_(True)
    clip = None if eps_low is None else ClipRange(eps_low=eps_low, eps_high=eps_high)
    cfg = PolicyLossConfig(name, settings=clip, **cfg_kwargs)
    loss, metrics = get_policy_loss(name)(logp, old, adv, mask, cfg, ref_logp_BT=ref)
    loss.backward()
    return loss.detach(), logp.grad, metrics


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name,scale", [("grpo", 0.3), ("gspo", 1e-3), ("gspo_token", 1e-3)])
def test_matches_float64_loop_reference(name, scale):
    logp, old, adv, mask = random_batch(0, scale=scale)
    cfg = PolicyLossConfig(name)
    loss, grad, m = run(name, logp, old, adv, mask)
    lp = logp.clone().requires_grad_(True)
    ref_loss, tok_frac, seq_frac = reference_loss(name, lp, old, adv, mask, *clip_range(cfg))
    ref_loss.backward()
    assert 0 < tok_frac < 1 and 0 < seq_frac < 1  # the case exercises clipping
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-12)
    torch.testing.assert_close(grad, lp.grad, rtol=1e-10, atol=1e-12)
    assert m["policy/clip_frac/token"] == pytest.approx(tok_frac)
    assert m["policy/clip_frac/seq"] == pytest.approx(seq_frac)
    assert m["policy/loss"] == pytest.approx(ref_loss.item())
    assert (grad[mask == 0] == 0).all()


def test_gspo_token_equals_gspo_for_equal_token_advantages():
    logp, old, adv, mask = random_batch(1, scale=1e-3)
    logp[0] = old[0] + 1e-3  # A > 0, s = e^1e-3 > 1 + 4e-4: clipped
    logp[3] = old[3] + 50.0  # one sequence beyond the max_log_ratio clamp (A < 0: unclipped)
    lg, gg, mg = run("gspo", logp, old, adv, mask)
    adv_BT = adv[:, None].expand(-1, logp.shape[1]).clone()
    for a in (adv, adv_BT):
        lt, gt, mt = run("gspo_token", logp, old, a, mask)
        assert 0 < mg["policy/clip_frac/seq"] < 1
        assert lt.item() == pytest.approx(lg.item(), abs=1e-12)
        torch.testing.assert_close(gt, gg, rtol=1e-10, atol=1e-13)
        assert mt.keys() == mg.keys()
        for k in mg:
            assert mt[k] == pytest.approx(mg[k], rel=1e-12, abs=1e-12), k
    assert (gg[3] == 0).all()  # clamp zeroes the gradient beyond it
    assert gg.abs().sum() > 0


def test_gspo_equals_grpo_for_one_token_responses():
    g = torch.Generator().manual_seed(2)
    B, T = 6, 4
    mask = torch.zeros(B, T)
    mask[torch.arange(B), torch.tensor([0, 3, 1, 2, 0, 3])] = 1
    old = -torch.rand(B, T, generator=g, dtype=D)
    logp = old + torch.randn(B, T, generator=g, dtype=D) * 0.2
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=D)
    eps = dict(eps_low=0.05, eps_high=0.08)
    lg, gg, mg = run("grpo", logp, old, adv, mask, **eps)
    ls, gs, ms = run("gspo", logp, old, adv, mask, **eps)
    assert 0 < mg["policy/clip_frac/token"] < 1
    assert ls.item() == pytest.approx(lg.item(), abs=1e-14)
    torch.testing.assert_close(gs, gg, rtol=1e-12, atol=1e-14)
    for k in mg:
        assert ms[k] == pytest.approx(mg[k], abs=1e-12), k


@pytest.mark.parametrize("name", NAMES)
def test_unit_ratios_give_minus_mean_advantage(name):
    logp, _, adv, mask = random_batch(3)
    loss, grad, m = run(name, logp, logp.clone(), adv, mask)
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-14)
    assert m["policy/ratio/mean"] == m["policy/ratio/min"] == m["policy/ratio/max"] == 1.0
    assert m["policy/clip_frac/token"] == m["policy/clip_frac/seq"] == 0.0
    # d loss / d logp_it = -A_i / (B |y_i|) for all three at ratio 1
    n = mask.sum(1, keepdim=True)
    torch.testing.assert_close(grad, -(adv[:, None] / (5 * n)) * mask, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_masked_positions_and_padding_change_nothing(name):
    logp, old, adv, mask = random_batch(4, scale=0.3 if name == "grpo" else 1e-3)
    ref = old - 0.1
    base = run(name, logp, old, adv, mask, ref=ref, kl_coef=0.1)
    junk_logp, junk_old, junk_ref = logp.clone(), old.clone(), ref.clone()
    m0 = mask == 0
    junk_logp[m0] = torch.tensor([1e30, float("inf"), -float("inf"), float("nan")],
                                 dtype=D).repeat(int(m0.sum()))[:int(m0.sum())]
    junk_old[m0] = -float("inf")
    junk_ref[m0] = float("nan")
    for mk in (mask, mask.bool()):
        out = run(name, junk_logp, junk_old, adv, mk, ref=junk_ref, kl_coef=0.1)
        assert out[0].item() == base[0].item()
        assert torch.equal(out[1], base[1])
        assert out[2] == base[2]
    pad = lambda x, v: torch.cat([x, torch.full((x.shape[0], 3), v, dtype=x.dtype)], 1)
    out = run(name, pad(logp, 5e3), pad(old, -7.0), adv, pad(mask, 0), ref=pad(ref, 9.0),
              kl_coef=0.1)
    assert out[0].item() == pytest.approx(base[0].item(), abs=1e-15)
    torch.testing.assert_close(out[1][:, :8], base[1], rtol=1e-14, atol=1e-16)
    assert (out[1][:, 8:] == 0).all()
    assert out[2] == pytest.approx(base[2], abs=1e-15)


def test_clip_fractions_hand_worked_grpo():
    # eps (0.2, 0.27). Row 0 (A=+1, 3 tokens): w = 1.5 (high-clipped), 0.5 (A>0: unclipped),
    # 1.0. Row 1 (A=-1, 2 tokens): w = 0.5 (low-clipped), 1.5 (A<0: unclipped branch active).
    lr = torch.tensor([[math.log(1.5), math.log(0.5), 0.0], [math.log(0.5), math.log(1.5), 0.0]],
                      dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, _, m = run("grpo", lr, torch.zeros(2, 3, dtype=D), torch.tensor([1.0, -1.0], dtype=D),
                     mask)
    assert m["policy/clip_frac/token"] == pytest.approx(2 / 5)
    assert m["policy/clip_frac/token_low"] == pytest.approx(1 / 5)
    assert m["policy/clip_frac/token_high"] == pytest.approx(1 / 5)
    assert m["policy/clip_frac/seq"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert m["policy/clip_frac/seq_low"] == pytest.approx((0 + 1 / 2) / 2)
    assert m["policy/clip_frac/seq_high"] == pytest.approx((1 / 3 + 0) / 2)
    # row 0: (1.27 + 0.5 + 1) / 3; row 1: (-0.8 - 1.5) / 2
    assert loss.item() == pytest.approx(-((1.27 + 0.5 + 1.0) / 3 + (-0.8 - 1.5) / 2) / 2)
    assert (m["policy/ratio/mean"], m["policy/ratio/min"], m["policy/ratio/max"]) == \
        pytest.approx((1.0, 0.5, 1.5))
    assert m["policy/log_ratio/abs_max"] == pytest.approx(math.log(2))


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_clip_fractions_hand_worked_gspo(name):
    # eps (3e-4, 4e-4). Lengths 2, 1, 3. Row 0: mean lr 1e-3, A=+1 -> high-clipped (2 tokens).
    # Row 1: lr -1e-3, A=-0.5 -> low-clipped (1 token). Row 2: mean lr 1e-4, A=2 -> in range.
    lr = torch.tensor([[2e-3, 0.0, 0.0], [-1e-3, 0.0, 0.0], [1e-4, 1e-4, 1e-4]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=D)
    loss, grad, m = run(name, lr, torch.zeros(3, 3, dtype=D), adv, mask)
    assert m["policy/clip_frac/token"] == pytest.approx(3 / 6)
    assert m["policy/clip_frac/token_high"] == pytest.approx(2 / 6)
    assert m["policy/clip_frac/token_low"] == pytest.approx(1 / 6)
    assert m["policy/clip_frac/seq"] == pytest.approx(2 / 3)
    assert m["policy/clip_frac/seq_high"] == pytest.approx(1 / 3)
    assert m["policy/clip_frac/seq_low"] == pytest.approx(1 / 3)
    s2 = math.exp(1e-4)
    assert loss.item() == pytest.approx(-(1.0004 * 1 + 0.9997 * -0.5 + s2 * 2) / 3, abs=1e-14)
    assert m["policy/ratio/max"] == pytest.approx(math.exp(1e-3))
    assert m["policy/ratio/min"] == pytest.approx(math.exp(-1e-3))
    # only row 2 carries gradient: -(1/3) * A * s / |y| per token
    expected = torch.zeros(3, 3, dtype=D)
    expected[2] = -(1 / 3) * 2 * s2 / 3
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_aggregation_is_per_sequence(name):
    # Lengths 1 and 3, A = (+1, -1), log-ratios in the clip range: s0 = e^2e-4, s1 = e^1e-4.
    lr = torch.tensor([[2e-4, 0.0, 0.0], [1e-4, 1e-4, 1e-4]], dtype=D)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0], dtype=D)
    loss, grad, _ = run(name, lr, torch.zeros(2, 3, dtype=D), adv, mask)
    s0, s1 = math.exp(2e-4), math.exp(1e-4)
    per_seq = -(s0 - s1) / 2                      # the paper: one term per sequence
    token_mean_batch = -(s0 - 3 * s1) / 4         # over-weights the long response
    seq_mean_token_sum = -(s0 - 3 * s1) / 2
    assert loss.item() == pytest.approx(per_seq, abs=1e-14)
    assert abs(per_seq - token_mean_batch) > 0.4 and abs(per_seq - seq_mean_token_sum) > 0.9
    # gradient: -(1/B) A_i s_i / |y_i| per token (token-mean-over-batch would be -A s / 4)
    expected = torch.tensor([[-s0 / 2, 0, 0], [s1 / 6, s1 / 6, s1 / 6]], dtype=D)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_huge_log_ratios_stay_finite(name):
    logp, old, adv, mask = random_batch(5)
    logp[0] = old[0] + 1000.0
    logp[1] = old[1] - 1000.0
    loss, grad, m = run(name, logp, old, adv, mask, ref=old, kl_coef=0.5)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in m.values())
    assert m["policy/log_ratio/abs_max"] == pytest.approx(1000.0)
    assert m["policy/ratio/max"] == pytest.approx(math.exp(20.0))
    # float32 too (exp(mean lr) overflows float32 at ~88 without the clamp)
    loss32, grad32, _ = run(name, logp.float(), old.float(), adv.float(), mask)
    assert torch.isfinite(loss32) and torch.isfinite(grad32).all()


def test_kl_k3_hand_worked():
    # d = ref - logp. Row 0: d = (-0.5, 1.0); row 1 (1 token): d = -0.2.
    logp = torch.tensor([[-1.0, -2.0], [-1.0, 0.0]], dtype=D)
    ref = torch.tensor([[-1.5, -1.0], [-1.2, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1], [1, 0]])
    k3 = lambda d: math.exp(d) - d - 1
    kl = ((k3(-0.5) + k3(1.0)) / 2 + k3(-0.2)) / 2
    assert kl == pytest.approx(((0.1065307 + 0.7182818) / 2 + 0.0187308) / 2, abs=1e-6)
    adv = torch.tensor([0.5, -1.5], dtype=D)
    for name in NAMES:
        loss, grad, m = run(name, logp, logp.clone(), adv, mask, ref=ref, kl_coef=0.1)
        assert m["policy/kl"] == pytest.approx(kl)
        assert loss.item() == pytest.approx(0.5 + 0.1 * kl)  # -mean(A) + coef * kl
        # d/dlogp of coef * k3 / (B |y_i|) is coef * (1 - e^d) / (B |y_i|), plus -A_i/(B |y_i|)
        expected = torch.tensor([[(0.1 * (1 - math.exp(-0.5)) - 0.5) / 4,
                                  (0.1 * (1 - math.exp(1.0)) - 0.5) / 4],
                                 [(0.1 * (1 - math.exp(-0.2)) + 1.5) / 2, 0.0]], dtype=D)
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
        loss0, _, m0 = run(name, logp, logp.clone(), adv, mask, ref=ref)  # kl_coef=0: logged
        assert loss0.item() == pytest.approx(0.5) and m0["policy/kl"] == pytest.approx(kl)
        assert run(name, logp, logp.clone(), adv, mask)[2]["policy/kl"] == 0.0
        with pytest.raises(ValueError, match="kl_coef"):
            run(name, logp, logp.clone(), adv, mask, kl_coef=0.1)


def test_bad_inputs_raise():
    logp, old, adv, mask = random_batch(7)
    cfg = PolicyLossConfig("gspo")
    with pytest.raises(ValueError, match="old_logp_BT"):
        policy_loss(logp, old[:, :-1], adv, mask, cfg)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, adv[:-1], mask, cfg)
    with pytest.raises(ValueError, match="advantages"):  # token advantages only for gspo_token
        policy_loss(logp, old, adv[:, None].expand(-1, 8), mask, cfg)
    empty = mask.clone()
    empty[2] = 0
    with pytest.raises(ValueError, match=r"rows \[2\]"):
        policy_loss(logp, old, adv, empty, cfg)
    bad = logp.clone()
    bad[1, 3] = float("nan")  # unmasked (row 1 covers columns 2..4)
    with pytest.raises(ValueError, match=r"logp_BT is NaN .*rows \[1\]"):
        policy_loss(bad, old, adv, mask, cfg)
    with pytest.raises(ValueError, match="advantages contain NaN"):
        policy_loss(logp, old, torch.full_like(adv, float("nan")), mask, cfg)
    with pytest.raises(ValueError, match="0 and 1"):
        policy_loss(logp, old, adv, mask * 0.5, cfg)


def test_clipped_surrogate_branches():
    # eps 0.25 (exact in binary); the last two sit exactly on the bounds: not clipped.
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1, 1.0, 1.25, 0.75])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, 0.0, 1.0, -1.0])
    term, low, high = clipped_surrogate(ratio, adv, 0.25, 0.25)
    torch.testing.assert_close(term, torch.tensor([1.25, -1.5, 0.5, -0.75, 2.2, 0.0, 1.25, -0.75]))
    assert low.tolist() == [False, False, False, True, False, False, False, False]
    assert high.tolist() == [True, False, False, False, False, False, False, False]


def test_zero_advantage_is_never_clipped():
    """Guards `adv < 0` / `adv > 0` in clipped_surrogate: with A = 0 both branches of the min are
    0, so no branch is "active" (verl's count); counting them would inflate the clip fractions
    with every zero-variance group."""
    ratio = torch.tensor([0.1, 10.0, 1.0], dtype=D)
    term, low, high = clipped_surrogate(ratio, torch.zeros(3, dtype=D), 0.2, 0.27)
    assert term.tolist() == [0.0, 0.0, 0.0]
    assert not low.any() and not high.any()
    # through the losses: row 0 has A = 0 and ratios far outside both clip bounds
    lr = torch.tensor([[math.log(0.1), math.log(10.0)], [0.0, 0.0]], dtype=D)
    adv = torch.tensor([0.0, 1.0], dtype=D)
    for name in NAMES:
        _, _, m = run(name, lr, torch.zeros(2, 2, dtype=D), adv, torch.ones(2, 2))
        for k in ("token", "seq", "token_low", "seq_low", "token_high", "seq_high"):
            assert m[f"policy/clip_frac/{k}"] == 0.0, (name, k)


def test_log_ratio_abs_max_is_per_sequence_for_gspo():
    """Guards the abs_max metric of gspo / gspo_token: it is the largest |sequence mean
    log-ratio| (the quantity the clamp acts on), not the largest token log-ratio (grpo's)."""
    lr = torch.tensor([[0.5, -0.5], [0.1, 0.3]], dtype=D)  # means 0 and 0.2 (tokens up to 0.5)
    adv = torch.tensor([1.0, -1.0], dtype=D)
    for name, want in (("gspo", 0.2), ("gspo_token", 0.2), ("grpo", 0.5)):
        _, _, m = run(name, lr, torch.zeros(2, 2, dtype=D), adv, torch.ones(2, 2))
        assert m["policy/log_ratio/abs_max"] == pytest.approx(want, abs=1e-15), name


def test_gspo_token_equals_gspo_exactly_at_the_clamp_bound():
    """At |mean log-ratio| = max_log_ratio itself gspo's gradient is torch.clamp's at its bound
    (1 up to torch 2.13, 0 from torch 2.14): gspo_token must follow the same rule, in every
    torch version, or the two differ there."""
    x = torch.tensor(0.5, dtype=D, requires_grad=True)
    x.clamp(-0.5, 0.5).backward()
    passes = x.grad.item()  # this torch's clamp gradient at the bound
    lr = torch.tensor([[0.5, 0.5], [0.1, -0.3]], dtype=D)  # row 0: mean exactly 0.5
    adv = torch.tensor([-1.0, 0.5], dtype=D)  # A < 0, s > 1: the unclipped branch is active
    lg, gg, _ = run("gspo", lr, torch.zeros(2, 2, dtype=D), adv, torch.ones(2, 2),
                    max_log_ratio=0.5)
    lt, gt, _ = run("gspo_token", lr, torch.zeros(2, 2, dtype=D), adv, torch.ones(2, 2),
                    max_log_ratio=0.5)
    # d/dlogp of -(1/B) A s / |y| per token, s = e^0.5, where the clamp passes the gradient
    torch.testing.assert_close(gg[0], torch.full((2,), passes * math.exp(0.5) / 4, dtype=D),
                               rtol=1e-12, atol=0)
    assert lt.item() == pytest.approx(lg.item(), abs=1e-15)
    torch.testing.assert_close(gt, gg, rtol=1e-12, atol=1e-15)
    assert gt[1].abs().min() > 0  # row 1 inside the clamp: both pass the gradient


def test_gspo_token_with_a_minus_inf_token_logp_stays_finite():
    """Guards gspo_token's isfinite() on the token factor: logp = -inf on a response token
    (the trainer gives a sampled token probability 0) makes logp - sg[logp] NaN; the sequence
    ratio is clamped there, so the loss and gradient are gspo's, finite."""
    logp = torch.tensor([[-0.1, -float("inf"), -0.2], [-0.5, -0.4, 0.0]], dtype=D)
    old = torch.full((2, 3), -0.3, dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([0.5, -1.0], dtype=D)
    lg, gg, mg = run("gspo", logp, old, adv, mask)
    lt, gt, mt = run("gspo_token", logp, old, adv, mask)
    assert math.isfinite(lt.item()) and torch.isfinite(gt).all()
    assert lt.item() == pytest.approx(lg.item(), abs=1e-15)
    torch.testing.assert_close(gt, gg, rtol=1e-12, atol=1e-15)
    assert mt["policy/ratio/min"] == pytest.approx(math.exp(-20.0))


@pytest.mark.parametrize("name", NAMES)
def test_low_precision_inputs_are_computed_in_float32(name):
    """Guards _prepare's promotion to >= float32: bf16 log-probs give the loss of their float32
    values (bf16 arithmetic would round mean log-ratios of ~1e-3 and the ratios to 1)."""
    logp, old, adv, mask = random_batch(8, scale=0.3 if name == "grpo" else 1e-2)
    lp16 = logp.to(torch.bfloat16).requires_grad_(True)
    loss16, m16 = policy_loss(lp16, old.to(torch.bfloat16), adv.to(torch.bfloat16), mask,
                              PolicyLossConfig(name))
    loss32, m32 = policy_loss(lp16.detach().float(), old.to(torch.bfloat16).float(),
                              adv.to(torch.bfloat16).float(), mask, PolicyLossConfig(name))
    assert loss16.dtype == torch.float32
    assert loss16.item() == pytest.approx(loss32.item(), rel=1e-6)
    assert m16 == pytest.approx(m32, rel=1e-6)
