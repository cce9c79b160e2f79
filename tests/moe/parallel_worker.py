"""Worker for the 2-process gloo equivalence tests (run through torch.multiprocessing.spawn).

Each layout is checked against a reference computed by the 1-process model with the same
weights: logits, gradients (gathered back to full tensors) and the global grad norm, both
`moe.grads`'s and the one megatron's optimizer clips with; padded and packed (`check_packed`).
"""

import os
import time
import warnings

import torch
import torch.multiprocessing as mp

from tests.moe.grads import dense_cache, reduce_grads
from moe.platform.parallel import free_port  # noqa: F401 (the tests' rendezvous port)

warnings.filterwarnings("ignore")

ATOL = RTOL = 1e-5


def spawn(fn, args: tuple, nprocs: int, timeout_s: float) -> None:
    """`mp.spawn(fn, args, nprocs)` under a hard deadline: a hang (ranks whose collectives got
    out of step, docs/pitfalls.md#collectives) kills the workers and fails the test instead of
    blocking CI.
    A worker's exception is re-raised as by `mp.spawn`."""
    ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join()
            raise TimeoutError(f"{nprocs} workers of {fn.__module__}.{fn.__name__} still "
                               f"running after {timeout_s:.0f} s (a collective hang?)")


FIRST = 5  # the first position the output layer projects in the sliced-output checks


def batch(vocab: int, B: int = 4, T: int = 12, seed: int = 7):
    """Fixed batch with ragged left padding and a fixed readout for a scalar loss."""
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(0, vocab, (B, T), generator=g)
    valid_BT = torch.ones(B, T, dtype=torch.bool)
    for b in range(B):
        valid_BT[b, : b % 3] = False
    readout_BTV = torch.randn(B, T, vocab, generator=g)
    return tokens_BT, valid_BT, readout_BTV


def loss_fn(logits_BTV, valid_BT, readout_BTV):
    """Mean over sequences of a per-sequence sum: DP-averaged grads equal the global ones.
    The batch's CPU tensors move to the logits' device (CUDA in `pytest -m gpu`)."""
    readout_BTV, valid_BT = readout_BTV.to(logits_BTV.device), valid_BT.to(logits_BTV.device)
    per_seq_B = (logits_BTV * readout_BTV * valid_BT[..., None]).sum(dim=(1, 2)) / 100
    return per_seq_B.mean()


def run_model(policy, tokens_BT, valid_BT, readout_BTV, first: int = 0):
    """Logits (from position `first`) and the grad norm of `loss_fn` on them."""
    policy.zero_grad()
    logits_BTV = policy.logits(tokens_BT, valid_BT, first=first)
    loss_fn(logits_BTV, valid_BT[:, first:], readout_BTV[:, first:]).backward()
    grad_norm = reduce_grads(policy)
    return logits_BTV.detach(), grad_norm


def local_columns(policy, info, T: int) -> slice:
    """The sequence positions this rank's routers see (its SP shard)."""
    if not policy.layout.sequence_parallel:
        return slice(None)
    chunk = T // info.tp
    return slice(info.tp_rank * chunk, (info.tp_rank + 1) * chunk)


def dense_ids(cache, B: int, T: int):
    """Batch-first [B, T, L, K] ids from a cache (zeros at padding)."""
    out = torch.zeros(B, T, cache.num_layers, cache.topk, dtype=torch.long)
    out[cache.valid_BT] = cache.ids_NLK.long()
    return out


def check_replay(policy, info, ref, rows, tokens_BT, valid_BT, what) -> None:
    """Under this layout, forced routing gives the 1-process forced-routing logits, and the
    routing recorded on this rank is the 1-process routing of the same tokens."""
    from moe.routing.replay import RoutingReplayCache, current_routing, replay_routing

    E = policy.preset.num_experts
    cols = local_columns(policy, info, tokens_BT.shape[1])
    forced = ref["forced_ids_BTLK"][rows][:, cols]
    local = dense_cache(forced, valid_BT[:, cols], E)
    with torch.no_grad(), replay_routing(policy, local):
        logits = policy.logits(tokens_BT, valid_BT)
    torch.testing.assert_close(logits[valid_BT], ref["forced_logits"][rows][valid_BT], atol=ATOL,
                               rtol=RTOL, msg=lambda m: f"{what}: replayed logits differ: {m}")
    _, recorded = current_routing(policy, tokens_BT, valid_BT)
    want = ref["live_ids_BTLK"][rows][:, cols][valid_BT[:, cols]]
    got = recorded.ids_NLK.long()
    assert torch.equal(got.sort(-1).values, want.sort(-1).values), f"{what}: recorded routing"


