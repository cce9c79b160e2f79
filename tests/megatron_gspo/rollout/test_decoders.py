"""The decoder samplers ("lean", "megatron") on a real (random-init) qwen3-moe-tiny policy: KV
cache vs recompute, sampler log-probs vs the trainer's recompute, padding / stop bookkeeping,
top-p, draws where the logits are, the rank-agreed stop, recorded routing."""

import math

import pytest
import torch

from megatron_gspo.rollout import decoders
from megatron_gspo.rollout.decoders import device_generator, top_p_filter
from megatron_gspo.tasks.toy import CharTokenizer
from tests.megatron_gspo.sampling import draw, encode_prompts, sample

PROMPTS = ["12+345=", "7+8=", "99+1=", "3+40="]


@pytest.fixture(scope="module")
def policy(single_process):
    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.model.settings import ParallelLayout

    return MoEPolicy.build(get_preset("qwen3-moe-tiny"), ParallelLayout(), real_vocab=26,
                           seed=3, optim=None)


def test_top_p_filter_hand_case():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.7 <= 0.8
    assert torch.isfinite(top_p_filter(logits, 1e-9)).sum() == 1  # never empty
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_top_p_filter_boundary_cases():
    """"Reaches top_p" is >=: at exactly p the set is complete; top_p <= 0 still keeps the top
    token; top_p=1.0 keeps every token even where the float cumsum hits 1.0 before the tail."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))  # exact in float32
    assert torch.isfinite(top_p_filter(logits, 0.5))[0].tolist() == [True, False, False, False]
    assert torch.isfinite(top_p_filter(logits, 0.75))[0].tolist() == [True, True, False, False]
    assert torch.isfinite(top_p_filter(logits, 0.0))[0].tolist() == [True, False, False, False]
    peaked = torch.tensor([[30.0] + [0.0] * 1000])  # tail mass ~1e-13 each: cumsum == 1.0 early
    assert torch.equal(top_p_filter(peaked, 1.0), peaked)


def test_top_p_filter_maps_the_kept_set_back_to_vocabulary_order():
    """The nucleus is chosen in sorted order but masks the tokens by id: unsorted logits keep
    their two most likely tokens (ids 3 and 1) in place, per row."""
    probs = torch.tensor([[0.05, 0.3, 0.15, 0.5], [0.6, 0.1, 0.25, 0.05]])
    kept = torch.isfinite(top_p_filter(torch.log(probs), 0.7)).tolist()
    assert kept == [[False, True, False, True], [True, False, True, False]]


def test_draw_is_invariant_to_a_logit_shift():
    """Softmax ignores a constant shift: the same ids (same generator stream) and log-probs for
    logits + 1000, where unnormalised exp(logits) would overflow to inf."""
    logits = torch.randn(6, 26, generator=torch.Generator().manual_seed(0))
    got = [draw(x, temperature=0.7, top_p=0.9, greedy=False,
                generator=torch.Generator().manual_seed(4)) for x in (logits, logits + 1000.0)]
    assert torch.equal(got[0][0], got[1][0])
    torch.testing.assert_close(got[0][1], got[1][1], atol=1e-3, rtol=0)


class HostCopies(torch.overrides.TorchFunctionMode):
    """Records the shape of every tensor copied to the host (`.cpu()` / `.to("cpu")`)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and "cpu" in map(str, args[1:])):
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **kwargs)


@pytest.mark.parametrize("greedy", [True, False])
def test_sampling_steps_copy_ids_and_logprobs_to_the_host_not_logits(policy, greedy):
    """Temperature, log-softmax, top-p and the draw run where the logits are: each step copies
    the B drawn ids and their log-probs, never a [B, V] row of logits (on a GPU that copy was
    39 MB per token at Qwen3's vocabulary)."""
    B, steps = 8, 4
    with HostCopies() as copies:
        sample(policy, CharTokenizer(), PROMPTS * 2, max_new_tokens=steps, temperature=0.8,
               top_p=0.9, greedy=greedy, generator=torch.Generator().manual_seed(1))
    assert copies.shapes.count((B,)) >= 2 * steps  # ids and log-probs, each step
    assert not [s for s in copies.shapes if len(s) > 1 and s[-1] >= policy.preset.vocab_size]


