"""A resume never takes what it cannot check or read for good: a step whose shards lack their
checksums is incomplete (the resume falls back past it, export refuses it in one line), and
metrics rows that cannot be read are kept aside and named, not dropped without a word."""

import os

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
