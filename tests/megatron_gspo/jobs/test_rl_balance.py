"""Whole groups swapped between data-parallel ranks to even out their real tokens
(`train.balance_dp`, `megatron_gspo.jobs.rl_rollouts.balance_over_dp`): on 2 gloo processes the
balanced step's gradient equals the unbalanced one's (the same rows together, the loss a mean
over sequences), with R3's routes moved and re-aligned with their rows, and the ranks' tokens
come closer."""

import torch

from tests.megatron_gspo.jobs import balance_worker as bw
from tests.moe import parallel_worker as pw


def test_balanced_groups_give_the_unbalanced_gradient(tmp_path, replay="r3"):
    pw.spawn(bw.worker, (2, pw.free_port(), str(tmp_path), replay), nprocs=2, timeout_s=600)
    out = {(b, r): torch.load(tmp_path / f"{replay}_{b}_rank{r}.pt", weights_only=False)
           for b in (True, False) for r in (0, 1)}
    on, off = out[True, 0]["metrics"], out[False, 0]
    assert on["train/dp_groups_moved"] > 0
    assert on["train/dp_tokens/max_over_mean"] < on["train/dp_tokens/max_over_mean_before"]
    assert "train/dp_tokens/max_over_mean" not in off["metrics"]
    norm = sum(float(g.norm() ** 2) for g in off["grads"].values()) ** 0.5
    assert norm > 1e-3
    for rank in (0, 1):
        for name, want in off["grads"].items():
            torch.testing.assert_close(out[True, rank]["grads"][name], want, rtol=1e-5,
                                       atol=1e-7, msg=lambda m: f"{name}: {m}")
