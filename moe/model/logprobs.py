"""Token log-probs from logits without a float32 copy of the logits.

Shape legend: B sequences, S positions, V the logits' (padded) vocabulary, U <= V the
tokenizer's, n the tokens of one chunk.

`log pi(y) = z_y - logsumexp(z)` with `z = x[..., :U] / tau`, computed in float32 over chunks of
tokens: whole sequences while one's [S, U] fits in `CHUNK_ELEMENTS`, else runs of a
sequence's positions, so each float32 scratch tensor stays within `CHUNK_ELEMENTS` (64 MiB)
whatever the sequence length and vocabulary (at 151,936 entries: 110 tokens a chunk). Each
chunk is one fused `log_softmax` (`softmax` in the backward) in float32. The forward keeps only
the logits (in their own dtype, not copied) and the targets for the backward, whose gradient
`(onehot(y) - softmax(z)) / tau` is rebuilt chunk by chunk (zero on the padded vocabulary) into
the logits' grad, the one vocabulary-sized tensor it writes. The entropy of each position
comes from the same chunks, without grad (a metric).

`plain_token_logprobs` is the path it replaced (`x.float()`, `log_softmax`, `gather`): it holds
a float32 [B, S, V] copy of 16-bit logits, saves the float32 log-softmax for the backward, and
its backward builds more vocabulary-sized tensors (the gather's and the log-softmax's grads);
at a 151,936-token vocabulary and 8 x 2,048 positions each is 9.3 GiB. Kept as the reference of
the tests and of `bench/logprobs.py`, which measures both. verl and OpenRLHF fuse the same
computation (flash-attn's cross-entropy kernel, chunked log-softmax); this is the torch version.
Both paths agree to float32 rounding (`tests/moe/model/test_logprobs.py`).
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24  # float32 scratch per chunk: 64 MiB


class ChunkedTokenLogProb(torch.autograd.Function):
    """(log softmax(x[..., :U] / tau)[target] [B, S], entropy [B, S] or an empty tensor), both
    float32; saves x and target only. The entropy carries no gradient."""

    @staticmethod
    def forward(ctx, x_BSV, target_BS, vocab: int, tau: float, with_entropy: bool):
        B, S, _ = x_BSV.shape
        logp_BS = torch.empty(B, S, dtype=torch.float32, device=x_BSV.device)
        entropy_BS = torch.empty_like(logp_BS) if with_entropy else logp_BS.new_empty(0)
        for rows in _chunks(x_BSV, vocab):
            logp_bsU = torch.log_softmax(_scaled(x_BSV[rows], vocab, tau), dim=-1)
            logp_BS[rows] = logp_bsU.gather(-1, target_BS[rows][..., None]).squeeze(-1)
            if with_entropy:  # H = -sum_u p_u log p_u (0 where z_u = -inf)
                p_bsU = logp_bsU.exp()
                entropy_BS[rows] = -(p_bsU * logp_bsU.nan_to_num_(neginf=0.0)).sum(-1)
        ctx.save_for_backward(x_BSV, target_BS)
        ctx.vocab, ctx.tau = vocab, tau
        ctx.mark_non_differentiable(entropy_BS)
        return logp_BS, entropy_BS

    @staticmethod
    def backward(ctx, grad_BS, _grad_entropy):
        x_BSV, target_BS = ctx.saved_tensors
        vocab, tau = ctx.vocab, ctx.tau
        grad_BSV = torch.empty_like(x_BSV)
        if vocab < x_BSV.shape[-1]:
            grad_BSV[..., vocab:] = 0
        for rows in _chunks(x_BSV, vocab):
            g_bs1 = grad_BS[rows][..., None].float()
            g_bsU = torch.softmax(_scaled(x_BSV[rows], vocab, tau), dim=-1)
            g_bsU.mul_(-g_bs1).scatter_add_(-1, target_BS[rows][..., None], g_bs1)
            if tau != 1.0:
                g_bsU /= tau
            grad_BSV[rows][..., :vocab] = g_bsU
        return grad_BSV, None, None, None, None


def _chunks(x_BSV: torch.Tensor, vocab: int) -> list[tuple[slice, slice]]:
    """(sequences, positions) of each chunk: as many whole sequences as `CHUNK_ELEMENTS` float32
    [S, vocab] rows hold, or, where one sequence does not fit, runs of its positions (at least
    one token a chunk)."""
    B, S, _ = x_BSV.shape
    per_token = max(vocab, 1)
    if S * per_token <= CHUNK_ELEMENTS:
        step = CHUNK_ELEMENTS // max(S * per_token, 1)
        return [(slice(b, b + step), slice(None)) for b in range(0, B, step)]
    step = max(1, CHUNK_ELEMENTS // per_token)
    return [(slice(b, b + 1), slice(s, s + step)) for b in range(B) for s in range(0, S, step)]


def _scaled(x_bsV: torch.Tensor, vocab: int, tau: float) -> torch.Tensor:
    """float32 x[..., :vocab] / tau (float32 logits at tau 1: a view of them, not a copy)."""
    z_bsU = x_bsV[..., :vocab].float()
    return z_bsU / tau if tau != 1.0 else z_bsU


def _check(logits_BSV: torch.Tensor, target_BS: torch.Tensor, vocab: int) -> None:
    B, S, V = logits_BSV.shape
    if target_BS.shape != (B, S) or not 0 < vocab <= V:
        raise ValueError(f"targets {tuple(target_BS.shape)} / vocab {vocab} do not match "
                         f"logits {tuple(logits_BSV.shape)}")


def chunked_token_logprobs(logits_BSV: torch.Tensor, target_BS: torch.Tensor, vocab: int,
                           temperature: float = 1.0, with_entropy: bool = False):
    """Float32 log-probs [B, S] of `target_BS` under softmax(logits[..., :vocab] / temperature),
    and with `with_entropy` the entropy [B, S] (no grad); any logits dtype."""
    _check(logits_BSV, target_BS, vocab)
    logp_BS, entropy_BS = ChunkedTokenLogProb.apply(
        logits_BSV, target_BS.to(logits_BSV.device), vocab, float(temperature), with_entropy)
    return (logp_BS, entropy_BS) if with_entropy else logp_BS


def plain_token_logprobs(logits_BSV: torch.Tensor, target_BS: torch.Tensor, vocab: int,
                         temperature: float = 1.0, with_entropy: bool = False):
    """`chunked_token_logprobs` the plain way: a float32 log-softmax over the whole [B, S, U]
    (the path float32 policies took before; the tests' and `bench/logprobs.py`'s reference)."""
    _check(logits_BSV, target_BS, vocab)
    logits_BSU = logits_BSV[..., :vocab].float()
    if temperature != 1.0:
        logits_BSU = logits_BSU / temperature
    logp_BSU = torch.log_softmax(logits_BSU, dim=-1)
    logp_BS = logp_BSU.gather(-1, target_BS.to(logp_BSU.device)[..., None]).squeeze(-1)
    if not with_entropy:
        return logp_BS
    with torch.no_grad():
        logp_BSU = logp_BSU.detach()
        p_BSU = logp_BSU.exp()
        entropy_BS = -(p_BSU * logp_BSU.masked_fill(p_BSU == 0, 0.0)).sum(-1)
    return logp_BS, entropy_BS

