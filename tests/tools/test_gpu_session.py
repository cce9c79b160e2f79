"""tools/gpu_session.sh without a GPU: each stage's command, recorded by a stand-in `python3`,
parses with its tool's own arguments and names a marker its README copy has; a failing stage
makes the script exit 1 while the later stages still run."""

import os
import re
import subprocess

from tools import bench_sampling, bench_sweep, bench_throughput, profile_ours

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARSERS = {"tools.bench_throughput": bench_throughput.parse_args,
           "tools.bench_sampling": bench_sampling.parse_args,
           "tools.profile_ours": profile_ours.parse_args}
FAKE_PYTHON = """#!/bin/bash
printf '%s\\0' "$@" > "$CALLS/$(ls "$CALLS" | wc -l | xargs printf %03d)"
case "$*" in *"$FAIL"*) exit 3 ;; esac
"""


def run_session(tmp_path, stages: list, fail: str = "no such module"):
    """The script on `stages`, run in a copy of its README's folder with a `python3` that
    records its arguments (exit 3 when they contain `fail`): (exit status, stderr, each call's
    argv in order, the README copy's text)."""
    work, calls = tmp_path / "work", tmp_path / "calls"
    for d in (work / "experiments" / "throughput", tmp_path / "bin", calls):
        d.mkdir(parents=True)
    with open(os.path.join(REPO, "experiments", "throughput", "README.md")) as f:
        (work / "experiments" / "throughput" / "README.md").write_text(f.read())
    (tmp_path / "bin" / "python3").write_text(FAKE_PYTHON)
    (tmp_path / "bin" / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
               OUT=str(tmp_path / "out"), CALLS=str(calls), FAIL=fail)
    proc = subprocess.run(["bash", os.path.join(REPO, "tools", "gpu_session.sh"), *stages],
                          cwd=work, env=env, capture_output=True, text=True, timeout=60)
    argvs = [(calls / name).read_text().split("\0")[:-1] for name in sorted(os.listdir(calls))]
    readme = tmp_path / "out" / "README.md"
    return proc.returncode, proc.stderr, argvs, readme.read_text() if readme.exists() else None


def test_every_stage_command_parses_and_names_a_marker_of_the_readme(tmp_path):
    rc, err, argvs, readme = run_session(tmp_path, ["point", "sampling", "profile", "real",
                                                    "sweep", "tests"])
    assert rc == 0, err
    assert [argv[:2] for argv in argvs] == [["-m", "tools.bench_throughput"],
                                           ["-m", "tools.bench_sampling"],
                                           ["-m", "tools.profile_ours"],
                                           ["-m", "tools.bench_throughput"],
                                           ["-m", "tools.bench_throughput"], ["-m", "pytest"]]
    for argv in argvs[:-1]:
        args = argv[2:]
        if "--sweep" in args:  # bench_throughput hands these to bench_sweep
            args = bench_sweep.parse_args([a for a in args if a != "--sweep"])
        else:
            args = PARSERS[argv[1]](args)
        assert args.readme == str(tmp_path / "out" / "README.md"), argv
        assert re.search(rf"<!-- table:{args.marker}:begin -->\n\(not yet run\)\n"
                         rf"<!-- table:{args.marker}:end -->", readme), args.marker
    tests = [a for a in argvs[-1] if a.startswith("tests/")]
    assert tests and all(os.path.exists(os.path.join(REPO, path)) for path in tests)


def test_a_failing_stage_is_reported_and_the_rest_still_run(tmp_path):
    rc, err, argvs, _ = run_session(tmp_path, ["point", "sampling", "profile"],
                                    fail="tools.bench_sampling")
    assert rc == 1 and "stage sampling failed (exit 3)" in err
    assert "stage point failed" not in err and "stage profile failed" not in err
    assert [argv[1] for argv in argvs] == ["tools.bench_throughput", "tools.bench_sampling",
                                           "tools.profile_ours"]


def test_an_unknown_stage_runs_nothing(tmp_path):
    rc, err, argvs, readme = run_session(tmp_path, ["point", "nonsense"])
    assert rc == 2 and "unknown stage 'nonsense'" in err and argvs == [] and readme is None
