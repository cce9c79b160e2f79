"""A run's record abused as an operator would: run.json deleted, cut off or emptied,
metrics.jsonl a folder, run_dir a symbolic link that leads nowhere. Each is one line (exit 2)
and nothing already written changes (megatron_gspo.run.record, megatron_gspo.run.rundir;
docs/reliability.md)."""

import json
import os

import pytest

from megatron_gspo.cli import main
from megatron_gspo.errors import RunDirError
from tests.jsonl import step_rows
from tests.megatron_gspo.run.test_faults import TINY, cli, one_line_error
from tests.megatron_gspo.run.test_rundir import claim


def _files(run) -> dict:
    """Every file under `run` with its bytes (what a refused start must leave as it was)."""
    out = {}
    for folder, _, names in os.walk(run):
        for name in names:
            if name != ".lock":
                with open(os.path.join(folder, name), "rb") as f:
                    out[os.path.relpath(os.path.join(folder, name), run)] = f.read()
    return out


def test_a_run_dir_whose_record_was_deleted_does_not_adopt_another_config(tmp_path, capsys):
    """`rm RUN/run.json`, then a resume with another loss, lr and seed: it exited 0 and wrote
    a record of the new config over the run's checkpoints. Now refused in one line;
    resume=force continues them, says so, and records this config."""
    run = tmp_path / "run"
    assert cli(capsys, "train", *TINY, f"run_dir={run}", "train.steps=1")[0] == 0
    os.remove(run / "run.json")
    before = _files(run)
    other = ["loss.name=gspo", "optim.lr=1e-2", "seed=7"]
    err = one_line_error(capsys, "train", *TINY, f"run_dir={run}", "train.steps=2", *other)
    assert f"run_dir={run} holds checkpoints but no run.json" in err and "resume=force" in err
    assert _files(run) == before
    assert main(["train", *TINY, f"run_dir={run}", "train.steps=2", "resume=force", *other]) == 0
    assert f"resume=force: run_dir={run} holds checkpoints but no run.json: continuing them " \
        "with this config" in capsys.readouterr().out
    record = json.loads((run / "run.json").read_text())
    assert (record["config"]["loss.name"], record["config"]["seed"]) == ("gspo", 7)
    assert [r["train/iteration"] for r in step_rows(run)] == [0, 0, 1, 1]  # resumed, not redone


@pytest.mark.parametrize("damage, says", [
    (lambda p: p.write_text(p.read_text()[:40]), r"run.json is not a readable run record \("),
    (lambda p: p.write_text("{}"), r"run.json is not a readable run record \(it holds no "
                                   r"'job', 'fingerprint', 'config'\)"),
    (lambda p: p.write_text("[1, 2]"), r"is not a readable run record \(it holds no 'job'"),
], ids=["cut off", "emptied", "a list"])
def test_an_unreadable_run_record_is_one_line(tmp_path, capsys, damage, says):
    """A cut-off or emptied run.json: a JSONDecodeError / KeyError traceback, exit 1."""
    claim(tmp_path / "run").release()
    damage(tmp_path / "run" / "run.json")
    before = _files(tmp_path / "run")
    with pytest.raises(RunDirError, match=says + r".*restore it, or move it away"):
        claim(tmp_path / "run")
    assert "is not a readable run record" in one_line_error(capsys, "train", *TINY,
                                                            f"run_dir={tmp_path / 'run'}")
    assert _files(tmp_path / "run") == before


def test_a_metrics_file_that_is_a_folder_is_one_line_before_anything_is_recorded(tmp_path,
                                                                                capsys):
    """metrics.jsonl a folder: IsADirectoryError, a traceback and exit 1, after run.json had
    been written."""
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    err = one_line_error(capsys, "train", *TINY, f"run_dir={tmp_path / 'run'}")
    assert f"{tmp_path / 'run' / 'metrics.jsonl'} is a folder, where the run logs its " \
        "metrics: move it away" in err
    assert sorted(os.listdir(tmp_path / "run")) == [".lock", "metrics.jsonl"]


@pytest.mark.parametrize("target, says", [
    ("nowhere", "is a symbolic link to {target}, which does not exist"),
    ("loop", "is a symbolic link loop"),
], ids=["dangling", "looping"])
def test_a_run_dir_through_a_link_to_nothing_says_what_the_path_is(tmp_path, capsys, target,
                                                                   says):
    """A dangling or looping symbolic link as run_dir (or above it): "cannot write there
    (File exists)", which names nothing that is wrong."""
    link = tmp_path / "link"
    os.symlink(tmp_path / target if target == "nowhere" else link, link)
    says = says.format(target=tmp_path / target)
    for run_dir in (link, link / "run"):
        with pytest.raises(RunDirError, match=rf"^run_dir={run_dir}: cannot write there "
                                              rf"\({link} {says}"):
            claim(run_dir)
    assert f"cannot write there ({link} {says}" in one_line_error(
        capsys, "train", *TINY, f"run_dir={link}")
