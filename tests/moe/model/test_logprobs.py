"""`moe.model.logprobs`: chunked float32 token log-probs against float64 references and against the
plain float32 log-softmax path they replaced."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe.model.logprobs
from moe.model.logprobs import chunked_token_logprobs, plain_token_logprobs


def _reference(x_BSV, target_BS, vocab, tau):
    """float64 log-probs, entropy and d(sum w * logp)/dx of the same logits."""
    x64 = x_BSV.detach().double().requires_grad_(True)
    logp_BSU = torch.log_softmax(x64[..., :vocab] / tau, dim=-1)
    logp_BS = logp_BSU.gather(-1, target_BS[..., None]).squeeze(-1)
    p = logp_BSU.exp()
    entropy_BS = -(p * logp_BSU).sum(-1)
    weights_BS = torch.linspace(-1, 2, logp_BS.numel(), dtype=torch.float64).view_as(logp_BS)
    (logp_BS * weights_BS).sum().backward()
    return logp_BS.detach(), entropy_BS.detach(), x64.grad, weights_BS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tau,chunk", [(1.0, 1 << 24), (0.7, 40)])
def test_matches_float64_log_softmax_values_entropy_and_grads(dtype, tau, chunk, monkeypatch):
    """Padded vocabulary (V=48, U=41) excluded; several chunks (chunk=40 elements: less than
    one row of 41 -> one token per chunk); the grad is zero on the padded columns."""
    monkeypatch.setattr(moe.model.logprobs, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(0)
    x_BSV = (torch.randn(3, 5, 48, generator=g) * 3).to(dtype).requires_grad_(True)
    target_BS = torch.randint(0, 41, (3, 5), generator=g)
    want_logp, want_entropy, want_grad, w_BS = _reference(x_BSV, target_BS, 41, tau)
    logp_BS, entropy_BS = chunked_token_logprobs(x_BSV, target_BS, 41, tau, with_entropy=True)
    assert logp_BS.dtype == entropy_BS.dtype == torch.float32
    assert not entropy_BS.requires_grad
    torch.testing.assert_close(logp_BS.double(), want_logp, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(entropy_BS.double(), want_entropy, atol=2e-6, rtol=1e-6)
    (logp_BS * w_BS.float()).sum().backward()
    assert x_BSV.grad.dtype == dtype and (x_BSV.grad[..., 41:] == 0).all()
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(x_BSV.grad.double(), want_grad, atol=tol, rtol=tol)


def test_masked_logits_get_no_probability():
    x_BSV = torch.randn(2, 3, 8).bfloat16()
    x_BSV[..., 6:] = float("-inf")
    target_BS = torch.randint(0, 6, (2, 3))
    logp_BS, entropy_BS = chunked_token_logprobs(x_BSV, target_BS, 8, with_entropy=True)
    want_logp, want_entropy, _, _ = _reference(x_BSV[..., :6], target_BS, 6, 1.0)
    torch.testing.assert_close(logp_BS.double(), want_logp, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(entropy_BS.double(), want_entropy, atol=2e-6, rtol=1e-6)


def test_keeps_no_float32_copy_of_the_logits_for_the_backward():
    """What autograd saves: the bf16 logits themselves and the [B, S] targets; the plain path
    saves a float32 [B, S, V] log-softmax on top."""
    x_BSV = torch.randn(2, 16, 1000).bfloat16().requires_grad_(True)
    target_BS = torch.randint(0, 1000, (2, 16))

    def saved_bytes(fn) -> int:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t) or t, lambda t: t):
            fn()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in saved if t.data_ptr() != x_BSV.data_ptr()}
        return sum(storages.values())

    ours = saved_bytes(lambda: chunked_token_logprobs(x_BSV, target_BS, 1000))
    plain = saved_bytes(lambda: torch.log_softmax(x_BSV.float(), -1).gather(
        -1, target_BS[..., None]))
    assert ours <= 2 * 16 * 8  # the int64 targets
    assert plain >= 2 * 16 * 1000 * 4


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="vocab 9"):
        chunked_token_logprobs(torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.long), 9)
    with pytest.raises(ValueError, match="vocab 0"):
        chunked_token_logprobs(torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.long), 0)


def test_chunks_bound_the_float32_scratch(monkeypatch):
    """Each chunk's float32 [b, s, U] scratch stays within CHUNK_ELEMENTS (at least one token):
    whole sequences while one fits (100 elements, S=4, U=10 -> 2 sequences a chunk, sized by U,
    not by the padded V=16), else runs of positions (S=10, U=30 -> 3 tokens a chunk)."""
    monkeypatch.setattr(moe.model.logprobs, "CHUNK_ELEMENTS", 100)
    every = slice(None)
    assert moe.model.logprobs._chunks(torch.zeros(5, 4, 16), 10) == [
        (slice(0, 2), every), (slice(2, 4), every), (slice(4, 6), every)]
    assert moe.model.logprobs._chunks(torch.zeros(2, 4, 25), 25) == [(slice(0, 1), every),
                                                             (slice(1, 2), every)]
    assert moe.model.logprobs._chunks(torch.zeros(2, 10, 32), 30) == [
        (slice(b, b + 1), slice(s, s + 3)) for b in range(2) for s in range(0, 10, 3)]
    assert moe.model.logprobs._chunks(torch.zeros(1, 2, 500), 500)[0] == (slice(0, 1), slice(0, 1))


class _Float32Tensors(TorchDispatchMode):
    """The sizes of the float32 tensors ops create within."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.sizes.append(t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_long_sequence_needs_no_float32_copy_of_its_logits(monkeypatch, dtype):
    """One sequence of 50 positions over a vocabulary of 20 (1,000 logits), chunks of 100
    elements: no op of the forward (with entropy) creates a float32 tensor larger than a chunk,
    nor the backward beyond the logits' grad itself (float32 for float32 logits); the plain
    path creates [S, U] ones in both."""
    monkeypatch.setattr(moe.model.logprobs, "CHUNK_ELEMENTS", 100)
    g = torch.Generator().manual_seed(1)
    x_BSV = torch.randn(1, 50, 20, generator=g).to(dtype).requires_grad_(True)
    target_BS = torch.randint(0, 20, (1, 50), generator=g)
    for fn, big in ((chunked_token_logprobs, []), (plain_token_logprobs, [1000])):
        with _Float32Tensors() as forward:
            logp_BS, _ = fn(x_BSV, target_BS, 20, 0.8, with_entropy=True)
        with _Float32Tensors() as backward:
            torch.autograd.grad(logp_BS.sum(), x_BSV)
        assert [n for n in forward.sizes if n > 100][:1] == big, fn.__name__
        grad = [1000] if dtype == torch.float32 else []
        assert [n for n in backward.sizes if n > 100][:1] == (big or grad), fn.__name__
        if fn is chunked_token_logprobs:
            assert [n for n in backward.sizes if n > 100] == grad


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_float32_parity_with_the_plain_path(monkeypatch, tau):
    """fp32 logits, several token chunks: log-probs, entropy and grads equal the plain float32
    log-softmax path (what fp32 policies computed before) to 1e-5."""
    monkeypatch.setattr(moe.model.logprobs, "CHUNK_ELEMENTS", 3 * 41)
    g = torch.Generator().manual_seed(4)
    x_BSV = (torch.randn(3, 7, 48, generator=g) * 4).requires_grad_(True)
    target_BS = torch.randint(0, 41, (3, 7), generator=g)
    w_BS = torch.randn(3, 7, generator=g)
    got, want = (fn(x_BSV, target_BS, 41, tau, with_entropy=True)
                 for fn in (chunked_token_logprobs, plain_token_logprobs))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    grads = [torch.autograd.grad((logp * w_BS).sum(), x_BSV)[0] for logp, _ in (got, want)]
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_policy_logprobs_take_the_chunked_path(single_process, monkeypatch, dtype):
    """A policy's token_logprobs (and entropy), whatever its dtype, equal float64 log-softmax of
    its own logits, zero before `start` with or without the entropy, through the chunks."""
    from tests.moe.model.test_experts import build

    calls = []
    real = moe.model.logprobs.ChunkedTokenLogProb.apply
    monkeypatch.setattr(moe.model.logprobs.ChunkedTokenLogProb, "apply",
                        lambda *a: calls.append(1) or real(*a))
    policy = build("qwen3-moe-tiny", dtype=dtype)
    g = torch.Generator().manual_seed(2)
    tokens_BT = torch.randint(0, 26, (3, 10), generator=g)
    valid_BT = torch.ones(3, 10, dtype=torch.bool)
    with torch.no_grad():
        logits_BTV = policy._raw_logits(tokens_BT, valid_BT, 3)[:, :-1]
        logp_BT, entropy_BT = policy.token_logprobs(tokens_BT, valid_BT, 0.9, True, start=4)
        assert torch.equal(policy.token_logprobs(tokens_BT, valid_BT, 0.9, start=4), logp_BT)
    assert calls == [1, 1]
    want_logp, want_entropy, _, _ = _reference(logits_BTV, tokens_BT[:, 4:],
                                               policy.real_vocab, 0.9)
    assert (logp_BT[:, :4] == 0).all() and (entropy_BT[:, :4] == 0).all()
    torch.testing.assert_close(logp_BT[:, 4:].double(), want_logp, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(entropy_BT[:, 4:].double(), want_entropy, atol=2e-6, rtol=1e-6)
