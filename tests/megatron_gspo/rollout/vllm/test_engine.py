"""megatron_gspo.rollout.vllm.engine: vLLM in-process vs transformers and vs our megatron policy.

Tiny MoE models with head_dim 32 (which vLLM's CPU attention supports) are built locally and
compared in float32 with transformers (log-probs within 1e-5, router top-k equal) and with
`moe.model.policy.MoEPolicy` before and after optimizer updates pushed into the engine. Each CPU fix
in `push_weights` (re-prepacking the MoE experts, rebuilding a tied output layer, resetting the
prefix cache) has a test that turns it off and sees the engine go wrong. Three engines are
shared by the module: `engine` (Qwen3-MoE, 8 experts, top-3) captures routing (prefix caching
off, eager, 32-token steps so prompts are prefilled in chunks and steps mix requests), `cached`
has prefix caching on, `tied` is a Qwen2-MoE with tied embeddings and a shared expert. Skipped
without vLLM (it needs Python >= 3.11; docs/vllm.md).
"""

import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch

from megatron_gspo.rollout.vllm import engine as vllm_engine
from tests.hf_fixtures import load_hf, make_model

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install -e '.[vllm]', "
                                       "Python >= 3.11: docs/vllm.md)")
MODEL = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
             max_position_embeddings=512)
# Qwen2-MoE: tied embeddings, a sigmoid-gated shared expert, QKV bias, top-2 not renormalised
MODEL2 = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=64, max_position_embeddings=512)
REAL_VOCAB = 300  # the fixture tokenizer's
TOL = 1e-5
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], list(range(30, 70)), list(range(100, 125))]


def test_unavailable_names_the_extra_when_vllm_is_missing(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)
    assert "pip install -e '.[vllm]'" in vllm_engine.unavailable()


@needs_vllm
def test_unavailable_refuses_a_cpu_head_dim(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16}))
    assert "head_dim=16 is not supported" in vllm_engine.unavailable(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 64, "num_attention_heads": 2}))  # head_dim from hidden / heads: 32
    assert vllm_engine.unavailable(str(tmp_path)) is None


# ---------------------------------------------------------------- fixtures
def model_pair(tmp_path_factory, family, **config):
    """A model folder, and a copy with every tensor perturbed (new weights to push).

    The output layer (the embedding where tied) is halved: at the fixture's full scale
    (log-probs down to -10) vLLM's and transformers' float32 log-probs each differ from a
    float64 forward by up to 1e-5, at half scale by up to 6e-6, which leaves the 1e-5
    tolerance a margin."""
    from safetensors.torch import load_file, save_file

    old = str(tmp_path_factory.mktemp(f"{family}_old"))
    make_model(old, family, **config)
    tensors = load_file(f"{old}/model.safetensors")
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    tensors[head] = (0.5 * tensors[head]).contiguous()
    save_file(tensors, f"{old}/model.safetensors")
    new = str(tmp_path_factory.mktemp(f"{family}_new"))
    shutil.copytree(old, new, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(1)
    save_file({k: (t + 0.1 * torch.randn(t.shape, generator=g)).contiguous()
               for k, t in tensors.items()}, f"{new}/model.safetensors")
    return {"old": old, "new": new}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return model_pair(tmp_path_factory, "qwen3_moe", **MODEL)


@pytest.fixture(scope="module")
def hf(dirs):
    return {k: load_hf(v) for k, v in dirs.items()}


def _start(folder, **kw):
    before = [value for _, _, value in vllm_engine._torch_attrs()]
    engine = vllm_engine.VLLMEngine(folder, max_model_len=256, kv_cache_gb=1, **kw)
    yield engine
    engine.close()
    # vLLM's CPU worker had patched torch (streams, set_num_threads): put back by close()
    assert [value for _, _, value in vllm_engine._torch_attrs()] == before
    assert torch.distributed.is_initialized()  # megatron's process group outlives the engine


@pytest.fixture(scope="module")
def engine(single_process, dirs):
    # 32-token steps: the 40-token prompt is prefilled in two chunks, next to other requests
    yield from _start(dirs["old"], capture_routing=True,
                      engine_args={"max_num_batched_tokens": 32, "max_num_seqs": 8})


@pytest.fixture(scope="module")
def cached(single_process, dirs):
    yield from _start(dirs["old"], capture_routing=False)


@pytest.fixture(scope="module")
def tied(single_process, tmp_path_factory):
    folders = model_pair(tmp_path_factory, "qwen2_moe", **MODEL2)
    hf = {k: load_hf(v) for k, v in folders.items()}
    for engine in _start(folders["old"], capture_routing=True):
        yield engine, folders, hf


def stream(folder):
    """(name, tensor) from a folder's safetensors, one tensor at a time."""
    from safetensors import safe_open

    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


# ---------------------------------------------------------------- references
def hf_forward(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), output_router_logits=True)


