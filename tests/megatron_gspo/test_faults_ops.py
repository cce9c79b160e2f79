"""An operator's abuse of a run dir, end to end (test_faults.py has the basic refusals): shards
gone from the latest checkpoint."""

import os

from megatron_gspo import checkpoint as ckpt
from tests.megatron_gspo.test_faults import trainer


def test_a_shard_gone_from_the_latest_step_falls_back_to_the_previous_one(tmp_path, capsys):
    run = tmp_path / "run"
    t = trainer(run, "train.steps=2")
    t.train()
    t.rt.close()
    dist_dir = os.path.join(ckpt.step_dir(str(run / "checkpoints"), 2), "dist")
    shard = sorted(n for n in os.listdir(dist_dir) if n.endswith(".distcp"))[0]
    os.remove(os.path.join(dist_dir, shard))  # e.g. a partial copy of the run dir
    resumed = trainer(run, "train.steps=2")
    assert resumed.state.iteration == 1
    out = capsys.readouterr().out
    assert f"skipping checkpoint step 2: checkpoint file {dist_dir}/{shard} is missing" in out
    resumed.rt.close()
