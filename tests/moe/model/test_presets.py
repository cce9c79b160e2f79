"""MoEPreset: the checks a preset and a parallel split must pass, vocab padding, and the analytic
parameter / FLOP counts (exact, from the architecture alone)."""

import dataclasses

import pytest

from moe.model.presets import get_preset

# Qwen2-MoE's extras on the tiny layer: QKV bias, a gated shared expert, tied embeddings, no QK-norm
QWEN2_STYLE = dict(qk_layernorm=False, qkv_bias=True, norm_topk_prob=False,
                   shared_expert_ffn_hidden_size=48, shared_expert_gate=True,
                   tie_word_embeddings=True)


@pytest.mark.parametrize("changes", [
    {"hidden_size": 32.0}, {"topk": True}, {"shared_expert_ffn_hidden_size": -1},
    {"shared_expert_ffn_hidden_size": 16.0}, {"shared_expert_gate": True},
    {"rotary_base": 0.0}, {"norm_epsilon": 0.0}])
def test_bad_preset_values_raise_naming_the_field(changes):
    """Non-int sizes (floats, bools), a negative shared expert, a gate without a shared expert
    and a non-positive RoPE theta or norm epsilon are refused, naming the field."""
    field = next(iter(changes))
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(get_preset("tiny"), **changes)


def test_boundary_presets_are_accepted():
    """topk == num_experts (dense routing) and a shared expert with its gate are valid."""
    tiny = get_preset("tiny")
    assert dataclasses.replace(tiny, topk=tiny.num_experts).topk == 8
    assert dataclasses.replace(tiny, **QWEN2_STYLE).shared_expert_gate


@pytest.mark.parametrize("field,value", [("num_query_groups", 1), ("vocab_size", 65),
                                         ("shared_expert_ffn_hidden_size", 33)])
def test_tensor_parallel_split_checked_per_field(field, value):
    """The query groups, the vocabulary and the shared expert's FFN (the sizes TP shards) must
    divide by tp; the error names the field and tp."""
    preset = dataclasses.replace(get_preset("tiny"), **{field: value})
    preset.check_parallel(tp=1, ep=1)
    with pytest.raises(ValueError, match=f"{field}={value} .*tp=2"):
        preset.check_parallel(tp=2, ep=1)


def test_tiny_presets_split_tp2_ep2():
    """The CPU presets the 2-process tests shard (and a Qwen2-style one) pass tp=2 x ep=2."""
    tiny = get_preset("tiny")
    for preset in (tiny, get_preset("qwen3-moe-tiny"), dataclasses.replace(tiny, **QWEN2_STYLE)):
        preset.check_parallel(tp=2, ep=2)


def test_with_vocab_rounds_up_to_the_multiple():
    tiny = get_preset("tiny")
    assert [tiny.with_vocab(v).vocab_size for v in (1, 16, 17, 40)] == [16, 16, 32, 48]
    assert tiny.with_vocab(300, multiple=128).vocab_size == 384
    assert tiny.with_vocab(256, multiple=128).vocab_size == 256


def test_qwen3_moe_tiny_keeps_the_qwen3_structure():
    """The CPU policy keeps what makes Qwen3-30B-A3B's routing: GQA, QK-norm, many experts,
    top-k > 2 with renormalised top-k probabilities."""
    p = get_preset("qwen3-moe-tiny")
    assert p.num_query_groups < p.num_attention_heads and p.qk_layernorm and p.norm_topk_prob
    assert p.topk > 2 and p.num_experts >= 4 * p.topk


@pytest.mark.parametrize("changes", [{}, QWEN2_STYLE])
def test_active_params_count_topk_of_the_experts(changes):
    """Activated = total less the (E - K) unused routed experts of every layer."""
    p = dataclasses.replace(get_preset("tiny"), **changes)
    counts = p.num_params()
    unused = p.num_layers * (p.num_experts - p.topk) * 3 * p.hidden_size * p.moe_ffn_hidden_size
    assert counts["total"] - counts["active"] == unused


@pytest.mark.parametrize("changes", [{"qk_layernorm": False},
                                     dict(QWEN2_STYLE, qkv_bias=False, tie_word_embeddings=False)])
def test_flops_are_twice_the_activated_matmul_weights(changes):
    """Without QK-norm or biases, the forward FLOPs at context 0 are 2 per activated weight
    outside the norms and the input embedding (shared expert and its gate included); each
    context key adds 4 q d per layer."""
    p = dataclasses.replace(get_preset("tiny"), **changes)
    h = p.hidden_size
    matmul = p.num_params()["active"] - p.num_layers * 2 * h - h - p.vocab_size * h
    assert p.flops_per_token(0) == 2 * matmul
    per_key = p.num_layers * 4 * p.num_attention_heads * p.kv_channels
    assert p.flops_per_token(10) - p.flops_per_token(0) == 10 * per_key


@pytest.mark.parametrize("name,base", [("qwen3-moe-tiny-hd32", "qwen3-moe-tiny"),
                                       ("qwen3-moe-tiny-hd32-wide", "qwen3-moe-tiny-wide")])
def test_head_dim_32_presets_are_the_tiny_layers_with_vllm_cpu_heads(name, base):
    """The head_dim-32 presets (rollout.backend=vllm on CPU) are the tiny presets' layers with
    2 query heads / 1 KV head of dim 32 instead of 4 / 2 of dim 16: a head_dim vLLM's CPU
    attention accepts, the same projection shapes, and parameter counts that differ only by
    the QK-norm's 2 * head_dim weights per layer."""
    from megatron_gspo.rollout.vllm.engine import CPU_HEAD_DIMS

    p, b = get_preset(name), get_preset(base)
    assert p.kv_channels in CPU_HEAD_DIMS and b.kv_channels not in CPU_HEAD_DIMS
    assert dataclasses.replace(p, name=b.name, num_attention_heads=b.num_attention_heads,
                               num_query_groups=b.num_query_groups,
                               kv_channels=b.kv_channels) == b
    assert p.num_attention_heads * p.kv_channels == b.num_attention_heads * b.kv_channels
    assert p.num_query_groups * p.kv_channels == b.num_query_groups * b.kv_channels
    for kind in ("total", "active"):
        assert p.num_params()[kind] - b.num_params()[kind] == \
            p.num_layers * 2 * (p.kv_channels - b.kv_channels)
    assert p.num_query_groups < p.num_attention_heads and p.topk > 2  # GQA, top-k > 2 kept


def test_head_dim_32_presets_export_a_config_vllm_reads_back():
    """The Hugging Face config.json the vllm backend writes for them round-trips to the preset
    (head_dim given explicitly, not hidden / heads)."""
    from moe.hf.config import hf_config_dict, preset_from_hf_config

    for name in ("qwen3-moe-tiny-hd32", "qwen3-moe-tiny-hd32-wide"):
        p = get_preset(name)
        cfg = hf_config_dict(p, p.vocab_size)
        assert cfg["head_dim"] == 32 and cfg["num_key_value_heads"] == 1
        back = preset_from_hf_config(cfg)
        assert dataclasses.replace(back, name=name, max_seq_len=p.max_seq_len) == p
