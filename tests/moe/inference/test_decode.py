"""moe.inference.decode.LeanKVDecoder == megatron's static-inference KVCacheDecoder: logits at every step
(to fp32 rounding: the grouped attention's matmuls are shaped differently from megatron's
expanded ones; bitwise where the core attention module is called as is) and the recorded
routing, with left padding, a row that stopped early, bf16 autocast and SDPA attention (EP=2 /
DP=2 against the 1-process reference: tests/moe/platform/test_parallel.py)."""

import pytest
import torch

from moe.inference.decode import (LeanKVDecoder, grouped_attention, lean_moe_ok, linear, qkv,
                                  sdpa_attention, sdpa_ok, unsupported)
from moe.inference.decode import KVCacheDecoder, kv_decoder
from moe.model.policy import MoEPolicy
from moe.model.presets import get_preset
from moe.model.settings import ParallelLayout


def _batch(B=6, P=7, N=6, vocab=26):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (B, P + N), generator=g)
    valid = torch.ones(B, P + N, dtype=torch.bool)
    valid[0, :3] = valid[1, :1] = False  # left padding
    valid[2, P + 2:] = False  # stopped early
    return tokens, valid, P


def _decode(decoder, tokens, valid, P):
    steps = [decoder.next_logits(tokens[:, :t], valid[:, :t])
             for t in range(P, tokens.shape[1] + 1)]
    return torch.stack(steps), decoder.routing(valid).ids_NLK


@pytest.mark.parametrize("preset_name,sdpa,autocast", [
    ("qwen3-moe-tiny", False, False), ("tiny", False, False),
    ("qwen3-moe-tiny", True, False), ("qwen3-moe-tiny", False, True)])
def test_lean_decoder_equals_megatron_static_inference(single_process, preset_name, sdpa,
                                                       autocast):
    preset = get_preset(preset_name)
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=26, optim=None,
                             sdpa_attention=sdpa)
    policy.train(True)
    tokens, valid, P = _batch()
    B, T = tokens.shape
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast \
        else torch.autocast("cpu", enabled=False)
    with context:
        want_logits, want_ids = _decode(KVCacheDecoder(policy, B, T, True), tokens, valid, P)
        got_logits, got_ids = _decode(LeanKVDecoder(policy, B, T, True), tokens, valid, P)
    assert torch.isinf(got_logits[..., 26:]).all() and torch.isfinite(got_logits[..., :26]).all()
    assert torch.equal(got_ids, want_ids)
    if sdpa:  # SDPAAttention is called as is: the same floats at every decode step. The
        # prefill's output projection runs over the last prompt row here, over every prompt row
        # in megatron's: a GEMM of another height, whose blocking may round differently (torch
        # 2.14.1's CPU GEMM does, by 1 ulp; 2.13's does not); its layers: the next test.
        assert torch.equal(got_logits[1:], want_logits[1:])
    tol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(got_logits, want_logits, atol=tol, rtol=tol)
    assert policy.model.training  # eval mode inside the decoder only


def test_lean_prefill_layers_equal_megatrons_with_sdpa(single_process, monkeypatch):
    """The prefill's decoder layer outputs, bitwise, with SDPA attention (its logits go through
    an output GEMM of another height: previous test)."""
    policy = MoEPolicy.build(get_preset("qwen3-moe-tiny"), ParallelLayout(), real_vocab=26,
                             optim=None, sdpa_attention=True)
    tokens, valid, P = _batch()
    B, T = tokens.shape
    layers = policy.model.module.decoder.layers
    want, got = [], []
    hooks = [layer.register_forward_hook(lambda m, i, o: want.append(o[0])) for layer in layers]
    KVCacheDecoder(policy, B, T, False).next_logits(tokens[:, :P], valid[:, :P])
    for hook in hooks:
        hook.remove()
    lean_layer = LeanKVDecoder._layer
    monkeypatch.setattr(LeanKVDecoder, "_layer", lambda self, *a: got.append(
        lean_layer(self, *a)) or got[-1])
    LeanKVDecoder(policy, B, T, False).next_logits(tokens[:, :P], valid[:, :P])
    assert len(got) == len(want) == len(layers)
    for g, w in zip(got, want):
        assert g.shape == w.shape == (P, B, policy.preset.hidden_size) and torch.equal(g, w)


