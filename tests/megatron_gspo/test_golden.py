"""Golden run: per-step metrics of a short SFT + GSPO + GRPO-R2 run, packed and padded, equal the
pinned ones, also with the CPU kernels of other instruction sets (the run does not amplify
rounding), and a packed run stopped after its first rollout batch resumes into them."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.megatron_gspo import golden

pytestmark = pytest.mark.slow
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _close(a, b) -> bool:
    return math.isclose(a, b, rel_tol=golden.TOLERANCE["rel"], abs_tol=golden.TOLERANCE["abs"])


def _pinned() -> dict:
    with open(golden.GOLDEN) as f:
        return json.load(f)


def assert_matches_pinned(got: dict, where: str, arms=None) -> None:
    """`got`'s rows equal the pinned ones of every arm (`arms`: of these only)."""
    pinned = _pinned()
    where = f"(pinned on {pinned['cpu']}, this is {where})"
    assert sorted(got) == sorted(arms or pinned["runs"])
    for arm, rows in pinned["runs"].items():
        if arms and arm not in arms:
            continue
        assert len(got[arm]) == len(rows), f"{arm}: {len(got[arm])} rows, pinned {len(rows)}"
        for want, have in zip(rows, got[arm]):
            assert sorted(have) == sorted(want), f"{arm} step {want['step']}: keys differ"
            bad = {k: (want[k], have[k]) for k in want if not _close(want[k], have[k])}
            assert not bad, f"{arm} step {want['step']}: (pinned, now) {bad} {where}"


def test_golden_run_metrics_are_unchanged(tmp_path):
    assert_matches_pinned(golden.run(str(tmp_path)), golden.cpu_model())
    # the run must exercise what it pins: clipping, flips and reward signal are non-trivial
    pinned = _pinned()
    rl = [r for arm in golden.ARMS for twin in ("", "_padded")
          for r in pinned["runs"][arm + twin]]
    assert max(r.get("policy/clip_frac/token", 0) for r in rl) > 0
    assert max(r.get("moe/flip_rate_all/mean", 0) for r in rl) > 0
    assert 0 < max(r.get("reward/mean", 0) for r in rl) < 1


def test_golden_run_is_unchanged_under_other_cpu_kernels(tmp_path):
    """The same run on other kernels (`golden.PERTURBED_ENV`) still matches: a golden run that
    amplified rounding would match only on the CPU it was pinned on."""
    out = tmp_path / "golden.json"
    subprocess.run([sys.executable, "-m", "tests.megatron_gspo.golden", "--out", str(out)],
                   cwd=ROOT, env={**os.environ, **golden.PERTURBED_ENV}, check=True,
                   capture_output=True, timeout=900)
    with open(out) as f:
        got = json.load(f)["runs"]
    assert_matches_pinned(got, f"{golden.cpu_model()} with {golden.PERTURBED_ENV}")


def test_a_resumed_packed_run_continues_its_golden_run(tmp_path):
    """The packed GSPO arm stopped after its first rollout batch (a checkpoint there) and
    started again: the resumed run's rows are the golden run's, its first batch's and the
    second's."""
    sft_dir = golden.sft(str(tmp_path / "sft"))
    run_dir = str(tmp_path / "gspo")
    golden.rl(run_dir, sft_dir, *golden.ARMS["gspo"], "train.steps=1", "train.save_every=1")
    assert len(golden.rows_of(run_dir)) < len(_pinned()["runs"]["gspo"])
    golden.rl(run_dir, sft_dir, *golden.ARMS["gspo"], "train.save_every=1")
    assert_matches_pinned({"gspo": golden.rows_of(run_dir)}, golden.cpu_model(),
                          arms=["gspo"])
