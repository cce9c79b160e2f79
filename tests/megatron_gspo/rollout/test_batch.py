"""Rollout batches joined (megatron_gspo.rollout.filters.concat_batches, align=True): batches
sampled apart, with other prompt columns and widths, join as one whose every row keeps its
tokens, responses and routes."""

import torch

from megatron_gspo.rollout.batch import RolloutBatch
from megatron_gspo.rollout.filters import concat_batches
from moe.routing.replay import RoutingReplayCache


def part(start: int, lengths: list[int], seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), start + max(lengths)
    cols = torch.arange(T)[None, :]
    valid_BT = (cols >= start - 2) & (cols < start + torch.tensor(lengths)[:, None])
    tokens_BT = torch.randint(1, 50, (B, T), generator=g) * valid_BT
    ids_NLK = torch.randint(0, 8, (int(valid_BT.sum()), 2, 2), generator=g).to(torch.uint8)
    return RolloutBatch(tokens_BT, valid_BT, valid_BT & (cols >= start), torch.rand(B, T) * valid_BT,
                        torch.rand(B), torch.arange(B) // 2, [f"c{seed}{b}" for b in range(B)],
                        [None] * B, routing=RoutingReplayCache(ids_NLK, valid_BT, 8),
                        version_B=torch.full((B,), seed))


def test_cat_aligns_the_prompt_columns_and_keeps_every_rows_tokens_and_routes():
    a, b = part(5, [3, 1, 2, 2], seed=1), part(2, [9, 4], seed=2)
    out = concat_batches([a, b], pad_id=0, align=True)
    assert out.response_start == 5 and out.tokens_BT.shape == (6, 14)
    assert out.response_BT[:, :5].sum() == 0 and out.response_BT[:, 5].all()
    assert out.group_B.tolist() == [0, 0, 1, 1, 2, 2]
    assert out.completions == a.completions + b.completions
    assert out.version_B.tolist() == [1, 1, 1, 1, 2, 2]
    for row, (src, r) in enumerate([(a, 0), (a, 1), (a, 2), (a, 3), (b, 0), (b, 1)]):
        for name in ("tokens_BT", "sampler_logp_BT", "response_BT"):
            got, want = getattr(out, name)[row], getattr(src, name)[r]
            assert torch.equal(got[out.valid_BT[row]], want[src.valid_BT[r]]), (name, row)
        assert torch.equal(out.routing.select(torch.tensor([row])).ids_NLK,
                           src.routing.select(torch.tensor([r])).ids_NLK)
    assert torch.equal(out.routing.valid_BT, out.valid_BT)  # routes sit on their tokens
