"""Core attention as one `F.scaled_dot_product_attention` call: megatron's `DotProductAttention`
for the local (non-TE) layer spec, fused on CPU.

Shape legend: S query positions, K key positions (the KV cache's under static inference),
B sequences, H query heads, G key/value groups, D head dim.

megatron-core's local `DotProductAttention` expands the K/V groups to all heads
(`repeat_interleave`), runs `baddbmm` into a [B*H, S, K] score buffer, fills masked scores with
-10000 (`attention_mask_func`), softmaxes, forks the CUDA RNG tracker for dropout and `bmm`s with
the values: half a dozen full-size ops per layer, plus their backward. `SDPAAttention` keeps its
construction and parameters (it has none here) and computes the same attention with torch's
SDPA (`enable_gqa`, the boolean mask as SDPA's additive one: `additive_mask`).
Departure: hidden scores get -inf instead of -10000. For any row with a visible key, exp(-10000 -
max) is exactly 0 in float32 either way; `attention_inputs` always leaves each query
one visible key. Equal to `DotProductAttention` to fp32 rounding, forward and grads
(tests/moe/model/test_attention.py), and with the KV cache. The default
(`model.attention=sdpa`; `megatron` keeps `DotProductAttention`): rounding differences of ~1e-6
are enough to flip an occasional multinomial draw, so runs of the two do not sample the same
tokens bit for bit (the experiment configs pin the attention their tables ran with).

16-bit inputs (bf16 / fp16, the GPU runs without TransformerEngine) also take SDPA: its kernels
keep the scores and the softmax in fp32 and round only the probabilities fed to the value
product, where megatron's unfused path rounds the [B*H, S, K] scores to 16 bits before its fp32
softmax; SDPA is closer to a float64 reference (tests/moe/model/test_attention.py), and it
does not materialise the scores (flash / memory-efficient kernels), which is what makes long
sequences fit without TE. Departure: not bitwise megatron's 16-bit numbers.

Packed sequences (megatron's `PackedSeqParams` in the `thd` format: [N, H, D] inputs, causal
within each segment, no mask; `moe.model.packed`) go to `moe.model.packed_attention`, which
`DotProductAttention` has no counterpart of.

Falls back to `DotProductAttention.forward` outside what it reproduces: other dtypes, dropout
while training, softmax offsets, attention bias, packed formats other than `thd`, query-key
layer scaling, and no mask with a causal mask type (SDPA's `is_causal` aligns top-left,
megatron's mask bottom-right under a KV cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from moe.model.packed_attention import packed_attention


SDPA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def additive_mask(mask_B1ST: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's float mask for megatron's boolean one (True = hidden): -inf where hidden, 0 where
    visible, in `dtype`; the values SDPA itself derives from the inverted boolean mask. Built once
    per mask tensor and kept on it: every layer of a forward gets the same mask object, so the
    layers share one conversion, and SDPA's CPU kernel saves that one tensor for the backward
    instead of a converted copy per layer (megatron's activation recompute detaches its inputs,
    a new mask object: one more conversion per recomputed chunk). A mask changed in place since
    (its version counter moved) is converted again; writes through `.data` do not move the
    counter and are not seen, as for autograd's saved tensors. An inference-mode mask, which has
    no version counter, is converted each call (the sampler's: one small mask per decode
    step)."""
    version = None if mask_B1ST.is_inference() else mask_B1ST._version
    cached_version, cached = getattr(mask_B1ST, "_sdpa_additive", (None, None))
    if version is None or cached is None or cached.dtype != dtype or cached_version != version:
        cached = torch.zeros(mask_B1ST.shape, dtype=dtype, device=mask_B1ST.device)
        cached.masked_fill_(mask_B1ST, float("-inf"))
        if version is not None:
            mask_B1ST._sdpa_additive = (version, cached)
    return cached


class SDPAAttention(DotProductAttention):
    """`DotProductAttention` computed by `F.scaled_dot_product_attention`."""

    def _sdpa_ok(self, query, attention_mask, attention_bias, packed_seq_params) -> bool:
        cfg = self.config
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        return (query.dtype in SDPA_DTYPES
                and (attention_mask is not None if packed_seq_params is None else thd)
                and attention_bias is None
                and self.softmax_offset is None and not cfg.apply_query_key_layer_scaling
                and (self.attention_dropout.p == 0.0 or not self.training))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if not self._sdpa_ok(query, attention_mask, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params)
        if packed_seq_params is not None:  # thd: [N, H, D], causal within each segment
            out_NHD = packed_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                       packed_seq_params.max_seqlen_q, self.softmax_scale)
            return out_NHD.reshape(out_NHD.shape[0], self.hidden_size_per_partition)
        S, B = query.shape[:2]
        q_BHSD = query.permute(1, 2, 0, 3)
        k_BGKD, v_BGKD = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
        out_BHSD = F.scaled_dot_product_attention(
            q_BHSD, k_BGKD, v_BGKD, attn_mask=additive_mask(attention_mask, query.dtype),
            scale=self.softmax_scale,
            enable_gqa=k_BGKD.shape[1] != q_BHSD.shape[1])
        return out_BHSD.permute(2, 0, 1, 3).reshape(S, B, self.hidden_size_per_partition)


def attention_inputs(valid_BT: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [B, T] and megatron's boolean attention mask [B, 1, T, T] (True = hidden).

    With `start`, only the query rows from `start` on: ids [B, T - start], mask
    [B, 1, T - start, T] (what a KV-cache step needs, without building the full T x T)."""
    B, T = valid_BT.shape
    valid_BT = valid_BT.bool()
    position_ids_BT = (valid_BT.long().cumsum(dim=1) - 1).clamp(min=0)
    rows_S = torch.arange(start, T, device=valid_BT.device)
    cols_T = torch.arange(T, device=valid_BT.device)
    causal_ST = cols_T[None, :] <= rows_S[:, None]
    allowed_BST = causal_ST[None] & valid_BT[:, None, :]
    # A padding query with no visible key would softmax over nothing: let it see itself.
    allowed_BST |= (cols_T[None, :] == rows_S[:, None])[None]
    return position_ids_BT[:, start:], ~allowed_BST[:, None]