def hf_logprobs(model, prompt, tokens, temperature=1.0):
    """transformers' log pi(tokens | prompt) under the temperature-scaled distribution."""
    logits = hf_forward(model, prompt + tokens).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def hf_routing(model, ids, k):
    """transformers' router top-k per token and layer, sorted [T, L, K]."""
    logits = hf_forward(model, ids).router_logits
    return torch.stack([r.topk(k, -1).indices for r in logits], 1).sort(-1).values


def max_diff(results, model, temperature):
    return max((torch.tensor(r.logprobs) - hf_logprobs(model, r.prompt, r.tokens, temperature)
                ).abs().max().item() for r in results)


def sample(engine, prompts=PROMPTS, **kw):
    kw = {"n": 2, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 8, **kw}
    return engine.generate(prompts, **kw)


# ---------------------------------------------------------------- log-probs
@needs_vllm
def test_logprobs_equal_transformers(engine, hf):
    results = sample(engine)
    assert len(results) == 2 * len(PROMPTS)
    assert [r.prompt for r in results] == [p for p in PROMPTS for _ in range(2)]
    assert all(len(r.tokens) == 8 == len(r.logprobs) for r in results)
    assert max_diff(results, hf["old"], 0.7) <= TOL
    probe = PROMPTS[2]
    ref = hf_logprobs(hf["old"], probe[:1], probe[1:])
    assert (torch.tensor(engine.logprobs_of(probe)) - ref).abs().max() <= TOL


@needs_vllm
def test_vllm_processed_logprobs_are_the_nucleus_ours_are_not(engine, hf):
    """vLLM's processed_logprobs renormalise over the top-p nucleus; the engine reports the
    temperature-scaled distribution before top-p, as our sampler does."""
    from megatron_gspo.rollout.decoders import top_p_filter

    engine._pre_top_p = False
    try:
        results = sample(engine, top_p=0.5)
    finally:
        engine._pre_top_p = True
    assert max_diff(results, hf["old"], 0.7) > 1e-3
    for r in results:
        logits = hf_forward(hf["old"], r.prompt + r.tokens).logits[0, len(r.prompt) - 1:-1]
        nucleus = torch.log_softmax(top_p_filter(logits[:, :REAL_VOCAB] / 0.7, 0.5), -1)
        ref = nucleus.gather(-1, torch.tensor(r.tokens)[:, None])[:, 0]
        assert (torch.tensor(r.logprobs) - ref).abs().max() <= TOL


@needs_vllm
def test_only_stop_ids_stop_and_the_stop_token_is_kept(engine):
    stops = set(range(0, REAL_VOCAB, 3))  # a third of the vocabulary: most samples stop
    results = sample(engine, stop_ids=sorted(stops), max_new_tokens=12)
    assert any(r.finish_reason == "stop" for r in results)
    for r in results:
        hits = [i for i, t in enumerate(r.tokens) if t in stops]
        if r.finish_reason == "stop":
            assert hits == [len(r.tokens) - 1]
        else:
            assert not hits and len(r.tokens) == 12


