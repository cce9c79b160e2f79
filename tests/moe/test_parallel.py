"""TP=2, EP=2, TP2xEP2 (sequence parallel) and DP=2 on 2 gloo processes equal the 1-process model.

Also the Routing Replay cache under each layout: a forced routing sliced to this rank's rows and
sequence shard reproduces the 1-process forced-routing logits, and the routing a rank records is
the 1-process routing of its tokens (PITFALLS #6, #11).

The sharded models load their weights sliced from the 1-process model (moe.sharding), so any
difference in logits, gathered gradients or grad norm is a parallelism bug.
"""

import pytest
import torch

from tests.moe import parallel_worker as pw

TIMEOUT_S = 600  # a hang fails the test (about 20 s when it passes)


@pytest.fixture(scope="module")
def reference(single_process, tmp_path_factory):
    from moe.model import ParallelLayout
    from moe.policy import MoEPolicy
    from moe.presets import get_preset
    from moe.sharding import gather_full_params

    preset = get_preset("tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, seed=3,
                             optim=None)
    ref = single_process_reference(policy)
    ref["trained"] = gather_full_params(pw.build_trained(preset, ref["params"], slice(None),
                                                         pw.STEPS).model.module)
    path = tmp_path_factory.mktemp("parallel") / "ref.pt"
    torch.save(ref, path)
    return str(path)


def single_process_reference(policy) -> dict:
    """What `pw.worker` compares each layout with: the 1-process logits, grads and grad norm of
    the fixed batch, the grads from position `pw.FIRST`, and the routing references."""
    from moe.sharding import gather_full_params

    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size)
    logits, grad_norm = pw.run_model(policy, tokens_BT, valid_BT, readout_BTV)
    assert grad_norm > 0
    ref = {"preset": policy.preset, "params": gather_full_params(policy.model.module),
           "grads": gather_full_params(policy.model.module, grads=True), "logits": logits,
           "grad_norm": grad_norm}
    pw.run_model(policy, tokens_BT, valid_BT, readout_BTV, first=pw.FIRST)
    ref["grads_from_first"] = gather_full_params(policy.model.module, grads=True)
    T = tokens_BT.shape[1] - 1  # an odd length: padded under SP
    pw.run_model(policy, tokens_BT[:, :T], valid_BT[:, :T], readout_BTV[:, :T], first=pw.FIRST)
    ref["grads_odd"] = gather_full_params(policy.model.module, grads=True)
    ref.update(replay_reference(policy, policy.preset, tokens_BT, valid_BT))
    return ref


def replay_reference(policy, preset, tokens_BT, valid_BT) -> dict:
    """1-process live routing, and logits under a forced routing distinct for every token."""
    from moe.replay import RoutingReplayCache, current_routing, replay_routing

    B, T = tokens_BT.shape
    L, K, E = preset.num_layers, preset.topk, preset.num_experts
    _, live = current_routing(policy, tokens_BT, valid_BT)
    g = torch.Generator().manual_seed(11)
    forced = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * L)])
    forced = forced.reshape(B, T, L, K)
    with torch.no_grad(), replay_routing(policy, RoutingReplayCache.from_dense(forced, valid_BT,
                                                                               E)):
        forced_logits = policy.logits(tokens_BT, valid_BT)
    return {"live_ids_BTLK": pw.dense_ids(live, B, T), "forced_ids_BTLK": forced,
            "forced_logits": forced_logits}


LAYOUTS = [
    # (tp, ep, sequence_parallel, dispatcher)
    (2, 1, True, "alltoall"),
    (1, 2, False, "alltoall"),
    (1, 2, False, "allgather"),
    (2, 2, True, "alltoall"),
    (2, 2, True, "allgather"),
    (1, 1, False, "alltoall"),  # pure DP=2: per-rank seq-mean losses average to the global one
    (2, 1, True, "allgather"),  # the default dispatcher without EP ('auto'), TP=2 + SP
]


@pytest.mark.slow
def test_two_process_layouts_match_single_process(reference):
    pw.spawn(pw.worker, (2, pw.free_port(), reference, LAYOUTS), nprocs=2, timeout_s=TIMEOUT_S)


def test_worker_detects_a_wrong_weight(single_process, reference, tmp_path):
    """The comparison is not vacuous: a perturbed reference fails it (1 process, DP=1)."""
    ref = torch.load(reference, weights_only=False)
    name = next(n for n in ref["params"] if "linear_proj" in n)
    ref["params"][name] = ref["params"][name] + 0.05 * torch.randn_like(ref["params"][name])
    bad = tmp_path / "bad.pt"
    torch.save(ref, bad)
    with pytest.raises(Exception, match="differ|grad"):
        pw.spawn(pw.worker, (1, pw.free_port(), str(bad), [(1, 1, False, "alltoall")]), nprocs=1,
                 timeout_s=TIMEOUT_S)


@pytest.mark.slow
def test_tied_embeddings_under_tp_and_sp_match_single_process(single_process, tmp_path):
    """Tied input / output embeddings: under TP=2 + SP the sliced output layer's grads reach the
    shared (vocab-parallel) embedding weight as in 1 process."""
    import dataclasses

    from moe.model import ParallelLayout
    from moe.policy import MoEPolicy
    from moe.presets import get_preset

    preset = dataclasses.replace(get_preset("tiny"), name="tiny-tied", tie_word_embeddings=True)
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, seed=3,
                             optim=None)
    assert policy.model.module.share_embeddings_and_output_weights
    path = tmp_path / "ref.pt"
    torch.save(single_process_reference(policy), path)
    pw.spawn(pw.worker, (2, pw.free_port(), str(path), [(2, 1, True, "allgather")]), nprocs=2,
             timeout_s=TIMEOUT_S)
