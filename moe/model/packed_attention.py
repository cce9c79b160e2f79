"""Causal attention within each segment of a packed sequence (megatron's `thd` format), per device.

Shape legend: N positions of the pack, H query heads, G key/value groups, D head dim, S segments.

A packed forward (`moe.model.packed`) runs the real tokens of several sequences as one: token i
of a segment attends to tokens 0..i of the same segment and to nothing else. Megatron's local
`DotProductAttention` refuses `packed_seq_params`; TransformerEngine's attention takes them
natively (its fused / flash kernels with `cu_seqlens`: where TE is installed the `thd`
parameters go to it unchanged, untested here: TE does not install on this project's machines).
Without TE, `SDPAAttention` calls `packed_attention`, which picks by device:

- CPU (`per_sequence`): `F.scaled_dot_product_attention(is_causal=True)` per segment, the
  segments of one length batched into one call. No mask tensor at all: each segment's scores
  are its own L_s x L_s inside the fused CPU kernel, sum_s L_s^2 work instead of the N^2 of one
  call with a block-diagonal mask. Measured on one CPU thread (N = 1024 to 4096, head dims 16 /
  64): 4-12x faster forward + backward than the block-diagonal mask, which also holds an N x N
  float mask (64 MiB at N = 4096); torch's flex attention without `torch.compile` materialises the
  N x N scores and was slower still. Batching equal lengths: 256 sequences of 16 tokens in one
  call instead of 256, 27x faster (4 heads of 16).
- CUDA with flash-attn installed (`flash_varlen`): `flash_attn_varlen_func` (causal, GQA, the
  `cu_seqlens` as they are). Untested here (no GPU).
- CUDA otherwise (`flex_document`): compiled flex attention with a document-causal block mask
  (segment ids of each position), the varlen path of torch alone. Its eager form is what the
  CPU tests check (`tests/moe/model/test_packed.py`); compiled on a GPU it is untested here.
  (torch's SDPA over nested jagged tensors refuses `is_causal` in torch 2.13.)

All return [N, H, D] in the inputs' dtype, equal to the padded attention to float rounding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def packed_attention(q_NHD: torch.Tensor, k_NGD: torch.Tensor, v_NGD: torch.Tensor,
                     cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None
                     ) -> torch.Tensor:
    """Causal attention inside each segment [cu[s], cu[s + 1]) (module docstring)."""
    if not q_NHD.is_cuda:
        return per_sequence(q_NHD, k_NGD, v_NGD, cu_seqlens, scale)
    if _flash_varlen() is not None:
        return flash_varlen(q_NHD, k_NGD, v_NGD, cu_seqlens, max_seqlen, scale)
    return flex_document(q_NHD, k_NGD, v_NGD, cu_seqlens, scale, compiled=True)


def per_sequence(q_NHD, k_NGD, v_NGD, cu_seqlens: torch.Tensor, scale) -> torch.Tensor:
    """Causal SDPA per segment (the CPU path): segments of one length in one batched call, so
    a pack of many short sequences is a few calls, not one per sequence."""
    gqa = k_NGD.shape[1] != q_NHD.shape[1]
    bounds = cu_seqlens.tolist()
    by_length: dict[int, list[int]] = {}
    for a, b in zip(bounds, bounds[1:]):
        by_length.setdefault(b - a, []).append(a)
    if len(by_length) == 1 and bounds[0] == 0:  # one length: the pack is [S, L] already
        (L, starts), = by_length.items()
        return _causal(q_NHD, k_NGD, v_NGD, len(starts), L, scale, gqa)
    out_NHD = q_NHD.new_empty(q_NHD.shape)
    for L, starts in by_length.items():
        rows = (torch.tensor(starts)[:, None] + torch.arange(L)).reshape(-1)
        out_NHD[rows] = _causal(q_NHD[rows], k_NGD[rows], v_NGD[rows], len(starts), L, scale,
                                gqa)
    return out_NHD


def _causal(q_NHD, k_NGD, v_NGD, S: int, L: int, scale, gqa: bool) -> torch.Tensor:
    """Causal SDPA over `S` consecutive sequences of `L` tokens each ([S * L, heads, D])."""
    q_SHLD, k_SGLD, v_SGLD = (x.reshape(S, L, *x.shape[1:]).transpose(1, 2)
                              for x in (q_NHD, k_NGD, v_NGD))
    out_SHLD = F.scaled_dot_product_attention(q_SHLD, k_SGLD, v_SGLD, is_causal=True,
                                              scale=scale, enable_gqa=gqa)
    return out_SHLD.transpose(1, 2).reshape(S * L, *q_NHD.shape[1:])


@functools.cache
def _flash_varlen():
    """flash-attn's varlen kernel, or None where flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func  # optional (a GPU build): probed here
    except Exception:  # ImportError, or a build for another CUDA / torch
        return None
    return flash_attn_varlen_func


def flash_varlen(q_NHD, k_NGD, v_NGD, cu_seqlens: torch.Tensor, max_seqlen: int, scale):
    """flash-attn's varlen causal attention (GQA native)."""
    cu = cu_seqlens.to(device=q_NHD.device, dtype=torch.int32)
    return _flash_varlen()(q_NHD, k_NGD, v_NGD, cu, cu, max_seqlen, max_seqlen,
                           softmax_scale=scale, causal=True)


@functools.cache
def _compiled_flex():
    """flex attention compiled once per process (its fused kernels exist only compiled)."""
    return torch.compile(flex_attention, dynamic=True)


def flex_document(q_NHD, k_NGD, v_NGD, cu_seqlens: torch.Tensor, scale,
                  compiled: bool = True) -> torch.Tensor:
    """Flex attention with a document-causal block mask (`compiled=False`: eager, which
    materialises the scores: for tests)."""
    N, device = q_NHD.shape[0], q_NHD.device
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    segment_N = torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), cu.diff(),
                                        output_size=N)

    def document_causal(b, h, q_idx, kv_idx):
        return (segment_N[q_idx] == segment_N[kv_idx]) & (q_idx >= kv_idx)

    mask = create_block_mask(document_causal, None, None, N, N, device=device,
                             _compile=compiled)
    attend = _compiled_flex() if compiled else flex_attention
    out_1HND = attend(*(x.transpose(0, 1)[None] for x in (q_NHD, k_NGD, v_NGD)),
                      block_mask=mask, scale=scale, enable_gqa=k_NGD.shape[1] != q_NHD.shape[1])
    return out_1HND[0].transpose(0, 1)
