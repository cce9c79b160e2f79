"""DAPO filters on hand-built rollout batches: truncation, overlong masking, dynamic sampling."""

import os

import pytest
import torch

from megatron_gspo.rollout.filters import (concat_batches, dynamic_sample, group_has_signal,
                                   overlong_filter, rollout_health, trim_columns)
from megatron_gspo.tasks.rewards import OK, RAISED, TIMED_OUT
from megatron_gspo.rollout.batch import RolloutBatch
from megatron_gspo.rollout.generate import truncated_rows

PAD, EOS, STOP2 = 0, 2, 7


def make_batch(rewards, prompt_len=2, resp_lens=None, T=None, stop=True, tag=0):
    """Rows [pads][prompt][response][pads]: prompt tokens 5, response tokens 10 + tag, the last
    response token EOS when `stop`. One group per 2 rows (G = 2)."""
    B = len(rewards)
    resp_lens = resp_lens or [2] * B
    T = T or prompt_len + max(resp_lens) + 1
    tokens = torch.full((B, T), PAD)
    valid = torch.zeros(B, T, dtype=torch.bool)
    resp = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(resp_lens):
        tokens[b, :prompt_len] = 5
        tokens[b, prompt_len:prompt_len + n] = 10 + tag
        if stop:
            tokens[b, prompt_len + n - 1] = EOS
        valid[b, :prompt_len + n] = True
        resp[b, prompt_len:prompt_len + n] = True
    logp = torch.where(resp, torch.full((B, T), -0.5 - tag), torch.zeros(B, T))
    return RolloutBatch(tokens, valid, resp, logp, torch.tensor(rewards, dtype=torch.float32),
                        torch.arange(B // 2).repeat_interleave(2), [f"c{tag}_{b}" for b in range(B)],
                        [f"e{tag}_{b // 2}" for b in range(B)], None,
                        torch.tensor([not stop] * B), torch.zeros(B, dtype=torch.int8))


def test_truncated_rows_hand_built():
    tokens = torch.tensor([[1, 5, 9, EOS, 0], [1, 5, 9, 9, 9], [0, 1, 5, STOP2, 0],
                           [1, 5, 9, 9, EOS]])
    resp = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 1, 0], [0, 0, 1, 1, 1]],
                        dtype=torch.bool)
    assert truncated_rows(tokens, resp, {EOS, STOP2}).tolist() == [False, True, False, False]
    assert truncated_rows(tokens, resp, {EOS}).tolist() == [False, True, True, False]


def test_truncated_rows_is_false_for_an_empty_response():
    """A row with no response token (max_new_tokens=0) did not run out of tokens: its "last
    response token" (argmax of an all-zero mask: column 0, a prompt token) is no evidence."""
    tokens = torch.tensor([[5, 5, 9], [5, 9, 9]])
    resp = torch.tensor([[0, 0, 0], [0, 1, 1]], dtype=torch.bool)
    assert truncated_rows(tokens, resp, {EOS}).tolist() == [False, True]


def test_response_start_is_never_column_0():
    """Log-probs of column t come from column t-1's logits, so they start at column >= 1, even
    when a response starts at column 0 (an empty prompt and no <bos>), or there is none."""
    batch = make_batch([1, 0])
    assert batch.response_start == 2
    batch.response_BT[:] = False
    assert batch.response_start == 1
    batch.response_BT[0, 0] = True
    assert batch.response_start == 1


def test_rollout_health_counts():
    batch = make_batch([1, 0, 0, 0])
    batch.truncated_B = torch.tensor([True, False, True, True])
    batch.reward_status_B = torch.tensor([OK, RAISED, TIMED_OUT, OK], dtype=torch.int8)
    assert rollout_health(batch) == {"response/truncated_frac": 0.75, "reward/errors": 2.0,
                                     "reward/timeouts": 1.0}


def test_overlong_filter_zeroes_only_truncated_advantages():
    batch = make_batch([1, 0, 0, 1])
    batch.truncated_B = torch.tensor([True, False, False, True])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    out, metrics = overlong_filter(adv, batch, enabled=True)
    assert out.tolist() == [0.0, -1.0, -1.0, 0.0] and metrics == {"filter/overlong_masked": 0.5}
    assert adv.tolist() == [1.0, -1.0, -1.0, 1.0]  # not in place
    same, none = overlong_filter(adv, batch, enabled=False)
    assert same is adv and none == {}


