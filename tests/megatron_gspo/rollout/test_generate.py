"""Rollouts and the greedy eval through a sampler: group-major rows, rewards and flags, the
rank-agreed chunk count, scores in example order."""

import pytest
import torch

from megatron_gspo.rollout import generate as rollout
from megatron_gspo.rollout.generate import evaluate, generate_rollouts
from megatron_gspo.tasks.toy import Addition, CharTokenizer, Example
from tests.megatron_gspo.sampling import decoder_sampler, encode_prompts, rollout_params, sample

PROMPTS = ["12+345=", "7+8=", "99+1=", "3+40="]


@pytest.fixture(scope="module")
def policy(single_process):
    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.model.settings import ParallelLayout

    return MoEPolicy.build(get_preset("qwen3-moe-tiny"), ParallelLayout(), real_vocab=26,
                           seed=3, optim=None)


class Counted:
    """A sampler that records each call's prompt count (and the policy's mode as the call
    starts), then samples with `inner`."""

    def __init__(self, inner, policy):
        self.inner, self.policy, self.calls = inner, policy, []

    def sample(self, prompts, params, generator=None):
        self.calls.append((len(prompts), self.policy.model.training))
        return self.inner.sample(prompts, params, generator)


def test_evaluate_runs_the_agreed_chunk_count_and_restores_the_mode(policy, monkeypatch):
    """`evaluate` decodes max_over_ranks(chunks) chunks (a rank past its own examples decodes a
    filler chunk and discards it) with its metrics unchanged, and leaves the policy's
    train/eval mode as it found it."""
    tok, task = CharTokenizer(), Addition()
    examples = [Example(p, str(sum(map(int, p[:-1].split("+"))))) for p in PROMPTS[:3]]
    sampler = decoder_sampler(policy, tok)
    was = policy.model.training
    try:
        for mode in (True, False):
            policy.train(mode)
            want = evaluate(sampler, tok, task, examples, max_new_tokens=4, batch_size=2)
            assert policy.model.training is mode
        counted = Counted(sampler, policy)
        monkeypatch.setattr(rollout, "max_over_ranks", lambda n: n + 2)  # a peer has 4 chunks
        assert evaluate(counted, tok, task, examples, max_new_tokens=4, batch_size=2) == want
        assert [n for n, _ in counted.calls] == [2, 1, 1, 1]
    finally:
        policy.train(was)


def test_generate_rollouts_rows_are_group_major(policy):
    """Rows [ex0] * G + [ex1] * G: group_B names each row's example, and each row's prompt is
    that example's."""
    examples = [Example("12+345=", "357"), Example("7+8=", "15")]
    tok = CharTokenizer()
    batch = generate_rollouts(decoder_sampler(policy, tok), tok, Addition(), examples,
                              group_size=3, params=rollout_params(3),
                              generator=torch.Generator().manual_seed(0))
    assert batch.group_B.tolist() == [0, 0, 0, 1, 1, 1]
    assert [ex.prompt for ex in batch.examples] == [examples[g].prompt for g in batch.group_B]


class _PenaltyTask:
    """Reward -1 - len(completion) (negative: kept as is); raises for the answer "boom"."""

    def reward(self, example, completion):
        if example.answer == "boom":
            raise RuntimeError("verifier bug")
        return -1.0 - len(completion)


