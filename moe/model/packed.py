"""One packed forward: the real tokens of a batch's rows as one sequence.

Shape legend: B sequences, T tokens per row, N real tokens of the rows (the pack), L = N + the
alignment padding (the positions the forward runs), P the positions the output layer projects,
S segments (the sequences, and the alignment padding as one more).

`Pack.of(valid_BT, multiple)` lists the real tokens of the rows in (row, position) order, the
order of `moe.routing.replay.RoutingReplayCache`, so a cache's tokens are the pack's tokens.
The forward sees one [1, L] sequence cut into segments by `cu_seqlens` (megatron's
`PackedSeqParams`, the `thd` format): rotary positions restart at 0 in every segment and no
token attends across segments (`moe.model.packed_attention`), which is the padded forward's
attention over each row's real tokens (causal, padding keys hidden); RoPE depends only on
position differences, so a row's left padding never mattered and the two agree to float
rounding (tests/moe/model/test_packed.py). Under sequence parallelism L is N rounded up to a
multiple of the TP size (`multiple`), once per pack, never per row; the padding positions are a
segment of their own that nothing reads.

A hole in a row's valid mask is closed up (the row's real tokens are consecutive in the pack);
the trainer's rows never have one (left-padded prompt, response, right padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pack:
    """Where each real token of a [B, T] batch sits in its packed forward."""

    flat_N: torch.Tensor
    """b * T + t of each real token, row by row (int64, on the batch's device)."""
    row_starts: torch.Tensor
    """[B + 1] offsets of each row's tokens in the pack (the last one is N)."""
    B: int
    T: int
    pad: int
    """Alignment positions after the N real tokens (L = N + pad is a multiple of `multiple`)."""

    @classmethod
    def of(cls, valid_BT: torch.Tensor, multiple: int = 1) -> "Pack":
        B, T = valid_BT.shape
        valid_BT = valid_BT.bool()
        flat_N = valid_BT.reshape(-1).nonzero()[:, 0]
        row_starts = torch.zeros(B + 1, dtype=torch.long, device=valid_BT.device)
        row_starts[1:] = valid_BT.sum(1).cumsum(0)
        n = int(row_starts[-1])
        return cls(flat_N, row_starts, B, T, (-n) % multiple)

    @property
    def n(self) -> int:
        return self.flat_N.shape[0]

    @property
    def length(self) -> int:
        """L: the positions the packed forward runs."""
        return self.n + self.pad

    def cu_seqlens(self) -> torch.Tensor:
        """int32 [S + 1] segment boundaries on the host: every row with a token, then the
        alignment padding (when there is some)."""
        starts = self.row_starts.cpu()
        bounds = torch.unique_consecutive(starts)  # rows without a token add no segment
        if self.pad:
            bounds = torch.cat([bounds, bounds.new_tensor([self.length])])
        return bounds.to(torch.int32)

    def tokens(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """[1, L] token ids: the real tokens, then `pad` zeros."""
        flat = tokens_BT.reshape(-1)[self.flat_N.to(tokens_BT.device)]
        return torch.cat([flat, flat.new_zeros(self.pad)])[None]

    def positions(self) -> torch.Tensor:
        """[1, L] position ids restarting at 0 in every segment (what RoPE sees under thd)."""
        cu = self.cu_seqlens().long()
        lengths = cu[1:] - cu[:-1]
        starts = torch.repeat_interleave(cu[:-1], lengths)
        return (torch.arange(self.length) - starts)[None].to(self.flat_N.device)

    def predictions(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pred_P, target_P): the packed positions whose next-token logits score a real token
        at a column >= `start` (each row's first token has no prediction in the row), and that
        token's flat index b * T + t."""
        col_N = self.flat_N % self.T
        first_N = torch.zeros_like(col_N, dtype=torch.bool)
        first_N[self.row_starts[:-1][self.row_starts[:-1] < self.n]] = True
        hit_N = (col_N >= start) & ~first_N
        target_P = self.flat_N[hit_N]
        return hit_N.nonzero()[:, 0] - 1, target_P

    def positions_at(self, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pos_P, flat_P): the packed positions of the real tokens at columns >= `first`, and
        their flat index (what a logits call from `first` returns)."""
        hit_N = self.flat_N % self.T >= first
        return hit_N.nonzero()[:, 0], self.flat_N[hit_N]

    def scatter(self, x_P: torch.Tensor, flat_P: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Values at flat indices `flat_P` back into the rows: [B, T - first, ...], zeros where
        nothing was computed (padding, columns without a prediction). Differentiable in x."""
        out = x_P.new_zeros((self.B * self.T, *x_P.shape[1:]))
        out = out.index_put((flat_P.to(x_P.device),), x_P)
        return out.reshape(self.B, self.T, *x_P.shape[1:])[:, first:]
