"""A resume never takes what it cannot check or read for good: a step whose shards lack their
checksums is incomplete (the resume falls back past it, export refuses it in one line), and
metrics rows that cannot be read are kept aside and named, not dropped without a word."""

import os

import pytest

from megatron_gspo.cli import main
from megatron_gspo.run.metrics import read_jsonl
from tests.megatron_gspo.run.test_faults import trainer


def _cut_off_row(path, step: int) -> int:
    """Cut the row of `step` short (a write killed part-way); returns its line number."""
    with open(path) as f:
        lines = f.read().splitlines()
    number = next(i for i, ln in enumerate(lines, 1) if ln.startswith(f'{{"step": {step},'))
    lines[number - 1] = lines[number - 1][:25]
    with open(path, "w") as f:
        f.write("".join(ln + "\n" for ln in lines))
    return number


def test_an_unreadable_metrics_row_before_the_resumed_step_is_named_and_kept(tmp_path,
                                                                             capsys):
    """A cut-off row before the step a run resumes from disappeared without a word (the steps
    read 1, 2, 3, 5, 6). Now the resume names its line, and the row is kept aside in
    metrics.unreadable.txt."""
    run = tmp_path / "run"
    trainer(run, "train.steps=3").train()
    metrics = run / "metrics.jsonl"
    before = [r["step"] for r in read_jsonl(str(metrics))]
    line = _cut_off_row(metrics, 2)
    cut = metrics.read_text().splitlines()[line - 1]
    capsys.readouterr()
    t = trainer(run, "train.steps=4")
    out = capsys.readouterr().out
    assert f"{metrics}: line {line} cannot be read (cut off, or no step): moved to " \
        f"{run / 'metrics.unreadable.txt'}" in out, out
    t.train()
    assert (run / "metrics.unreadable.txt").read_text() == f"metrics.jsonl:{line}: {cut}\n"
    after = [r["step"] for r in read_jsonl(str(metrics))]
    assert after[:len(before) - 1] == [s for s in before if s != 2] and len(after) > len(before)


def _flip_a_byte(path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("shard, damaged", [("dist/__0_0.distcp", True),
                                            ("rank_00000.pt", False)])
def test_a_shard_without_its_checksum_is_an_incomplete_step_the_resume_falls_back_past(
        tmp_path, capsys, shard, damaged):
    """A shard whose .sha256 sidecar was gone loaded unchecked (exit 0, no warning); damaged
    too, the resume died on `PytorchStreamReader failed` with no fallback. A step whose
    checksums are incomplete is incomplete now: skipped with a warning naming the shard, and
    the run resumes from the step before."""
    run = tmp_path / "run"
    trainer(run, "train.steps=2").train()
    step = run / "checkpoints" / "step_000002"
    (step / f"{shard}.sha256").unlink()
    if damaged:
        _flip_a_byte(step / shard)
    capsys.readouterr()
    t = trainer(run, "train.steps=3")
    assert t.state.iteration == 1
    assert f"skipping checkpoint step 2: checkpoint file {step / shard} has no checksum " \
        f"beside it ({step / shard}.sha256 is missing)" in capsys.readouterr().out


@pytest.mark.parametrize("shard, damaged", [("dist/common.pt", True), ("rank_00000.pt", False)])
def test_export_refuses_a_step_without_every_checksum_in_one_line(tmp_path, capsys, shard,
                                                                  damaged):
    """Export read a shard whose checksum was gone unchecked (an UnpicklingError traceback when
    it was damaged too). Now one line naming it, and nothing is written."""
    run = tmp_path / "run"
    trainer(run, "train.steps=1").train()
    path = run / "checkpoints" / "step_000001" / shard
    (path.parent / f"{path.name}.sha256").unlink()
    if damaged:
        _flip_a_byte(path)
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export", "--run-dir", str(run), "--to-hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"checkpoint file {path} has no checksum beside it" in err, err
    assert not out.exists()
