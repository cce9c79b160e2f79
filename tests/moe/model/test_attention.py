"""`moe.model.attention.SDPAAttention` equals megatron's `DotProductAttention`: logits, grads, KV cache.

The reference is the same model with its core attention's class set back to megatron's
`DotProductAttention` (same modules, no parameters; only `forward` differs). The default
(`model.attention=sdpa`); `model.attention=megatron` keeps megatron's attention.
"""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

import moe.model.attention
from moe.inference.decode import kv_decoder
from moe.model.attention import SDPAAttention
from tests.moe import parallel_worker as pw
from tests.moe.model.test_experts import build, grads


def attention_modules(policy) -> list:
    return [m for m in policy.model.module.modules() if isinstance(m, DotProductAttention)]


def as_megatron(policy) -> None:
    for m in attention_modules(policy):
        m.__class__ = DotProductAttention


@pytest.fixture
def sdpa_calls(monkeypatch):
    calls = []
    sdpa = moe.model.attention.F.scaled_dot_product_attention
    monkeypatch.setattr(moe.model.attention.F, "scaled_dot_product_attention",
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
        decoder = kv_decoder(policy, "lean", 5, 14)
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
    from megatron_gspo.config.schema import load_config
    from megatron_gspo.errors import ConfigError

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
    assert attn._sdpa_ok(q.bfloat16(), mask, None, None)  # 16-bit: SDPA (see below)
    assert not attn._sdpa_ok(q.double(), mask, None, None)
    assert not attn._sdpa_ok(q, mask, torch.zeros(1), None)
    assert attn._sdpa_ok(q, None, None, PackedSeqParams(qkv_format="thd"))  # packed: segments
    assert not attn._sdpa_ok(q, None, None, PackedSeqParams(qkv_format="sbhd"))
    attn.softmax_offset = torch.zeros(policy.preset.num_attention_heads)
    assert not attn._sdpa_ok(q, mask, None, None)
    attn.softmax_offset = None
    attn.config.apply_query_key_layer_scaling = True
    assert not attn._sdpa_ok(q, mask, None, None)
    attn.config.apply_query_key_layer_scaling = False
    attn.attention_dropout.p = 0.1
    assert not attn.train()._sdpa_ok(q, mask, None, None)  # dropout while training
    assert attn.eval()._sdpa_ok(q, mask, None, None)  # no dropout in eval: SDPA


def test_sdpa_uses_the_modules_softmax_scale(single_process):
    """A softmax scale other than SDPA's default 1/sqrt(D) (megatron's `config.softmax_scale`)
    is the one applied: float64 attention with that scale, GQA and left padding."""
    from moe.model.attention import attention_inputs

    policy = build("qwen3-moe-tiny", sdpa_attention=True)
    attn, p = attention_modules(policy)[0], policy.preset
    g = torch.Generator().manual_seed(3)
    S, B, H, G, D = 6, 2, p.num_attention_heads, p.num_query_groups, p.kv_channels
    q = torch.randn(S, B, H, D, generator=g)
    k, v = (torch.randn(S, B, G, D, generator=g) for _ in range(2))
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, :2] = False
    _, mask = attention_inputs(valid)
    attn.softmax_scale = 0.9
    with torch.no_grad():
        got = attn(q, k, v, mask)
    torch.testing.assert_close(got.double(), float64_attention(q, k, v, mask, 0.9), atol=1e-5,
                               rtol=1e-5)