def response_mask(valid_BT):
    """The batch's last 5 columns as the response (the loss positions start at column 6)."""
    response_BT = torch.zeros_like(valid_BT)
    response_BT[:, -5:] = True
    return response_BT


def sensitivity_and_margins(policy, tokens_BT, valid_BT) -> tuple[list[float], dict]:
    """Route sensitivity (every loss position swapped: no draw depends on the rank's shard) and
    the router margins of the live routing, over every rank (collectives)."""
    from megatron_gspo.algo.margins import margin_metrics
    from megatron_gspo.algo.sensitivity import margin_rows, route_sensitivity
    from moe.routing.scores import RouterScores, record_router_scores

    response_BT = response_mask(valid_BT)
    sens = route_sensitivity(policy, tokens_BT, valid_BT, response_BT, 1.0, torch.Generator())
    with torch.no_grad(), record_router_scores(policy) as recorded:
        policy.logits(tokens_BT, valid_BT)
    scores = RouterScores.from_recorded(recorded, policy.routed_valid(valid_BT),
                                        policy.preset.num_experts)
    return sens, margin_metrics(scores, margin_rows(policy, scores, response_BT), 0.05)


def check_sensitivity(policy, ref, rows, tokens_BT, valid_BT, what) -> None:
    """Under this layout (EP included: the swap goes through the replay cache) the route
    sensitivity and the router margins over all ranks are the 1-process ones."""
    sens, margins = sensitivity_and_margins(policy, tokens_BT, valid_BT)
    torch.testing.assert_close(torch.tensor(sens), torch.tensor(ref["sensitivity"]), atol=1e-6,
                               rtol=1e-3, msg=lambda m: f"{what}: route sensitivity: {m}")
    for key, want in ref["margins"].items():
        assert abs(margins[key] - want) <= 1e-6, f"{what}: {key} {margins[key]} != {want}"


def check_kv_decode(policy, ref, rows, tokens_BT, valid_BT, what) -> None:
    """Both KV-cache decoders (lean and megatron's; prefill 8 columns, then one at a time) give
    the 1-process full-forward logits at each step and record the 1-process routing (none
    under SP)."""
    for kind in ("lean", "megatron"):
        _check_kv_decoder(policy, kind, ref, rows, tokens_BT, valid_BT,
                          f"{what}, {kind} decoder")


def _check_kv_decoder(policy, kind, ref, rows, tokens_BT, valid_BT, what) -> None:
    from moe.inference.decode import kv_decoder

    B, T = tokens_BT.shape
    decoder = kv_decoder(policy, kind, B, T, record_routing=True)
    if decoder is None:
        assert policy.layout.sequence_parallel, what
        return
    for t in range(8, T + 1):
        step = decoder.next_logits(tokens_BT[:, :t], valid_BT[:, :t])
        live = valid_BT[:, t - 1]
        torch.testing.assert_close(step[live], ref["logits"][rows][:, t - 1][live], atol=ATOL,
                                   rtol=RTOL, msg=lambda m: f"{what}: KV logits at {t}: {m}")
    got = decoder.routing(valid_BT).ids_NLK.long()
    want = ref["live_ids_BTLK"][rows][valid_BT]
    assert torch.equal(got.sort(-1).values, want.sort(-1).values), f"{what}: KV routing"


