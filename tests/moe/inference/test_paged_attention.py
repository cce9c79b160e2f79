"""moe.inference.paged_attention against dense causal attention in float64, on CPU."""

import math

import pytest
import torch

from moe.inference.paged_attention import paged_attention


def pages_of(seqs_k, seqs_v, S, P, M, generator):
    """Scatter each request's [L_r, G, D] keys / values into shuffled pages of S tokens:
    (k pages [P, S, G, D], v pages, block table [R, M] with garbage past each request)."""
    G, D = seqs_k[0].shape[1:]
    k_PSGD = torch.randn(P, S, G, D, dtype=torch.float64, generator=generator)
    v_PSGD = torch.randn(P, S, G, D, dtype=torch.float64, generator=generator)
    free = torch.randperm(P, generator=generator).tolist()
    table = torch.randint(0, P, (len(seqs_k), M), generator=generator)
    for r, (k, v) in enumerate(zip(seqs_k, seqs_v)):
        for m in range(math.ceil(k.shape[0] / S)):
            page = free.pop()
            table[r, m] = page
            rows = slice(m * S, min((m + 1) * S, k.shape[0]))
            k_PSGD[page, :rows.stop - rows.start] = k[rows]
            v_PSGD[page, :rows.stop - rows.start] = v[rows]
    return k_PSGD, v_PSGD, table


def dense_reference(q_LHD, k_LGD, v_LGD, q_len):
    """The last q_len query rows of causal attention over one request's L tokens."""
    L, H, D = q_LHD.shape
    G = k_LGD.shape[1]
    k_LHD = k_LGD.repeat_interleave(H // G, dim=1)
    v_LHD = v_LGD.repeat_interleave(H // G, dim=1)
    out = []
    for t in range(L - q_len, L):
        scores_HL = torch.einsum("hd,lhd->hl", q_LHD[t], k_LHD[:t + 1]) / math.sqrt(D)
        out.append(torch.einsum("hl,lhd->hd", scores_HL.softmax(-1), v_LHD[:t + 1]))
    return torch.stack(out)


@pytest.mark.parametrize("q_lens, k_lens", [
    ([5, 1, 3], [5, 9, 3]),        # prefill of two new requests beside one decoding
    ([1, 1, 1, 1], [7, 1, 12, 4]),  # decode only
    ([4, 0], [4, 0]),              # a padding request (length 0) at the end
])
def test_paged_attention_equals_dense_causal_attention(q_lens, k_lens):
    g = torch.Generator().manual_seed(0)
    H, G, D, S, M, P = 4, 2, 8, 4, 4, 16
    qs = [torch.randn(L, H, D, dtype=torch.float64, generator=g) for L in k_lens]
    ks = [torch.randn(L, G, D, dtype=torch.float64, generator=g) for L in k_lens]
    vs = [torch.randn(L, G, D, dtype=torch.float64, generator=g) for L in k_lens]
    k_PSGD, v_PSGD, table = pages_of(ks, vs, S, P, M, g)
    q_N1HD = torch.cat([q[L - n:] for q, L, n in zip(qs, k_lens, q_lens)])[:, None]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = paged_attention(q_N1HD, k_PSGD, v_PSGD, cu, torch.tensor(k_lens, dtype=torch.int32),
                          table, max(q_lens))
    assert out.shape == q_N1HD.shape
    assert torch.isfinite(out).all()
    for r, (n, L) in enumerate(zip(q_lens, k_lens)):
        if n:
            rows = slice(cu[r].item(), cu[r + 1].item())
            torch.testing.assert_close(out[rows, 0], dense_reference(qs[r], ks[r], vs[r], n))


def test_padding_tokens_past_the_last_request_leave_real_rows_alone():
    """The engine pads a step's token count: rows past cu[R] must not overwrite real queries."""
    g = torch.Generator().manual_seed(2)
    H, G, D, S, M, P = 2, 1, 8, 4, 2, 6
    k_lens = [3, 5]
    qs = [torch.randn(L, H, D, dtype=torch.float64, generator=g) for L in k_lens]
    ks = [torch.randn(L, G, D, dtype=torch.float64, generator=g) for L in k_lens]
    vs = [torch.randn(L, G, D, dtype=torch.float64, generator=g) for L in k_lens]
    k_PSGD, v_PSGD, table = pages_of(ks, vs, S, P, M, g)
    real = torch.cat(qs)[:, None]
    padded = torch.cat([real, torch.randn(3, 1, H, D, dtype=torch.float64, generator=g)])
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    out = paged_attention(padded, k_PSGD, v_PSGD, cu, torch.tensor(k_lens), table, 5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:3, 0], dense_reference(qs[0], ks[0], vs[0], 3))
    torch.testing.assert_close(out[3:8, 0], dense_reference(qs[1], ks[1], vs[1], 5))


def test_decode_signature_builds_its_own_query_offsets():
    """The engine's decode-only call passes one query per request: same result as prefill
    offsets [0, 1, ..., R]."""
    from moe.inference.paged_attention import flash_decode_and_prefill

    g = torch.Generator().manual_seed(1)
    k_lens = [3, 6]
    ks = [torch.randn(L, 1, 8, dtype=torch.float64, generator=g) for L in k_lens]
    vs = [torch.randn(L, 1, 8, dtype=torch.float64, generator=g) for L in k_lens]
    k_PSGD, v_PSGD, table = pages_of(ks, vs, 4, 8, 2, g)
    q_N1HD = torch.randn(2, 1, 2, 8, dtype=torch.float64, generator=g)
    seqlens = torch.tensor(k_lens, dtype=torch.int32)
    decode = flash_decode_and_prefill(object(), q_N1HD, k_PSGD, v_PSGD, 99, 99, None, None,
                                      seqlens, table, True)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    torch.testing.assert_close(decode, paged_attention(q_N1HD, k_PSGD, v_PSGD, cu, seqlens,
                                                       table, 1))
