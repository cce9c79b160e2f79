"""Tiny MoE policy on CPU: presets, forward/backward/optimizer step, masking and padding."""

import dataclasses

import pytest
import torch

from moe.model.attention import attention_inputs
from moe.inference.decode import kv_decoder
from moe.model.gpt import ParallelLayout, transformer_config
from moe.model.policy import MoEPolicy, OptimSettings
from moe.model.presets import PRESETS, get_preset
from tests.moe.model.test_presets import QWEN2_STYLE


def test_qwen3_30b_a3b_preset_matches_the_released_architecture():
    p = get_preset("qwen3-30b-a3b")
    assert (p.num_layers, p.hidden_size, p.num_attention_heads, p.num_query_groups,
            p.kv_channels, p.num_experts, p.topk, p.moe_ffn_hidden_size, p.vocab_size) == \
        (48, 2048, 32, 4, 128, 128, 8, 768, 151936)
    assert p.rotary_base == 1e6 and p.qk_layernorm
    counts = p.num_params()
    # Qwen3-30B-A3B: ~30.5B total, ~3.3B activated parameters
    assert 30.0e9 < counts["total"] < 31.0e9, counts
    assert 3.0e9 < counts["active"] < 3.6e9, counts


@pytest.mark.parametrize("field,value", [("topk", 99), ("num_query_groups", 3),
                                         ("hidden_size", 0), ("num_experts", -1)])
def test_bad_preset_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(get_preset("tiny"), **{field: value})


def test_unknown_preset_lists_valid_names():
    with pytest.raises(KeyError, match="qwen3-moe-tiny"):
        get_preset("qwen3-tiny")


def test_parallel_split_checked():
    with pytest.raises(ValueError, match="ep=3"):
        get_preset("tiny").check_parallel(tp=1, ep=3)
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by ep=3"):
        transformer_config(get_preset("tiny"), ParallelLayout(ep=3))  # before megatron sees it
    with pytest.raises(ValueError, match="sequence_parallel"):
        ParallelLayout(tp=1, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=False: must be true with tp=2"):
        ParallelLayout(tp=2, sequence_parallel=False)


@pytest.mark.parametrize("name,changes", [("qwen3-moe-tiny", {}), ("tiny", QWEN2_STYLE)],
                         ids=["qwen3", "qwen2-style"])
def test_param_count_matches_built_model(single_process, name, changes):
    """`num_params` counts what megatron builds, Qwen2-MoE's QKV bias, gated shared expert and
    tied embeddings included."""
    preset = dataclasses.replace(get_preset(name), **changes)
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, optim=None)
    built = sum(p.numel() for p in policy.model.module.parameters())
    assert built == preset.num_params()["total"]


def test_attention_inputs_left_padding():
    valid_BT = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    pos_BT, mask_B1TT = attention_inputs(valid_BT)
    assert pos_BT.tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    # row 0, query 3 sees keys 2,3 only (True = hidden)
    assert mask_B1TT[0, 0, 3].tolist() == [True, True, False, False]
    assert mask_B1TT[1, 0, 1].tolist() == [False, False, True, True]
    assert mask_B1TT[0, 0, 1].tolist() == [True, False, True, True]  # padding query: itself


def test_attention_inputs_from_a_start_row_are_the_full_rows():
    valid_BT = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]],
                            dtype=torch.bool)
    pos_BT, mask_B1TT = attention_inputs(valid_BT)
    for start in range(6):
        pos_BS, mask_B1ST = attention_inputs(valid_BT, start=start)
        assert torch.equal(pos_BS, pos_BT[:, start:]) and torch.equal(
            mask_B1ST, mask_B1TT[:, :, start:]), start


def test_forward_backward_step_learns_and_masks_vocab(single_process):
    preset = get_preset("tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=40, seed=0,
                             optim=OptimSettings(lr=3e-3))
    g = torch.Generator().manual_seed(0)
    tokens_BT = torch.randint(0, 40, (6, 12), generator=g)
    valid_BT = torch.ones(6, 12, dtype=torch.bool)
    valid_BT[:2, :3] = False
    logits = policy.logits(tokens_BT, valid_BT)
    assert logits.shape == (6, 12, preset.vocab_size)
    assert torch.isinf(logits[..., 40:]).all() and torch.isfinite(logits[..., :40]).all()
    losses = []
    for _ in range(8):
        policy.zero_grad()
        logp_BT = policy.token_logprobs(tokens_BT, valid_BT)
        loss = -(logp_BT[:, 1:] * valid_BT[:, 1:]).sum() / valid_BT[:, 1:].sum()
        loss.backward()
        stepped, grad_norm = policy.step()
        assert stepped and grad_norm > 0
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses


def test_left_padding_does_not_change_real_token_logprobs(single_process):
    preset = get_preset("tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, optim=None)
    tokens = torch.randint(0, preset.vocab_size, (1, 7))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), tokens], dim=1)
    valid = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 7, dtype=torch.bool)],
                      dim=1)
    a = policy.token_logprobs(tokens, torch.ones_like(tokens, dtype=torch.bool))
    b = policy.token_logprobs(padded, valid)[:, 3:]
    torch.testing.assert_close(a[:, 1:], b[:, 1:], atol=1e-5, rtol=1e-5)


def test_nonfinite_grad_skips_the_step(single_process):
    preset = get_preset("tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size,
                             optim=OptimSettings(lr=1e-2))
    before = {n: p.detach().clone() for n, p in policy.model.module.named_parameters()}
    tokens = torch.randint(0, preset.vocab_size, (2, 6))
    policy.zero_grad()
    (policy.logits(tokens, torch.ones_like(tokens, dtype=torch.bool)).sum() * float("nan")) \
        .backward()
    stepped, grad_norm = policy.step()
    assert not stepped and grad_norm != grad_norm
    for n, p in policy.model.module.named_parameters():
        assert torch.equal(p, before[n]), n


def test_all_presets_build_configs():
    for name, preset in PRESETS.items():
        cfg = transformer_config(preset)
        assert cfg.num_moe_experts == preset.num_experts and cfg.moe_router_topk == preset.topk
        assert cfg.moe_enable_routing_replay and not cfg.moe_router_pre_softmax


def test_kv_cache_decoder_matches_full_forward(single_process):
    """Prefill + one-column decode steps == the full forward's last-position logits, with left
    padding, a row that stopped early (right padding), and the padded vocab masked."""
    preset = get_preset("qwen3-moe-tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=26, optim=None)
    policy.train(True)
    g = torch.Generator().manual_seed(0)
    B, P, N = 6, 7, 5
    tokens = torch.randint(0, 26, (B, P + N), generator=g)
    valid = torch.ones(B, P + N, dtype=torch.bool)
    valid[0, :3] = valid[1, :1] = False
    valid[2, P + 2:] = False
    decoder = kv_decoder(policy, "lean", B, P + N)
    full = policy.logits(tokens, valid)
    for t in range(P, P + N + 1):
        step = decoder.next_logits(tokens[:, :t], valid[:, :t])
        assert step.shape == (B, preset.vocab_size)
        live = valid[:, t - 1]
        torch.testing.assert_close(step[live], full[live, t - 1], atol=1e-5, rtol=1e-5)
        assert torch.isinf(step[:, 26:]).all()
    assert policy.model.training  # the decoder's eval mode does not leak
    with pytest.raises(ValueError, match="columns"):
        decoder.next_logits(tokens, valid)  # all columns already seen
    with pytest.raises(ValueError, match="max_seq_len"):
        kv_decoder(policy, "lean", B, preset.max_seq_len + 1)


def test_auto_dispatcher_resolves_by_ep():
    from moe.model.settings import resolve_dispatcher

    assert ParallelLayout().dispatcher == "allgather"
    assert ParallelLayout(ep=2).dispatcher == "alltoall"
    assert resolve_dispatcher("alltoall", 1) == "alltoall"
    assert resolve_dispatcher("allgather", 4) == "allgather"
    with pytest.raises(ValueError, match="dispatcher='a2a'"):
        ParallelLayout(dispatcher="a2a")


def test_allgather_equals_alltoall_bitwise_on_one_ep_rank(single_process):
    """Why 'auto' picks allgather at EP=1: the same logits and grads, bit for bit, without the
    all-to-all's identity sort copies (left padding and a readout mixing every position)."""
    from tests.moe import parallel_worker as pw
    from tests.moe.model.test_experts import build, grads

    out = {}
    for dispatcher in ("alltoall", "allgather"):
        policy = build("qwen3-moe-tiny", layout=ParallelLayout(dispatcher=dispatcher))
        assert policy.model.module.config.moe_token_dispatcher_type == dispatcher
        tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size, B=6, T=16)
        logits, _ = pw.run_model(policy, tokens_BT, valid_BT, readout_BTV)
        out[dispatcher] = logits, grads(policy)
    (a_logits, a_grads), (b_logits, b_grads) = out.values()
    assert torch.equal(a_logits, b_logits)
    assert all(torch.equal(a_grads[n], b_grads[n]) for n in a_grads)


