"""Token log-probs from 16-bit logits without a float32 copy of the logits.

Shape legend: B sequences, S positions, V the logits' (padded) vocabulary, U <= V the
tokenizer's.

`log pi(y) = z_y - logsumexp(z)` with `z = x[..., :U] / tau`, computed in float32 over chunks of
sequences: the forward keeps only the logits (in their own dtype, not copied) and the float32
log-partition [B, S] for the backward, whose gradient `(onehot(y) - softmax(z)) / tau` is rebuilt
chunk by chunk (zero on the padded vocabulary). The plain path (`x.float()`, `log_softmax`,
`gather`) holds a float32 [B, S, V] copy of the logits and saves the float32 log-softmax for the
backward: at a 151,936-token vocabulary and 8 x 2,048 positions that is 2 x 9.3 GiB next to the
4.6 GiB of bf16 logits. verl and OpenRLHF fuse the same computation (flash-attn's cross-entropy
kernel, chunked log-softmax); this is the torch version. The entropy of each position comes from
the same chunks, without grad (a metric).

Used for 16-bit logits (`moe.policy.MoEPolicy.token_logprobs`); float32 logits keep the plain
path, whose numbers the golden run and the experiments pin (the two agree to float32 rounding,
`tests/moe/test_logprobs.py`).
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24  # float32 scratch per chunk: 64 MiB


class ChunkedTokenLogProb(torch.autograd.Function):
    """(log softmax(x[..., :U] / tau)[target] [B, S], entropy [B, S] or an empty tensor), both
    float32; saves x, target and the log-partition only. The entropy carries no gradient."""

    @staticmethod
    def forward(ctx, x_BSV, target_BS, vocab: int, tau: float, with_entropy: bool):
        B, S, _ = x_BSV.shape
        logp_BS = torch.empty(B, S, dtype=torch.float32, device=x_BSV.device)
        lse_BS = torch.empty_like(logp_BS)
        entropy_BS = torch.empty_like(logp_BS) if with_entropy else logp_BS.new_empty(0)
        for rows in _chunks(x_BSV, vocab):
            z_bSU = _scaled(x_BSV[rows], vocab, tau)
            lse_bS = torch.logsumexp(z_bSU, dim=-1)
            lse_BS[rows] = lse_bS
            logp_BS[rows] = z_bSU.gather(-1, target_BS[rows, :, None]).squeeze(-1) - lse_bS
            if with_entropy:  # H = -sum_u p_u log p_u (0 where z_u = -inf)
                logp_bSU = z_bSU.sub_(lse_bS[..., None])
                p_bSU = logp_bSU.exp()
                entropy_BS[rows] = -(p_bSU * logp_bSU.nan_to_num_(neginf=0.0)).sum(-1)
        ctx.save_for_backward(x_BSV, target_BS, lse_BS)
        ctx.vocab, ctx.tau = vocab, tau
        ctx.mark_non_differentiable(entropy_BS)
        return logp_BS, entropy_BS

    @staticmethod
    def backward(ctx, grad_BS, _grad_entropy):
        x_BSV, target_BS, lse_BS = ctx.saved_tensors
        vocab, tau = ctx.vocab, ctx.tau
        grad_BSV = torch.zeros_like(x_BSV)
        for rows in _chunks(x_BSV, vocab):
            g_bS1 = grad_BS[rows, :, None].float()
            g_bSU = (_scaled(x_BSV[rows], vocab, tau) - lse_BS[rows, :, None]).exp_()
            g_bSU.mul_(-g_bS1).scatter_add_(-1, target_BS[rows, :, None], g_bS1)
            if tau != 1.0:
                g_bSU /= tau
            grad_BSV[rows, :, :vocab] = g_bSU
        return grad_BSV, None, None, None, None


def _chunks(x_BSV: torch.Tensor, vocab: int):
    B, S, _ = x_BSV.shape
    step = max(1, CHUNK_ELEMENTS // max(S * vocab, 1))
    return [slice(i, i + step) for i in range(0, B, step)]


def _scaled(x_bSV: torch.Tensor, vocab: int, tau: float) -> torch.Tensor:
    """float32 x[..., :vocab] / tau (a fresh tensor: callers modify it in place)."""
    z_bSU = x_bSV[..., :vocab].float()
    if z_bSU.dtype == x_bSV.dtype:  # already float32: .float() returned a view
        z_bSU = z_bSU.clone()
    if tau != 1.0:
        z_bSU /= tau
    return z_bSU


def chunked_token_logprobs(logits_BSV: torch.Tensor, target_BS: torch.Tensor, vocab: int,
                           temperature: float = 1.0, with_entropy: bool = False):
    """Float32 log-probs [B, S] of `target_BS` under softmax(logits[..., :vocab] / temperature),
    and with `with_entropy` the entropy [B, S] (no grad)."""
    B, S, V = logits_BSV.shape
    if target_BS.shape != (B, S) or not 0 < vocab <= V:
        raise ValueError(f"targets {tuple(target_BS.shape)} / vocab {vocab} do not match "
                         f"logits {tuple(logits_BSV.shape)}")
    logp_BS, entropy_BS = ChunkedTokenLogProb.apply(
        logits_BSV, target_BS.to(logits_BSV.device), vocab, float(temperature), with_entropy)
    return (logp_BS, entropy_BS) if with_entropy else logp_BS