# ---------------------------------------------------------------- routing
@needs_vllm
def test_routing_equals_transformers_router_and_the_engines_gate(engine, hf):
    gate = engine._add_capture("gate")  # top-k of the router logits, a second path
    try:
        results = sample(engine, n=3)
    finally:
        engine.captures.remove(gate)
    capture = engine.captures[0]
    assert capture.max_batch > 1  # steps held several requests
    chunked = [k for k, parts in capture.rows.items() if len(parts[0][0]) < len(PROMPTS[2])
               and len(parts[0][0]) > 1]
    assert chunked  # and the 40-token prompt was prefilled in pieces
    for key, r in enumerate(results):
        ids = r.prompt + r.tokens
        assert r.routing.dtype == np.uint8
        assert r.routing.shape == (len(ids) - 1, 2, 3)
        ours = torch.from_numpy(r.routing).long().sort(-1).values
        assert torch.equal(ours, hf_routing(hf["old"], ids, 3)[:-1])
        other = torch.from_numpy(gate.routing(key, len(ids) - 1)).long().sort(-1).values
        assert torch.equal(ours, other)


# ---------------------------------------------------------------- weight pushes
@needs_vllm
def test_push_matches_new_weights_and_pushing_back_restores(engine, hf, dirs):
    probe = PROMPTS[2]
    before = engine.logprobs_of(probe)
    try:
        assert engine.push_weights(stream(dirs["new"])) == len(list(stream(dirs["new"])))
        results = sample(engine)
        assert max_diff(results, hf["new"], 0.7) <= TOL
        r = results[0]
        ids = r.prompt + r.tokens
        ours = torch.from_numpy(r.routing).long().sort(-1).values
        assert torch.equal(ours, hf_routing(hf["new"], ids, 3)[:-1])
        assert max(abs(a - b) for a, b in zip(engine.logprobs_of(probe), before)) > 1e-2
    finally:
        engine.push_weights(stream(dirs["old"]))
    assert engine.logprobs_of(probe) == before
    assert max_diff(sample(engine), hf["old"], 0.7) <= TOL


@needs_vllm
def test_without_the_moe_reprepack_a_push_is_silently_wrong(engine, hf, dirs):
    """vLLM 0.32's reload leaves CPU experts in checkpoint layout (module docstring)."""
    engine._reprepack = False
    try:
        engine.push_weights(stream(dirs["new"]))
        wrong = max_diff(sample(engine), hf["new"], 0.7)
    finally:
        engine._reprepack = True
        engine.push_weights(stream(dirs["old"]))
    assert wrong > 1e-2
    assert max_diff(sample(engine), hf["old"], 0.7) <= TOL


@needs_vllm
def test_without_the_prefix_cache_reset_a_cached_prompt_keeps_old_weights(cached, hf, dirs):
    prompt = list(range(140))  # longer than one 128-token block: its first block is cached
    assert max_diff(sample(cached, [prompt]), hf["old"], 0.7) <= TOL
    cached._reset_prefix_cache = False
    try:
        cached.push_weights(stream(dirs["new"]))
        stale = max_diff(sample(cached, [prompt]), hf["new"], 0.7)
        # the probe guard cannot see it: prompt log-prob requests skip the prefix cache
        ref = hf_logprobs(hf["new"], prompt[:1], prompt[1:])
        assert (torch.tensor(cached.logprobs_of(prompt)) - ref).abs().max() <= TOL
    finally:
        cached._reset_prefix_cache = True
    assert stale > 1e-2
    cached.push_weights(stream(dirs["new"]))
    assert max_diff(sample(cached, [prompt]), hf["new"], 0.7) <= TOL
    cached.push_weights(stream(dirs["old"]))
    assert max_diff(sample(cached, [prompt]), hf["old"], 0.7) <= TOL


