"""Worker for the 2-process gloo equivalence tests (run through torch.multiprocessing.spawn).

Each layout is checked against a reference computed by the 1-process model with the same
weights: logits, gradients (gathered back to full tensors) and the global grad norm.
"""

import os
import socket
import time
import warnings

import torch
import torch.multiprocessing as mp

warnings.filterwarnings("ignore")

ATOL = RTOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, args: tuple, nprocs: int, timeout_s: float) -> None:
    """`mp.spawn(fn, args, nprocs)` under a hard deadline: a hang (ranks whose collectives got
    out of step, PITFALLS #13) kills the workers and fails the test instead of blocking CI.
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
    """Mean over sequences of a per-sequence sum: DP-averaged grads equal the global ones."""
    per_seq_B = (logits_BTV * readout_BTV * valid_BT[..., None]).sum(dim=(1, 2)) / 100
    return per_seq_B.mean()


def run_model(policy, tokens_BT, valid_BT, readout_BTV):
    policy.zero_grad()
    logits_BTV = policy.logits(tokens_BT, valid_BT)
    loss_fn(logits_BTV, valid_BT, readout_BTV).backward()
    grad_norm = policy.reduce_grads()
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
    from moe.replay import RoutingReplayCache, current_routing, replay_routing

    E = policy.preset.num_experts
    cols = local_columns(policy, info, tokens_BT.shape[1])
    forced = ref["forced_ids_BTLK"][rows][:, cols]
    local = RoutingReplayCache.from_dense(forced, valid_BT[:, cols], E)
    with torch.no_grad(), replay_routing(policy, local):
        logits = policy.logits(tokens_BT, valid_BT)
    torch.testing.assert_close(logits[valid_BT], ref["forced_logits"][rows][valid_BT], atol=ATOL,
                               rtol=RTOL, msg=lambda m: f"{what}: replayed logits differ: {m}")
    _, recorded = current_routing(policy, tokens_BT, valid_BT)
    want = ref["live_ids_BTLK"][rows][:, cols][valid_BT[:, cols]]
    got = recorded.ids_NLK.long()
    assert torch.equal(got.sort(-1).values, want.sort(-1).values), f"{what}: recorded routing"


def check_kv_decode(policy, ref, rows, tokens_BT, valid_BT, what) -> None:
    """The KV-cache decoder (prefill 8 columns, then one at a time) gives the 1-process
    full-forward logits at each step and records the 1-process routing (none under SP)."""
    B, T = tokens_BT.shape
    decoder = policy.kv_decoder(B, T, record_routing=True)
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


def worker(rank: int, world: int, port: int, ref_path: str, layouts: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from moe.model import ParallelLayout
    from moe.parallel import destroy_parallel, init_parallel
    from moe.policy import MoEPolicy
    from moe.presets import get_preset
    from moe.sharding import gather_full_params, load_full_params

    ref = torch.load(ref_path, weights_only=False)
    preset = get_preset(ref["preset"])
    tokens_BT, valid_BT, readout_BTV = batch(preset.vocab_size)
    try:
        for tp, ep, sp, dispatcher in layouts:
            info = init_parallel(tp=tp, ep=ep, seed=0)
            layout = ParallelLayout(tp=tp, ep=ep, sequence_parallel=sp, dispatcher=dispatcher)
            policy = MoEPolicy.build(preset, layout, real_vocab=preset.vocab_size, optim=None)
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
            check_replay(policy, info, ref, rows, tokens_BT[rows], valid_BT[rows], what)
            check_kv_decode(policy, ref, rows, tokens_BT[rows], valid_BT[rows], what)
    finally:
        destroy_parallel()
