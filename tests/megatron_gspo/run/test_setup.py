"""megatron_gspo.run.setup: the parts a run is built from (layout, preset, recompute, optimizer
settings, policy) as the config says, `setup_runtime`'s checks and clean-up, and the checkpoints
it reads (`init_checkpoint`: megatron_gspo.run.init; a resume's optimizer format:
megatron_gspo.run.resume)."""

import json
import os
import shutil

import pytest
import torch

from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import CheckpointError, ConfigError
from megatron_gspo.run.init import check_init_checkpoint, load_init_weights
from megatron_gspo.run.resume import save_state
from megatron_gspo.jobs import evaluate, rl
from megatron_gspo.jobs import sft as sft_job
from megatron_gspo.run.setup import (build_policy, layout_of, model_max_len, recompute_of,
                                     resolve_preset, setup_runtime)
from megatron_gspo.errors import DataError
from moe.model.dist_ckpt import files_written_by
from moe.model.settings import Recompute
from tests.hf_fixtures import make_model
from tests.megatron_gspo.run.test_rundir import _lock_is_held

TP2 = ["model.tp=2", "model.sequence_parallel=true"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Qwen3-MoE folder: 300-token vocab, 128 positions (the default preset has 64)."""
    folder = str(tmp_path_factory.mktemp("qwen3"))
    make_model(folder, "qwen3_moe", seed=1)
    return folder


def test_layout_is_the_configured_tp_ep_and_dispatcher():
    layout = layout_of(load_config(None, [*TP2, "model.ep=4"]))
    assert (layout.tp, layout.ep, layout.sequence_parallel, layout.dispatcher) == \
        (2, 4, True, "alltoall")


def test_toy_vocab_pads_to_16_times_tp_and_depth_and_length_follow_the_config():
    assert resolve_preset(load_config(None, []), 40).vocab_size == 48
    assert resolve_preset(load_config(None, TP2), 40).vocab_size == 64
    preset = resolve_preset(load_config(None, ["model.num_layers=3", "model.max_seq_len=30"]), 40)
    assert (preset.num_layers, preset.max_seq_len) == (3, 30)


def test_hf_vocab_covers_the_tokenizer_and_pads_to_vocab_multiple_times_tp(hf_dir):
    """config.json's 300 rows, or the tokenizer's when it has more, padded to 128 * tp; the
    model length is config.json's (128) unless model.max_seq_len is set."""
    cfg = load_config(None, [f"model.hf_path={hf_dir}"])
    assert resolve_preset(cfg, 300).vocab_size == 384
    assert resolve_preset(cfg, 400).vocab_size == 512
    assert resolve_preset(load_config(None, [f"model.hf_path={hf_dir}", *TP2]), 300) \
        .vocab_size == 512
    assert model_max_len(cfg) == 128
    assert model_max_len(load_config(None, [f"model.hf_path={hf_dir}", "model.max_seq_len=96"])) \
        == 96


def test_recompute_off_is_none_and_modules_are_stripped():
    assert recompute_of(load_config(None, [])) == Recompute(None, ("moe",))
    cfg = load_config(None, ["model.recompute_granularity=selective",
                             "model.recompute_modules=moe, core_attn"])
    assert recompute_of(cfg) == Recompute("selective", ("moe", "core_attn"))


def test_sft_optimizer_is_adam_at_sft_lr_without_warmup():
    """sft: the optim section's Adam at sft.lr / sft.min_lr, no warmup, decaying over sft.steps
    (lr_decay_steps 0 when constant)."""
    over = ["optim.warmup_steps=5", "optim.lr=1e-4", "optim.min_lr=1e-5", "sft.lr=2e-3",
            "sft.min_lr=2e-4", "sft.steps=40", "optim.beta2=0.95"]
    sft = sft_job.optim_settings(load_config(None, [*over, "sft.lr_decay_style=cosine"]))
    assert (sft.lr, sft.min_lr, sft.warmup_steps, sft.lr_decay_style, sft.lr_decay_steps,
            sft.beta2) == (2e-3, 2e-4, 0, "cosine", 40, 0.95)
    sft = sft_job.optim_settings(load_config(None, over))
    assert (sft.lr_decay_style, sft.lr_decay_steps) == ("constant", 0)


def test_train_optimizer_decays_over_every_update_unless_set():
    """train: lr_decay_steps 0 means the run's last update (train.steps x num_minibatches)."""
    over = ["train.steps=7", "train.num_minibatches=2", "optim.warmup_steps=3"]
    train = rl.optim_settings(load_config(None, over))
    assert (train.lr_decay_steps, train.warmup_steps) == (14, 3)
    assert rl.optim_settings(load_config(None, [*over, "optim.lr_decay_steps=9"])) \
        .lr_decay_steps == 9
    assert evaluate.SPEC.optim is None  # eval builds a policy without an optimizer


def _weights(policy) -> dict:
    return {n: p.detach().clone() for n, p in policy.model.module.named_parameters()}


def test_build_policy_seed_is_cfg_seed_unless_given(single_process):
    cfg = load_config(None, ["model.preset=tiny", "seed=5"])
    base = _weights(build_policy(cfg, 40, None))
    same = _weights(build_policy(cfg, 40, None, seed=5))
    other = _weights(build_policy(cfg, 40, None, seed=6))
    assert all(torch.equal(base[n], same[n]) for n in base)
    assert any(not torch.equal(base[n], other[n]) for n in base)


def test_build_policy_dtype_and_attention_follow_the_config(single_process):
    bf16 = build_policy(load_config(None, ["model.preset=tiny", "model.dtype=bf16"]), 40, None)
    assert {p.dtype for p in bf16.model.module.parameters()} == {torch.bfloat16}
    for attention, cls in (("sdpa", "SDPAAttention"), ("megatron", "DotProductAttention")):
        policy = build_policy(load_config(None, ["model.preset=tiny",
                                                 f"model.attention={attention}"]), 40, None)
        core = policy.model.module.decoder.layers[0].self_attention.core_attention
        assert type(core).__name__ == cls, attention


TOY = ["model.preset=tiny", "task.n_train=60", "task.n_eval=8", "wandb.mode=disabled"]


def test_a_failed_setup_releases_the_run_dir(single_process, tmp_path):
    """An error after the run dir was claimed (a bad data row) leaves it free for the next
    start, which needs no new process."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    run_dir = tmp_path / "run"
    cfg = load_config(None, [*TOY, "task.name=dataset", f"data.train_files={bad}",
                             f"run_dir={run_dir}"])
    with pytest.raises(DataError, match="not valid JSON"):
        setup_runtime(cfg, rl.SPEC)
    assert not _lock_is_held(run_dir)


def test_eval_writes_nothing(single_process, tmp_path):
    rt = setup_runtime(load_config(None, [*TOY, f"run_dir={tmp_path / 'run'}"]), evaluate.SPEC)
    rt.close()
    assert rt.lock is None and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def saved(single_process, tmp_path_factory):
    """A toy sft run dir holding one checkpoint (step 0) of a seed-3 policy, its weights and
    its tokenizer's vocab size."""
    run_dir = tmp_path_factory.mktemp("init") / "sft"
    rt = setup_runtime(load_config(None, [*TOY, "seed=3", f"run_dir={run_dir}"]), sft_job.SPEC)
    save_state(rt, 0, {"job": "test"})
    weights, vocab = _weights(rt.policy), rt.tokenizer.vocab_size
    rt.close()
    return run_dir, weights, vocab


@pytest.mark.parametrize("where", ["", "checkpoints", "checkpoints/step_000000"])
def test_init_weights_from_a_run_dir_its_checkpoints_or_a_step_dir(saved, where):
    run_dir, weights, vocab = saved
    policy = build_policy(load_config(None, TOY), vocab, None)
    load_init_weights(policy, str(run_dir / where))
    got = _weights(policy)
    assert all(torch.equal(got[n], weights[n]) for n in weights)


def test_init_checkpoint_without_a_checkpoint_or_with_a_corrupt_shard_is_refused(saved,
                                                                                 tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"init_checkpoint=.*empty holds no checkpoint"):
        check_init_checkpoint(str(tmp_path / "empty"))
    copy = tmp_path / "copy"
    shutil.copytree(saved[0], copy)
    shard = files_written_by(str(copy / "checkpoints" / "step_000000" / "dist"), 0)[0]
    with open(shard, "r+b") as f:  # same size, other bytes
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\x00\x00\x80\x7f")
    with pytest.raises(CheckpointError, match="truncated or overwritten|corrupt"):
        load_init_weights(build_policy(load_config(None, TOY), saved[2], None), str(copy))


def test_hf_weights_reach_the_fp32_masters_of_a_16bit_policy(single_process, hf_dir):
    """With model.hf_path and bf16, the optimizer's fp32 master weights are the loaded ones: an
    update that moves nothing (zero grads) leaves config.json's weights in place instead of
    writing back the random init."""
    cfg = load_config(None, [f"model.hf_path={hf_dir}", "model.dtype=bf16"])
    policy = build_policy(cfg, 300, rl.optim_settings(cfg))
    loaded = _weights(policy)
    policy.zero_grad()
    policy.step()
    after = _weights(policy)
    assert all(torch.equal(after[n], loaded[n]) for n in loaded)


@pytest.mark.parametrize("over, steps", [
    (["train.steps=2", "train.num_minibatches=4"], "train.steps x train.num_minibatches = 8"),
    (["optim.lr_decay_steps=10"], "optim.lr_decay_steps=10"),
])
def test_a_decay_that_ends_within_the_warmup_is_refused_before_the_run_dir(tmp_path, over,
                                                                        steps):
    """A linear / cosine decay must end after the warmup; otherwise it is a config error
    naming the keys, raised before the run dir is claimed (it was a ValueError traceback
    from the optimizer, after the claim)."""
    cfg = load_config(None, [*TOY, "optim.lr_decay_style=linear", "optim.warmup_steps=10",
                             f"run_dir={tmp_path / 'run'}", *over])
    with pytest.raises(ConfigError, match=rf"optim.warmup_steps=10: the lr decay .*{steps}"):
        rl.optim_settings(cfg)
    with pytest.raises(ConfigError, match="optim.warmup_steps=10"):
        setup_runtime(cfg, rl.SPEC)
    assert not (tmp_path / "run").exists()
    assert rl.optim_settings(load_config(None, [*TOY, "optim.warmup_steps=10", *over]))


def test_an_sft_target_longer_than_the_model_fails_before_the_run_is_recorded(single_process,
                                                                              tmp_path):
    """data.sft_key targets (worked solutions) are not bounded by data.max_prompt_tokens: one
    that does not fit with its prompt in model.max_seq_len failed in the forward of the SFT
    step that drew it (a ValueError traceback mid-run). Now a DataError naming the row at
    setup, before the run is recorded (so the fixed config can reuse the run dir); train
    does not check it (RL never feeds the SFT target)."""
    fixture = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "gsm_tiny")
    row = {"prompt": "What is 2 + 2?", "reward_model": {"ground_truth": "4"},
           "extra_info": {"answer": "2 + 2 = 4. " * 40 + "#### 4"}}
    data = tmp_path / "t.jsonl"
    data.write_text("\n".join([json.dumps(row)] * 6))
    run_dir = tmp_path / "run"
    over = [*TOY, "task.name=dataset", f"data.train_files={data}", f"data.tokenizer_path={fixture}",
            "data.sft_key=extra_info.answer", "reward.name=exact", "model.max_seq_len=96",
            "rollout.max_new_tokens=32", f"run_dir={run_dir}"]
    with pytest.raises(DataError, match=r"t.jsonl:\d: the SFT example .* is 2\d\d tokens, "
                                        r"over the model's max_seq_len=96"):
        setup_runtime(load_config(None, over), sft_job.SPEC)
    assert not (run_dir / "run.json").exists()
    setup_runtime(load_config(None, over), rl.SPEC).close()


