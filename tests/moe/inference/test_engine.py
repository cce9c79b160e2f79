"""moe.inference.engine: result conversion and routing layout on CPU; the engine itself on a GPU."""

import numpy as np
import pytest
import torch

from moe.inference.engine import EngineRequest, cut_at_stop, routing_mismatch, to_batch, unavailable


def request(prompt, tokens, L=2, K=2, seed=0):
    g = np.random.default_rng(seed)
    n = len(prompt) + len(tokens) - 1
    routing = np.stack([g.permutation(8)[:K] for _ in range(n * L)]).reshape(n, L, K)
    return EngineRequest(prompt, tokens, [-0.5 - i for i in range(len(tokens))], routing)


def test_to_batch_left_pads_prompts_and_packs_routing_in_token_order():
    reqs = [request([5, 6, 7], [8, 9], seed=1), request([4], [3, 2, 1], seed=2)]
    tokens_BT, valid_BT, response_BT, logp_BT, cache = to_batch(reqs, pad_id=0, num_experts=8)
    assert tokens_BT.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 4, 3, 2, 1]]
    assert valid_BT.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert response_BT.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert logp_BT[1, 3:].tolist() == [-0.5, -1.5, -2.5] and logp_BT[0, 5] == 0
    assert cache.ids_NLK.shape == (9, 2, 2) and cache.valid_BT.equal(valid_BT)
    # row 0's five tokens: four routed by the engine, then filler for the last one
    assert cache.ids_NLK[:4].long().tolist() == reqs[0].routing.tolist()
    assert cache.ids_NLK[4].long().tolist() == [[0, 1], [0, 1]]
    assert cache.ids_NLK[5:8].long().tolist() == reqs[1].routing.tolist()


def test_to_batch_without_routing_gives_no_cache():
    reqs = [EngineRequest([1, 2], [3], [-1.0], None)]
    assert to_batch(reqs, 0, 8)[-1] is None


def test_to_batch_refuses_routing_of_the_wrong_length():
    bad = request([1, 2], [3, 4])
    bad.routing = bad.routing[:-1]
    with pytest.raises(ValueError, match="routing has 2 tokens, expected 3"):
        to_batch([bad], 0, 8)


def test_cut_at_stop_keeps_the_stop_token_and_cuts_routing_to_match():
    req = request([1, 2], [3, 7, 4, 7])
    cut = cut_at_stop(req, {7, 99})
    assert cut.tokens == [3, 7] and cut.logprobs == req.logprobs[:2]
    assert cut.routing.shape[0] == 2 + 2 - 1
    assert cut_at_stop(req, {42}) is req


def test_routing_mismatch_counts_sets_and_activations_per_layer():
    trainer = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # N=2, L=2, K=2
    engine = torch.tensor([[[1, 0], [2, 5]], [[4, 5], [1, 0]]])    # same set; 1 of 2; 2 of 2
    m = routing_mismatch(engine, trainer)
    assert m["set"] == [0.0, 1.0]
    assert m["expert"] == [0.0, (0.5 + 1.0) / 2]
    assert m["any_layer"] == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_engine_says_in_one_line_that_it_needs_cuda():
    why = unavailable()
    assert why and "CUDA" in why and "\n" not in why


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_samples_what_the_trainer_recomputes_in_fp32(single_process):
    """fp32 tiny model: the engine's log-probs and routing equal the trainer's full forward
    over the same tokens (paged attention and in-flight batching change nothing but rounding)."""
    if unavailable():
        pytest.skip(unavailable())
    from moe.inference.engine import EngineSampler
    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.routing.replay import current_routing
    from moe.model.settings import ParallelLayout

    preset = get_preset("qwen3-moe-tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=60, optim=None)
    sampler = EngineSampler(policy, max_requests=8, max_seq_len=48, max_tokens=512,
                            buffer_size_gb=1, block_size=16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 60, (n,), generator=g).tolist() for n in (3, 9, 5, 12)] * 2
    reqs = sampler.generate(prompts, max_new_tokens=20)
    assert all(max(r.tokens) < 60 for r in reqs), "sampled a padding id of the vocabulary"
    tokens_BT, valid_BT, response_BT, logp_BT, cache = to_batch(reqs, 0, preset.num_experts)
    assert response_BT.sum() == 8 * 20
    with torch.no_grad():
        train_logp_BT, train_cache = current_routing(policy, tokens_BT, valid_BT)
    resp = response_BT.bool()
    torch.testing.assert_close(logp_BT[resp], train_logp_BT.cpu()[resp], atol=2e-4, rtol=0)
    last_N = torch.zeros_like(valid_BT)
    last_N[torch.arange(8), valid_BT.long().cumsum(1).argmax(1)] = True
    keep = ~last_N[valid_BT]
    m = routing_mismatch(cache.ids_NLK[keep], train_cache.ids_NLK[keep])
    assert m["any_layer"] < 0.02, m