def test_generate_rollouts_is_the_sampler_plus_rewards_and_flags(policy):
    """generate_rollouts passes the sampling parameters and the generator on to the sampler
    (the same draws and log-probs as calling it directly); completions are the
    decoded response tokens; rewards (negative ones kept) and reward status come from the task;
    truncation uses all of the tokenizer's stop ids, not just EOS."""
    from megatron_gspo.tasks.rewards import OK, RAISED
    from megatron_gspo.rollout.generate import truncated_rows

    tok = CharTokenizer()
    tok.stop_ids = frozenset({tok.eos_id, *(tok.encode(d)[0] for d in "01234")})
    examples = [Example("12+3=", "15"), Example("7+8=", "boom")]
    kw = dict(max_new_tokens=4, temperature=0.7, top_p=0.9)
    batch = generate_rollouts(decoder_sampler(policy, tok), tok, _PenaltyTask(), examples,
                              group_size=3, params=rollout_params(record_routing=True, **kw),
                              generator=torch.Generator().manual_seed(11))
    want = sample(policy, tok, [ex.prompt for ex in batch.examples],
                  generator=torch.Generator().manual_seed(11), **kw)
    for got, w in zip((batch.tokens_BT, batch.valid_BT, batch.response_BT,
                       batch.sampler_logp_BT), want):
        assert torch.equal(got, w)
    assert batch.routing is not None and torch.equal(batch.routing.valid_BT, batch.valid_BT)
    assert batch.completions == [tok.decode(r[m].tolist()) for r, m in zip(want[0], want[2])]
    assert batch.rewards_B.tolist() == [-1.0 - len(c) for c in batch.completions[:3]] + [0.0] * 3
    assert batch.reward_status_B.tolist() == [OK] * 3 + [RAISED] * 3
    assert torch.equal(batch.truncated_B, truncated_rows(want[0], want[2], tok.stop_ids))
    P = encode_prompts(tok, [ex.prompt for ex in examples])[0].shape[1]
    last_B = batch.tokens_BT.gather(1, (P + batch.response_lengths_B - 1)[:, None]).squeeze(1)
    assert ((last_B != tok.eos_id) & ~batch.truncated_B).any()  # a non-EOS stop ended a row


def test_evaluate_scores_the_greedy_completions_in_example_order(policy, monkeypatch):
    """evaluate scores exactly the examples' greedy completions, in order (a filler chunk's
    are dropped), decoding ceil(n / batch_size) chunks (here 4 / 2, plus the peer's filler) in
    with the sampler it was given; no examples is a ValueError."""
    tok = CharTokenizer()
    examples = [Example(p, "0") for p in PROMPTS]
    want = []
    for chunk in (PROMPTS[:2], PROMPTS[2:]):
        out = sample(policy, tok, chunk, max_new_tokens=2, greedy=True, kv_cache=False)
        want += rollout.decode_responses(tok, out[0], out[2])
    seen = []
    counted = Counted(decoder_sampler(policy, tok, kv_cache=False), policy)
    monkeypatch.setattr(rollout, "score",
                        lambda task, exs, comps: seen.append((exs, comps)) or {})
    monkeypatch.setattr(rollout, "max_over_ranks", lambda n: n + 1)  # a peer has 3 chunks
    evaluate(counted, tok, Addition(), examples, max_new_tokens=2, batch_size=2)
    assert seen == [(examples, want)]
    assert [n for n, _ in counted.calls] == [2, 2, 1]
    with pytest.raises(ValueError, match="no examples"):
        evaluate(counted, tok, Addition(), [], max_new_tokens=3)




def test_rollouts_in_blocks_of_whole_groups_are_the_blocks_sampled_in_turn(policy):
    """`max_rows=5` at G=2 (`rollout.max_batch_rows`): the sampler gets 2 prompts x 2 (4 rows),
    then the last prompt's 2; the one batch holds each block's rows as sampling that block from
    the same generator in turn gives them (right-padded to the widest block), group ids
    0..2, and R3's routing merged row by row."""
    from megatron_gspo.rollout.filters import concat_batches

    tok = CharTokenizer()
    examples = [Example("12+345=", "357"), Example("7+8=", "15"), Example("9+1=", "10")]
    params = rollout_params(4, record_routing=True)
    counted = Counted(decoder_sampler(policy, tok), policy)
    batch = generate_rollouts(counted, tok, Addition(), examples, group_size=2, params=params,
                              generator=torch.Generator().manual_seed(5), max_rows=5)
    assert [n for n, _ in counted.calls] == [4, 2]
    gen = torch.Generator().manual_seed(5)
    blocks = [generate_rollouts(decoder_sampler(policy, tok), tok, Addition(), part,
                                group_size=2, params=params, generator=gen)
              for part in (examples[:2], examples[2:])]
    want = concat_batches(blocks, tok.pad_id)
    for name in ("tokens_BT", "valid_BT", "response_BT", "sampler_logp_BT", "rewards_B"):
        assert torch.equal(getattr(batch, name), getattr(want, name)), name
    assert batch.group_B.tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(batch.routing.valid_BT, batch.valid_BT)
    for rows, block in ((torch.arange(4), blocks[0]), (torch.arange(4, 6), blocks[1])):
        assert torch.equal(batch.routing.select(rows).ids_NLK, block.routing.ids_NLK)
    assert batch.tokens_BT.shape[1] == max(b.tokens_BT.shape[1] for b in blocks)