def float64_attention(q_SBHD, k_SBGD, v_SBGD, mask_B1SK, scale):
    """Exact-ish reference: float64 scores, softmax and value product, K/V groups expanded."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q_SBHD, k_SBGD, v_SBGD))
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(mask_B1SK, float("-inf"))
    out = scores.softmax(-1) @ v
    S, B = q_SBHD.shape[:2]
    return out.permute(2, 0, 1, 3).reshape(S, B, -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_sdpa_is_closer_to_float64_than_megatrons_unfused_path(single_process, dtype,
                                                                      sdpa_calls):
    """bf16 / fp16 SDPA keeps scores and softmax in fp32; megatron's unfused path rounds the
    scores to 16 bits first. Over random inputs with causal + left-padding masks, SDPA's error
    against float64 is clearly smaller than megatron's (and small)."""
    from moe.model.attention import attention_inputs

    policy = build("qwen3-moe-tiny", sdpa_attention=True)
    attn = attention_modules(policy)[0]
    p = policy.preset
    g = torch.Generator().manual_seed(5)
    errors = {"sdpa": [], "megatron": []}
    for trial in range(4):
        S, B, H, G, D = 24, 3, p.num_attention_heads, p.num_query_groups, p.kv_channels
        q = (3 * torch.randn(S, B, H, D, generator=g)).to(dtype)  # spread scores: rounding shows
        k = (3 * torch.randn(S, B, G, D, generator=g)).to(dtype)
        v = torch.randn(S, B, G, D, generator=g).to(dtype)
        valid = torch.ones(B, S, dtype=torch.bool)
        valid[1, :trial + 1] = False
        _, mask = attention_inputs(valid)
        want = float64_attention(q, k, v, mask, attn.softmax_scale)
        for kind in ("sdpa", "megatron"):
            attn.__class__ = SDPAAttention if kind == "sdpa" else DotProductAttention
            with torch.no_grad():
                got = attn(q, k, v, mask).double()
            rows = valid.T[:, :, None].expand_as(got)  # padded query rows: any value
            errors[kind].append(((got - want)[rows].norm() / want[rows].norm()).item())
        attn.__class__ = SDPAAttention
    assert len(sdpa_calls) == 4
    assert max(errors["sdpa"]) < 1e-2, errors
    assert sum(errors["sdpa"]) <= 0.7 * sum(errors["megatron"]), errors  # ~1/3 here


def test_bf16_kv_decode_uses_sdpa_and_matches_the_full_forward(single_process, sdpa_calls):
    """bf16 weights: the lean decoder's attention is the same SDPA as the full forward's, so
    the decoded next-token logits match the full forward to bf16 rounding."""
    policy = build("qwen3-moe-tiny", dtype=torch.bfloat16, sdpa_attention=True)
    tokens_BT, valid_BT, _ = pw.batch(policy.preset.vocab_size, B=5, T=14)
    decoder = kv_decoder(policy, "lean", 5, 14)
    got = torch.stack([decoder.next_logits(tokens_BT[:, :t], valid_BT[:, :t])
                       for t in range(6, 15)])
    L = policy.preset.num_layers
    assert len(sdpa_calls) == 9 * L  # one SDPA per layer and step, not megatron's grouped math
    with torch.no_grad():
        full = policy.logits(tokens_BT, valid_BT)[:, 5:].transpose(0, 1)
    assert len(sdpa_calls) == 10 * L
    live = valid_BT[:, 5:].T
    torch.testing.assert_close(got[live], full[live], atol=5e-2, rtol=5e-2)


def test_layers_share_one_additive_mask_equal_to_sdpas_own(single_process, monkeypatch):
    """One float mask per forward for all layers (`moe.model.attention.additive_mask`), with the values
    SDPA derives from the inverted boolean mask (outputs bitwise equal), in the dtype asked for;
    a mask changed in place is converted again."""
    from moe.model.attention import additive_mask
    from moe.model.attention import attention_inputs

    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(moe.model.attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: masks.append(k["attn_mask"]) or sdpa(*a, **k))
    policy = build("qwen3-moe-tiny", sdpa_attention=True)
    tokens_BT, valid_BT, _ = pw.batch(policy.preset.vocab_size, B=5, T=14)
    assert not valid_BT.all()  # padding in the mask
    policy.logits(tokens_BT, valid_BT)
    assert len(masks) == policy.preset.num_layers and all(m is masks[0] for m in masks)
    _, mask_B1ST = attention_inputs(valid_BT)
    assert masks[0].dtype == torch.float32
    assert torch.equal(masks[0] == float("-inf"), mask_B1ST) and not masks[0][~mask_B1ST].any()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 2, 14, 8, generator=g) for _ in range(3))
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        assert additive_mask(mask_B1ST, dtype).dtype == dtype  # not the other dtype's cached
        assert torch.equal(sdpa(q, k, v, attn_mask=additive_mask(mask_B1ST, dtype)),
                           sdpa(q, k, v, attn_mask=~mask_B1ST))
    before = additive_mask(mask_B1ST, torch.float32)
    assert additive_mask(mask_B1ST, torch.float32) is before  # cached
    mask_B1ST[0, 0, -1, 0] = True
    after = additive_mask(mask_B1ST, torch.float32)
    assert after is not before and after[0, 0, -1, 0] == float("-inf")
