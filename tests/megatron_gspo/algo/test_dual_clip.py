"""`loss.dual_clip` (dual-clip PPO, verl's clip_ratio_c): a negative-advantage token or
sequence whose ratio exceeds c adds the constant c A, with no gradient, in every loss; off by
default; counted in `policy/clip_frac/token_dual`."""

import math

import pytest
import torch

from tests.megatron_gspo.algo.test_losses import NAMES, run

D = torch.float64


def test_grpo_hand_worked():
    """Row 0 (A = -1): token ratios 5 (past c = 3: the term is 3 A, gradient 0), 2 (inside:
    r A, gradient A r) and 0.5 (low-clipped: 0.8 A). Row 1 (A = +1, ratio 5): high-clipped,
    untouched by the dual clip. Without it the first token adds 5 A and pulls with A r."""
    lr = torch.tensor([[math.log(5.0), math.log(2.0), math.log(0.5)],
                       [math.log(5.0), 0.0, 0.0]], dtype=D)
    old, adv = torch.zeros(2, 3, dtype=D), torch.tensor([-1.0, 1.0], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, grad, m = run("grpo", lr, old, adv, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx(-((-3.0 - 2.0 - 0.8) / 3 + 1.27) / 2)
    assert grad[0].tolist() == pytest.approx([0.0, 2.0 / 6, 0.0])
    assert m["policy/clip_frac/token_dual"] == pytest.approx(1 / 4)
    assert m["policy/log_ratio/abs_max"] == pytest.approx(math.log(5.0))
    off_loss, off_grad, off = run("grpo", lr, old, adv, mask)
    assert off_loss.item() == pytest.approx(-((-5.0 - 2.0 - 0.8) / 3 + 1.27) / 2)
    assert off_grad[0, 0].item() == pytest.approx(5.0 / 6)
    assert off["policy/clip_frac/token_dual"] == 0.0


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_sequence_ratio(name):
    """The sequence ratio exp(mean log-ratio) = 4 > c with A < 0: the sequence adds c A and
    sends no gradient; at c = 5 it is inside and pulls as without the dual clip."""
    lr = torch.tensor([[math.log(2.0), math.log(8.0)]], dtype=D)
    old, adv, mask = torch.zeros(1, 2, dtype=D), torch.tensor([-1.0], dtype=D), torch.ones(1, 2)
    loss, grad, m = run(name, lr, old, adv, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0) and grad.abs().max() == 0
    assert m["policy/clip_frac/token_dual"] == 1.0
    inside, base = run(name, lr, old, adv, mask, dual_clip=5.0), run(name, lr, old, adv, mask)
    assert inside[0].item() == pytest.approx(base[0].item()) == pytest.approx(4.0)
    torch.testing.assert_close(inside[1], base[1])
    assert inside[2]["policy/clip_frac/token_dual"] == 0.0


def test_positive_advantages_and_small_ratios_are_untouched():
    """A > 0, or a ratio below c: every loss is the same with and without the dual clip."""
    g = torch.Generator().manual_seed(0)
    lr = torch.randn(4, 5, generator=g, dtype=D) * 0.5
    adv = torch.tensor([1.0, 0.5, -0.2, -1.0], dtype=D)
    mask = torch.ones(4, 5)
    for name in NAMES:
        with_c, without = run(name, lr, torch.zeros(4, 5, dtype=D), adv, mask, dual_clip=10.0), \
            run(name, lr, torch.zeros(4, 5, dtype=D), adv, mask)
        assert with_c[0].item() == without[0].item()
        assert torch.equal(with_c[1], without[1])