def test_zero_grad_starts_each_backward_from_zero(single_process):
    """The same backward twice, each after `zero_grad`, gives the same reduced grads (nothing
    of the first is left in the buffers the second adds into)."""
    from tests.moe import parallel_worker as pw

    policy = MoEPolicy.build(get_preset("tiny"), ParallelLayout(), real_vocab=32, seed=3,
                             optim=None)
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size)
    _, first = pw.run_model(policy, tokens_BT, valid_BT, readout_BTV)
    _, second = pw.run_model(policy, tokens_BT, valid_BT, readout_BTV)
    assert first > 0 and second == pytest.approx(first, rel=1e-6)


def _output_rows_seen(policy) -> list[int]:
    """Sequence rows the output layer projects, per call (a forward hook on it)."""
    seen = []
    policy.model.module.output_layer.register_forward_hook(
        lambda m, args, out: seen.append(out[0].shape[0]))
    return seen


def test_logprobs_from_start_project_only_those_positions(single_process):
    """`token_logprobs(start=s)`: the float64 log-softmax over the tokenizer's vocabulary at
    columns >= s, 0 before; the output layer sees T - s + 1 rows; the entropy keeps no graph;
    grads flow to the same parameters as the full computation."""
    preset = get_preset("tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=40, seed=0, optim=None)
    g = torch.Generator().manual_seed(1)
    tokens_BT = torch.randint(0, 40, (5, 12), generator=g)
    valid_BT = torch.ones(5, 12, dtype=torch.bool)
    valid_BT[:2, :3] = False
    seen = _output_rows_seen(policy)
    full_BTV = policy.logits(tokens_BT, valid_BT).double()[:, :-1, :40] / 0.7
    want_BT = torch.log_softmax(full_BTV, -1).gather(-1, tokens_BT[:, 1:, None]).squeeze(-1)
    for start in (1, 4, 11):
        logp_BT, entropy_BT = policy.token_logprobs(tokens_BT, valid_BT, 0.7,
                                                    with_entropy=True, start=start)
        assert seen[-1] == 12 - start + 1
        assert (logp_BT[:, :start] == 0).all() and (entropy_BT[:, :start] == 0).all()
        torch.testing.assert_close(logp_BT[:, start:].double(), want_BT[:, start - 1:],
                                   atol=1e-5, rtol=1e-5)
        assert logp_BT.requires_grad and not entropy_BT.requires_grad
        p_BTV = torch.softmax(full_BTV[:, start - 1:], -1)
        torch.testing.assert_close(entropy_BT[:, start:].double(),
                                   -(p_BTV * p_BTV.log()).sum(-1), atol=1e-5, rtol=1e-5)
    for bad in (0, 12):
        with pytest.raises(ValueError, match=f"start={bad}"):
            policy.token_logprobs(tokens_BT, valid_BT, start=bad)


def test_trainer_logprobs_start_at_the_response(tmp_path):
    """pi_old's pass, every train step and the routing log-ratio's forward run the output layer
    from the last prompt column on; the flip forwards (routing only) on the last two. Padded
    (packed forwards project only their scored positions: tests/moe/model/test_packed.py)."""
    from megatron_gspo.config.schema import load_config
    from megatron_gspo.jobs.rl import Trainer

    trainer = Trainer.from_config(load_config(None, [
        "task.name=addition", "task.n_train=40", "task.n_eval=4", "rollout.prompts_per_batch=2",
        "rollout.group_size=2", "rollout.max_new_tokens=3", "train.num_minibatches=2",
        "train.steps=1", "train.eval_every=0", "train.save_every=0", "train.flip_every=1",
        "train.pack=false", "wandb.mode=disabled", f"run_dir={tmp_path}"]))
    seen = _output_rows_seen(trainer.policy)
    batch = trainer.rollout(0)
    trainer.rollout = lambda it: batch
    seen.clear()
    trainer.iteration()
    trainer.rt.close()
    T, start = batch.tokens_BT.shape[1], batch.response_start
    assert 1 < start < T and not batch.response_BT[:, :start].any()
    assert batch.response_BT[:, start].all()
    # pi_old, then per minibatch: train forward, flip forward (its first "before" is pi_old's);
    # from the second on, the routing log-ratio's forward under pi_old's routing before the flips'
    full = T - start + 1
    assert seen == [full, full, 2, full, full, 2], seen


def test_flops_per_token_match_torchs_flop_counter(single_process):
    """The analytic forward FLOPs per token (`MoEPreset.flops_per_token`, for MFU) equal what
    torch's FlopCounterMode counts for a full-sequence forward (megatron's SequentialMLP
    experts and DotProductAttention: every matmul is an op it counts) and its backward (2x)."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from torch.utils.flop_counter import FlopCounterMode

    preset = get_preset("qwen3-moe-tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, optim=None,
                             sdpa_attention=False, experts=SequentialMLP)  # megatron's loop
    B, T = 3, 20
    tokens_BT = torch.randint(0, preset.vocab_size, (B, T))
    valid_BT = torch.ones(B, T, dtype=torch.bool)
    counter = FlopCounterMode(display=False)
    with counter:
        logits = policy.logits(tokens_BT, valid_BT)
    forward = counter.get_total_flops()
    assert forward == pytest.approx(B * T * preset.flops_per_token(T), rel=1e-3), \
        (forward, B * T * preset.flops_per_token(T))
    with counter:
        logits.float().sum().backward()
    assert counter.get_total_flops() == pytest.approx(2 * forward, rel=0.02)
    assert B * T * preset.flops_per_token(T) > B * T * preset.flops_per_token(0)  # attention


def test_model_params_in_the_model_dtype_and_expert_weights_tagged(single_process):
    """bf16: every parameter bf16 (megatron's torch RMSNorm makes fp32 weights). The routed
    experts' weights, and only they, are tagged `is_moe_expert` with `allreduce=False` (their
    grads reduce over the expert-DP group, also at ep=1)."""
    from tests.moe.model.test_experts import build

    params = dict(build("tiny", dtype=torch.bfloat16).model.module.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    experts = {n for n in params if ".mlp.experts." in n}
    assert len(experts) == 2 * 2  # layers x (fc1, fc2), each stacked over the 8 experts
    assert {n for n, p in params.items() if p.is_moe_expert} == experts
    assert {n for n, p in params.items() if getattr(p, "allreduce", True) is False} == experts


def test_transformer_config_precision_and_aux_loss():
    """16-bit models say so to megatron and route in fp32; a positive aux-loss coefficient
    turns megatron's load-balancing loss on."""
    tiny = get_preset("tiny")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cfg = transformer_config(tiny, dtype=dtype)
        assert (cfg.params_dtype, cfg.bf16, cfg.fp16, cfg.moe_router_dtype) == \
            (dtype, dtype == torch.bfloat16, dtype == torch.float16, "fp32")
    cfg = transformer_config(tiny, aux_loss_coeff=1e-2)
    assert (cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff) == ("aux_loss", 1e-2)


def test_routing_replay_off_builds_no_router_replays(single_process):
    """`build_gpt_moe(routing_replay=False)`: megatron's routers get no `RouterReplay`; the
    default gives one per layer."""
    from moe.model.gpt import build_gpt_moe

    tiny = get_preset("tiny")
    assert len(build_gpt_moe(tiny).router_replays) == tiny.num_layers
    model = build_gpt_moe(tiny, routing_replay=False)
    assert model.router_replays == [] and not model.config.moe_enable_routing_replay


def test_seed_alone_fixes_the_initial_weights(single_process):
    """The same `seed` builds the same weights whatever the global RNG did in between; another
    seed builds another embedding."""
    from moe.model.gpt import build_gpt_moe

    def weights(seed: int) -> dict:
        return dict(build_gpt_moe(get_preset("tiny"), seed=seed).named_parameters())

    first = weights(3)
    torch.rand(100)
    again, other = weights(3), weights(4)
    assert all(torch.equal(p, again[n]) for n, p in first.items())
    name = "embedding.word_embeddings.weight"
    assert not torch.equal(first[name], other[name])


def test_top1_with_renormalised_gate_is_a_hard_gate(single_process):
    """topk 1 with norm_topk_prob (Qwen3's renormalisation over one expert): every gate weight
    is 1 and the loss sends the router no gradient, which megatron's own config check refuses;
    without the renormalisation the gate is the all-expert softmax and the router learns."""
    tokens_BT = torch.randint(0, 40, (4, 10), generator=torch.Generator().manual_seed(0))
    valid_BT = torch.ones(4, 10, dtype=torch.bool)
    for norm in (True, False):
        preset = dataclasses.replace(get_preset("tiny"), topk=1, norm_topk_prob=norm)
        assert transformer_config(preset).moe_router_pre_softmax is not norm
        policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=40, seed=0,
                                 optim=OptimSettings(lr=1e-3))
        router = policy.model.module.decoder.layers[0].mlp.router
        gates = []
        router.register_forward_hook(lambda m, i, out: gates.append(out[0].detach()))
        policy.zero_grad()
        policy.token_logprobs(tokens_BT, valid_BT).sum().backward()
        weights = torch.cat([g[g != 0] for g in gates])
        grad = router.weight.main_grad.abs().max()
        if norm:
            assert torch.equal(weights, torch.ones_like(weights)) and grad == 0
        else:
            assert weights.max() < 1 and grad > 0
