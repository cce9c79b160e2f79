"""moe.decode.LeanKVDecoder == megatron's static-inference KVCacheDecoder, bitwise: logits at
every step and the recorded routing, with left padding, a row that stopped early, bf16 autocast
and SDPA attention (EP=2 / DP=2 against the 1-process reference: tests/moe/test_parallel.py)."""

import pytest
import torch

from moe.decode import LeanKVDecoder, unsupported
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
    assert torch.equal(got_logits, want_logits) and torch.equal(got_ids, want_ids)
    assert policy.model.training  # eval mode inside the decoder only


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
