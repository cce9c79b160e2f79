"""Golden run: per-step metrics of a short SFT + GSPO + GRPO-R2 run equal the pinned ones."""

import json
import math

import pytest

from tests.megatron_gspo import golden

pytestmark = pytest.mark.slow


def _close(a, b) -> bool:
    return math.isclose(a, b, rel_tol=golden.TOLERANCE["rel"], abs_tol=golden.TOLERANCE["abs"])


def test_golden_run_metrics_are_unchanged(tmp_path):
    with open(golden.GOLDEN) as f:
        pinned = json.load(f)
    got = golden.run(str(tmp_path))
    where = f"(pinned on {pinned['cpu']}, this is {golden.cpu_model()})"
    assert sorted(got) == sorted(pinned["runs"])
    for arm, rows in pinned["runs"].items():
        assert len(got[arm]) == len(rows), f"{arm}: {len(got[arm])} rows, pinned {len(rows)}"
        for want, have in zip(rows, got[arm]):
            assert sorted(have) == sorted(want), f"{arm} step {want['step']}: keys differ"
            bad = {k: (want[k], have[k]) for k in want if not _close(want[k], have[k])}
            assert not bad, f"{arm} step {want['step']}: (pinned, now) {bad} {where}"
    # the run must exercise what it pins: clipping, flips and reward signal are non-trivial
    rl = [r for arm in golden.ARMS for r in pinned["runs"][arm]]
    assert max(r.get("policy/clip_frac/token", 0) for r in rl) > 0
    assert max(r.get("moe/flip_rate_all/mean", 0) for r in rl) > 0
    assert 0 < max(r.get("reward/mean", 0) for r in rl) < 1