@torch.no_grad()  # as `sample`
def host_sampler(policy, tok, prompts, steps, temperature, top_p, greedy, generator):
    """The sampler as it was before the draws moved to the logits' device (full recompute):
    the [B, V] logits on the host, the live mask applied before the log-prob gather."""
    tokens_BT, valid_BT = encode_prompts(tok, prompts)
    logp_BT = torch.zeros(tokens_BT.shape)
    done_B = torch.zeros(len(prompts), dtype=torch.bool)
    for _ in range(steps):
        logits_BV = policy.logits(tokens_BT, valid_BT)[:, -1].cpu() / temperature
        logp_BV = torch.log_softmax(logits_BV, dim=-1)
        next_B = logits_BV.argmax(-1) if greedy else torch.multinomial(
            top_p_filter(logits_BV, top_p).softmax(-1), 1, generator=generator).squeeze(1)
        live_B = ~done_B
        next_B = torch.where(live_B, next_B, torch.full_like(next_B, tok.pad_id))
        tokens_BT = torch.cat([tokens_BT, next_B[:, None]], dim=1)
        valid_BT = torch.cat([valid_BT, live_B[:, None]], dim=1)
        step_logp_B = logp_BV.gather(1, next_B[:, None]).squeeze(1) * live_B
        logp_BT = torch.cat([logp_BT, step_logp_B[:, None]], dim=1)
        done_B |= torch.isin(next_B, torch.tensor(sorted(tok.stop_ids)))
    return tokens_BT, logp_BT


@pytest.mark.parametrize("top_p,greedy", [(1.0, False), (0.9, False), (1.0, True)])
def test_cpu_sampling_is_bitwise_the_host_sampler(policy, top_p, greedy):
    """On CPU the device-side draws are the same ops on the same generator stream: the same
    tokens and log-probs, bitwise, rows finishing early included."""
    tok, steps = CharTokenizer(), 10
    got = sample(policy, tok, PROMPTS * 4, max_new_tokens=steps, temperature=0.8, top_p=top_p,
                 greedy=greedy, generator=torch.Generator().manual_seed(5), kv_cache=False)
    want_tokens, want_logp = host_sampler(policy, tok, PROMPTS * 4, steps, 0.8, top_p, greedy,
                                          torch.Generator().manual_seed(5))
    T = got[0].shape[1]  # sample stops once every row is done
    assert torch.equal(got[0], want_tokens[:, :T]) and torch.equal(got[3], want_logp[:, :T])


def test_device_generator_keeps_a_generator_of_the_device_and_seeds_others():
    cpu = torch.Generator().manual_seed(3)
    assert device_generator(cpu, torch.device("cpu")) is cpu  # CPU runs: the stream unchanged
    assert device_generator(None, torch.device("cpu")) is None  # (CUDA: tests/moe/model/test_gpu.py)


