"""moe.decode.LeanKVDecoder == megatron's static-inference KVCacheDecoder: logits at every step
(to fp32 rounding: the grouped attention's matmuls are shaped differently from megatron's
expanded ones; bitwise where the core attention module is called as is) and the recorded
routing, with left padding, a row that stopped early, bf16 autocast and SDPA attention (EP=2 /
DP=2 against the 1-process reference: tests/moe/test_parallel.py)."""

import pytest
import torch

from moe.decode import LeanKVDecoder, grouped_attention, linear, qkv, unsupported
from moe.model import ParallelLayout
from moe.policy import KVCacheDecoder, MoEPolicy
from moe.presets import get_preset


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


def test_grouped_attention_equals_dot_product_attention_with_gqa(single_process):
    """4 query heads over 2 K/V groups (heads 0, 1 -> group 0), 3 new rows over 7 keys with a
    padding key hidden: megatron's expanded computation to fp32 rounding."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from moe.model import transformer_config
    from moe.policy import attention_inputs

    preset = get_preset("tiny")
    cfg = transformer_config(preset, ParallelLayout())
    cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels = 4, 2, 8
    core = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                               attention_type="self").eval()
    g = torch.Generator().manual_seed(1)
    S, B, T = 3, 2, 7
    q = torch.randn(S, B, 4, 8, generator=g)
    k, v = torch.randn(T, B, 2, 8, generator=g), torch.randn(T, B, 2, 8, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 0] = False
    _, mask = attention_inputs(valid, start=T - S)
    want = core(q, k, v, mask, attn_mask_type=AttnMaskType.no_mask)
    k_BGTD, v_BGTD = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # the decoder's cache layout
    got = grouped_attention(core, q, k_BGTD, v_BGTD, mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    swapped = grouped_attention(core, q[:, :, [1, 0, 2, 3]], k_BGTD, v_BGTD, mask)
    assert not torch.allclose(swapped, want, atol=1e-3)  # head order matters: the check bites


def test_policy_picks_the_configured_decoder_and_checks_bad_input(single_process):
    preset = get_preset("tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=26, optim=None)
    assert type(policy.kv_decoder(2, 8)) is LeanKVDecoder
    policy.decoder = "megatron"
    assert type(policy.kv_decoder(2, 8)) is KVCacheDecoder
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
        MoEPolicy.build(preset, ParallelLayout(), real_vocab=26, optim=None, decoder="fast")


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
    from moe.decode import lean_moe, lean_moe_ok

    preset = get_preset(preset_name)
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=26, optim=None)
    policy.train(False)
    mlp = policy.model.module.decoder.layers[1].mlp
    assert lean_moe_ok(mlp)
    x = torch.randn(5, 3, preset.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # as the decoder runs it (torch 2.14's grouped GEMM rounds
        want, got = mlp(x)[0], lean_moe(mlp, x)[0]  # differently when autograd records)
        stacked = mlp.experts.stacked_weights()  # what the decoder caches for a rollout
        with_stacked, flipped = lean_moe(mlp, x, stacked)[0], lean_moe(mlp, x.flip(0))[0]
    assert got.shape == x.shape and torch.equal(got, want)
    assert torch.equal(with_stacked, want)
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
