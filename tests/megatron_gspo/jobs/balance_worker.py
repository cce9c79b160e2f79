"""Worker for the 2-process data-parallel balance test (tests/megatron_gspo/jobs/test_rl_balance.py),
run through `parallel_worker.spawn`.

Each rank builds a DP=2 trainer (packed) twice, with `train.balance_dp` on and off, and trains
one rollout batch in one minibatch on a hand-made batch: rank 0's groups long (prompt column 5,
responses of 9-14 tokens), rank 1's short (prompt column 3, 1-3 tokens), rewards differing
within each group. The batch is the same on both ranks together either way, so the
gradient (the mean over sequences of a per-sequence term) must be too; it is captured after
the data-parallel reduction, before the optimizer step.
"""

import os
import warnings

import torch

warnings.filterwarnings("ignore")

G = 4
OVERRIDES = ("wandb.mode=disabled", "model.preset=tiny", "task.name=addition",
             "task.n_train=32", "task.n_eval=4", "rollout.prompts_per_batch=4",
             f"rollout.group_size={G}", "rollout.max_new_tokens=14", "train.num_minibatches=1",
             "train.flip_every=0", "train.eval_every=0", "train.save_every=0",
             "train.micro_max_tokens=40", "train.logprob_max_tokens=40", "optim.lr=1e-3",
             "model.dist_timeout_min=1")


def rank_batch(trainer, rank: int):
    """Rank `rank`'s rollout batch: 2 groups of G rows; R3's routes recorded from the policy."""
    from megatron_gspo.rollout.batch import RolloutBatch
    from moe.routing.replay import current_routing

    g = torch.Generator().manual_seed(100 + rank)
    start, lengths = (5, [9, 14, 12, 10, 13, 11, 9, 14]) if rank == 0 else \
        (3, [1, 3, 2, 1, 2, 3, 1, 2])
    B, T = 2 * G, start + max(lengths)
    tokens_BT = torch.randint(3, trainer.policy.real_vocab, (B, T), generator=g)
    cols = torch.arange(T)[None, :]
    prompt_B = torch.tensor([start - (b % 3) for b in range(B)])  # left padding varies
    valid_BT = (cols >= start - prompt_B[:, None]) & (cols < start + torch.tensor(lengths)[:, None])
    response_BT = valid_BT & (cols >= start)
    tokens_BT[~valid_BT] = 0
    _, routing = current_routing(trainer.policy, tokens_BT, valid_BT, start=start)
    rewards_B = torch.rand(B, generator=g)
    return RolloutBatch(tokens_BT, valid_BT, response_BT, torch.zeros(B, T), rewards_B,
                        torch.arange(2).repeat_interleave(G), [""] * B, [None] * B,
                        routing=routing)


def worker(rank: int, world: int, port: int, out_dir: str, replay: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from megatron_gspo.config.schema import load_config
    from megatron_gspo.jobs.rl import Trainer
    from moe.platform.parallel import destroy_parallel

    try:
        for balance in (True, False):
            cfg = load_config(None, [*OVERRIDES, f"train.balance_dp={balance}",
                                     f"train.routing_replay={replay}",
                                     f"run_dir={os.path.join(out_dir, f'run_{balance}')}"])
            trainer = Trainer.from_config(cfg)
            batch = rank_batch(trainer, rank)
            trainer.rollout = lambda it: batch
            grads, optimizer = {}, trainer.policy.optimizer
            step = optimizer.step

            def capture():
                for n, p in trainer.policy.model.module.named_parameters():
                    grads[n] = p.main_grad.detach().clone()
                return step()

            optimizer.step = capture
            metrics = trainer.iteration()
            trainer.rt.logger.close()
            torch.save({"grads": grads, "metrics": metrics},
                       os.path.join(out_dir, f"{replay}_{balance}_rank{rank}.pt"))
    finally:
        destroy_parallel()
