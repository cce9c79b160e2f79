"""TP=2, EP=2, TP2xEP2 (sequence parallel) and DP=2 on 2 gloo processes equal the 1-process model.

Also the Routing Replay cache under each layout: a forced routing sliced to this rank's rows and
sequence shard reproduces the 1-process forced-routing logits, and the routing a rank records is
the 1-process routing of its tokens (docs/pitfalls.md#replay-layout and #replay-payload); and
the route sensitivity (a swap forced through that cache) and router margins over all ranks.

The sharded models load their weights sliced from the 1-process model (moe.model.sharding), so any
difference in logits, gathered gradients or grad norm is a parallelism bug.
"""

import pytest
import torch

from tests.moe import parallel_worker as pw

TIMEOUT_S = 600  # a hang fails the test (about 20 s when it passes)


@pytest.fixture(scope="module")
def reference(single_process, tmp_path_factory):
    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.model.settings import ParallelLayout
    from moe.model.sharding import gather_full_params

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
    from moe.model.sharding import gather_full_params

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
    ref["sensitivity"], ref["margins"] = pw.sensitivity_and_margins(policy, tokens_BT, valid_BT)
    assert min(ref["sensitivity"]) > 0
    return ref


def replay_reference(policy, preset, tokens_BT, valid_BT) -> dict:
    """1-process live routing, and logits under a forced routing distinct for every token."""
    from moe.routing.replay import current_routing, replay_routing
    from tests.moe.grads import dense_cache

    B, T = tokens_BT.shape
    L, K, E = preset.num_layers, preset.topk, preset.num_experts
    _, live = current_routing(policy, tokens_BT, valid_BT)
    g = torch.Generator().manual_seed(11)
    forced = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * L)])
    forced = forced.reshape(B, T, L, K)
    with torch.no_grad(), replay_routing(policy, dense_cache(forced, valid_BT, E)):
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

    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.model.settings import ParallelLayout

    preset = dataclasses.replace(get_preset("tiny"), name="tiny-tied", tie_word_embeddings=True)
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, seed=3,
                             optim=None)
    assert policy.model.module.share_embeddings_and_output_weights
    path = tmp_path / "ref.pt"
    torch.save(single_process_reference(policy), path)
    pw.spawn(pw.worker, (2, pw.free_port(), str(path), [(2, 1, True, "allgather")]), nprocs=2,
             timeout_s=TIMEOUT_S)


def test_bad_layouts_raise_and_leave_the_groups_alone(single_process):
    """`init_parallel` refuses a non-positive timeout, tp or ep < 1, and sizes that do not divide
    the world, naming the value, before touching megatron's groups; the same layout again is a
    no-op for the groups and reseeds torch."""
    from megatron.core import parallel_state as ps

    from moe.platform.parallel import init_parallel

    group = ps.get_data_parallel_group()
    for kwargs, msg in (({"timeout_min": 0}, "timeout_min=0"), ({"tp": 0}, "tp=0 and ep=1"),
                        ({"ep": 0}, "tp=1 and ep=0"), ({"tp": 2}, "divisible by tp=2"),
                        ({"ep": 2}, "divisible by ep=2")):
        with pytest.raises(ValueError, match=msg):
            init_parallel(**kwargs)
    assert ps.get_data_parallel_group() is group
    info = init_parallel(tp=1, ep=1, seed=5)
    assert ps.get_data_parallel_group() is group and (info.world_size, info.dp) == (1, 1)
    assert torch.equal(torch.randn(4), torch.randn(4, generator=torch.Generator().manual_seed(5)))
    init_parallel(tp=1, ep=1, seed=0)  # the session's seed for the tests after this one


def test_groups_get_the_collective_timeout(single_process):
    """The world, EP and DP groups wait `timeout_min` (10 minutes by default), not torch's or
    megatron's 30."""
    from tests.megatron_gspo.sync_worker import collective_timeouts_s

    assert collective_timeouts_s() == [600.0] * 3


@pytest.mark.parametrize("env", [{"RANK": "0", "WORLD_SIZE": "1"}, {"WORLD_SIZE": "1"}, {}])
def test_process_group_from_torchrun_env_else_one_local_process(monkeypatch, env):
    """torchrun's RANK and WORLD_SIZE (both) select the env:// rendezvous; otherwise a 1-process
    group on a local port. Either way with the collective timeout."""
    from datetime import timedelta

    from moe.platform import parallel

    calls = []
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda **kw: calls.append(kw))
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parallel._init_process_group(2.5)
    [kw] = calls
    assert kw.pop("timeout") == timedelta(minutes=2.5)
    assert kw.pop("backend") == ("nccl" if parallel.cuda_available() else "gloo")
    if len(env) == 2:
        assert kw == {}
    else:
        assert kw.pop("init_method").startswith("tcp://127.0.0.1:") and kw == dict(rank=0,
                                                                                  world_size=1)


def test_only_rank_0_is_main():
    from moe.platform.parallel import ParallelInfo

    infos = [ParallelInfo(rank=r, world_size=2, tp=1, ep=1, dp=2, tp_rank=0, ep_rank=0,
                          dp_rank=r, device=torch.device("cpu")) for r in (0, 1)]
    assert [i.is_main for i in infos] == [True, False]
