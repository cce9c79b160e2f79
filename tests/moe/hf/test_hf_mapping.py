"""moe.hf.mapping without a model: local-spec -> TE-spec names, dtype of fused tensors, the
error for a parameter mbridge cannot name."""

import pytest
import torch

from moe.hf.mapping import local_to_te


def test_local_to_te_hand_written_names():
    """Attention norms fuse into linear_qkv; a dense layer's pre-MLP norm fuses into linear_fc1,
    a MoE layer's (one with a router) stays; stacked experts keep their name (TE's name of
    expert e is it followed by e). Layer 11 is dense though layer 1 is MoE."""
    names = ["decoder.layers.0.input_layernorm.weight",
             "decoder.layers.0.pre_mlp_layernorm.weight",
             "decoder.layers.0.mlp.linear_fc1.weight",
             "decoder.layers.1.pre_mlp_layernorm.weight",
             "decoder.layers.1.mlp.router.weight",
             "decoder.layers.1.mlp.experts.linear_fc2.weight",
             "decoder.layers.11.pre_mlp_layernorm.weight",
             "decoder.final_layernorm.weight"]
    assert local_to_te(iter(names)) == {
        names[0]: "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        names[1]: "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
        names[2]: "decoder.layers.0.mlp.linear_fc1.weight",
        names[3]: "decoder.layers.1.pre_mlp_layernorm.weight",
        names[4]: "decoder.layers.1.mlp.router.weight",
        names[5]: "decoder.layers.1.mlp.experts.linear_fc2.weight",
        names[6]: "decoder.layers.11.mlp.linear_fc1.layer_norm_weight",
        names[7]: "decoder.final_layernorm.weight"}


@pytest.fixture(scope="module")
def bf16_mapping():
    pytest.importorskip("mbridge")
    from moe.hf.mapping import HFMapping
    from tests.hf_fixtures import QWEN3

    return HFMapping({**QWEN3, "model_type": "qwen3_moe", "vocab_size": 300}, torch.bfloat16)


def test_fused_expert_fc1_is_gate_then_up_in_the_mappings_dtype(bf16_mapping):
    """[gate; up] rows, cast to the mapping's dtype; to_hf splits it back by name."""
    name = "decoder.layers.1.mlp.experts.linear_fc1.weight2"
    assert bf16_mapping.hf_names(name) == ["model.layers.1.mlp.experts.2.gate_proj.weight",
                                           "model.layers.1.mlp.experts.2.up_proj.weight"]
    gate, up = torch.randn(32, 64), torch.randn(32, 64)
    fused = bf16_mapping.to_mcore(name, [gate, up])
    assert fused.dtype == torch.bfloat16 and torch.equal(fused, torch.cat([gate, up]).bfloat16())
    back = dict(bf16_mapping.to_hf(name, fused))
    assert torch.equal(back["model.layers.1.mlp.experts.2.up_proj.weight"], up.bfloat16())


def test_a_stacked_expert_weight_is_each_experts_tensors(bf16_mapping):
    """A stacked fc1 [E, 2F, H]: the Hugging Face names of the experts asked for, and to_hf
    gives every expert's gate and up in expert order."""
    name = "decoder.layers.1.mlp.experts.linear_fc1.weight"
    assert bf16_mapping.hf_names(name, range(2, 4)) == [
        f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in (2, 3) for p in ("gate", "up")]
    stacked = torch.randn(3, 8, 4).bfloat16()
    parts = bf16_mapping.to_hf(name, stacked)
    assert [n for n, _ in parts] == [f"model.layers.1.mlp.experts.{e}.{p}_proj.weight"
                                     for e in range(3) for p in ("gate", "up")]
    assert torch.equal(parts[3][1], stacked[1, 4:]) and torch.equal(parts[4][1], stacked[2, :4])


def test_unknown_parameter_is_a_key_error_naming_it(bf16_mapping):
    with pytest.raises(KeyError, match="has no Hugging Face name for megatron parameter "
                                       "'decoder.layers.0.mlp.bogus.weight'"):
        bf16_mapping.hf_names("decoder.layers.0.mlp.bogus.weight")
