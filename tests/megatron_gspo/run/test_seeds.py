"""megatron_gspo.run.seeds: each stream's seed is the same number it has always been (the golden
run and every experiment's results depend on them), and streams differ where they must."""

import torch

from megatron_gspo.run import seeds


def test_derived_seeds_are_the_pinned_numbers():
    assert seeds.sft_batches(3, 1).initial_seed() == 3 * 31 + 1
    assert seeds.rollout_prompts(3, 2, 1).initial_seed() == 3 * 7_919 + 2 * 104_729 + 1
    assert seeds.minibatch_order(3, 2).initial_seed() == 3 * 1_000_003 + 2
    gen = seeds.router_noise(3, 5, "cpu")
    assert gen.initial_seed() == 3 * 1_000_033 + 5 + 17 and gen.device == torch.device("cpu")


def test_streams_differ_across_iterations_ranks_and_steps_and_repeat_for_the_same_place():
    def draw(gen):
        return torch.randint(1 << 30, (4,), generator=gen).tolist()

    assert draw(seeds.rollout_prompts(0, 1, 0)) == draw(seeds.rollout_prompts(0, 1, 0))
    assert len({tuple(draw(seeds.rollout_prompts(0, it, rank))) for it in range(3)
                for rank in range(2)}) == 6
    assert draw(seeds.sft_batches(0, 0)) != draw(seeds.sft_batches(0, 1))
    assert draw(seeds.minibatch_order(0, 0)) != draw(seeds.minibatch_order(0, 1))
    assert draw(seeds.router_noise(0, 0, "cpu")) != draw(seeds.router_noise(0, 1, "cpu"))