def test_group_has_signal():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert group_has_signal(r, 2).tolist() == [False, True, False, False]
    assert group_has_signal(r, 4).tolist() == [True, True]


def test_concat_pads_right_and_keeps_rows():
    a = make_batch([1, 0], resp_lens=[1, 2], tag=0)
    b = make_batch([0, 0], prompt_len=3, resp_lens=[4, 1], tag=1)
    ab = concat_batches([a, b], pad_id=PAD)
    assert ab.tokens_BT.shape == (4, 8) and ab.group_B.tolist() == [0, 0, 1, 1]
    assert torch.equal(ab.tokens_BT[:2, :a.tokens_BT.shape[1]], a.tokens_BT)
    assert bool((ab.tokens_BT[:2, a.tokens_BT.shape[1]:] == PAD).all())
    assert not ab.valid_BT[:2, a.tokens_BT.shape[1]:].any()
    assert torch.equal(ab.sampler_logp_BT[2:], b.sampler_logp_BT)
    assert ab.completions == a.completions + b.completions
    assert ab.rewards_B.tolist() == [1.0, 0.0, 0.0, 0.0]
    a.routing = object()
    with pytest.raises(ValueError, match="R3"):
        concat_batches([a, b], pad_id=PAD)


def test_trim_columns_drops_all_invalid_edges():
    batch = make_batch([1, 0], resp_lens=[1, 1], T=6)
    batch.valid_BT[:, 0] = False
    out = trim_columns(batch)
    assert out.tokens_BT.shape == (2, 2) and bool(out.valid_BT.all())


def draws(*reward_lists, **kw):
    batches = [make_batch(r, tag=k, resp_lens=[1 + k] * len(r), **kw)
               for k, r in enumerate(reward_lists)]
    it = iter(batches)
    return (lambda: next(it)), batches


def test_dynamic_sampling_keeps_varied_groups_in_draw_order():
    # 3 groups of G=2 per draw. Round 0: only group 1 varied; round 1: groups 0 and 2 varied.
    draw, batches = draws([1, 1, 0, 1, 0, 0], [1, 0, 1, 1, 0, 1], [0, 1, 0, 1, 0, 1])
    out, metrics = dynamic_sample(draw, n_prompts=3, group_size=2, max_rounds=4, pad_id=PAD)
    assert metrics == {"filter/zero_std_frac/before": 3 / 6, "filter/zero_std_frac/after": 0.0,
                       "filter/rounds": 2.0, "filter/prompts_drawn": 6.0}
    assert out.examples == ["e0_1", "e0_1", "e1_0", "e1_0", "e1_2", "e1_2"]
    assert out.rewards_B.tolist() == [0, 1, 1, 0, 0, 1]
    assert out.group_B.tolist() == [0, 0, 1, 1, 2, 2]
    assert out.tokens_BT.shape == (6, 4)  # round 1's 2-token responses set the width
    assert out.sampler_logp_BT[0].tolist() == [0, 0, -0.5, 0]  # a round-0 row, right-padded
    assert out.sampler_logp_BT[2].tolist() == [0, 0, -1.5, -1.5]
    assert group_has_signal(out.rewards_B, 2).all()


def test_dynamic_sampling_fills_with_flat_groups_when_rounds_run_out():
    draw, _ = draws([1, 1, 0, 0, 1, 1], [0, 1, 1, 1, 0, 0], [0, 1, 0, 1, 0, 1])
    out, metrics = dynamic_sample(draw, n_prompts=3, group_size=2, max_rounds=2, pad_id=PAD)
    assert metrics["filter/rounds"] == 2.0 and metrics["filter/prompts_drawn"] == 6.0
    assert metrics["filter/zero_std_frac/before"] == 5 / 6
    assert metrics["filter/zero_std_frac/after"] == 2 / 3
    assert out.examples == ["e1_0", "e1_0", "e0_0", "e0_0", "e0_1", "e0_1"]
    assert len(out) == 6


def test_dynamic_sampling_one_round_when_the_first_batch_suffices():
    draw, batches = draws([1, 0, 0, 1], [1, 0, 1, 0])
    out, metrics = dynamic_sample(draw, n_prompts=2, group_size=2, max_rounds=3, pad_id=PAD)
    assert metrics["filter/rounds"] == 1.0 and metrics["filter/zero_std_frac/before"] == 0.0
    assert torch.equal(out.tokens_BT, batches[0].tokens_BT[:, :3])  # its padding column trimmed
    assert out.examples == batches[0].examples


