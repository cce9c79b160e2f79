"""Worker for the 2-process rank-sync tests (docs/pitfalls.md#collectives), run through
`parallel_worker.spawn`.

Each rank builds the Trainer for a layout (EP=2, or pure DP=2), loads the 1-process reference
weights, then runs `evaluate` (one example per chunk, a chunk count that differs between ranks)
and `rollout_and_train` on its half of the prompts (greedy sampling with and without the KV
cache, R3 routing, two optimizer steps, then one whose loss is infinite on rank 1 only). Results are
saved per rank; the tests compare them with the 1-process reference. Every collective has a 60 s
timeout (`model.dist_timeout_min`), so a rank left waiting by a desynchronised peer fails fast
instead of hanging.
"""

import os
import warnings
from functools import partial

import torch

warnings.filterwarnings("ignore")

MAX_NEW = 6
TRAIN_KEYS = ("policy/loss", "policy/clip_frac/seq", "train/grad_norm")
"""Metrics whose mean over equal DP halves equals the 1-process value (token-weighted ones,
e.g. policy/entropy, are per-rank ratios and do not)."""
OVERRIDES = ("wandb.mode=disabled", "task.n_train=64", "task.n_eval=4", "train.flip_every=1",
             f"rollout.max_new_tokens={MAX_NEW}", "optim.lr=1e-3", "loss.name=gspo",
             "model.dist_timeout_min=1", "rollout.group_size=4")


def make_config(run_dir: str, ep: int):
    from megatron_gspo.config.schema import load_config

    return load_config(None, [*OVERRIDES, f"run_dir={run_dir}", f"model.ep={ep}"])


@torch.no_grad()
def force_early_eos(policy, tokenizer, prompts: list[str], strength: float) -> None:
    """Make a random-init policy end its greedy responses at prompt-dependent lengths.

    Adds `strength * m / |m|^2` to the <eos> row of the output layer, m the mean final hidden
    state over the prompts' tokens: the <eos> logit rises by about `strength` on typical tokens
    (more on some, less on others), so some greedy responses stop after 1 token, others run to
    the length limit."""
    from tests.megatron_gspo.sampling import encode_prompts

    gpt = policy.model.module
    hidden = []
    hook = gpt.output_layer.register_forward_pre_hook(lambda m, a: hidden.append(a[0]))
    tokens_BP, valid_BP = encode_prompts(tokenizer, prompts)
    try:
        policy.logits(tokens_BP, valid_BP)
    finally:
        hook.remove()
    if policy.pack:  # the prompts' real tokens, one after another: [N, 1, H]
        m = hidden[0][:, 0].mean(0)
    else:
        m = hidden[0].transpose(0, 1)[valid_BP].mean(0)  # megatron's hidden is [T, B, H]
    gpt.output_layer.weight[tokenizer.eos_id] += strength * m / m.norm() ** 2