def check_sliced_output(policy, ref, rows, tokens_BT, valid_BT, readout_BTV, what) -> None:
    """The output layer projects positions FIRST.. only (under SP: gathered, then sliced), with
    the 1-process logits and grads; also at T - 1 columns, which SP pads to a multiple of TP."""
    from moe.model.sharding import gather_full_params

    for T, key in ((tokens_BT.shape[1], "from_first"), (tokens_BT.shape[1] - 1, "odd")):
        seen = []
        hook = policy.model.module.output_layer.register_forward_hook(
            lambda m, args, out: seen.append(out[0].shape[0]))
        part, _ = run_model(policy, tokens_BT[:, :T], valid_BT[:, :T], readout_BTV[:, :T],
                            first=FIRST)
        hook.remove()
        at = f"{what}, T={T}"
        assert seen == [T + (-T) % (policy.layout.tp if policy.layout.sequence_parallel else 1)
                        - FIRST], f"{at}: output layer rows {seen}"
        torch.testing.assert_close(part, ref["logits"][rows][:, FIRST:T], atol=ATOL, rtol=RTOL,
                                   msg=lambda m: f"{at}: logits from {FIRST}: {m}")
        for name, g in gather_full_params(policy.model.module, grads=True).items():
            torch.testing.assert_close(g, ref[f"grads_{key}"][name], atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{at}: grad {name} from {FIRST}: {m}")


def worker(rank: int, world: int, port: int, ref_path: str, layouts: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from moe.platform.parallel import destroy_parallel, init_parallel
    from moe.model.policy import MoEPolicy
    from moe.model.settings import OptimSettings, ParallelLayout
    from moe.model.sharding import gather_full_params, load_full_params
    from tests.moe.packed_checks import check_packed  # imports this module's helpers

    ref = torch.load(ref_path, weights_only=False)
    preset = ref["preset"]  # a MoEPreset (variants of the named ones included)
    tokens_BT, valid_BT, readout_BTV = batch(preset.vocab_size)
    try:
        for tp, ep, sp, dispatcher in layouts:
            info = init_parallel(tp=tp, ep=ep, seed=0)
            layout = ParallelLayout(tp=tp, ep=ep, sequence_parallel=sp, dispatcher=dispatcher)
            policy = MoEPolicy.build(preset, layout, real_vocab=preset.vocab_size,
                                     optim=OptimSettings())
            load_full_params(policy.model.module, ref["params"])
            rows = slice(None)
            if info.dp > 1:  # each DP rank takes its contiguous share of the batch
                per = tokens_BT.shape[0] // info.dp
                rows = slice(info.dp_rank * per, (info.dp_rank + 1) * per)
            logits, grad_norm = run_model(policy, tokens_BT[rows], valid_BT[rows],
                                          readout_BTV[rows])
            what = f"layout tp={tp} ep={ep} sp={sp} {dispatcher} rank={rank}"
            torch.testing.assert_close(logits, ref["logits"][rows], atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{what}: logits differ: {m}")
            grads = gather_full_params(policy.model.module, grads=True)
            assert grads.keys() == ref["grads"].keys(), what
            for name, g in grads.items():
                torch.testing.assert_close(g, ref["grads"][name], atol=ATOL, rtol=RTOL,
                                           msg=lambda m: f"{what}: grad {name}: {m}")
            assert abs(grad_norm - ref["grad_norm"]) <= 1e-5 * max(1.0, ref["grad_norm"]), \
                f"{what}: grad norm {grad_norm} != {ref['grad_norm']}"
            policy.optimizer.optimizer.prepare_grads()
            clip_norm = policy.optimizer.optimizer.get_grad_norm()  # what megatron clips with
            assert abs(clip_norm - ref["grad_norm"]) <= 1e-5 * max(1.0, ref["grad_norm"]), \
                f"{what}: optimizer grad norm {clip_norm} != {ref['grad_norm']}"
            check_replay(policy, info, ref, rows, tokens_BT[rows], valid_BT[rows], what)
            check_kv_decode(policy, ref, rows, tokens_BT[rows], valid_BT[rows], what)
            check_sensitivity(policy, ref, rows, tokens_BT[rows], valid_BT[rows], what)
            check_sliced_output(policy, ref, rows, tokens_BT[rows], valid_BT[rows],
                                readout_BTV[rows], what)
            check_packed(policy, ref, rows, tokens_BT[rows], valid_BT[rows], readout_BTV[rows],
                         what)  # tests/moe/packed_checks.py
    finally:
        destroy_parallel()


# ------------------------------------------------------------------ optimizer (DP=2)
LR, CLIP, STEPS = 1e-3, 0.5, 3
DP_ATOL = 2e-6  # fp32, 3 Adam steps at lr 1e-3: DP grads differ from 1-process by summation order


def train_steps(policy, rows, steps: int, start: int = 0) -> None:
    """`steps` clipped Adam updates on this rank's rows of the fixed batch."""
    tokens_BT, valid_BT, readout_BTV = batch(policy.preset.vocab_size)
    for _ in range(start, steps):
        policy.zero_grad()
        loss_fn(policy.logits(tokens_BT[rows], valid_BT[rows]), valid_BT[rows],
                readout_BTV[rows]).backward()
        assert policy.step()[0]


def build_trained(preset, params, rows, steps, dtype=torch.float32, distributed=False):
    from moe.model.policy import MoEPolicy
    from moe.model.settings import OptimSettings, ParallelLayout
    from moe.model.sharding import load_full_params

    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, dtype=dtype,
                             optim=OptimSettings(lr=LR, grad_clip=CLIP, distributed=distributed))
    load_full_params(policy.model.module, params)
    policy.weights_changed()
    train_steps(policy, rows, steps)
    return policy


def optimizer_checks(rank: int, preset, ref: dict, ckpt_dir: str) -> dict:
    """DP=2: megatron's distributed optimizer (masters and moments sharded over the 2 ranks)
    after 3 updates, its resume from the ranks' dist checkpoint, and bf16 sharded vs not."""
    from moe.model import dist_ckpt
    from moe.platform.parallel import init_parallel
    from moe.model.sharding import gather_full_params

    info = init_parallel(tp=1, ep=1, seed=0)
    assert info.dp == 2
    rows = slice(rank * 2, rank * 2 + 2)
    sharded = build_trained(preset, ref["params"], rows, STEPS, distributed=True)
    out = {"dp2_params3": gather_full_params(sharded.model.module),
           "dp2_total_numel": sum(p.numel() for p in sharded.model.module.parameters()),
           "dp2_local_master_numel": sum(p.numel() for p in sharded.optimizer.master_params())}
    # Resume: each rank's shards after 2 updates (moe.model.dist_ckpt, megatron's dp_reshardable
    # optimizer format), loaded into a fresh policy whose Adam state does not exist yet.
    half = build_trained(preset, ref["params"], rows, 2, distributed=True)
    dist_ckpt.save(half, ckpt_dir)
    resumed = build_trained(preset, ref["params"], rows, 0, distributed=True)
    dist_ckpt.load(resumed, ckpt_dir)
    train_steps(resumed, rows, STEPS, start=2)
    out["dp2_resumed_params3"] = gather_full_params(resumed.model.module)
    # bf16: sharded fp32 masters vs unsharded fp32 masters, same DP grads.
    out["dp2_bf16"] = [gather_full_params(build_trained(preset, ref["params"], rows, STEPS,
                                                        torch.bfloat16, d).model.module)
                       for d in (True, False)]
    return out


def training_worker(rank: int, world: int, port: int, ref_path: str, tmp_dir: str,
                    out_path: str) -> None:
    """One spawn for the 2-process training-state tests: `optimizer_checks`, then
    `checkpoint_checks`; rank 0 saves what the tests compare."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from moe.platform.parallel import destroy_parallel

    ref = torch.load(ref_path, weights_only=False)
    preset = ref["preset"]
    try:
        out = optimizer_checks(rank, preset, ref, os.path.join(tmp_dir, "dp2"))
        out.update(checkpoint_checks(rank, preset, ref, os.path.join(tmp_dir, "tp2_step_2")))
        if rank == 0:
            torch.save(out, out_path)
    finally:
        destroy_parallel()


# ------------------------------------------------------------------ dist checkpoints
def step_loss(policy, rows) -> float:
    """The fixed-batch loss over all DP ranks (per-sequence means: the 1-process loss)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tokens_BT, valid_BT, readout_BTV = batch(policy.preset.vocab_size)
    with torch.no_grad():
        loss = loss_fn(policy.logits(tokens_BT[rows], valid_BT[rows]), valid_BT[rows],
                       readout_BTV[rows])
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return float(loss) / ps.get_data_parallel_world_size()


def build_layout(preset, tp: int, ep: int):
    from moe.platform.parallel import init_parallel
    from moe.model.policy import MoEPolicy
    from moe.model.settings import OptimSettings, ParallelLayout

    info = init_parallel(tp=tp, ep=ep, seed=0)
    layout = ParallelLayout(tp=tp, ep=ep, sequence_parallel=tp > 1)
    policy = MoEPolicy.build(preset, layout, real_vocab=preset.vocab_size,
                             optim=OptimSettings(lr=LR, grad_clip=CLIP))
    per = 4 // info.dp  # the fixed batch has 4 sequences; each DP rank takes its share
    return policy, slice(info.dp_rank * per, (info.dp_rank + 1) * per)


def checkpoint_checks(rank: int, preset, ref: dict, ckpt_dir: str) -> dict:
    """TP=2: 2 updates, save (each rank its shards), then the uninterrupted 3rd step; EP=2
    (DP=2): resume from the TP=2 checkpoint, save it again (each EP rank its experts), and
    take the same 3rd step."""
    from moe.model import dist_ckpt
    from moe.model.sharding import gather_full_params, load_full_params

    policy, rows = build_layout(preset, tp=2, ep=1)
    load_full_params(policy.model.module, ref["params"])
    train_steps(policy, rows, 2)
    dist_ckpt.save(policy, ckpt_dir)
    out = {"tp2_ckpt": ckpt_dir, "tp2_loss3": step_loss(policy, rows)}
    train_steps(policy, rows, 3, start=2)
    out["tp2_params3"] = gather_full_params(policy.model.module)

    resumed, rows = build_layout(preset, tp=1, ep=2)
    dist_ckpt.load(resumed, ckpt_dir)
    out["ep2_ckpt"] = os.path.join(os.path.dirname(ckpt_dir), "ep2_step_2")
    dist_ckpt.save(resumed, out["ep2_ckpt"])
    out["ep2_loss3"] = step_loss(resumed, rows)
    train_steps(resumed, rows, 3, start=2)
    out["ep2_params3"] = gather_full_params(resumed.model.module)
    out["ep2_updates"] = resumed.optimizer.updates
    return out