def _ranks_worker(rank: int, port: int, out_dir: str) -> None:
    """Rank 0 finds 2 varied groups in its first draw, rank 1 only in its second: both must
    run 2 rounds (their sampler forwards are collective under EP)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        first = [1, 0, 0, 1] if rank == 0 else [1, 1, 0, 0]
        calls = []

        def draw():
            calls.append(1)
            return make_batch(first if len(calls) == 1 else [0, 1, 1, 0], tag=len(calls))

        out, metrics = dynamic_sample(draw, n_prompts=2, group_size=2, max_rounds=3,
                                      pad_id=PAD)
        torch.save({"calls": len(calls), "metrics": metrics, "examples": out.examples},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dynamic_sampling_ranks_agree_on_the_number_of_rounds(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ranks_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["calls"] == r1["calls"] == 2
    assert r0["metrics"]["filter/rounds"] == r1["metrics"]["filter/rounds"] == 2.0
    assert r0["examples"] == ["e1_0", "e1_0", "e1_1", "e1_1"]  # its first draw sufficed
    assert r1["examples"] == ["e2_0", "e2_0", "e2_1", "e2_1"]
    assert r1["metrics"]["filter/zero_std_frac/before"] == 0.5


def test_group_has_signal_agrees_with_group_advantages_at_the_tolerance():
    """Guards the population std in group_has_signal: it must be the test group_advantages
    uses, or dynamic sampling keeps a group whose advantages are all 0. Group 0: population std
    0.8e-12 < 1e-12 (the Bessel std, 1.13e-12, would pass); group 1: 1.2e-12."""
    from megatron_gspo.algo.advantages import group_advantages

    r = torch.tensor([1.0, 1.0 + 1.6e-12, 1.0, 1.0 + 2.4e-12], dtype=torch.float64)
    adv, m = group_advantages(r, 2)
    assert adv[:2].tolist() == [0.0, 0.0] and (adv[2:] != 0).all()
    assert m["adv/zero_std_frac"] == 0.5
    assert group_has_signal(r, 2).tolist() == [False, True]


def test_rollout_health_counts_timeouts_apart_from_raises():
    """reward/timeouts counts TIMED_OUT only, reward/errors both kinds; a batch without
    truncation or reward status (hand-built, or an old caller) logs neither metric."""
    batch = make_batch([1, 0, 0, 0, 1, 1])
    batch.reward_status_B = torch.tensor([RAISED, RAISED, TIMED_OUT, OK, RAISED, OK],
                                         dtype=torch.int8)
    health = rollout_health(batch)
    assert health["reward/errors"] == 4.0 and health["reward/timeouts"] == 1.0
    batch.truncated_B = batch.reward_status_B = None
    assert rollout_health(batch) == {}


def test_overlong_filter_needs_the_truncation_flags():
    """filter.overlong on a batch without truncated_B is a ValueError naming the field, not a
    silent no-op or a crash deep in masked_fill."""
    batch = make_batch([1, 0])
    batch.truncated_B = None
    with pytest.raises(ValueError, match="truncated_B"):
        overlong_filter(torch.tensor([1.0, -1.0]), batch, enabled=True)
    assert overlong_filter(torch.tensor([1.0, -1.0]), batch, enabled=False)[1] == {}


def test_group_has_signal_at_exactly_the_tolerance():
    """Population std == ZERO_STD_TOL (0 and 2e-12: std 1e-12 exactly in float64) is signal, as
    group_advantages (zero only below the tolerance) gives it nonzero advantages."""
    from megatron_gspo.algo.advantages import ZERO_STD_TOL, group_advantages

    r = torch.tensor([0.0, 2e-12], dtype=torch.float64)
    assert r.std(unbiased=False).item() == ZERO_STD_TOL
    assert (group_advantages(r, 2)[0] != 0).all()
    assert group_has_signal(r, 2).tolist() == [True]


def test_group_has_signal_tests_float32_rewards_in_float64():
    """RolloutBatch rewards are float32. float32(2e-12) = 1.99999999e-12, so [0, it] has
    population std 9.99999996e-13 < ZERO_STD_TOL in float64: group_advantages gives it zero
    advantages, and group_has_signal must agree (a float32 std compared in float32 rounds the
    tolerance to that same value and would call it signal)."""
    from megatron_gspo.algo.advantages import group_advantages

    r = torch.tensor([0.0, 2e-12, 0.0, 1.0], dtype=torch.float32)
    assert group_advantages(r, 2)[0][:2].tolist() == [0.0, 0.0]
    assert group_has_signal(r, 2).tolist() == [False, True]


def test_concat_pads_tokens_with_pad_id_and_masks_with_false():
    """Right padding: tokens take the tokenizer's pad id (here 9, not 0); valid/response masks
    False and sampler log-probs 0, whatever the pad id."""
    a = make_batch([1, 0], resp_lens=[1, 1], tag=0)
    b = make_batch([0, 1], resp_lens=[3, 3], tag=1)
    ab = concat_batches([a, b], pad_id=9)
    Ta = a.tokens_BT.shape[1]
    assert ab.tokens_BT.shape[1] > Ta
    assert bool((ab.tokens_BT[:2, Ta:] == 9).all())
    assert not ab.valid_BT[:2, Ta:].any() and not ab.response_BT[:2, Ta:].any()
    assert bool((ab.sampler_logp_BT[:2, Ta:] == 0).all())
    assert ab.valid_BT.dtype == torch.bool and ab.response_BT.dtype == torch.bool


def test_dynamic_sampling_after_frac_is_zero_when_extra_varied_groups_were_found():
    """filter/zero_std_frac/after is the filler fraction of the kept batch: 0, never negative,
    when the last round brings more varied groups than still needed (1 + 2 for 2 prompts)."""
    draw, _ = draws([1, 0, 1, 1], [0, 1, 1, 0])
    out, metrics = dynamic_sample(draw, n_prompts=2, group_size=2, max_rounds=3, pad_id=PAD)
    assert metrics["filter/zero_std_frac/after"] == 0.0
    assert metrics["filter/zero_std_frac/before"] == 1 / 4 and metrics["filter/rounds"] == 2.0
    assert out.examples == ["e0_0", "e0_0", "e1_0", "e1_0"]


def test_sample_rollouts_dispatches_on_the_filter_config():
    """filter.dynamic_sampling=false: one draw, no metrics; true: dynamic_sample with
    filter.max_rounds (here 1: the flat first draw is kept, no second draw)."""
    from types import SimpleNamespace

    from megatron_gspo.rollout.filters import sample_rollouts

    draw, batches = draws([1, 1, 0, 0], [1, 0, 0, 1])
    out, metrics = sample_rollouts(draw, SimpleNamespace(dynamic_sampling=False, max_rounds=4),
                                   2, 2, PAD)
    assert out is batches[0] and metrics == {}
    draw, _ = draws([1, 1, 0, 0], [1, 0, 0, 1])
    out, metrics = sample_rollouts(draw, SimpleNamespace(dynamic_sampling=True, max_rounds=1),
                                   2, 2, PAD)
    assert metrics["filter/rounds"] == 1.0 and metrics["filter/zero_std_frac/after"] == 1.0
    assert out.examples == ["e0_0", "e0_0", "e0_1", "e0_1"]


def test_rollout_batch_select_and_response_lengths():
    """select(rows) picks those rows, in that order, from every tensor, list and the routing
    cache (through its own select); response lengths count response tokens, not the prompt."""

    class Routing:
        def select(self, rows):
            return ("selected", rows.tolist())

    batch = make_batch([1, 0, 0, 1], prompt_len=2, resp_lens=[1, 3, 2, 1])
    assert batch.response_lengths_B.tolist() == [1, 3, 2, 1]
    batch.routing = Routing()
    sub = batch.select(torch.tensor([3, 1]))
    assert sub.routing == ("selected", [3, 1])
    assert sub.completions == ["c0_3", "c0_1"] and sub.rewards_B.tolist() == [1.0, 0.0]
    assert torch.equal(sub.tokens_BT, batch.tokens_BT[[3, 1]])
    assert sub.response_lengths_B.tolist() == [1, 3]


def test_dynamic_sampling_judges_whole_groups_of_group_size():
    """Signal is judged per group of G=4 rows (not per pair): [1, 1, 0, 0] is one varied group
    although each of its pairs is flat."""
    draw, _ = draws([1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 2, 2, 2, 2])
    out, metrics = dynamic_sample(draw, n_prompts=2, group_size=4, max_rounds=3, pad_id=PAD)
    assert metrics["filter/rounds"] == 2.0 and metrics["filter/zero_std_frac/before"] == 0.5
    assert out.rewards_B.tolist() == [1, 1, 0, 0, 0, 0, 1, 1]
    assert out.group_B.tolist() == [0] * 4 + [1] * 4
