"""rollout.backend=vllm through the trainer: weights pushed after every update (the engine's
log-probs stay the trainer's, float32), R3 from the engine's routing, the stale-weight guard,
and bad input. A tiny Qwen3-MoE of head_dim 32 (vLLM's CPU attention needs >= 32) on the
committed GSM8K-style fixture; skipped without vLLM (Python >= 3.11, docs/vllm.md)."""

import importlib.util
import os
import re

import pytest
import torch

from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import ConfigError
from megatron_gspo.run.metrics import read_jsonl
from tests.hf_fixtures import make_model
from tests.processes import communicate_or_kill

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install -e '.[vllm]')")
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "fixtures", "gsm_tiny")
MODEL = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
             max_position_embeddings=256)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The model folder; its output layer halved (float32 noise floor: vllm/test_engine)."""
    from safetensors.torch import load_file, save_file

    folder = str(tmp_path_factory.mktemp("qwen3_hd32"))
    make_model(folder, **MODEL)
    tensors = load_file(f"{folder}/model.safetensors")
    tensors["lm_head.weight"] = (0.5 * tensors["lm_head.weight"]).contiguous()
    save_file(tensors, f"{folder}/model.safetensors")
    return folder


def config(tmp_path, hf_dir, *overrides):
    return load_config(None, [
        f"model.hf_path={hf_dir}", "model.max_seq_len=256", "task.name=dataset",
        f"data.train_files=[{FIXTURE}/train.jsonl]", f"data.eval_files=[{FIXTURE}/test.jsonl]",
        "reward.name=math", "rollout.max_new_tokens=8", "rollout.prompts_per_batch=2",
        "rollout.group_size=4", "train.num_minibatches=2", "train.eval_every=0",
        "train.save_every=0", "wandb.mode=disabled", "rollout.backend=vllm",
        "optim.lr=1e-3", f"run_dir={tmp_path / 'run'}", *overrides])


@needs_vllm
def test_rl_with_r3_from_vllm_keeps_the_engine_on_the_trainers_weights(tmp_path, hf_dir):
    """Two iterations of two minibatches (4 updates, a push before each rollout batch): the
    engine's log-probs equal the trainer's recompute within 1e-5 and its routing the trainer's
    (float32, same weights), pi_old replays the engine's routing (first-minibatch ratio 1)."""
    from megatron_gspo.jobs.rl import Trainer

    cfg = config(tmp_path, hf_dir, "train.steps=2", "train.routing_replay=r3")
    trainer = Trainer.from_config(cfg)
    # rewards with variance in every group (an untrained model scores 0 on math): real updates
    object.__setattr__(trainer.rt.task, "reward", lambda example, completion:
                       float(len(completion) % 2))
    start = trainer.policy.version
    before = [p.detach().clone() for p in trainer.policy.model.module.parameters()]
    trainer.train()
    after = list(trainer.policy.model.module.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(after, before))  # the pushes mattered
    rows = [r for r in read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl")) if r["step"]]
    assert [r["train/minibatch"] for r in rows] == [0, 1, 0, 1]
    for r in rows:
        assert r["rollout/logprob_mismatch/max"] <= 1e-5
        assert r["rollout/routing_mismatch/max"] == 0.0
        assert r["rollout/routing_any_diff"] == 0.0
        assert r["replay/route_diff"] == 0.0  # the loss forwards used the engine's routes
        assert "rollout/routing_mismatch/layer_01" in r
    for r in rows[::2]:
        assert r["policy/log_ratio/abs_max"] < 1e-5  # pi_old routed as the engine did
    for r in rows[2::2]:  # the first push came with step 0's test eval, before any rollout
        assert r["rollout/push_probe_diff"] <= 1e-5 and r["time/weight_sync"] > 0
    assert trainer.policy.version == start + 4  # four updates; pushed before each batch


@needs_vllm
def test_weights_the_engine_did_not_get_stop_the_run_before_sampling(tmp_path, hf_dir):
    """A push that delivers nothing (the engine keeps the old weights) is caught by the probe
    once the policy has moved: one ConfigError naming the difference, no batch sampled."""
    from megatron_gspo.jobs.rl import Trainer

    trainer = Trainer.from_config(config(tmp_path, hf_dir, "train.steps=2"))
    sampler = trainer.rt.sampler
    trainer.rollout(0)  # the first push: the engine holds the policy's weights
    with torch.no_grad():  # the policy moves (as an update would)
        for p in trainer.policy.model.module.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    trainer.policy.weights_changed()
    pushes, calls = [], []
    sampler.engine.push_weights = lambda stream: pushes.append(sum(1 for _ in stream)) or 0
    real = sampler.engine.generate
    sampler.engine.generate = lambda *a, **k: calls.append(k.get("greedy")) or real(*a, **k)
    with pytest.raises(ConfigError, match=r"probe sequence differ from the trainer's by .* "
                                          r"\(mean\) > rollout.vllm.push_check_tol=0.0001"):
        trainer.rollout(1)
    assert pushes and pushes[0] > 0 and calls == [True]  # the probe's continuation, no rollout
    trainer.rt.close()


def test_the_guard_ignores_one_token_whose_bf16_routing_flipped_but_not_a_moved_model():
    """In bfloat16 the probe's number is robust to one outlier token (a routing flip: a correct
    push that a mean over 16 tokens once reported as stale) and still sees every token move,
    also half of them (the median between the middle two); in float32 one wrong token shows."""
    from megatron_gspo.rollout.vllm.sampler import CHECK_TOL, probe_statistic

    ours = -torch.rand(16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    flipped = ours + 0.01
    flipped[3] -= 2.0  # one token two nats off
    assert probe_statistic(ours, flipped, "bfloat16") == pytest.approx(0.01)
    assert probe_statistic(ours, flipped, "bfloat16") <= CHECK_TOL["bfloat16"]
    assert probe_statistic(ours, ours - 1.0, "bfloat16") > CHECK_TOL["bfloat16"]  # all move
    half = ours.clone()
    half[::2] -= 2.0  # eight of sixteen tokens two nats off
    assert probe_statistic(ours, half, "bfloat16") > CHECK_TOL["bfloat16"]
    one = ours.clone()
    one[5] -= 0.01  # float32: one token a hundredth off
    assert probe_statistic(ours, ours, "float32") == 0.0
    assert probe_statistic(ours, one, "float32") > CHECK_TOL["float32"]


def test_the_config_reference_states_the_guards_defaults():
    from megatron_gspo.config.docs import field_docs
    from megatron_gspo.config.vllm import VLLMConfig
    from megatron_gspo.rollout.vllm.sampler import CHECK_TOL

    doc = " ".join(field_docs(VLLMConfig)["push_check_tol"].split())
    assert "mean for a float32 engine, median for bfloat16" in doc
    m = re.search(r"None: (\S+) for a float32 engine, (\S+) for bfloat16", doc)
    assert m and (float(m[1]), float(m[2])) == (CHECK_TOL["float32"], CHECK_TOL["bfloat16"])


@needs_vllm
def test_the_bf16_guard_passes_a_correct_push_and_stops_a_mis_packed_one(tmp_path, hf_dir):
    """The bfloat16 default bound sits between a correct push and one whose MoE weights were
    not re-prepacked (the CPU engine's silent failure): measured here, not assumed."""
    from megatron_gspo.jobs.rl import Trainer
    from megatron_gspo.rollout.vllm.sampler import CHECK_TOL, hf_stream

    trainer = Trainer.from_config(config(tmp_path, hf_dir, "rollout.vllm.dtype=bf16"))
    sampler = trainer.rt.sampler
    trainer.rollout(0)
    assert sampler.metrics["rollout/push_probe_diff"] <= CHECK_TOL["bfloat16"] / 10
    sampler.engine._reprepack = False  # the fix switched off, as a vLLM without it would be
    with torch.no_grad():  # any push re-reads the experts; a small move, as an update makes
        for p in trainer.policy.model.module.parameters():
            p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    sampler.engine.push_weights(hf_stream(trainer.policy, sampler.hf_config))
    assert sampler.probe_diff() > CHECK_TOL["bfloat16"]
    trainer.rt.close()


@needs_vllm
def test_an_unsupported_cpu_head_dim_is_one_line_and_writes_nothing(tmp_path):
    from megatron_gspo.jobs.rl import Trainer

    if torch.cuda.is_available():
        pytest.skip("the CPU attention's limit")
    cfg = load_config(None, ["model.preset=tiny", "rollout.backend=vllm", "wandb.mode=disabled",
                             f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="head_dim=8 is not supported by vLLM's CPU"):
        Trainer.from_config(cfg)
    assert not os.path.exists(os.path.join(cfg.run_dir, "metrics.jsonl"))


def test_without_vllm_the_backend_names_the_extra(tmp_path, monkeypatch):
    """vLLM missing: one ConfigError naming the extra, before any set-up."""
    import sys

    from megatron_gspo.rollout.backends import check_backend

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ConfigError, match=r"pip install -e '.\[vllm\]'"):
        check_backend(load_config(None, ["rollout.backend=vllm"]))


@needs_vllm
@pytest.mark.slow
def test_under_ep2_each_rank_engine_gets_the_gathered_weights(tmp_path, hf_dir):
    """`torchrun --nproc-per-node 2 ... model.ep=2 rollout.backend=vllm`: each rank's engine is
    pushed the experts of both ranks (gathered per tensor), and its log-probs equal the
    trainer's within 1e-5 before and after the updates (weight decay moves every weight even
    where the math reward gives no gradient)."""
    import json
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_gspo.cli", "train", f"model.hf_path={hf_dir}",
           "model.max_seq_len=256", "task.name=dataset", f"data.train_files=[{FIXTURE}/train.jsonl]",
           f"data.eval_files=[{FIXTURE}/test.jsonl]", "reward.name=math",
           "rollout.max_new_tokens=8", "rollout.prompts_per_batch=2", "rollout.group_size=4",
           "train.num_minibatches=2", "train.eval_every=0", "train.save_every=0",
           "wandb.mode=disabled", "rollout.backend=vllm", "optim.lr=1e-2",
           "optim.weight_decay=0.1", "train.steps=2", "train.routing_replay=r3", "model.ep=2",
           f"run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    _, err = communicate_or_kill(proc, 600)
    assert proc.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"]]  # step 0: the test split's eval of the initial policy
    assert [r["train/iteration"] for r in rows] == [0, 0, 1, 1]
    assert rows[-1]["policy/log_ratio/abs_max"] > 1e-4  # the weights moved between pushes
    for r in rows:
        assert r["rollout/logprob_mismatch/max"] <= 1e-5 and r["rollout/routing_any_diff"] == 0.0
    for r in rows[2:]:  # the first push came with step 0's test eval, before any rollout
        assert r["rollout/push_probe_diff"] <= 1e-5


class _Fake:
    """Stands in for `VLLMEngine`: starts (or not), and pushes (or not)."""

    fail_start = fail_push = None

    def __init__(self, *args, **kwargs):
        if self.fail_start:
            raise RuntimeError(self.fail_start)

    def push_weights(self, stream):
        raise RuntimeError(self.fail_push)


def _sampler(monkeypatch, **fail):
    """A VLLMSampler over `_Fake` for a stub policy of the qwen3-moe-tiny preset (no vLLM)."""
    from types import SimpleNamespace

    from megatron_gspo.rollout.vllm import sampler as backend
    from moe.model.presets import get_preset

    monkeypatch.setattr(backend, "VLLMEngine", type("Fake", (_Fake,), fail))
    policy = SimpleNamespace(preset=get_preset("qwen3-moe-tiny"), real_vocab=26, version=1)
    return backend.VLLMSampler(policy, SimpleNamespace(vocab_size=26),
                               load_config(None, ["rollout.backend=vllm"]))


def test_an_engine_that_does_not_start_is_one_config_error(monkeypatch):
    with pytest.raises(ConfigError, match=r"^rollout.backend=vllm: the engine did not start: "
                                          r"RuntimeError: no KV cache fits$"):
        _sampler(monkeypatch, fail_start="no KV cache fits\nmore lines")


def test_a_push_that_fails_is_one_config_error_before_sampling(monkeypatch):
    sampler = _sampler(monkeypatch, fail_push="shape mismatch for w13_weight")
    with pytest.raises(ConfigError, match=r"pushing the weights \(version 1\) failed: "
                                          r"RuntimeError: shape mismatch for w13_weight"):
        sampler.sync()
    assert sampler.pushed is None  # nothing counts as pushed
