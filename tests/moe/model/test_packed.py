"""Packed forwards (moe.model.packed, moe.model.packed_attention): the rows' real tokens as one
sequence give the padded forward's log-probs, entropy, logits and gradients to float32 rounding;
positions restart per sequence and nothing attends across sequences."""

import pytest
import torch
import torch.nn.functional as F

from moe.model.packed import Pack
from moe.model.packed_attention import flex_document, per_sequence
from tests.moe.model.test_experts import build

TOL = dict(atol=1e-6, rtol=0)  # float32: packed vs padded differ by summation order only
REL = dict(atol=1e-6, rtol=1e-6)  # values of a few nats or larger: a few float32 ulps


def ragged_batch(B=6, T=40, vocab=64, seed=0):
    """Rows of different lengths: left padding (prompts) and right padding (responses)."""
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(0, vocab, (B, T), generator=g)
    valid_BT = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        left = int(torch.randint(0, 6, (1,), generator=g))
        n = int(torch.randint(8, T - left + 1, (1,), generator=g))
        valid_BT[b, left:left + n] = True
    return tokens_BT, valid_BT


def test_pack_indices_by_hand():
    """Rows' real tokens row by row; segments per row plus the alignment tail; positions
    restart at 0; each row's first token has no prediction."""
    valid_BT = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    pack = Pack.of(valid_BT, multiple=4)
    assert pack.flat_N.tolist() == [1, 2, 3, 4, 5, 10, 11]
    assert (pack.n, pack.pad, pack.length) == (7, 1, 8)
    assert pack.cu_seqlens().tolist() == [0, 3, 5, 7, 8]
    assert pack.positions().tolist() == [[0, 1, 2, 0, 1, 0, 1, 0]]
    tokens_BT = torch.arange(12).reshape(3, 4) + 20
    assert pack.tokens(tokens_BT).tolist() == [[21, 22, 23, 24, 25, 30, 31, 0]]
    pred_P, target_P = pack.predictions(start=2)
    # targets at columns >= 2 that follow a token of their row: (0,2) (0,3) (2,3)
    assert target_P.tolist() == [2, 3, 11] and pred_P.tolist() == [0, 1, 5]
    pos_P, flat_P = pack.positions_at(first=1)
    assert flat_P.tolist() == [1, 2, 3, 5, 10, 11] and pos_P.tolist() == [0, 1, 2, 4, 5, 6]
    out = pack.scatter(torch.tensor([1.0, 2.0, 3.0]), target_P)
    assert out.tolist() == [[0, 0, 1, 2], [0, 0, 0, 0], [0, 0, 0, 3]]


@pytest.mark.parametrize("preset", ["tiny", "qwen3-moe-tiny"])
def test_packed_log_probs_entropy_and_logits_equal_the_padded_ones(single_process, preset):
    policy = build(preset)
    tokens_BT, valid_BT = ragged_batch(vocab=policy.preset.vocab_size)
    want_logp, want_ent = policy.token_logprobs(tokens_BT, valid_BT, start=12, with_entropy=True)
    want_logits = policy.logits(tokens_BT, valid_BT, first=3)
    policy.pack = True
    got_logp, got_ent = policy.token_logprobs(tokens_BT, valid_BT, start=12, with_entropy=True)
    got_logits = policy.logits(tokens_BT, valid_BT, first=3)
    scored = valid_BT.clone()
    scored[:, :12] = False
    scored[:, 1:] &= valid_BT[:, :-1]  # a token whose predecessor in the row is real
    assert int(scored.sum()) > 80
    torch.testing.assert_close(got_logp[scored], want_logp[scored], **TOL)
    torch.testing.assert_close(got_ent[scored], want_ent[scored], **REL)
    assert not got_logp[~scored].any() and not got_ent[~scored].any()
    V = policy.real_vocab
    torch.testing.assert_close(got_logits[valid_BT[:, 3:]][:, :V],
                               want_logits[valid_BT[:, 3:]][:, :V], **REL)


def _loss_grads(policy, tokens_BT, valid_BT, weights_BT) -> dict:
    policy.zero_grad()
    logp_BT = policy.token_logprobs(tokens_BT, valid_BT, start=12)
    (logp_BT * weights_BT).sum().div(weights_BT.ne(0).sum()).backward()  # a token mean
    return {n: p.main_grad.clone() for n, p in policy.model.module.named_parameters()}


