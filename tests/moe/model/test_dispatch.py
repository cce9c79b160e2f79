"""`moe.model.dispatch`: megatron's permutation without host syncs; the same rows, bitwise."""

import os

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import permute
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from moe.inference.decode import kv_decoder
from moe.model.dispatch import SyncFreeDispatcher, permute_by_expert
from moe.model.experts import grouped_mm_runs
from tests.moe import parallel_worker as pw
from tests.moe.model.test_experts import build, grads
from bench.profile_iteration import WouldSync

def moe_layers(policy) -> list:
    return [m for m in policy.model.module.modules() if hasattr(m, "token_dispatcher")]


def count_moe_syncs(policy, fn) -> list[str]:
    """The host-syncing calls (`bench.profile_iteration.WouldSync`) made inside the MoE layers'
    forwards while `fn()` runs."""
    counter = WouldSync()
    counter.active = False
    handles = []
    for layer in moe_layers(policy):
        handles.append(layer.register_forward_pre_hook(
            lambda *_: setattr(counter, "active", True)))
        handles.append(layer.register_forward_hook(lambda *_: setattr(counter, "active", False)))
    try:
        with counter:
            fn()
    finally:
        for h in handles:
            h.remove()
    return counter.records


def syncs_of_the_dispatch(policy, records: list) -> list:
    """The recorded syncs, less those of the per-expert loop where it is the experts' fallback
    (the grouped GEMM does not run on this device and dtype, e.g. fp32 on some CUDA builds): it
    reads the tokens per expert on the host whatever the dispatcher does."""
    if grouped_mm_runs(policy.device.type, next(policy.model.parameters()).dtype):
        return records
    loop = os.path.join("moe", "experts.py")
    return [r for r in records if not r.filename.endswith(loop)]


def routing(N: int, E: int, K: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ids_NK = torch.rand(N, E, generator=g).topk(K, dim=1).indices
    routing_map_NE = torch.zeros(N, E, dtype=torch.bool).scatter(1, ids_NK, True)
    probs_NE = torch.rand(N, E, generator=g).mul(routing_map_NE).to(dtype)
    return torch.randn(N, 8, generator=g).to(dtype), probs_NE, routing_map_NE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,E,K", [(37, 16, 4), (5, 128, 8), (64, 8, 1), (3, 4, 4)])
def test_permute_by_expert_equals_megatrons_permute(N, E, K, dtype):
    x_NH, probs_NE, routing_map_NE = routing(N, E, K, seed=N + E + K, dtype=dtype)
    want_x, want_probs, want_idx = permute(x_NH, routing_map_NE, probs=probs_NE,
                                           num_out_tokens=N * K)[:3]
    got_x, got_probs, got_idx = permute_by_expert(x_NH, probs_NE, routing_map_NE, K)
    assert torch.equal(got_idx, want_idx)
    assert torch.equal(got_x, want_x) and torch.equal(got_probs, want_probs)


@pytest.mark.parametrize("row_change", [-1, +1])
def test_a_token_without_exactly_k_experts_is_an_error(row_change):
    """The premise (exactly K experts per token, so M = N * K) is asserted on the device: a
    row with one expert fewer or more fails instead of returning shifted rows."""
    x_NH, probs_NE, routing_map_NE = routing(9, 8, 2, seed=3)
    row = routing_map_NE[4]
    if row_change < 0:
        row[row.nonzero()[0]] = False
    else:
        row[(~row).nonzero()[0]] = True
    with pytest.raises(RuntimeError, match="exactly topk=2"):
        permute_by_expert(x_NH, probs_NE, routing_map_NE, 2)


def test_model_dispatches_without_host_syncs_and_the_same_numbers(single_process):
    policy = build("qwen3-moe-tiny")
    layers = moe_layers(policy)
    assert layers and all(type(m.token_dispatcher) is SyncFreeDispatcher for m in layers)
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size, B=6, T=16)

    def run():
        policy.zero_grad()
        logits = policy.logits(tokens_BT, valid_BT)
        pw.loss_fn(logits, valid_BT, readout_BTV).backward()
        return logits.detach(), grads(policy)

    assert syncs_of_the_dispatch(
        policy, count_moe_syncs(policy, lambda: policy.logits(tokens_BT, valid_BT))) == []
    logits, got = run()
    for m in layers:
        m.token_dispatcher.__class__ = MoEAllGatherTokenDispatcher  # megatron's own
    megatron_syncs = count_moe_syncs(policy, lambda: policy.logits(tokens_BT, valid_BT))
    assert len(megatron_syncs) >= 3 * len(layers)  # .cpu() and two masked_select per layer
    ref_logits, ref = run()
    # bitwise on CPU; CUDA's scatter-add (megatron's unpermute) and index_select backward add
    # in a nondeterministic order: equal to its rounding there
    same = torch.equal if policy.device.type == "cpu" else \
        lambda a, b: torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    assert same(logits, ref_logits)
    for name, g in ref.items():
        assert same(got[name], g), name


def test_lean_decode_step_routes_without_host_syncs(single_process):
    policy = build("qwen3-moe-tiny")
    tokens_BT, valid_BT, _ = pw.batch(policy.preset.vocab_size, B=5, T=14)
    decoder = kv_decoder(policy, "lean", 5, 14)
    decoder.next_logits(tokens_BT[:, :6], valid_BT[:, :6])  # prefill

    counter = WouldSync()
    counter.active = False
    from moe.inference import decode

    lean_moe, entered = decode.lean_moe, []

    def counted(*args, **kwargs):
        counter.active = True
        entered.append(1)
        try:
            return lean_moe(*args, **kwargs)
        finally:
            counter.active = False
    decode.lean_moe = counted
    try:
        with counter:
            decoder.next_logits(tokens_BT[:, :7], valid_BT[:, :7])
    finally:
        decode.lean_moe = lean_moe
    assert len(entered) == policy.preset.num_layers  # every layer's MoE went through it
    assert syncs_of_the_dispatch(policy, counter.records) == [] and counter.active is False


def test_sync_free_dispatch_is_installed_once_where_it_computes_megatrons(single_process,
                                                                          monkeypatch):
    """Every MoE layer `moe.inference.decode.lean_moe_ok` accepts, whose experts run grouped and are all
    local, gets the dispatcher, once (installing again counts none); any other layer keeps
    megatron's."""
    import moe.model.dispatch
    from moe.model.dispatch import install_sync_free_dispatch

    policy = build("tiny")
    layers = moe_layers(policy)

    def reinstall() -> int:
        for m in layers:
            m.token_dispatcher.__class__ = MoEAllGatherTokenDispatcher
        count = install_sync_free_dispatch(policy.model)
        assert count == sum(type(m.token_dispatcher) is SyncFreeDispatcher for m in layers)
        return count

    assert install_sync_free_dispatch(policy.model) == 0  # build_gpt_moe installed them
    assert reinstall() == len(layers) == policy.preset.num_layers
    with monkeypatch.context() as patch:
        patch.setattr(layers[0].config, "moe_expert_capacity_factor", 1.0)  # every layer's
        assert reinstall() == 0
    with monkeypatch.context() as patch:
        patch.setattr(moe.model.dispatch, "StackedExperts", type("Other", (), {}))
        assert reinstall() == 0
    with monkeypatch.context() as patch:
        patch.setattr(layers[0].token_dispatcher, "local_expert_indices",
                      layers[0].token_dispatcher.local_expert_indices[1:])
        assert reinstall() == len(layers) - 1
