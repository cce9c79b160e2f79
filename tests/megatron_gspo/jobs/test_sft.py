"""Cold-start SFT (megatron_gspo.jobs.sft): the batch and its masks, the loss, the data-parallel
split, its state in checkpoints old and new, and a stopped run resuming to the same steps."""

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import ConfigError
from megatron_gspo.jobs import sft
from megatron_gspo.run import loop
from megatron_gspo.run.metrics import read_jsonl
from megatron_gspo.run.preempt import Preempted
from megatron_gspo.tasks.tokenizer import CharTokenizer
from megatron_gspo.tasks.toy import Example
from tests.megatron_gspo.jobs.test_band import BASE, _scripted_eval

EXAMPLES = [Example("1+2=", "3"), Example("12+3=", "15")]


def test_batch_is_left_padded_prompt_then_answer_and_eos():
    """Each row `<bos> prompt answer <eos>` is left-padded to the longest row; only answer
    tokens and <eos> are targets, and padding is not valid."""
    tok = CharTokenizer()
    tokens_BT, valid_BT, target_BT = sft.sft_batch(tok, EXAMPLES)
    enc = tok.encode
    pad, bos, eos = tok.pad_id, tok.bos_id, tok.eos_id
    assert tokens_BT.tolist() == [[pad, pad, bos, *enc("1+2="), *enc("3"), eos],
                                  [bos, *enc("12+3="), *enc("15"), eos]]
    assert valid_BT.tolist() == [[False] * 2 + [True] * 7, [True] * 9]
    assert target_BT.tolist() == [[False] * 7 + [True] * 2,
                                  [False] * 6 + [True] * 3]


def test_batch_is_as_long_as_its_longest_row():
    """A long prompt with a short answer and a short prompt with a long answer: 9 columns
    (the longest row), not 12 (longest prompt + longest answer), which crashed SFT with
    'sequence length exceeds max_seq_len' when every row fitted the model."""
    tok = CharTokenizer()
    tokens_BT, valid_BT, target_BT = sft.sft_batch(
        tok, [Example("1+2+3=", "6"), Example("1=", "1111")])
    assert tokens_BT.shape == (2, 9) and valid_BT.sum(1).tolist() == [9, 8]
    assert target_BT.sum(1).tolist() == [2, 5]


class RecordingPolicy:
    """token_logprobs returns fixed values; records the order of zero_grad / backward."""

    def __init__(self):
        self.calls, self.tokens = [], None

    def zero_grad(self):
        self.calls.append("zero_grad")

    def token_logprobs(self, tokens_BT, valid_BT):
        self.tokens = tokens_BT
        g = torch.Generator().manual_seed(0)
        return -torch.rand(tokens_BT.shape, generator=g).requires_grad_()

    def backward(self, loss):
        self.calls.append("backward")

    def step(self):
        return True, 0.5


def fake_runtime(batch_size: int, dp: int) -> SimpleNamespace:
    cfg = load_config(None, [f"sft.batch_size={batch_size}"])
    return SimpleNamespace(cfg=cfg, info=SimpleNamespace(dp=dp), tokenizer=CharTokenizer(),
                           train_set=EXAMPLES, policy=RecordingPolicy())


def test_step_loss_is_the_token_mean_over_answer_tokens_of_this_ranks_share():
    """-log p averaged over answer tokens and <eos> only, on batch_size / dp rows, with the
    gradients zeroed before the backward (float64 reference)."""
    rt = fake_runtime(batch_size=8, dp=2)
    rt.train_set = EXAMPLES[1:]  # every row "<bos>12+3=" then targets "15<eos>"
    out = sft.sft_step(rt, sft.draw_batch(rt, torch.Generator().manual_seed(1)))
    policy = rt.policy
    assert policy.calls == ["zero_grad", "backward"] and policy.tokens.shape == (4, 9)
    logp = -torch.rand(4, 9, generator=torch.Generator().manual_seed(0)).double()
    want = -logp[:, 6:].sum() / (4 * 3)
    assert out["sft/loss"] == pytest.approx(want.item(), rel=1e-6)
    assert (out["train/grad_norm"], out["train/skipped"]) == (0.5, 0.0)