@pytest.mark.parametrize("greedy", [True, False])
def test_kv_cache_samples_what_full_recompute_samples(policy, greedy):
    tok = CharTokenizer()
    out = [sample(policy, tok, PROMPTS * 4, max_new_tokens=6, temperature=0.8, greedy=greedy,
                  generator=torch.Generator().manual_seed(5), kv_cache=kv) for kv in (True, False)]
    for a, b in zip(out[0][:3], out[1][:3]):
        assert torch.equal(a, b)
    torch.testing.assert_close(out[0][3], out[1][3], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("greedy", [True, False])
def test_full_recompute_samples_the_same_packed(policy, greedy):
    """Sampling by full recompute (the eval and rollout path without a KV cache, and under
    sequence parallelism) with packed forwards: the padded run's tokens, log-probs close."""
    tok = CharTokenizer()
    out = []
    for pack in (False, True):
        policy.pack = pack
        out.append(sample(policy, tok, PROMPTS * 4, max_new_tokens=6, temperature=0.8,
                          greedy=greedy, generator=torch.Generator().manual_seed(5),
                          kv_cache=False))
    policy.pack = False
    for a, b in zip(out[0][:3], out[1][:3]):
        assert torch.equal(a, b)
    torch.testing.assert_close(out[0][3], out[1][3], atol=1e-5, rtol=1e-5)


def test_sampler_logprobs_match_the_recompute_and_padding_is_exact(policy):
    tok = CharTokenizer()
    T_temp = 0.7
    tokens_BT, valid_BT, response_BT, logp_BT, _ = sample(
        policy, tok, PROMPTS * 8, max_new_tokens=6, temperature=T_temp,
        generator=torch.Generator().manual_seed(0))
    recompute_BT = policy.token_logprobs(tokens_BT, valid_BT, temperature=T_temp).cpu()
    torch.testing.assert_close(logp_BT[response_BT], recompute_BT[response_BT], atol=1e-5,
                               rtol=1e-5)
    assert (logp_BT[~response_BT] == 0).all()
    assert not (response_BT & ~valid_BT).any()
    for row_tokens, row_resp in zip(tokens_BT, response_BT):
        resp = row_tokens[row_resp].tolist()
        assert tok.eos_id not in resp[:-1]  # nothing is generated after <eos>
        tail = row_tokens[row_resp.nonzero().max() + 1:] if row_resp.any() else row_tokens[:0]
        assert (tail == tok.pad_id).all()
    assert math.isfinite(logp_BT.sum().item())


def test_tiny_top_p_is_greedy(policy):
    tok = CharTokenizer()
    greedy = sample(policy, tok, PROMPTS, max_new_tokens=5, greedy=True)[0]
    nucleus = sample(policy, tok, PROMPTS, max_new_tokens=5, top_p=1e-9,
                     generator=torch.Generator().manual_seed(1))[0]
    assert torch.equal(greedy, nucleus)


def test_recorded_rollout_routing_is_the_full_forward_routing(policy):
    """R3's cache: the sampler's per-step routing, stitched, equals one full forward's routing on
    every valid token (the last sampled column included), and padding is excluded."""
    from moe.routing.replay import current_routing

    tok = CharTokenizer()
    tokens_BT, valid_BT, _, _, routing = sample(
        policy, tok, PROMPTS * 3, max_new_tokens=6, temperature=1.0,
        generator=torch.Generator().manual_seed(2), record_routing=True)
    _, full = current_routing(policy, tokens_BT, valid_BT)
    assert torch.equal(routing.valid_BT, valid_BT)
    assert routing.ids_NLK.shape[0] == int(valid_BT.sum())
    assert torch.equal(routing.ids_NLK, full.ids_NLK)
    sub = routing.select(torch.tensor([4, 0]))
    assert torch.equal(sub.valid_BT, valid_BT[[4, 0]])


def test_recording_routing_without_a_kv_decoder_is_refused(policy, monkeypatch):
    """A layout with no KV decoder (as under sequence parallelism) cannot record routing."""
    monkeypatch.setattr(decoders, "kv_decoder", lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match="KV-cache"):
        sample(policy, CharTokenizer(), PROMPTS, max_new_tokens=2, record_routing=True)


def _check_layout(tok, prompts, out, max_new_tokens):
    """[prompt][response ... stop][padding]: response_BT is the valid part after the prompt, it
    includes its stop token and nothing after one, and a row without a stop token is
    max_new_tokens long."""
    tokens_BT, valid_BT, response_BT, logp_BT, _ = out
    _, prompt_valid_BP = encode_prompts(tok, prompts)
    P = prompt_valid_BP.shape[1]
    assert not response_BT[:, :P].any() and torch.equal(valid_BT[:, :P], prompt_valid_BP)
    assert torch.equal(valid_BT[:, P:], response_BT[:, P:])  # padding after a stop is not valid
    stops = torch.tensor(sorted(tok.stop_ids))
    for row_tokens, row_resp in zip(tokens_BT, response_BT):
        n = int(row_resp.sum())
        assert row_resp[P:P + n].all()  # contiguous from the prompt's end
        resp = row_tokens[P:P + n]
        assert not torch.isin(resp[:-1], stops).any()
        assert bool(torch.isin(resp[-1:], stops).all()) or n == max_new_tokens
        assert (row_tokens[P + n:] == tok.pad_id).all()
    assert (logp_BT[~response_BT] == 0).all() and (logp_BT[response_BT] < 0).all()
    return P


def test_sampling_stops_at_the_step_the_last_row_finishes(policy):
    """The loop breaks once every row is done: the last column holds some row's stop token; a
    row done earlier has padding (not valid, not response) there."""
    tok, steps = CharTokenizer(), 30
    out = sample(policy, tok, PROMPTS, max_new_tokens=steps, temperature=1.0,
                 generator=torch.Generator().manual_seed(7))  # every row stops (by step 24)
    P = _check_layout(tok, PROMPTS, out, steps)
    tokens_BT, _, response_BT, _, _ = out
    lengths = response_BT.sum(1)
    last_B = tokens_BT.gather(1, (P + lengths - 1)[:, None]).squeeze(1)
    assert (last_B == tok.eos_id).all()
    assert tokens_BT.shape[1] - P == int(lengths.max()) < steps
    assert int(lengths.min()) < int(lengths.max())  # some rows decoded padding meanwhile


def test_every_rank_decodes_until_all_ranks_are_done(policy, monkeypatch):
    """docs/pitfalls.md#collectives in one process: the stop test goes through `all_ranks`;
    while another rank still has live rows (all_ranks -> False) this rank keeps decoding padding
    to max_new_tokens instead of breaking on its own rows."""
    tok, steps = CharTokenizer(), 30
    flags = []

    def other_rank_busy(flag):
        flags.append(flag)
        return False

    monkeypatch.setattr(decoders, "all_ranks", other_rank_busy)
    out = sample(policy, tok, PROMPTS, max_new_tokens=steps, temperature=1.0,
                 generator=torch.Generator().manual_seed(7))  # as above: all done by step 24
    P = _check_layout(tok, PROMPTS, out, steps)
    assert out[0].shape[1] == P + steps and len(flags) == steps
    assert flags[-1] is True and not out[2][:, -1].any()  # this rank was done before the end


def test_every_stop_id_ends_a_row(policy):
    """A row stops on any of `tokenizer.stop_ids` (EOS and e.g. Qwen's <|im_end|>), not just
    EOS: the stop token is the row's last response token, padding follows."""
    tok = CharTokenizer()
    base = sample(policy, tok, PROMPTS, max_new_tokens=6, greedy=True)
    P = encode_prompts(tok, PROMPTS)[0].shape[1]
    stop2 = int(base[0][0, P])  # row 0's first greedy token: make it a stop token
    assert stop2 != tok.eos_id
    tok2 = CharTokenizer()
    tok2.stop_ids = frozenset({tok.eos_id, stop2})
    out = sample(policy, tok2, PROMPTS, max_new_tokens=6, greedy=True)
    _check_layout(tok2, PROMPTS, out, 6)
    assert int(out[2][0].sum()) == 1 and int(out[0][0, P]) == stop2


def test_record_routing_takes_the_kv_decoder_even_with_kv_cache_off(policy):
    """record_routing builds the KV decoder whatever kv_cache says (only a layout without one,
    as under sequence parallelism, is refused): same draws, routing recorded."""
    tok = CharTokenizer()
    out = [sample(policy, tok, PROMPTS, max_new_tokens=3, kv_cache=kv, record_routing=True,
                  generator=torch.Generator().manual_seed(2)) for kv in (False, True)]
    assert out[0][4] is not None and torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][4].ids_NLK, out[1][4].ids_NLK)


def test_sampling_restores_the_policy_mode(policy):
    """The sampler runs the model in eval mode and leaves it as it found it."""
    was = policy.model.training
    try:
        for mode in (True, False):
            policy.train(mode)
            sample(policy, CharTokenizer(), PROMPTS, max_new_tokens=2, greedy=True)
            assert policy.model.training is mode
    finally:
        policy.train(was)