def test_a_layout_the_world_size_cannot_hold_exits_2(single_process, tmp_path, capsys):
    """model.ep=2 started as one process (torchrun forgotten): one line naming the keys, no run
    dir (was init_parallel's ValueError traceback)."""
    from megatron_gspo.cli import main

    run_dir = tmp_path / "run"
    assert main(["train", *TOY, "model.ep=2", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.tp=1 model.ep=2: world size 1 is not divisible by ep=2" \
        in err[0] and "torchrun --nproc-per-node" in err[0], err
    assert not run_dir.exists()


def test_a_distributed_optimizer_run_resumed_with_another_tp_ep_is_refused(single_process,
                                                                           tmp_path):
    """optim.distributed=true saves megatron's dp_reshardable optimizer state: a resume with
    another TP / EP (its rank file records (tp, ep, world)) is a ConfigError pointing at
    init_checkpoint (was, under resume=force, a KeyError traceback from dist_checkpointing
    listing every shard). Another DP size alone resumes."""
    from megatron_gspo.run import checkpoint as ckpt
    from megatron_gspo.cli import main
    from megatron_gspo.run.resume import try_resume

    args = [*TOY, "optim.distributed=true", f"run_dir={tmp_path / 'run'}", "train.steps=1",
            "rollout.prompts_per_batch=2", "rollout.group_size=2", "train.num_minibatches=1"]
    assert main(["train", *args]) == 0  # the optimizer state exists after a step
    cfg = load_config(None, args)
    rt = setup_runtime(cfg, rl.SPEC)
    try:
        root = os.path.join(cfg.run_dir, "checkpoints")
        state = ckpt.load_checkpoint(root, rank=0)
        for layout, ok in (((1, 1, 2), True), ((1, 2, 2), False), ((2, 1, 2), False)):
            ckpt.save_checkpoint(root, 1, {**state, "layout": layout})
            if ok:
                assert try_resume(rt)["iteration"] == 1
                continue
            with pytest.raises(ConfigError, match=rf"saved with \(tp, ep\)=\({layout[0]}, "
                               rf"{layout[1]}\), resuming with \(1, 1\).*init_checkpoint="):
                try_resume(rt)
    finally:
        rt.close()


def test_sft_targets_longer_than_max_new_tokens_are_counted_and_warned(single_process, tmp_path,
                                                                       capsys):
    """SFT on worked solutions longer than rollout.max_new_tokens trains answers that every
    eval cuts (accuracy stays 0, sft.target_accuracy is never reached), silently before."""
    from megatron_gspo.tasks.datasets import check_sft_lengths
    from megatron_gspo.tasks.toy import Example
    from megatron_gspo.tasks.tokenizer import CharTokenizer

    examples = [Example("1+2=", "3"), Example("1+2=", "333"), Example("1+2=", "3333")]
    assert check_sft_lengths(CharTokenizer(), examples, 64, max_new_tokens=4) == 1
    assert check_sft_lengths(CharTokenizer(), examples, 64, max_new_tokens=5) == 0
    data = tmp_path / "t.jsonl"
    fixture = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "gsm_tiny")
    data.write_text(open(os.path.join(fixture, "train.jsonl")).read())
    over = [*TOY, "task.name=dataset", f"data.train_files={data}", f"data.tokenizer_path={fixture}",
            "data.sft_key=extra_info.answer", "reward.name=exact", "model.max_seq_len=160",
            "rollout.max_new_tokens=16", f"run_dir={tmp_path / 'run'}"]
    setup_runtime(load_config(None, over), sft_job.SPEC).close()
    assert "SFT targets are longer than rollout.max_new_tokens=16: eval and rollouts cut" \
        in capsys.readouterr().out


def test_a_data_tokenizer_that_renumbers_the_models_tokens_is_refused(hf_dir, tmp_path):
    """The dataset example (README, docs/data.md) sets data.tokenizer_path; kept next to
    model.hf_path, the model trained with another tokenizer's ids (silently). The model folder's
    tokenizer with added tokens (or another chat template) is fine."""
    import shutil

    from transformers import AutoTokenizer

    from megatron_gspo.run.setup import run_tokenizer

    gsm = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "gsm_tiny")
    cfg = load_config(None, [f"model.hf_path={hf_dir}", f"data.tokenizer_path={gsm}"])
    with pytest.raises(ConfigError, match=r"gsm_tiny is not model.hf_path's tokenizer "
                                          r"\(\d+ of its 300 tokens differ"):
        run_tokenizer(cfg)
    more = tmp_path / "more"
    shutil.copytree(hf_dir, more)
    tok = AutoTokenizer.from_pretrained(str(more))
    tok.add_tokens(["<tool_call>"], special_tokens=True)
    tok.save_pretrained(str(more))
    cfg = load_config(None, [f"model.hf_path={hf_dir}", f"data.tokenizer_path={more}"])
    assert run_tokenizer(cfg).vocab_size == 301