def rollout_and_train(trainer, prompts: list[str], adv_B: torch.Tensor,
                      bad_adv_B: torch.Tensor) -> dict:
    """Greedy samples (KV cache with R3 routing, and full recompute), pi_old's pass
    (`Trainer.prepare`, its forwards counted), then two optimizer steps on the KV samples with
    advantages `adv_B` and a third with `bad_adv_B` (inf on some rows: a non-finite loss,
    skipped): tensors, step metrics, the third step's local `train/skipped` and the final
    weights."""
    from megatron_gspo.rollout.batch import RolloutBatch
    from tests.megatron_gspo.sampling import sample
    from megatron_gspo.jobs.rl import Minibatch
    from megatron_gspo.dist import reduce_metrics
    from moe.model.sharding import gather_full_params

    policy, tok = trainer.policy, trainer.rt.tokenizer
    out = {}
    policy.train(False)
    for kv in (True, False):
        tokens_BT, valid_BT, response_BT, logp_BT, routing = sample(
            policy, tok, prompts, max_new_tokens=MAX_NEW, greedy=True, kv_cache=kv,
            record_routing=kv)
        out[f"kv={kv}"] = {"tokens": tokens_BT, "valid": valid_BT, "response": response_BT,
                           "logp": logp_BT, "routing": None if routing is None
                           else routing.ids_NLK.sort(-1).values}
    policy.train(True)
    s = out["kv=True"]
    B = len(prompts)
    batch = RolloutBatch(s["tokens"], s["valid"], s["response"], s["logp"], torch.zeros(B),
                         torch.arange(B), [""] * B, [None] * B)
    forwards = []
    hook = policy.model.module.output_layer.register_forward_hook(
        lambda *args: forwards.append(1))
    prepared, _ = trainer.prepare(batch)
    hook.remove()
    out["pi_old_forwards"] = len(forwards)
    old_logp_BT, old_routing = prepared.old_logp_BT, prepared.old_routing
    out["train"] = []
    for _ in range(2):
        metrics = trainer.train_step(Minibatch(batch, old_logp_BT, adv_B, old_routing))
        out["train"].append(reduce_metrics({k: metrics[k] for k in TRAIN_KEYS}))
    out["bad_step_skipped"] = trainer.train_step(
        Minibatch(batch, old_logp_BT, bad_adv_B, old_routing))["train/skipped"]
    out["params_after"] = gather_full_params(policy.model.module)
    return out


def collective_timeouts_s() -> list[float]:
    """Timeouts of the world, EP and DP gloo groups (torch's private accessor)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    groups = (dist.group.WORLD, ps.get_expert_model_parallel_group(),
              ps.get_data_parallel_group())
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]


def wanting(n: int, valid_BT, budget: int, packed: bool) -> list:
    """`megatron_gspo.algo.packing.microbatches`, its bins `n` (round robin over the rows) before
    the ranks agree on a count: what a rank would want on its own."""
    from megatron_gspo.algo import packing

    real = packing.pack_rows
    packing.pack_rows = lambda lengths, budget: [list(range(len(lengths)))[r::n]
                                                 for r in range(n)]
    try:
        return packing.microbatches(valid_BT, budget, packed)
    finally:
        packing.pack_rows = real


def worker(rank: int, world: int, port: int, ref_path: str, out_dir: str, eps: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from megatron_gspo.rollout.generate import evaluate
    from megatron_gspo.jobs.rl import Trainer
    from moe.platform.parallel import destroy_parallel
    from moe.model.sharding import load_full_params

    from megatron_gspo.jobs import rl as trainer_module
    from megatron_gspo.dist import all_ranks, max_over_ranks, reduce_metrics

    # pi_old's pass in 1 forward on rank 0 and 2 on rank 1 (as when the ranks' rows hold
    # different token counts): the trainer must agree on 2, or rank 0 leaves its peer waiting in
    # the MoE all-to-all
    trainer_module.microbatches = partial(wanting, 1 + rank)

    ref = torch.load(ref_path, weights_only=False)
    half = len(ref["prompts"]) // world
    rows = slice(rank * half, (rank + 1) * half)
    try:
        for ep in eps:
            trainer = Trainer.from_config(make_config(os.path.join(out_dir, f"run_ep{ep}"), ep))
            load_full_params(trainer.policy.model.module, ref["params"])
            out_timeouts = collective_timeouts_s()
            acc = evaluate(trainer.rt.sampler, trainer.rt.tokenizer, trainer.rt.task,
                           ref["eval_examples"][rank], max_new_tokens=MAX_NEW, batch_size=1)
            out = rollout_and_train(trainer, ref["prompts"][rows], ref["adv_B"][rows],
                                    ref["bad_adv_B"][rows])
            out["eval"], out["timeouts_s"] = acc, out_timeouts
            out["agree"] = (all_ranks(rank == 0), all_ranks(True), max_over_ranks(10 * rank + 1))
            out["reduced"] = reduce_metrics({"x/max": rank, "x/min": rank + 1.0, "x": rank})
            trainer.rt.logger.close()
            torch.save(out, os.path.join(out_dir, f"ep{ep}_rank{rank}.pt"))
    finally:
        destroy_parallel()
