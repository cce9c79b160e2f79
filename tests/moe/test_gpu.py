"""GPU checks (skipped without CUDA): the policy trains and replays on the GPU, TE spec if present.

Run with `make test-gpu` (or `pytest -m gpu`) on a machine with a GPU.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_policy_trains_and_replays_on_gpu(single_process):
    from moe.model import ParallelLayout, have_transformer_engine
    from moe.policy import MoEPolicy, OptimSettings
    from moe.presets import get_preset
    from moe.replay import current_routing, replay_routing

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
