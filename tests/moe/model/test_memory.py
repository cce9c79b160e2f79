"""moe.model.memory: the analytic per-rank accounting (parameters by layout, training state, the
replay cache's itemsize, the log-prob's chunks); against measured peaks:
tests/megatron_gspo/jobs/test_plan_measured.py."""

import dataclasses

import pytest

from moe.model import memory
from moe.model.presets import get_preset
from tests.moe.model.test_presets import QWEN2_STYLE


@pytest.mark.parametrize("preset", [get_preset("qwen3-30b-a3b"),
                                    dataclasses.replace(get_preset("tiny"), **QWEN2_STYLE)],
                         ids=["qwen3", "qwen2-style"])
def test_a_ranks_parameters_add_up_to_the_model(preset):
    """At TP = EP = 1 a rank holds the whole model; TP x EP ranks hold the split parts once and
    the replicated ones (router, norms) on every rank."""
    whole = memory.params_per_rank(preset)
    assert whole.total == preset.num_params()["total"]
    tp, ep = 2, 4
    split = memory.params_per_rank(preset.with_vocab(preset.vocab_size, tp), tp, ep)
    assert split.expert * ep == whole.expert
    replicated = preset.num_layers * (preset.hidden_size * preset.num_experts
                                      + 2 * preset.hidden_size
                                      + (2 * preset.kv_channels if preset.qk_layernorm else 0)
                                      + (preset.hidden_size if preset.shared_expert_gate else 0)
                                      ) + preset.hidden_size
    padded = preset.with_vocab(preset.vocab_size, tp)
    emb = (1 if preset.tie_word_embeddings else 2) * preset.hidden_size \
        * (padded.vocab_size - preset.vocab_size)
    assert (split.dense - replicated) * tp == whole.dense - replicated + emb


def test_the_policy_built_holds_the_counted_parameters(single_process):
    """The tiny policy megatron builds has exactly `params_per_rank`'s parameters."""
    from moe.model.policy import MoEPolicy
    from moe.model.settings import ParallelLayout

    preset = get_preset("qwen3-moe-tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, optim=None)
    built = sum(p.numel() for p in policy.model.parameters())
    assert built == memory.params_per_rank(preset).total


def test_training_state_by_part_and_the_distributed_optimizer():
    """bf16: weight 2 + grad 4 + master 4 + Adam 8; the distributed optimizer shards masters
    and Adam over the dense parameters' DP and the experts' expert-DP ranks."""
    params = memory.RankParams(dense=1000, expert=3000)
    state = memory.state_bytes(params, "bf16 + fp32 masters", dp=8, edp=2, distributed=False)
    assert state == {"weights": 8000, "grads": 16000, "masters": 16000, "optimizer": 32000}
    shard = memory.state_bytes(params, "bf16 + fp32 masters", dp=8, edp=2, distributed=True)
    assert shard["masters"] == 4 * (1000 / 8 + 3000 / 2)
    assert shard["optimizer"] == 8 * (1000 / 8 + 3000 / 2)
    assert sum(memory.state_bytes(memory.RankParams(10, 0), "fp32", 4, 1, True).values()) \
        == 10 * memory.bytes_per_param("fp32", 4, distributed=True)


def test_the_cache_itemsize_is_the_replay_caches_dtype():
    """The formula's itemsize is `moe.routing.replay.ids_dtype`'s (uint8 up to 256 experts)."""
    from moe.routing.replay import ids_dtype

    for experts in (16, 256, 257, 1024):
        assert memory.ids_itemsize(experts) == ids_dtype(experts).itemsize
    assert memory.replay_cache_bytes(10, 4, 2, 16) == 80


def test_logits_count_the_chunks_moe_logprobs_takes():
    """16-bit logits: themselves and their gradient, plus three float32 chunks of as many rows
    as fit 2**24 elements (one row at least); fp32: three float32 copies."""
    from moe.model import logprobs

    assert memory.CHUNK_ELEMENTS == logprobs.CHUNK_ELEMENTS
    rows, positions, vocab = 8, 1023, 151936  # one row per chunk
    assert memory.logits_bytes(rows, positions, vocab, 2) == \
        2 * 2 * rows * positions * vocab + 3 * 4 * positions * vocab
    assert memory.logits_bytes(32, 63, 64, 2) == 2 * 2 * 32 * 63 * 64 + 3 * 4 * 32 * 63 * 64
    assert memory.logits_bytes(32, 63, 64, 4) == 3 * 4 * 32 * 63 * 64


def test_recompute_keeps_less_and_rebuilds_one_layer():
    """Full keeps each layer's input and rebuilds a whole layer; selective `moe` keeps the
    attention part and the MoE layer's input; off keeps everything."""
    p, a = get_preset("qwen3-30b-a3b"), 2
    attention, moe = memory.layer_bytes_per_token(p, a)
    assert memory.saved_and_rebuilt(p, a, "off") == (attention + moe, 0.0, attention + moe)
    assert memory.saved_and_rebuilt(p, a, "full") == (a * p.hidden_size, attention + moe,
                                                      attention + moe)
    kept, rebuilt, _ = memory.saved_and_rebuilt(p, a, "selective", ("moe",))
    assert kept == attention + 2 * a * p.hidden_size and kept + rebuilt == attention + moe
    off, full = (memory.train_step_memory(p, 4, 2048, 2047, a, recompute=r)
                 for r in ("off", "full"))
    assert full.layers < off.layers / 30 and full.layer_backward > off.layer_backward