@pytest.mark.parametrize("recompute", [None, "full"])
def test_packed_gradients_equal_the_padded_ones(single_process, recompute):
    from moe.model.settings import OptimSettings, Recompute

    policy = build("qwen3-moe-tiny", optim=OptimSettings(),
                   recompute=Recompute(recompute, ("moe",)))
    tokens_BT, valid_BT = ragged_batch(vocab=policy.preset.vocab_size)
    weights_BT = torch.randn(tokens_BT.shape, generator=torch.Generator().manual_seed(1))
    weights_BT[:, 1:] *= valid_BT[:, :-1] & valid_BT[:, 1:]  # only real scored tokens
    want = _loss_grads(policy, tokens_BT, valid_BT, weights_BT)
    policy.pack = True
    got = _loss_grads(policy, tokens_BT, valid_BT, weights_BT)
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 1e-3
    worst = max(float((got[n] - g).abs().max()) for n, g in want.items())
    assert worst <= 1e-6 and worst <= 1e-5 * scale, (worst, scale)


def test_no_token_attends_across_sequences(single_process):
    """A row's log-probs are the same alone and packed with others, in any order: the
    attention is block-diagonal and its positions restart at its first token."""
    policy = build("qwen3-moe-tiny")
    policy.pack = True
    tokens_BT, valid_BT = ragged_batch(vocab=policy.preset.vocab_size)
    together = policy.token_logprobs(tokens_BT, valid_BT, start=12)
    order = torch.tensor([3, 0, 5, 1])
    some = policy.token_logprobs(tokens_BT[order], valid_BT[order], start=12)
    torch.testing.assert_close(some, together[order], **TOL)
    for b in range(tokens_BT.shape[0]):
        alone = policy.token_logprobs(tokens_BT[b:b + 1], valid_BT[b:b + 1], start=12)
        torch.testing.assert_close(alone, together[b:b + 1], **TOL)


def test_output_layer_projects_only_the_scored_positions(single_process):
    policy = build("tiny")
    policy.pack = True
    tokens_BT, valid_BT = ragged_batch()
    seen = []
    policy.model.module.output_layer.register_forward_hook(
        lambda m, args, out: seen.append(out[0].shape[0]))
    policy.token_logprobs(tokens_BT, valid_BT, start=12)
    pred_P, _ = Pack.of(valid_BT).predictions(12)
    assert seen == [len(pred_P)] and len(pred_P) < valid_BT.sum()


def _attention_inputs(seed=0, N=23, H=4, G=2, D=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, h, D, generator=g, dtype=dtype) for h in (H, G, G)], \
        torch.tensor([0, 5, 6, 14, 23], dtype=torch.int32)


def _reference(q_NHD, k_NGD, v_NGD, cu):
    """One SDPA over the pack with a block-diagonal causal mask (float64)."""
    N = q_NHD.shape[0]
    seg_N = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff().long())
    allowed_NN = (seg_N[:, None] == seg_N[None]) & (torch.arange(N)[:, None] >= torch.arange(N))
    out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q_NHD, k_NGD,
                                                                              v_NGD)),
                                         attn_mask=allowed_NN, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("path", ["per_sequence", "flex_document"])
@pytest.mark.parametrize("lengths", [(5, 1, 8, 9), (4, 4, 3, 4, 3, 5), (6, 6, 6)],
                         ids=["distinct", "repeated", "equal"])
def test_packed_attention_paths_equal_the_block_diagonal_mask(path, lengths):
    """The CPU path (segments of one length batched into one call) and the CUDA flex path (run
    eagerly here) against one SDPA call with a block-diagonal causal mask, GQA included, in
    float64."""
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
    (q, k, v), _ = _attention_inputs(N=int(cu[-1]))
    fn = per_sequence if path == "per_sequence" else \
        (lambda *a: flex_document(*a, compiled=False))
    got = fn(q, k, v, cu, None)
    torch.testing.assert_close(got, _reference(q, k, v, cu), atol=1e-12, rtol=0)
