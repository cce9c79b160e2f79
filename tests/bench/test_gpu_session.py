"""bench/gpu_session.sh without a GPU: each stage's command, recorded by a stand-in `python3`,
parses with bench.gpu_lease's own arguments; a failing stage makes the script exit 1 while the
later stages still run; an unknown stage runs nothing."""

import os
import subprocess

from bench import gpu_lease

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_PYTHON = """#!/bin/bash
printf '%s\\0' "$@" > "$CALLS/$(ls "$CALLS" | wc -l | xargs printf %03d)"
case "$*" in *"$FAIL"*) exit 3 ;; esac
case "$*" in *report*) touch "$OUT/README.md" ;; esac
"""


def run_session(tmp_path, stages: list, fail: str = "no such thing"):
    """(exit status, stderr, each python3 call's argv in order)."""
    calls, bin_dir = tmp_path / "calls", tmp_path / "bin"
    calls.mkdir()
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               CALLS=str(calls), FAIL=fail)
    proc = subprocess.run(["bash", os.path.join(REPO, "bench", "gpu_session.sh"), *stages],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    argvs = [(calls / name).read_text().split("\0")[:-1] for name in sorted(os.listdir(calls))]
    return proc.returncode, proc.stderr, argvs


def test_every_stage_command_parses_with_the_bench_arguments(tmp_path):
    rc, err, argvs = run_session(tmp_path, ["env", "rollout", "train", "tests", "report"])
    assert rc == 0, err
    assert [a[:2] for a in argvs] == [["-"], ["-m", "bench.gpu_lease"],
                                      ["-m", "bench.gpu_lease"], ["-m", "pytest"],
                                      ["-m", "bench.gpu_lease"]]
    lease = [a[2:] for a in argvs if a[:2] == ["-m", "bench.gpu_lease"]]
    assert [gpu_lease.parse_args(a).stage for a in lease] == ["rollout", "train", "report"]
    assert all(gpu_lease.parse_args(a).out == str(tmp_path / "out") for a in lease)
    tests = [a for a in argvs[3] if a.startswith("tests/")]
    assert tests and all(os.path.exists(os.path.join(REPO, t)) for t in tests)


def test_a_failing_stage_is_reported_and_the_rest_still_run(tmp_path):
    rc, err, argvs = run_session(tmp_path, ["rollout", "train", "report"], fail="rollout")
    assert rc == 1 and "stage rollout failed" in err
    assert "stage train failed" not in err
    assert [a[2] for a in argvs] == ["rollout", "train", "report"]


def test_an_unknown_stage_runs_nothing(tmp_path):
    rc, err, argvs = run_session(tmp_path, ["env", "nonsense"])
    assert rc == 2 and "unknown stage 'nonsense'" in err and argvs == []