def _gqa_case(core_cls=None, **core_kwargs):
    """A core attention module (megatron's `DotProductAttention` unless `core_cls`) with 4 query
    heads over 2 K/V groups (heads 0, 1 -> group 0), 3 new rows over 7 keys with a padding key
    hidden: (core, q [S, B, Hq, D], k, v [B, G, T, D] as the decoder caches them, mask, the
    module's own output)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from moe.model.attention import attention_inputs
    from moe.model.gpt import transformer_config

    cfg = transformer_config(get_preset("tiny"), ParallelLayout())
    cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels = 4, 2, 8
    core = (core_cls or DotProductAttention)(cfg, layer_number=1, attention_type="self",
                                             attn_mask_type=AttnMaskType.causal, **core_kwargs)
    g = torch.Generator().manual_seed(1)
    S, B, T = 3, 2, 7
    q = torch.randn(S, B, 4, 8, generator=g)
    k, v = torch.randn(T, B, 2, 8, generator=g), torch.randn(T, B, 2, 8, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 0] = False
    _, mask = attention_inputs(valid, start=T - S)
    want = core.eval()(q, k, v, mask, attn_mask_type=AttnMaskType.no_mask)
    return core, q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), mask, want


def test_grouped_attention_equals_dot_product_attention_with_gqa(single_process):
    """megatron's expanded computation to fp32 rounding (`_gqa_case`)."""
    core, q, k_BGTD, v_BGTD, mask, want = _gqa_case()
    got = grouped_attention(core, q, k_BGTD, v_BGTD, mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    swapped = grouped_attention(core, q[:, :, [1, 0, 2, 3]], k_BGTD, v_BGTD, mask)
    assert not torch.allclose(swapped, want, atol=1e-3)  # head order matters: the check bites


def test_kv_decoder_builds_the_named_decoder_and_checks_bad_input(single_process):
    preset = get_preset("tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=26, optim=None)
    assert type(kv_decoder(policy, "lean", 2, 8)) is LeanKVDecoder
    assert type(kv_decoder(policy, "megatron", 2, 8)) is KVCacheDecoder
    decoder = LeanKVDecoder(policy, 2, 8)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    valid = torch.ones(2, 8, dtype=torch.bool)
    decoder.next_logits(tokens[:, :5], valid[:, :5])
    with pytest.raises(ValueError, match="5 of at most 8"):
        decoder.next_logits(tokens[:, :5], valid[:, :5])  # no new column
    with pytest.raises(ValueError, match="expected \\[2, T\\]"):
        decoder.next_logits(tokens[:1], valid[:1])
    with pytest.raises(ValueError, match="max_seq_len"):
        LeanKVDecoder(policy, 2, preset.max_seq_len + 1)
    with pytest.raises(RuntimeError, match="record_routing"):
        decoder.routing(valid[:, :5])
    with pytest.raises(ValueError, match="decoder='fast'"):
        kv_decoder(policy, "fast", 2, 8)


def test_unsupported_layouts_are_named(single_process):
    policy = MoEPolicy.build(get_preset("tiny"), ParallelLayout(), real_vocab=26, optim=None)
    gpt = policy.model.module
    assert unsupported(gpt) == ""
    gpt.config.sequence_parallel, gpt.config.flash_decode = True, True
    try:
        assert unsupported(gpt) == "sequence parallelism, flash decode"
        with pytest.raises(ValueError, match="does not support sequence parallelism"):
            LeanKVDecoder(policy, 2, 8)
    finally:
        gpt.config.sequence_parallel, gpt.config.flash_decode = False, False


@pytest.mark.parametrize("preset_name", ["qwen3-moe-tiny", "tiny"])
def test_lean_moe_equals_the_moe_layer(single_process, preset_name):
    """One rank: router + permute + experts + unpermute == MoELayer.forward, bitwise."""
    from moe.inference.decode import lean_moe

    preset = get_preset(preset_name)
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=26, optim=None)
    policy.train(False)
    mlp = policy.model.module.decoder.layers[1].mlp
    assert lean_moe_ok(mlp)
    x = torch.randn(5, 3, preset.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # as the decoder runs it (torch 2.14's grouped GEMM rounds
        want, got = mlp(x)[0], lean_moe(mlp, x)[0]  # differently when autograd records)
        flipped = lean_moe(mlp, x.flip(0))[0]
    assert got.shape == x.shape and torch.equal(got, want)
    assert not torch.equal(flipped, want)  # token order matters


@pytest.mark.parametrize("preset_name", ["qwen3-moe-tiny", "tiny"])
def test_qkv_and_linear_equal_megatrons_modules(single_process, preset_name):
    """The projection as `x @ W^T` and the per-group split: megatron's floats, bitwise (GQA and
    q/k norms in qwen3-moe-tiny)."""
    preset = get_preset(preset_name)
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=26, optim=None)
    attn = policy.model.module.decoder.layers[0].self_attention
    x = torch.randn(3, 2, preset.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for got, want in zip(qkv(attn, x), attn.get_query_key_value_tensors(x, None)):
            assert got.shape == want.shape and torch.equal(got, want)
        core = torch.randn(3, 2, attn.linear_proj.weight.shape[1])
        assert torch.equal(linear(attn.linear_proj, core)[0], attn.linear_proj(core)[0])


def _policy(preset="tiny", **kwargs):
    return MoEPolicy.build(get_preset(preset) if isinstance(preset, str) else preset,
                           ParallelLayout(), real_vocab=26, optim=None, **kwargs)


def test_sdpa_attention_uses_the_cores_scale_groups_and_mask(single_process):
    """One SDPA call == megatron's module with a configured softmax scale (not SDPA's default
    1 / sqrt(D)), 2 K/V groups and the padding + causal mask, to fp32 rounding."""
    core, q, k_BGTD, v_BGTD, mask, want = _gqa_case(softmax_scale=0.5)
    torch.testing.assert_close(sdpa_attention(core, q, k_BGTD, v_BGTD, mask), want, atol=1e-6,
                               rtol=1e-6)


def test_sdpa_ok_only_where_one_sdpa_call_is_the_cores_math(single_process, monkeypatch):
    """fp32 queries, or 16-bit ones for `SDPAAttention` (megatron's unfused 16-bit softmax rounds
    otherwise); never with a softmax offset or query-key layer scaling."""
    from moe.model.attention import SDPAAttention

    core, sdpa_core = _gqa_case()[0], _gqa_case(SDPAAttention)[0]
    q32, q16 = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    assert sdpa_ok(core, q32) and sdpa_ok(sdpa_core, q32) and sdpa_ok(sdpa_core, q16)
    assert not sdpa_ok(core, q16)
    monkeypatch.setattr(core, "softmax_offset", torch.zeros(4))
    assert not sdpa_ok(core, q32)
    monkeypatch.setattr(sdpa_core.config, "apply_query_key_layer_scaling", True)
    assert not sdpa_ok(sdpa_core, q32)


def test_linear_keeps_a_projections_bias(single_process):
    """A QKV projection with a bias (`MoEPreset.qkv_bias`, as Qwen2-MoE has) is megatron's
    module call: the output includes the bias, and so do q, k, v."""
    import dataclasses

    policy = _policy(dataclasses.replace(get_preset("tiny"), qkv_bias=True))
    attn = policy.model.module.decoder.layers[0].self_attention
    x = torch.randn(3, 2, policy.preset.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        attn.linear_qkv.bias.normal_(generator=torch.Generator().manual_seed(5))
        got, want = linear(attn.linear_qkv, x), attn.linear_qkv(x)
        assert torch.equal(got[0], want[0]) and (got[1] is None) == (want[1] is None)
        for got, want in zip(qkv(attn, x), attn.get_query_key_value_tensors(x, None)):
            assert torch.equal(got, want)


def test_lean_decoder_checks_lengths_and_shapes(single_process):
    """A cache as long as the preset allows is accepted; tokens and valid of different shapes,
    a call past the cache's length, and a routing mask other than the columns run are not."""
    policy = _policy()
    LeanKVDecoder(policy, 2, policy.preset.max_seq_len)
    decoder = LeanKVDecoder(policy, 2, 8, record_routing=True)
    tokens, valid = torch.zeros(2, 9, dtype=torch.long), torch.ones(2, 9, dtype=torch.bool)
    with pytest.raises(ValueError, match="tokens \\(2, 5\\) / valid \\(2, 4\\)"):
        decoder.next_logits(tokens[:, :5], valid[:, :4])
    with pytest.raises(ValueError, match="9 columns: the cache holds 0 of at most 8"):
        decoder.next_logits(tokens, valid)
    decoder.next_logits(tokens[:, :5], valid[:, :5])
    with pytest.raises(ValueError, match="must be \\[2, 5\\]"):
        decoder.routing(valid[:, :4])
    assert decoder.routing(valid[:, :5]).ids_NLK.shape[:2] == (10, policy.preset.num_layers)


@pytest.mark.parametrize("on_config,name,value,problem", [
    (False, "pre_process", False, "pipeline parallelism"),
    (False, "post_process", False, "pipeline parallelism"),
    (False, "position_embedding_type", "learned_absolute", "non-RoPE positions"),
    (True, "multi_latent_attention", True, "multi-latent attention"),
    (True, "attention_output_gate", True, "an attention output gate"),
    (True, "apply_residual_connection_post_layernorm", True, "post-layernorm residuals"),
    (True, "fp32_residual_connection", True, "fp32 residuals")])
def test_each_unsupported_layout_is_named(single_process, monkeypatch, on_config, name, value,
                                          problem):
    """Every layout the lean step does not reproduce is named (a pipeline stage without the
    embedding or without the output layer each counts)."""
    gpt = _policy().model.module
    monkeypatch.setattr(gpt.config if on_config else gpt, name, value, raising=False)
    assert unsupported(gpt) == problem


class _Group:
    """A process group of `n` ranks, as far as `lean_moe_ok` asks."""

    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


@pytest.mark.parametrize("owner,name,value", [
    ("config", "moe_expert_capacity_factor", 1.0),
    ("config", "moe_router_padding_for_quantization", True),
    ("config", "moe_latent_size", 4), ("config", "moe_permute_fusion", True),
    ("mlp", "use_shared_expert", True), ("mlp", "ep_group", _Group(2)),
    ("mlp", "tp_group", _Group(2)), ("experts", "tp_group", _Group(2)),
    ("experts", "tp_group", None)])
def test_lean_moe_declines_layers_it_does_not_compute(single_process, monkeypatch, owner, name,
                                                      value):
    """Token dropping or padding, a latent projection, TE's fused permutation, shared experts,
    more than one expert-parallel or tensor-parallel rank, experts without a TP group: the
    layer's own forward runs instead. A layer that is not MoE is declined too."""
    layer = _policy().model.module.decoder.layers[0]
    mlp = layer.mlp
    assert lean_moe_ok(mlp) and not lean_moe_ok(layer.self_attention)
    monkeypatch.setattr({"config": mlp.config, "mlp": mlp, "experts": mlp.experts}[owner], name,
                        value)
    assert not lean_moe_ok(mlp)


@pytest.mark.parametrize("interleaved,rotary_percent", [(False, 1.0), (True, 1.0), (False, 0.5)])
def test_rope_equals_megatrons_in_each_dtype(single_process, monkeypatch, interleaved,
                                            rotary_percent):
    """The decoder's cached cos / sin tables give megatron's `_apply_rotary_pos_emb_bshd`,
    bitwise, at the cache's positions: one table per input dtype, a YaRN mscale, interleaved
    pairs, and partial rotary dims (the rest passed through)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    policy = _policy()
    attn = policy.model.module.decoder.layers[0].self_attention
    monkeypatch.setattr(attn.config, "rotary_interleaved", interleaved)
    D = attn.hidden_size_per_attention_head
    decoder = LeanKVDecoder(policy, 2, 8)
    decoder.freqs_T11D = RotaryEmbedding(D, rotary_percent, rotary_interleaved=interleaved)(8)
    decoder.mscale, decoder._seen = 1.5, 3  # three columns cached: positions 3, 4
    freqs_S11D = decoder.freqs_T11D[3:5]
    g = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        t = torch.randn(2, 2, 4, D, generator=g).to(dtype)
        want = _apply_rotary_pos_emb_bshd(t, freqs_S11D, rotary_interleaved=interleaved,
                                          mscale=1.5)
        got = decoder._rope(attn, t, freqs_S11D)
        assert got.dtype == dtype and torch.equal(got, want)


def test_stitched_routing_is_the_full_forward_routing(single_process):
    """The routing recorded by the prefill and each step, stitched in call order, is what one
    full forward over the same columns routes (R3's replay cache)."""
    from moe.routing.replay import current_routing

    policy = _policy()
    tokens, valid, P = _batch(B=3, P=4, N=3)
    _, got = _decode(LeanKVDecoder(policy, *tokens.shape, True), tokens, valid, P)
    assert torch.equal(got, current_routing(policy, tokens, valid)[1].ids_NLK)


def test_a_bf16_policys_logits_are_float32(single_process):
    """The logits of a bf16 policy come back as float32 (the sampler's softmax and log-probs
    run on them), with the padding vocabulary masked."""
    policy = _policy(dtype=torch.bfloat16)
    tokens, valid, P = _batch(B=3, P=4, N=1)
    logits = LeanKVDecoder(policy, *tokens.shape).next_logits(tokens, valid)
    assert logits.dtype == torch.float32 and logits.shape == (3, policy.preset.vocab_size)
    assert torch.isinf(logits[:, 26:]).all() and torch.isfinite(logits[:, :26]).all()
