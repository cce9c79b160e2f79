"""Resume never overwrites good checkpoints (issue 30): a `latest` gone, emptied or pointing at a
step dir that is gone, a KL reference whose source run moved on, an eval racing a run that prunes
its steps, resume=force across model.dtype."""

import hashlib
import os
import shutil

import pytest

from megatron_gspo import checkpoint as ckpt
from tests.megatron_gspo.test_faults import trainer


def _digests(root) -> dict:
    """sha256 of every file of the step dirs under checkpoint root `root`."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            path = os.path.join(d, n)
            if d != str(root):
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.parametrize("damage, resumed_at", [("deleted", 3), ("emptied", 3),
                                                ("newest step dir deleted", 2)])
def test_a_missing_latest_resumes_the_newest_complete_step(tmp_path, capsys, damage,
                                                           resumed_at):
    """`checkpoints/latest` deleted (or emptied, or its step dir deleted): the re-run started
    from step 0 and rewrote the complete steps (or refused with no fallback). It resumes from
    the newest complete step now, with a warning, and the steps before it stay as they were."""
    run = tmp_path / "run"
    trainer(run, "train.steps=3").train()
    root = run / "checkpoints"
    if damage == "deleted":
        (root / "latest").unlink()
    elif damage == "emptied":
        (root / "latest").write_text("")
    else:
        shutil.rmtree(root / "step_000003")
    kept = _digests(root)
    capsys.readouterr()
    t = trainer(run, "train.steps=4")
    assert t.state.iteration == resumed_at
    assert f"resuming from the newest complete step, {resumed_at}" in capsys.readouterr().out
    t.train()
    now = _digests(root)
    assert {k: now.get(k) for k in kept} == kept
    assert ckpt.latest_step(str(root)) == 4

