"""`moe.attention.SDPAAttention` equals megatron's `DotProductAttention`: logits, grads, KV cache.

The reference is the same model with its core attention's class set back to megatron's
`DotProductAttention` (same modules, no parameters; only `forward` differs). The default
(`model.attention=sdpa`); `model.attention=megatron` keeps megatron's attention.
"""

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

import moe.attention
from moe.attention import SDPAAttention
from tests.moe import parallel_worker as pw
from tests.moe.test_experts import build, grads


def attention_modules(policy) -> list:
    return [m for m in policy.model.module.modules() if isinstance(m, DotProductAttention)]


def as_megatron(policy) -> None:
    for m in attention_modules(policy):
        m.__class__ = DotProductAttention


@pytest.fixture
def sdpa_calls(monkeypatch):
    calls = []
    sdpa = moe.attention.F.scaled_dot_product_attention
    monkeypatch.setattr(moe.attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    return calls


@pytest.mark.parametrize("preset_name", ["tiny", "qwen3-moe-tiny"])
def test_sdpa_attention_matches_dot_product_attention(single_process, preset_name, sdpa_calls):
    policy = build(preset_name, sdpa_attention=True)
    assert all(type(m) is SDPAAttention for m in attention_modules(policy))
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size, B=6, T=16)
    logits, norm = pw.run_model(policy, tokens_BT, valid_BT, readout_BTV)
    got = grads(policy)
    assert len(sdpa_calls) == policy.preset.num_layers
    as_megatron(policy)
    ref_logits, ref_norm = pw.run_model(policy, tokens_BT, valid_BT, readout_BTV)
    assert len(sdpa_calls) == policy.preset.num_layers
    torch.testing.assert_close(logits, ref_logits, atol=2e-6, rtol=1e-5)
    for name, g in grads(policy).items():
        torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-4,
                                   msg=lambda m: f"{name}: {m}")
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm


def test_sdpa_kv_cache_decode_matches_dot_product_attention(single_process, sdpa_calls):
    """Prefill 6 columns, then decode one at a time: the same next-token logits as megatron's
    attention through the same cache (padding rows included)."""
    policy = build("qwen3-moe-tiny", sdpa_attention=True)
    tokens_BT, valid_BT, _ = pw.batch(policy.preset.vocab_size, B=5, T=14)

    def decode() -> torch.Tensor:
        decoder = policy.kv_decoder(5, 14)
        return torch.stack([decoder.next_logits(tokens_BT[:, :t], valid_BT[:, :t])
                            for t in range(6, 15)])

    got = decode()
    assert len(sdpa_calls) == 9 * policy.preset.num_layers
    as_megatron(policy)
    ref = decode()
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    full = policy.logits(tokens_BT, valid_BT)[:, 5:].transpose(0, 1)
    live = valid_BT[:, 5:].T
    torch.testing.assert_close(got[live], full[live], atol=2e-5, rtol=1e-4)


def test_default_model_uses_sdpa_and_megatron_attention_is_kept_on_request(single_process):
    assert all(type(m) is SDPAAttention for m in attention_modules(build("tiny")))
    kept = attention_modules(build("tiny", sdpa_attention=False))
    assert kept and all(type(m) is DotProductAttention for m in kept)


def test_config_selects_attention():
    from megatron_gspo.config import ConfigError, load_config

    assert load_config(None, []).model.attention == "sdpa"
    assert load_config(None, ["model.attention=megatron"]).model.attention == "megatron"
    with pytest.raises(ConfigError, match="attention"):
        load_config(None, ["model.attention=flash"])


def test_falls_back_where_sdpa_would_differ(single_process):
    policy = build("tiny", sdpa_attention=True)
    attn = attention_modules(policy)[0]
    q = torch.randn(4, 2, 4, 8)
    mask = torch.zeros(2, 1, 4, 4, dtype=torch.bool)
    assert attn._sdpa_ok(q, mask, None, None)
    assert not attn._sdpa_ok(q, None, None, None)  # megatron would build its own causal mask
    assert not attn._sdpa_ok(q.bfloat16(), mask, None, None)  # megatron's fp32-softmax rules
    assert not attn._sdpa_ok(q, mask, torch.zeros(1), None)
