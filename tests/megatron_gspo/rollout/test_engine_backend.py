"""rollout.backend=megatron_engine: refused in one line where it cannot run; on a GPU, RL with
R3 from the engine's routing (the trainer logs the engine-vs-trainer mismatch per layer)."""

import os

import pytest
import torch

from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import ConfigError
from megatron_gspo.run.metrics import read_jsonl

BASE = ["model.preset=qwen3-moe-tiny", "task.name=addition", "task.kwargs.num_digits=1",
        "task.n_train=60", "task.n_eval=8", "rollout.prompts_per_batch=4",
        "rollout.group_size=4", "rollout.max_new_tokens=4", "train.num_minibatches=2",
        "train.eval_every=1", "train.save_every=0", "wandb.mode=disabled",
        "rollout.backend=megatron_engine"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_the_engine_backend_on_cpu_is_one_config_error_before_the_run_dir(tmp_path):
    from megatron_gspo.jobs.rl import Trainer

    cfg = load_config(None, [*BASE, f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        Trainer.from_config(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, graphs, tol", [("fp32", False, 1e-3), ("bf16", True, 0.1)])
def test_rl_with_r3_from_the_engine(tmp_path, dtype, graphs, tol):
    """Two iterations: pi_old replays the engine's routing, so each rollout batch's first
    minibatch has ratio 1; the engine-vs-trainer routing mismatch is logged per layer (the
    tiny model's padded vocabulary masked in the engine's logits, not in the trainer's grads)."""
    from moe.inference.engine import unavailable

    if unavailable():
        pytest.skip(unavailable())
    from megatron_gspo.jobs.rl import Trainer

    cfg = load_config(None, [*BASE, "train.steps=2", "train.routing_replay=r3",
                             f"model.dtype={dtype}",
                             f"rollout.megatron_engine.cuda_graphs={str(graphs).lower()}",
                             f"run_dir={tmp_path / 'run'}"])
    Trainer.from_config(cfg).train()
    rows = read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl"))
    steps = [r for r in rows if "train/minibatch" in r]
    assert len(steps) == 4
    for r in steps:
        assert "rollout/routing_mismatch/layer_00" in r
        assert r["rollout/logprob_mismatch/mean"] < tol  # engine vs trainer, same weights
    for r in (r for r in steps if r["train/minibatch"] == 0):
        assert r["policy/log_ratio/abs_max"] < tol  # pi_old: the same routing, same weights
    assert "eval/accuracy" in rows[-1]
