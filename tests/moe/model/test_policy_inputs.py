"""`moe.model.policy.MoEPolicy`: input checks, build arguments, and the sequence-parallel bookkeeping
(padding, output-layer slicing, flags, routed columns) on one process.

The sequence-parallel test gives a 1-process policy a stand-in layout claiming TP=4 with SP: the
policy then pads, slices and sets flags as under SP, while the 1-rank TP group's gather is an
identity, so the logits must equal the plain ones (the multi-process equality is
tests/moe/platform/test_parallel.py)."""

import types

import pytest
import torch

from moe.model.attention import attention_inputs
from moe.inference.decode import kv_decoder
from moe.model.policy import MoEPolicy
from moe.model.presets import get_preset
from moe.model.settings import ParallelLayout
from tests.moe import parallel_worker as pw
from tests.moe.model.test_experts import build
from tests.moe.model.test_model import _output_rows_seen


def test_build_rejects_a_tokenizer_vocab_beyond_the_preset(single_process):
    preset = get_preset("tiny")
    with pytest.raises(ValueError, match="exceeds preset"):
        MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size + 1, optim=None)


def test_build_uses_its_seed_and_aux_loss_coeff(single_process):
    """The same seed builds the same weights, another seed others; the load-balancing loss
    coefficient reaches the model's config."""
    def weights(seed: int) -> list:
        return [p.detach().clone() for p in build("tiny", seed=seed).model.module.parameters()]

    a, b, c = weights(3), weights(3), weights(4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, z) for x, z in zip(a, c))
    config = build("tiny", aux_loss_coeff=0.01).model.module.config
    assert config.moe_aux_loss_coeff == 0.01 and config.moe_router_load_balancing_type == "aux_loss"


def test_logits_check_shapes_length_and_first(single_process):
    """Mismatched or non-2-D tokens / valid, a `first` outside [0, T) and a sequence beyond the
    preset's max_seq_len raise; exactly max_seq_len columns run."""
    policy = build("tiny")
    tokens_BT = torch.zeros(2, 5, dtype=torch.long)
    valid_BT = torch.ones(2, 5, dtype=torch.bool)
    for tokens, valid in ((tokens_BT, valid_BT[:, :4]), (tokens_BT[0], valid_BT[0])):
        with pytest.raises(ValueError, match="must be equal"):
            policy.logits(tokens, valid)
    for bad in (-1, 5):
        with pytest.raises(ValueError, match=f"first={bad}"):
            policy.logits(tokens_BT, valid_BT, first=bad)
    T = policy.preset.max_seq_len
    tokens_BT, valid_BT = torch.zeros(1, T + 1, dtype=torch.long), torch.ones(1, T + 1).bool()
    assert policy.logits(tokens_BT[:, :T], valid_BT[:, :T]).shape[1] == T
    with pytest.raises(ValueError, match="max_seq_len"):
        policy.logits(tokens_BT, valid_BT)


def test_integer_valid_masks_are_read_as_booleans(single_process):
    """`attention_inputs` and `routed_valid` take a 0/1 integer `valid` as its boolean."""
    valid_BT = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    for start in (0, 2):
        pos_BS, mask_B1ST = attention_inputs(valid_BT, start)
        want_pos_BS, want_mask_B1ST = attention_inputs(valid_BT.bool(), start)
        assert mask_B1ST.dtype == torch.bool and torch.equal(mask_B1ST, want_mask_B1ST)
        assert torch.equal(pos_BS, want_pos_BS)
    routed_BT = build("tiny").routed_valid(valid_BT)
    assert routed_BT.dtype == torch.bool and torch.equal(routed_BT, valid_BT.bool())


def test_sequence_parallel_bookkeeping_on_one_process(single_process):
    """Under SP (stand-in layout, TP=4): T=13 is padded on the right to 16, the output layer
    projects rows first..15 and the logits keep columns first..12 only, equal to the plain
    forward's; the output layer's flags are restored; no KV decoder; the routers' columns are
    TP rank 0's quarter of the padded sequence."""
    policy = build("tiny")
    tokens_BT, valid_BT, _ = pw.batch(policy.preset.vocab_size, B=3, T=13)
    want_BTV = policy.logits(tokens_BT, valid_BT)
    layer = policy.model.module.output_layer
    flags = {k: getattr(layer, k)
             for k in ("sequence_parallel", "allreduce_dgrad", "disable_grad_reduce")}
    policy.layout = types.SimpleNamespace(tp=4, sequence_parallel=True)
    seen = _output_rows_seen(policy)
    for first in (0, 2):
        got_BSV = policy.logits(tokens_BT, valid_BT, first=first)
        assert seen[-1] == 16 - first
        torch.testing.assert_close(got_BSV, want_BTV[:, first:], atol=1e-5, rtol=1e-5)
    assert {k: getattr(layer, k) for k in flags} == flags
    assert kv_decoder(policy, "lean", 3, 13) is None
    assert torch.equal(policy.routed_valid(valid_BT), valid_BT[:, :4])


def test_output_layer_called_with_a_keyword_input_is_sliced_too(single_process):
    """`_output_rows` slices the output layer's input however it is passed (positionally, as
    megatron's GPTModel does, or as `input_=`)."""
    policy = build("tiny")
    layer = policy.model.module.output_layer
    x_TBH = torch.randn(7, 2, policy.preset.hidden_size)
    with torch.no_grad(), policy._output_rows(slice(3, None)):
        by_keyword, _ = layer(input_=x_TBH)
        by_position, _ = layer(x_TBH)
    assert by_keyword.shape[0] == 4 and torch.equal(by_keyword, by_position)

