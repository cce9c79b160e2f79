"""A lean KV-cache decode step over megatron-core's own modules (the sampler's hot loop).

Shape legend: B sequences, S new columns of one call, T columns so far (cached + new), H hidden,
Hq query heads, G key/value groups, D head dim, V vocab, L layers.

`LeanKVDecoder` has `moe.model.policy.KVCacheDecoder`'s interface and results, but runs the decoder
layers itself instead of `GPTModel.forward(..., inference_context=StaticInferenceContext)`:

- keys are stored in the cache *after* RoPE, each rotated once at its own position. megatron's
  static-batch path stores them unrotated and re-applies RoPE to every cached key of every
  layer at every decode step (`Attention._adjust_key_value_for_inference` then
  `apply_rotary_pos_emb` over `[:sequence_end]`): O(T) work per step that the cached values
  make unnecessary. Rotating a key at position p gives the same floats whenever it is done.
- the rotary table is built once per decoder, not once per step;
- the layer walk skips megatron's per-call framework work (inference-context bookkeeping,
  offload and NVTX wrappers, config checks) that the profile of a 128-token rollout showed.

- megatron's `DotProductAttention` expands K/V to every query head (`repeat_interleave` over
  the whole cache, per layer per step); `grouped_attention` computes the same math with each
  K/V group's query heads in one batched matmul instead.

What it reuses unchanged: the embedding, each layer's norms, `get_query_key_value_tensors`
(QKV projection, q/k norms, TP head split), the core attention's scale and masked softmax (any
other core attention module, e.g. `moe.model.attention.SDPAAttention`, is called as is over the first
T cached keys with the mask of `moe.model.policy.attention_inputs(valid, start)`), `linear_proj`, each
layer's bias-dropout-add (eval mode: the residual add, in the output's dtype under autocast),
the MoE layer (router, RouterReplay RECORD for R3, token dispatcher, experts, EP), the final
norm and the output layer (vocab gathered), on the last column only.

Departures: none in the math. The grouped matmuls round differently from megatron's expanded
ones (logits within ~1e-7 on the tiny presets; with SDPA bitwise equal; routing equal:
tests/moe/inference/test_decode.py). It serves the layouts `KVCacheDecoder` serves (no sequence or
pipeline parallelism; standard RoPE, no MLA, no output gate; checked at construction).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.common.embeddings.rope_utils import _rotate_half, apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import \
    _yarn_get_concentration_factor_from_config
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from moe.routing import replay
from moe.model.attention import SDPA_DTYPES, SDPAAttention, additive_mask, attention_inputs
from moe.model.dispatch import lean_moe, lean_moe_ok


class DecoderBase:
    """What both KV-cache decoders share (`LeanKVDecoder`, `moe.model.policy.KVCacheDecoder`): the
    argument checks, eval mode around each model call (toggled only if the model is training:
    each `train()` walks every module), and with `record_routing` each call's top-k ids per
    MoE layer (megatron's RECORD action, `moe.routing.replay.record_routing`), stitched by `routing`
    into the routing of the whole sequence: what R3 replays."""

    def __init__(self, policy, batch_size: int, max_len: int, record_routing: bool):
        if max_len > policy.preset.max_seq_len:
            raise ValueError(f"KV cache length {max_len} exceeds preset max_seq_len="
                             f"{policy.preset.max_seq_len}")
        self.policy, self.batch_size, self.max_len = policy, batch_size, max_len
        self.recorded: list[list[torch.Tensor]] | None = [] if record_routing else None

    def columns(self, tokens_BT: torch.Tensor, valid_BT: torch.Tensor) -> tuple[int, int]:
        """(columns already cached, columns now): ValueError naming the shapes if they do not
        continue this decoder's sequence."""
        seen, T = self.seen, tokens_BT.shape[1]
        if tokens_BT.shape != valid_BT.shape or tokens_BT.shape[0] != self.batch_size:
            raise ValueError(f"tokens {tuple(tokens_BT.shape)} / valid {tuple(valid_BT.shape)}: "
                             f"expected [{self.batch_size}, T]")
        if not seen < T <= self.max_len:
            raise ValueError(f"{T} columns: the cache holds {seen} of at most {self.max_len}")
        return seen, T

    @contextmanager
    def model_call(self):
        """Eval mode for one model call, its routing recorded when asked."""
        model = self.policy.model
        was_training = model.training
        if was_training:
            model.train(False)
        recording = replay.record_routing(self.policy) if self.recorded is not None \
            else nullcontext()
        try:
            with recording as recorded_L:
                yield
        finally:
            if was_training:
                model.train(True)
        if recorded_L is not None:
            self.recorded.append(recorded_L)

    def routing(self, valid_BT: torch.Tensor):
        """The recorded routing of all `seen` columns as a replay cache for `valid_BT`.

        Each call's ids are sequence-first over its own columns ([S_call * B, K]); concatenated
        in call order they are sequence-first over all columns, the layout of one full forward.
        """
        if self.recorded is None:
            raise RuntimeError("this decoder was built without record_routing=True")
        if valid_BT.shape != (self.batch_size, self.seen):
            raise ValueError(f"valid {tuple(valid_BT.shape)} must be [{self.batch_size}, "
                             f"{self.seen}] (the columns run so far)")
        layers = [torch.cat([call[layer] for call in self.recorded])
                  for layer in range(len(self.recorded[0]))]
        return replay.RoutingReplayCache.from_recorded(layers, valid_BT,
                                                       self.policy.preset.num_experts)


class LeanKVDecoder(DecoderBase):
    """Next-token logits with a KV cache; see the module docstring. `policy`: a
    `moe.model.policy.MoEPolicy` (the model runs in eval mode for each call). One decoder serves one
    generation at fixed weights: it caches keys and values."""

    def __init__(self, policy, batch_size: int, max_len: int, record_routing: bool = False):
        gpt = policy.model.module if hasattr(policy.model, "module") else policy.model
        problems = unsupported(gpt)
        if problems:
            raise ValueError(f"rollout.decoder=lean does not support {problems}; use "
                             "rollout.decoder=megatron")
        super().__init__(policy, batch_size, max_len, record_routing)
        self.gpt = gpt
        self.freqs_T11D = gpt.rotary_pos_emb(max_len)  # [max_len, 1, 1, D], built once
        self.mscale = _yarn_get_concentration_factor_from_config(gpt.config)
        self.cos_sin: dict[torch.dtype, tuple] = {}  # dtype -> RoPE cos, sin [max_len, 1, 1, D]
        self.cache_k: list[torch.Tensor] = []  # per layer [B, G, max_len, D], rotated keys
        self.cache_v: list[torch.Tensor] = []
        self._seen = 0

    @property
    def seen(self) -> int:
        """Columns already run through the model (and in the cache)."""
        return self._seen

    @torch.inference_mode()
    def next_logits(self, tokens_BT: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
        """Float32 logits [B, V] for the token after column T-1; T grows between calls."""
        seen, T = self.columns(tokens_BT, valid_BT)
        policy, gpt = self.policy, self.gpt
        position_ids_BS, mask_B1ST = attention_inputs(valid_BT.to(policy.device), start=seen)
        with self.model_call():
            hidden_SBH = gpt.embedding(input_ids=tokens_BT[:, seen:].to(policy.device),
                                       position_ids=position_ids_BS)
            freqs_S11D = self.freqs_T11D[seen:T]
            for i, layer in enumerate(gpt.decoder.layers):
                hidden_SBH = self._layer(i, layer, hidden_SBH, freqs_S11D, mask_B1ST, T)
            hidden_SBH = gpt.decoder.final_layernorm(hidden_SBH[-1:])
            weight = gpt.shared_embedding_or_output_weight() \
                if gpt.share_embeddings_and_output_weights else None
            logits_1BV, _ = gpt.output_layer(hidden_SBH, weight=weight,
                                             runtime_gather_output=True)
        self._seen = T
        return policy.mask_vocab(logits_1BV[0].float())

    def _rope(self, attn, t_SBXD, freqs_S11D):
        """megatron's unfused RoPE (`_apply_rotary_pos_emb_bshd`) of the new columns, with its
        cos / sin tables (x mscale, in the input's dtype) computed once per decoder; megatron's
        `apply_rotary_pos_emb` where RoPE fusion is configured."""
        cfg = attn.config
        if cfg.apply_rope_fusion:
            return apply_rotary_pos_emb(t_SBXD, freqs_S11D, config=cfg, mscale=self.mscale,
                                        cp_group=attn.pg_collection.cp)
        if t_SBXD.dtype not in self.cos_sin:
            self.cos_sin[t_SBXD.dtype] = tuple((f(self.freqs_T11D) * self.mscale).to(t_SBXD.dtype)
                                               for f in (torch.cos, torch.sin))
        cos_T11D, sin_T11D = self.cos_sin[t_SBXD.dtype]
        seen, S, rot = self._seen, t_SBXD.shape[0], freqs_S11D.shape[-1]
        t, t_pass = t_SBXD[..., :rot], t_SBXD[..., rot:]
        t = t * cos_T11D[seen:seen + S] + _rotate_half(t, cfg.rotary_interleaved) \
            * sin_T11D[seen:seen + S]
        return torch.cat((t, t_pass), dim=-1) if t_pass.shape[-1] else t

    def _layer(self, i: int, layer, hidden_SBH, freqs_S11D, mask_B1ST, T: int):
        """One TransformerLayer on the new columns, its K/V appended to the cache."""
        attn, fused = layer.self_attention, layer.config.bias_dropout_fusion
        core_SBX = self._attention(i, attn, layer.input_layernorm(hidden_SBH), freqs_S11D,
                                   mask_B1ST, T)
        hidden_SBH = layer.self_attn_bda(False, fused)(linear(attn.linear_proj, core_SBX),
                                                      hidden_SBH, layer.hidden_dropout)
        mlp, x_SBH = layer.mlp, layer.pre_mlp_layernorm(hidden_SBH)
        out = lean_moe(mlp, x_SBH) if lean_moe_ok(mlp) else mlp(x_SBH)
        return layer.mlp_bda(False, fused)(out, hidden_SBH, layer.hidden_dropout)

    def _attention(self, i: int, attn, x_SBH, freqs_S11D, mask_B1ST, T: int):
        """Layer i's core attention output [S, B, Hq * D] for the new columns: q, k, v, RoPE,
        the new keys and values into the cache, the new rows over all T cached columns."""
        seen = self._seen
        q_SBHD, k_SBGD, v_SBGD = qkv(attn, x_SBH)
        q_SBHD = self._rope(attn, q_SBHD, freqs_S11D)
        k_SBGD = self._rope(attn, k_SBGD, freqs_S11D)
        if i == len(self.cache_k):  # keys of one (sequence, group) contiguous: read per step
            S, B, G, D = k_SBGD.shape
            self.cache_k.append(k_SBGD.new_empty(B, G, self.max_len, D))
            self.cache_v.append(v_SBGD.new_empty(B, G, self.max_len, D))
        self.cache_k[i][:, :, seen:T] = k_SBGD.permute(1, 2, 0, 3)
        self.cache_v[i][:, :, seen:T] = v_SBGD.permute(1, 2, 0, 3)
        core = attn.core_attention
        k_BGTD, v_BGTD = self.cache_k[i][:, :, :T], self.cache_v[i][:, :, :T]
        if not isinstance(core, DotProductAttention):  # e.g. TE's: called as is, with
            # megatron's decode arguments (no_mask after the prefill, the explicit padding mask)
            mask_type = AttnMaskType.no_mask if seen else attn.attn_mask_type
            k_TBGD, v_TBGD = (t.permute(2, 0, 1, 3).contiguous() for t in (k_BGTD, v_BGTD))
            return core(q_SBHD, k_TBGD, v_TBGD, mask_B1ST, attn_mask_type=mask_type)
        if sdpa_ok(core, q_SBHD):
            return sdpa_attention(core, q_SBHD, k_BGTD, v_BGTD, mask_B1ST)
        return grouped_attention(core, q_SBHD, k_BGTD, v_BGTD, mask_B1ST)


def linear(module, x):
    """`module(x)`: (output, bias). A megatron Column/RowParallelLinear on one TP rank without
    bias or sequence parallelism runs `x @ W^T` (what its autograd function's forward
    computes, without the Function and region-mapping calls around it); others are called."""
    if (type(module) in (ColumnParallelLinear, RowParallelLinear) and module.bias is None
            and not module.sequence_parallel and module.tp_group.size() == 1):
        return torch.matmul(x, module.weight.t()), None
    return module(x)


def qkv(attn, x_SBH):
    """`attn.get_query_key_value_tensors(x)` ([S, B, Hq, D], [S, B, G, D] x 2) with the QKV
    projection through `linear`: the fused projection viewed per K/V group as
    [q heads of the group | k | v], split, q/k norms applied."""
    D, G = attn.hidden_size_per_attention_head, attn.num_query_groups_per_partition
    r = attn.num_attention_heads_per_partition // G
    if attn.config.num_query_groups < attn.world_size:  # groups split over TP: megatron's path
        return attn.get_query_key_value_tensors(x_SBH, None)
    mixed_SBX, _ = linear(attn.linear_qkv, x_SBH)
    mixed_SBGX = mixed_SBX.view(*mixed_SBX.shape[:2], G, (r + 2) * D)
    q_SBGX, k_SBGD, v_SBGD = torch.split(mixed_SBGX, [r * D, D, D], dim=3)
    q_SBHD = q_SBGX.reshape(q_SBGX.size(0), q_SBGX.size(1), -1, D)
    if attn.q_layernorm is not None:
        q_SBHD = attn.q_layernorm(q_SBHD)
    if attn.k_layernorm is not None:
        k_SBGD = attn.k_layernorm(k_SBGD)
    return q_SBHD, k_SBGD, v_SBGD


def sdpa_ok(core, q_SBHD) -> bool:
    """Whether one `F.scaled_dot_product_attention` computes what `core` computes in a full
    forward: fp32 queries (megatron's `DotProductAttention` to rounding), or 16-bit ones where
    `core` is `moe.model.attention.SDPAAttention` (the same SDPA; megatron's unfused 16-bit path rounds
    its scores differently); no learnable softmax offset, no query-key layer scaling (eval mode:
    no dropout)."""
    dtype_ok = q_SBHD.dtype == torch.float32 or (
        q_SBHD.dtype in SDPA_DTYPES and isinstance(core, SDPAAttention))
    return (dtype_ok and core.softmax_offset is None
            and not core.config.apply_query_key_layer_scaling)


def sdpa_attention(core, q_SBHD, k_BGTD, v_BGTD, mask_B1ST):
    """megatron attention of the new query rows over the cached keys as one fused SDPA call
    (K/V groups shared through `enable_gqa`, megatron's boolean mask as SDPA's additive one;
    the call `moe.model.attention.SDPAAttention` makes).
    Returns [S, B, Hq * D]."""
    S, B, Hq, D = q_SBHD.shape
    out_BHSD = torch.nn.functional.scaled_dot_product_attention(
        q_SBHD.permute(1, 2, 0, 3), k_BGTD, v_BGTD,
        attn_mask=additive_mask(mask_B1ST, q_SBHD.dtype),
        scale=core.softmax_scale, enable_gqa=k_BGTD.shape[1] != Hq)
    return out_BHSD.permute(2, 0, 1, 3).reshape(S, B, Hq * D)


def grouped_attention(core, q_SBHD, k_BGTD, v_BGTD, mask_B1ST):
    """megatron `DotProductAttention.forward`'s math (eval mode) without expanding K/V to every
    query head: each K/V group's r = Hq / G query heads share one batched matmul (query heads
    h = g * r + j use group g, as `repeat_interleave` pairs them). Same scale
    (`core.softmax_scale` inside `baddbmm`), the module's own masked softmax, no dropout (eval).
    Returns [S, B, Hq * D]."""
    S, B, Hq, D = q_SBHD.shape
    G, T = k_BGTD.shape[1], k_BGTD.shape[2]
    r = Hq // G
    q_XMD = q_SBHD.permute(1, 2, 0, 3).reshape(B * G, r * S, D)  # X = B * G rows, M = r * S
    k_XDT = k_BGTD.reshape(B * G, T, D).transpose(1, 2)
    scores_XMT = torch.baddbmm(q_XMD.new_empty(B * G, r * S, T), q_XMD, k_XDT, beta=0.0,
                               alpha=core.softmax_scale)
    probs_BHST = core.scale_mask_softmax(scores_XMT.view(B, Hq, S, T), mask_B1ST,
                                         core.softmax_offset)
    v_XTD = v_BGTD.reshape(B * G, T, D)
    out_XMD = torch.bmm(probs_BHST.reshape(B * G, r * S, T), v_XTD)
    return out_XMD.view(B, Hq, S, D).permute(2, 0, 1, 3).reshape(S, B, Hq * D)


def unsupported(gpt) -> str:
    """What about this GPTModel the lean decode step does not reproduce ('' when none)."""
    cfg = gpt.config
    checks = {"sequence parallelism": cfg.sequence_parallel,
              "pipeline parallelism": not (gpt.pre_process and gpt.post_process),
              "non-RoPE positions": gpt.position_embedding_type != "rope",
              "multi-latent attention": cfg.multi_latent_attention,
              "an attention output gate": getattr(cfg, "attention_output_gate", False),
              "post-layernorm residuals": cfg.apply_residual_connection_post_layernorm,
              "fp32 residuals": cfg.fp32_residual_connection,
              "flash decode": cfg.flash_decode}
    return ", ".join(name for name, bad in checks.items() if bad)


class KVCacheDecoder(DecoderBase):
    """Next-token logits for sampling, feeding each column through the model only once.

    Built on megatron-core's `StaticInferenceContext` (the per-layer K/V buffers its static-batch
    generation uses): the first call prefills the prompt columns, later calls run only the new
    columns and attend to the cached keys and values. `next_logits(tokens_BT, valid_BT)` equals
    `policy.logits(tokens_BT, valid_BT)[:, -1]` up to float rounding (tests/moe/model/test_model.py),
    padding included: the mask hides padding keys exactly as the full forward does. The model
    runs in eval mode (megatron's inference path needs `not training`); MoE routing is computed
    as usual.

    With `record_routing`, every call records each MoE layer's top-k ids for the columns it runs
    (megatron's RECORD action, `moe.routing.replay.record_routing`); `routing(valid_BT)` stitches them
    into the routing of the whole sequence, the rollout-time routing R3 replays.
    """

    def __init__(self, policy: MoEPolicy, batch_size: int, max_len: int,
                 record_routing: bool = False):
        super().__init__(policy, batch_size, max_len, record_routing)
        self.context = StaticInferenceContext(batch_size, max_len)

    @property
    def seen(self) -> int:
        """Columns already run through the model (and in the cache)."""
        return self.context.sequence_len_offset

    @torch.no_grad()
    def next_logits(self, tokens_BT: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
        """Float32 logits [B, V] for the token after column T-1; T grows between calls."""
        seen, T = self.columns(tokens_BT, valid_BT)
        policy = self.policy
        position_ids_BS, mask_B1ST = attention_inputs(valid_BT.to(policy.device), start=seen)
        if seen:
            self.context.enable_decode_mode()
        with self.model_call():
            logits_BSV = policy.model(tokens_BT[:, seen:].to(policy.device), position_ids_BS,
                                      mask_B1ST, inference_context=self.context,
                                      runtime_gather_output=True)
        self.context.sequence_len_offset = T
        return policy.mask_vocab(logits_BSV[:, -1].float())


DECODERS = {"lean": LeanKVDecoder, "megatron": KVCacheDecoder}


def kv_decoder(policy, kind: str, batch_size: int, max_len: int,
               record_routing: bool = False) -> "LeanKVDecoder | KVCacheDecoder | None":
    """A KV-cached next-token decoder of `kind` ("lean": `LeanKVDecoder`, "megatron":
    `KVCacheDecoder`, same results) for `policy`, or None under sequence parallelism (a single
    new column cannot be split over the TP ranks; callers recompute the full forward). As
    megatron-core requires sequence parallelism for MoE with TP > 1, the cache serves TP=1
    layouts (any EP and DP: tested on 2 processes with EP=2 and DP=2)."""
    if kind not in DECODERS:
        raise ValueError(f"decoder={kind!r}: expected one of {sorted(DECODERS)}")
    if policy.layout.sequence_parallel:
        return None
    return DECODERS[kind](policy, batch_size, max_len, record_routing)