def test_the_test_split_is_also_scored_by_the_trainers_clean_decoder(tmp_path, monkeypatch):
    """With the sampler's routers noisy (an engine that disagrees), `test/accuracy_trainer`
    scores the same policy through the trainer's own clean decoder: its greedy tokens are the
    sampler's with the noise off; without a mismatch there is no second score."""
    from types import SimpleNamespace

    from megatron_gspo.rollout.sampler import SamplingParams
    from megatron_gspo.run import setup

    base = ["model.preset=tiny", "task.kwargs.num_digits=1", "task.n_train=20", "task.n_val=4",
            "task.n_test=6", "rollout.max_new_tokens=3", "wandb.mode=disabled"]
    rt = setup_runtime(load_config(None, [*base, "rollout.decoders.router_noise_std=30.0",
                                          f"run_dir={tmp_path / 'n'}"]), evaluate.SPEC)
    try:
        prompts, greedy = [[3, 4, 5], [6, 7, 8]], SamplingParams(max_new_tokens=3, greedy=True)
        ours, engine = (s.sample(prompts, greedy) for s in (setup.trainer_sampler(rt),
                                                             rt.sampler))
        rt.sampler.noise_std = 0.0
        theirs = rt.sampler.sample(prompts, greedy)
        rt.sampler.noise_std = 30.0
        assert torch.equal(ours.tokens_BT, theirs.tokens_BT)
        assert torch.equal(ours.logp_BT, theirs.logp_BT)
        assert not torch.equal(engine.logp_BT, theirs.logp_BT)  # the noise reached the engine
        monkeypatch.setattr(setup, "evaluate", lambda sampler, *a, **k: {
            "eval/accuracy": 0.25 if sampler.noise_std else 0.75, "eval/format_ok": 1.0})
        monkeypatch.setattr(setup, "sampled_reward", lambda *a, **k: 0.5)
        assert setup.evaluate_test(rt, step=0) == {
            "test/accuracy": 0.25, "test/format_ok": 1.0, "test/reward": 0.5,
            "test/accuracy_trainer": 0.75}
        clean = SimpleNamespace(cfg=load_config(None, base), test_set=rt.test_set,
                                sampler=rt.sampler, tokenizer=rt.tokenizer, task=rt.task)
        assert setup.trainer_sampler(clean) is None
        assert "test/accuracy_trainer" not in setup.evaluate_test(clean, step=0)
    finally:
        rt.close()