def test_a_packed_sft_step_is_the_padded_one(single_process):
    """sft.pack: the batch's rows as one packed forward give the padded step's loss and
    gradients (float32, within 1e-6); examples of different lengths, so rows are padded."""
    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.model.settings import OptimSettings, ParallelLayout

    tok = CharTokenizer()
    preset = get_preset("qwen3-moe-tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=tok.vocab_size, seed=3,
                             optim=OptimSettings(lr=0.0))
    examples = [Example("1+2=", "3"), Example("12+345=", "357"), Example("7+80=", "87")] * 3
    batch = sft.sft_batch(tok, examples)
    assert not batch[1].all()
    out = {}
    for pack in (False, True):
        policy.pack = pack
        loss = sft.sft_step(SimpleNamespace(policy=policy), batch)["sft/loss"]
        out[pack] = loss, {n: p.main_grad.clone()
                           for n, p in policy.model.module.named_parameters()}
    assert abs(out[True][0] - out[False][0]) <= 1e-6
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, atol=1e-6, rtol=0, msg=name)
    assert max(float(g.abs().max()) for g in out[False][1].values()) > 1e-3


def test_batch_size_must_split_over_data_parallel_ranks():
    """Refused before anything runs: each rank trains on an equal share. A ConfigError (one
    line, exit 2 from the CLI), not the bare ValueError (a traceback) it was."""
    rt = fake_runtime(batch_size=8, dp=3)
    with pytest.raises(ConfigError, match="sft.batch_size=8 is not divisible by the "
                                          "data-parallel size 3"):
        sft.SFTJob(rt)


class StopAt:
    """Preemption stand-in: a SIGTERM is 'received' during step `step`."""

    def __init__(self, step: int):
        self.step, self.calls = step, 0

    def __call__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def requested(self):
        self.calls += 1
        return signal.SIGTERM if self.calls == self.step else None


def test_stopped_run_resumes_to_the_same_steps(tmp_path, monkeypatch):
    """SFT stopped after step 1 and run again logs the same losses as an uninterrupted run
    (same batches, no step repeated), and evaluates at the last step off the eval grid."""
    _scripted_eval(monkeypatch, [0.0] * 6)  # evals at steps 0, 2, 3; then 0 | 2, 3
    args = [*BASE, "sft.steps=3", "sft.eval_every=2", "sft.batch_size=8"]
    sft.run_sft(load_config(None, [*args, f"run_dir={tmp_path / 'straight'}"]))
    cut = load_config(None, [*args, f"run_dir={tmp_path / 'cut'}"])
    monkeypatch.setattr(loop, "Preemption", StopAt(1))
    with pytest.raises(Preempted, match="stopped at SFT step 1 of 3"):
        sft.run_sft(cut)
    monkeypatch.setattr(loop, "Preemption", StopAt(0))
    sft.run_sft(cut)

    def rows(name):
        return [(r["step"], r.get("sft/loss"), r.get("eval/accuracy"))
                for r in read_jsonl(os.path.join(tmp_path, name, "metrics.jsonl"))]

    straight = rows("straight")
    assert [s for s, _, acc in straight if acc is not None] == [0, 2, 3]
    assert rows("cut") == straight


def test_an_sft_checkpoint_from_before_the_state_dataclass_resumes(tmp_path):
    """SFT checkpoints have always held loose keys (`job`, `step`, `eval`: the saved step's
    metrics, `band` once SFT stopped inside sft.target_accuracy, `gen`: the batch stream). The
    state dataclass writes the same keys and reads old checkpoints: the step, the stream where
    it was, and the band's memory (the previous eval a jump is named from, or where it
    stopped)."""
    gen = torch.Generator().manual_seed(5)
    torch.randint(10, (3,), generator=gen)
    old = {"job": "sft", "step": 4, "eval": {"sft/loss": 1.5, "eval/accuracy": 0.25},
           "gen": gen.get_state()}
    rt = fake_runtime(batch_size=8, dp=1)
    rt.info.dp_rank = 0
    rt.cfg = load_config(None, ["sft.batch_size=8", "sft.target_accuracy=[0.5,0.6]",
                                "sft.eval_every=2", "run_dir=r"])
    job = sft.SFTJob(rt)
    job.restore(old)
    assert job.state.step == 4 and job.state.done == job.state.log_step == 4
    assert torch.equal(torch.randint(10, (3,), generator=job.state.gen),
                       torch.randint(10, (3,), generator=gen))
    assert job.band.last == (4, 0.25) and job.band.record() == {}
    with pytest.raises(ConfigError, match=r"jumped from 0\.2500 at step 4 to 0\.9000 at step 6"):
        job.band.update(6, 0.9)
    new = job.state.to_checkpoint()
    assert set(new) == {"job", "step", "gen"} and new["job"] == "sft" and new["step"] == 4
    stopped = sft.SFTJob(rt)
    stopped.restore({**old, "band": {"sft/start_accuracy": 0.55, "sft/band_step": 4.0}})
    assert stopped.band.record() == {"sft/start_accuracy": 0.55, "sft/band_step": 4.0}
    assert stopped.band.summary() == ("SFT entered sft.target_accuracy=[0.5, 0.6] at step 4: "
                                      "held-out accuracy 0.5500")