# ---------------------------------------------------------------- vs our policy
def policy_hf_stream(policy, hf_config):
    """The policy's weights as Hugging Face tensors, one megatron parameter at a time (1
    process: every parameter is whole), in layer order, vocabulary padding cut."""
    from moe.hf.mapping import HFMapping, local_to_te

    params = dict(policy.model.module.named_parameters())
    mapping = HFMapping(hf_config)
    te = local_to_te(params)
    for name, param in params.items():
        for hf_name, part in mapping.to_hf(te[name], param.detach()):
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                part = part[:hf_config["vocab_size"]]
            yield hf_name, part.contiguous()


def policy_diff(policy, results, temperature):
    worst = 0.0
    for r in results:
        ids = torch.tensor([r.prompt + r.tokens])
        with torch.no_grad():
            logp = policy.token_logprobs(ids, torch.ones_like(ids, dtype=torch.bool),
                                         temperature=temperature, start=len(r.prompt))
        worst = max(worst, (logp[0, len(r.prompt):] - torch.tensor(r.logprobs)).abs().max()
                    .item())
    return worst


@needs_vllm
def test_logprobs_equal_our_policy_before_and_after_three_pushed_updates(engine, dirs):
    from moe.hf.config import preset_from_hf, read_hf_config
    from moe.hf.weights import load_hf_weights
    from moe.model.policy import MoEPolicy
    from moe.model.settings import OptimSettings, ParallelLayout

    preset = preset_from_hf(dirs["old"]).with_vocab(REAL_VOCAB, multiple=128)
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=REAL_VOCAB,
                             optim=OptimSettings(lr=3e-3))
    load_hf_weights(policy.model.module, dirs["old"])
    policy.weights_changed()
    hf_config = read_hf_config(dirs["old"])
    probe = PROMPTS[2]
    start = engine.logprobs_of(probe)
    try:
        for update in range(4):
            if update:  # a step on the sampled tokens' log-likelihood, then push
                policy.zero_grad()
                ids = torch.tensor([r.prompt + r.tokens for r in results[:2]])
                logp = policy.token_logprobs(ids, torch.ones_like(ids, dtype=torch.bool),
                                             start=len(results[0].prompt))
                policy.backward(-logp.sum())
                assert policy.step()[0]
            engine.push_weights(policy_hf_stream(policy, hf_config))
            results = sample(engine)
            assert policy_diff(policy, results, 0.7) <= TOL, f"after update {update}"
        moved = max(abs(a - b) for a, b in zip(engine.logprobs_of(probe), start))
        assert moved > 1e-2  # the updates changed what the engine computes
    finally:
        engine.push_weights(stream(dirs["old"]))


@needs_vllm
def test_tied_output_layer_follows_a_pushed_embedding(tied):
    """Qwen2-MoE with tied embeddings: on CPU the output layer multiplies with a packed copy of
    the embedding that vLLM's reload does not rebuild (module docstring)."""
    engine, folders, hf = tied
    results = sample(engine)
    assert max_diff(results, hf["old"], 0.7) <= TOL
    ids = results[0].prompt + results[0].tokens
    ours = torch.from_numpy(results[0].routing).long().sort(-1).values
    assert torch.equal(ours, hf_routing(hf["old"], ids, 2)[:-1])
    engine._repack_tied_head = False
    try:
        engine.push_weights(stream(folders["new"]))
        stale = max_diff(sample(engine), hf["new"], 0.7)
    finally:
        engine._repack_tied_head = True
    assert stale > 1e-2
    engine.push_weights(stream(folders["new"]))
    assert max_diff(sample(engine), hf["new"], 0.7) <= TOL
    engine.push_weights(stream(folders["old"]))
    assert max_diff(sample(engine), hf["old"], 0.7) <= TOL


@needs_vllm
def test_a_compiled_engine_skips_routing_hooks_and_the_capture_says_so(cached):
    """Without enforce_eager vLLM compiles the model with no guards: hooks installed after
    start-up never run. The capture fails loudly instead of returning partial routing. (Runs
    last on `cached`: the failed step leaves that engine unusable.)"""
    cached._add_capture("router")
    with pytest.raises(RuntimeError, match="reported no routing"):
        cached.generate([[1, 2, 3]], max_new_tokens=2)
