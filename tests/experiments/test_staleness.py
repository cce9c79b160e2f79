"""experiments/staleness: the report's per-run numbers (averaged over the batches sampled k
versions old), its pairing by seed, and the runner's arms."""

import json

import pytest

from experiments.replay_dose_response.report import ci
from experiments.staleness import report, run
from megatron_gspo.config.schema import load_config


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(k: int, final: float, mismatch: float = 0.1) -> list[dict]:
    """4 rollout batches of 2 minibatches; the first k sampled by version 0 (less stale)."""
    rows = [{"step": 0, "test/accuracy": 0.3}]
    for it in range(4):
        stale = min(it, k)
        for mb in range(2):
            rows.append({"step": 2 * it + mb + 1, "reward/mean": 0.2, "train/minibatch": mb,
                         "train/iteration": it, "rollout/staleness/max": stale,
                         "rollout/routing_mismatch/mean": mismatch * stale,
                         "rollout/routing_mismatch/layer_00": mismatch * stale / 2,
                         "policy/log_ratio/abs_mean": 0.0 if mb == 0 else 0.01,
                         "policy/clip_frac/token": 0.1})
    rows.append({"step": 8, "test/accuracy": final})
    return rows


def test_run_stats_average_the_batches_sampled_k_versions_old():
    """k = 2: batches 2 and 3 only (0 and 1 were sampled fresher); the first minibatch's
    |log-ratio| from their first minibatches; the clip fraction over every step."""
    rows = _run(2, 0.5)
    stats = report.run_stats_of(rows, 2)
    assert stats["batches"] == 2 and stats["staleness"] == 2
    assert stats["route_mm"] == pytest.approx(0.2) and stats["layer_00"] == pytest.approx(0.1)
    assert stats["lr0"] == 0.0 and stats["clip"] == pytest.approx(0.1)
    assert (stats["start"], stats["final"]) == (0.3, 0.5)


def test_r3_is_paired_with_grpo_by_seed_and_each_arm_with_itself_at_k0(tmp_path):
    for seed, (g0, r0, g1, r1) in enumerate([(0.4, 0.5, 0.3, 0.6), (0.5, 0.4, 0.5, 0.9),
                                             (0.2, 0.2, 0.1, 0.3)]):
        for arm, k, final in (("grpo", 0, g0), ("grpo_r3", 0, r0), ("grpo", 1, g1),
                              ("grpo_r3", 1, r1)):
            _write(tmp_path / "runs" / f"{arm}_k{k}_s{seed}" / "metrics.jsonl", _run(k, final))
    assert report.distill(str(tmp_path / "runs"), str(tmp_path / "results")) == 12
    runs = report.collect(str(tmp_path / "results"))
    answer = report.answer_table(runs).splitlines()
    r3 = next(ln for ln in answer if ln.startswith("| 1 | GRPO + R3 vs GRPO |"))
    m, h = ci([0.3, 0.4, 0.2])
    assert f"{m:.3f} ± {h:.3f}" in r3 and "| 3 |" in r3
    did = next(ln for ln in answer if "R3's gap at k = 1 minus at k = 0" in ln)
    m, h = ci([0.3 - 0.1, 0.4 - (-0.1), 0.2 - 0.0])
    assert f"{m:.3f} ± {h:.3f}" in did
    grpo_k1 = next(ln for ln in report.arms_table(runs).splitlines()
                   if ln.startswith("| 1 | GRPO |"))
    m, h = ci([0.3 - 0.4, 0.5 - 0.5, 0.1 - 0.2])
    assert f"{m:.3f} ± {h:.3f}" in grpo_k1


def test_the_arms_differ_only_in_loss_and_replay_and_share_the_corrected_recipe():
    cfgs = {arm: load_config(run.CONFIG, [*over, "rollout.max_staleness=1"])
            for arm, over in run.ARMS.items()}
    assert {c.loss.tis_cap for c in cfgs.values()} == {2.0}
    assert cfgs["grpo_r3"].train.routing_replay == "r3" and cfgs["grpo"].train.routing_replay \
        == cfgs["gspo"].train.routing_replay == "off"
    assert cfgs["gspo"].loss.name == "gspo" and cfgs["grpo"].train == cfgs["gspo"].train
