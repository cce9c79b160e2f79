"""Paged attention in plain torch, for megatron-core's dynamic inference engine without flash-attn.

Shape legend: N query tokens of one engine step (all requests, flattened), R requests, H query
heads, G key/value groups, D head dim, P pages (KV blocks) in the cache, S tokens per page,
M pages per request in the block table, Q the longest query run of one request (max_seqlen_q).

megatron-core's dynamic engine (`megatron.core.inference`) keeps keys and values in pages
([P, S, G, D] per layer, keys already rotated) and calls `Attention.flash_decode_and_prefill`,
which needs flash-attn >= 2.7.3 (or FA3 / FA4). None of them installs without a CUDA build of
its own (flash-attn-4's CUTLASS DSL alone is a 92 MB wheel), so `install(model)` binds this
module's `flash_decode_and_prefill` to each attention layer of one model instead: the pages of
each request are gathered into a dense [R, M*S, G, D] view and one `scaled_dot_product_attention`
(grouped-query, boolean mask) runs over the padded [R, H, Q, D] queries. Same math as the
flash kernels (causal within the request, keys beyond the request's length masked); slower, as
it reads M*S keys per request rather than the request's own, and the prefill pads each request's
queries to Q. Every shape is fixed by the step's tensors and `max_seqlen_q`, so decode steps can
be captured in CUDA graphs (no host syncs).

Departures: no sliding window, no attention sinks (`softmax_offset`), no MLA: `check` refuses
models that need them.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from megatron.core.transformer import attention
from megatron.core.transformer.attention import Attention


def paged_attention(q_N1HD: torch.Tensor, k_PSGD: torch.Tensor, v_PSGD: torch.Tensor,
                    cu_seqlens_q_R1: torch.Tensor, seqlens_k_R: torch.Tensor,
                    block_table_RM: torch.Tensor, max_seqlen_q: int,
                    softmax_scale: float | None = None) -> torch.Tensor:
    """Causal attention of each request's new queries over its cached keys: [N, 1, H, D].

    `cu_seqlens_q_R1` [R + 1]: request r's queries are rows cu[r]..cu[r+1]-1 of `q_N1HD`, the
    last q_len of its `seqlens_k_R[r]` tokens (keys and values of the new tokens are already in
    the pages). `block_table_RM[r, m]`: the page holding request r's tokens m*S..(m+1)*S-1
    (entries past the request's length may be anything: they are masked).
    Rows of padding requests (length 0), and padding tokens past cu[R], come out finite (the
    engine ignores them).
    """
    N, _, H, D = q_N1HD.shape
    R, M = block_table_RM.shape
    S, G = k_PSGD.shape[1], k_PSGD.shape[2]
    Q = max(int(max_seqlen_q), 1)
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    device = q_N1HD.device
    pages_RM = block_table_RM.long().clamp(0, k_PSGD.shape[0] - 1)
    k_RGLD = k_PSGD[pages_RM].reshape(R, M * S, G, D).transpose(1, 2)
    v_RGLD = v_PSGD[pages_RM].reshape(R, M * S, G, D).transpose(1, 2)
    cu_R1 = cu_seqlens_q_R1.long()
    q_len_R = cu_R1[1:] - cu_R1[:-1]
    # token n -> (request, column j < Q); columns past a request's queries stay zero. Tokens
    # past cu[R] (the engine pads a step's token count) write to a spare column Q, dropped.
    token_N = torch.arange(N, device=device)
    req_N = torch.searchsorted(cu_R1[1:].contiguous(), token_N, right=True).clamp(max=R - 1)
    col_N = (token_N - cu_R1[req_N]).clamp(0, Q - 1)
    write_N = torch.where(token_N < cu_R1[-1], col_N, Q)
    q_RQHD = q_N1HD.new_zeros(R, Q + 1, H, D)
    q_RQHD[req_N, write_N] = q_N1HD[:, 0]
    q_RQHD = q_RQHD[:, :Q]
    # absolute position of query column j of request r: its length - q_len + j (>= 0 if real)
    pos_RQ = seqlens_k_R.long()[:, None] - q_len_R[:, None] + torch.arange(Q, device=device)
    key_L = torch.arange(M * S, device=device)
    mask_RQL = (key_L <= pos_RQ[..., None]) & (key_L < seqlens_k_R.long()[:, None, None])
    mask_RQL[..., 0] = True  # every row sees one key: padding rows stay finite
    out_RHQD = F.scaled_dot_product_attention(
        q_RQHD.transpose(1, 2), k_RGLD, v_RGLD, attn_mask=mask_RQL[:, None], scale=scale,
        enable_gqa=G != H)
    return out_RHQD.transpose(1, 2)[req_N, col_N][:, None]


def flash_decode_and_prefill(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q,
                             cu_seqlens_k, seqlens_k, block_table, is_decode_only,
                             softmax_offset=None):
    """`megatron.core.transformer.attention.Attention.flash_decode_and_prefill`'s signature
    over `paged_attention` (bound to one attention module by `install`)."""
    if softmax_offset is not None:
        raise NotImplementedError("paged_attention has no attention sinks (softmax_offset)")
    if is_decode_only:  # q arrives [R * n, 1, H, D], n queries per request (n > 1: speculative)
        n = q.shape[0] // seqlens_k.shape[0]
        cu_seqlens_q = torch.arange(seqlens_k.shape[0] + 1, device=q.device,
                                    dtype=torch.int32) * n
        max_seqlen_q = n
    return paged_attention(q, k, v, cu_seqlens_q, seqlens_k, block_table, max_seqlen_q,
                           getattr(self, "softmax_scale", None))


def check(config) -> list[str]:
    """What a model config uses that `paged_attention` does not implement (empty if none)."""
    problems = []
    if getattr(config, "window_size", None) is not None:
        problems.append(f"window_size={config.window_size}")
    if getattr(config, "multi_latent_attention", False):
        problems.append("multi-latent attention")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        problems.append(f"softmax_type={config.softmax_type}")
    return problems


def install(model) -> int:
    """Bind `flash_decode_and_prefill` to every self-attention module of `model` (this model
    only: others keep megatron's flash kernels); returns how many were bound."""
    bound = 0
    for module in model.modules():
        if isinstance(module, Attention):
            module.flash_decode_and_prefill = types.MethodType(flash_decode_and_prefill, module)
            bound += 1
    return bound


@contextlib.contextmanager
def flash_check_waived():
    """Within: megatron's `Attention.forward` skips its 'flash attn >= 2.7.3 is required for
    dynamic batching' assertion (the only use of `is_fa_min_version` in that module), for
    models whose attention `install` replaced. Restored on exit."""
    saved = attention.is_fa_min_version
    attention.is_fa_min_version = lambda *args, **kwargs: True
    try:
        yield
    finally:
        attention.is_fa_min_version = saved
