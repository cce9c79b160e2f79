"""GPU checks (skipped without CUDA): the policy trains and replays on the GPU, TE spec if present.

Run with `make test-gpu` (or `pytest -m gpu`) on a machine with a GPU.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_policy_trains_and_replays_on_gpu(single_process):
    from moe.model.gpt import ParallelLayout, have_transformer_engine
    from moe.model.policy import MoEPolicy, OptimSettings
    from moe.model.presets import get_preset
    from moe.routing.replay import current_routing, replay_routing

    preset = get_preset("qwen3-moe-tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size,
                             optim=OptimSettings(lr=3e-3))
    assert policy.device.type == "cuda"
    print("TransformerEngine spec:", have_transformer_engine())
    tokens = torch.randint(0, preset.vocab_size, (8, 16))
    valid = torch.ones(8, 16, dtype=torch.bool)
    valid[:3, :4] = False
    _, cache = current_routing(policy, tokens, valid)
    losses = []
    for _ in range(5):
        policy.zero_grad()
        with replay_routing(policy, cache):
            logp = policy.token_logprobs(tokens, valid)
        loss = -(logp * valid.to(logp.device)).sum() / valid.sum()
        loss.backward()
        stepped, _ = policy.step()
        assert stepped
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    _, after = current_routing(policy, tokens, valid)
    assert after.ids_NLK.shape == cache.ids_NLK.shape
    with torch.no_grad():  # replaying the live routes gives the live logits at real tokens
        live = policy.logits(tokens, valid)
        with replay_routing(policy, after):
            replayed = policy.logits(tokens, valid)
    mask = valid.to(live.device)  # padding gets filler routes (token_logprobs reads one)
    torch.testing.assert_close(replayed[mask], live[mask], atol=2e-4, rtol=2e-4)


def test_kv_cache_decoder_matches_full_forward_on_gpu(single_process):
    """The sampler's KV-cache path on CUDA (TE spec when installed) equals the full forward."""
    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.routing.replay import current_routing
    from moe.model.settings import ParallelLayout

    preset = get_preset("qwen3-moe-tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=26, optim=None)
    tokens = torch.randint(0, 26, (4, 12))
    valid = torch.ones(4, 12, dtype=torch.bool)
    valid[0, :3] = False
    full = policy.logits(tokens, valid)
    from moe.inference.decode import kv_decoder

    decoder = kv_decoder(policy, "lean", 4, 12, record_routing=True)
    for t in range(7, 13):
        step = decoder.next_logits(tokens[:, :t], valid[:, :t])
        torch.testing.assert_close(step, full[:, t - 1], atol=2e-4, rtol=2e-4)
    got = decoder.routing(valid).ids_NLK.long()  # same experts as the full forward, per token
    _, want = current_routing(policy, tokens, valid)
    assert torch.equal(got.sort(-1).values.cpu(), want.ids_NLK.long().sort(-1).values.cpu())


def test_sampler_draws_on_the_gpu_reproducibly(single_process):
    """The sampler's draws run on the GPU (a device generator seeded from the host one): host
    tensors come back, the same seed gives the same tokens, the log-probs match the trainer's
    recompute."""
    from megatron_gspo.rollout.decoders import sample_prompts
    from megatron_gspo.rollout.sampler import SamplingParams
    from megatron_gspo.tasks.toy import CharTokenizer
    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.model.settings import ParallelLayout

    policy = MoEPolicy.build(get_preset("qwen3-moe-tiny"), ParallelLayout(), real_vocab=26,
                             optim=None)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9)
    runs = [sample_prompts(policy, CharTokenizer(), ["12+34=", "7+8="] * 4, params,
                           generator=torch.Generator().manual_seed(s)) for s in (4, 4, 5)]
    tokens_BT, valid_BT, response_BT, logp_BT = (runs[0].tokens_BT, runs[0].valid_BT,
                                                 runs[0].response_BT, runs[0].logp_BT)
    assert all(t.device.type == "cpu" for t in (tokens_BT, valid_BT, response_BT, logp_BT))
    assert torch.equal(runs[1].tokens_BT, tokens_BT)
    assert not torch.equal(runs[2].tokens_BT, tokens_BT)
    recompute_BT = policy.token_logprobs(tokens_BT, valid_BT, temperature=0.8).cpu()
    torch.testing.assert_close(logp_BT[response_BT], recompute_BT[response_BT], atol=2e-4,
                               rtol=2e-4)


def test_device_generator_seeds_a_cuda_generator_from_the_host_one():
    from megatron_gspo.rollout.decoders import device_generator

    host = torch.Generator().manual_seed(3)
    state = host.get_state()
    first = device_generator(host, torch.device("cuda", 0))
    assert first.device == torch.device("cuda", 0) and not torch.equal(host.get_state(), state)
    host.set_state(state)  # the same host state gives the same device seed
    assert device_generator(host, torch.device("cuda", 0)).initial_seed() == first.initial_seed()
    assert device_generator(first, torch.device("cuda", 0)) is first


def test_the_foreach_grad_norm_is_float32_on_cuda_as_megatrons():
    """megatron all-reduces the norm with the float32 zeros a rank without grads keeps: the
    `_foreach` norm must be float32 there (mixed dtypes fail the collective), and equal the
    float64 norm to float32 rounding."""
    from moe.platform.compat import _local_l2_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    lists = [[torch.randn(300, 7, device="cuda", generator=g), torch.randn(5, device="cuda",
                                                                            generator=g)]]
    got, _ = _local_l2_norm(2048, None, lists, False)
    want = torch.cat([t.double().flatten() for t in lists[0]]).norm()
    assert got.dtype == torch.float32 and got.is_cuda and got.shape == (1,)
    assert abs(float(got) - float(want)) <= 1e-6 * float(want)
    assert _local_l2_norm(2048, None, [[]], False)[0].dtype == torch.float32
