"""bench/gpu_session.sh without a GPU: each stage's command, recorded by a stand-in `python3`,
parses with bench.gpu_stages's own arguments; a failing stage makes the script exit 1 while the
later stages still run; an unknown stage runs nothing; $PYTHON picks the interpreter."""

import os
import subprocess

from bench import gpu_stages

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_PYTHON = """#!/bin/bash
printf '%s\\0' "$@" > "$CALLS/$(ls "$CALLS" | wc -l | xargs printf %03d)"
case "$*" in *"$FAIL"*) exit 3 ;; esac
case "$*" in *report*) touch "$RESULTS/README.md" ;; esac
"""


def run_session(tmp_path, stages: list, fail: str = "no such thing", **env_extra):
    """(exit status, stderr, each python3 call's argv in order)."""
    calls, bin_dir = tmp_path / "calls", tmp_path / "bin"
    calls.mkdir()
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", RESULTS=str(tmp_path / "out"),
               CALLS=str(calls), FAIL=fail, **env_extra)
    proc = subprocess.run(["bash", os.path.join(REPO, "bench", "gpu_session.sh"), *stages],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    argvs = [(calls / name).read_text().split("\0")[:-1] for name in sorted(os.listdir(calls))]
    return proc.returncode, proc.stderr, argvs


def test_every_stage_command_parses_with_the_bench_arguments(tmp_path):
    rc, err, argvs = run_session(tmp_path, ["env", "rollout", "train", "tests", "report"])
    assert rc == 0, err
    assert [a[:2] for a in argvs] == [["-"], ["-m", "bench.gpu_stages"],
                                      ["-m", "bench.gpu_stages"], ["-m", "pytest"],
                                      ["-m", "bench.gpu_stages"]]
    bench = [a[2:] for a in argvs if a[:2] == ["-m", "bench.gpu_stages"]]
    assert [gpu_stages.parse_args(a).stage for a in bench] == ["rollout", "train", "report"]
    assert all(gpu_stages.parse_args(a).out == str(tmp_path / "out") for a in bench)
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


def test_python_names_the_interpreter_every_stage_runs(tmp_path):
    """A machine whose project lives in a virtual environment: PYTHON=.venv/bin/python."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "python").write_text(FAKE_PYTHON.replace("$CALLS/", "$CALLS/venv-"))
    (venv / "python").chmod(0o755)
    rc, err, argvs = run_session(tmp_path, ["env", "train", "tests"],
                                 PYTHON=str(venv / "python"))
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path / "calls")) == ["venv-000", "venv-001", "venv-002"]
