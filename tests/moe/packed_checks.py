"""The packed-forward checks of the 2-process gloo equivalence tests (`parallel_worker.worker`
runs them under each layout after the padded ones)."""

import pytest
import torch

from tests.moe.grads import dense_cache
from tests.moe.parallel_worker import ATOL, RTOL, run_model


def check_packed(policy, ref, rows, tokens_BT, valid_BT, readout_BTV, what) -> None:
    """Packed forwards (`moe.model.packed`: the rows' real tokens as one sequence, under SP
    padded to a multiple of TP once and split over the TP ranks) under this layout: the
    1-process logits, grads and grad norm at the real tokens; the recorded routing is the
    1-process routing of every token of the rows on every TP rank (gathered); a forced
    routing replays token for token in two packings of the rows (misplaced routes would move
    the logits: tests/moe/routing/test_replay_packed.py)."""
    from moe.model.policy import packable
    from moe.model.sharding import gather_full_params
    from moe.routing.replay import current_routing, replay_routing

    if policy.layout.ep > 1 and policy.layout.dispatcher == "allgather":
        with pytest.raises(ValueError, match="all-to-all token dispatcher"):
            packable(policy.layout)  # refused: its all-gather needs equal counts on EP ranks
        return
    policy.pack = True
    try:
        logits, grad_norm = run_model(policy, tokens_BT, valid_BT, readout_BTV)
        torch.testing.assert_close(logits[valid_BT], ref["logits"][rows][valid_BT], atol=ATOL,
                                   rtol=RTOL, msg=lambda m: f"{what}, packed: logits: {m}")
        for name, g in gather_full_params(policy.model.module, grads=True).items():
            torch.testing.assert_close(g, ref["grads"][name], atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{what}, packed: grad {name}: {m}")
        assert abs(grad_norm - ref["grad_norm"]) <= 1e-5 * max(1.0, ref["grad_norm"]), what
        policy.zero_grad()
        B = tokens_BT.shape[0]
        _, recorded = current_routing(policy, tokens_BT, valid_BT, chunks=[
            torch.arange(B - 1, -1, -1)])  # one pack, rows reversed
        want = ref["live_ids_BTLK"][rows][valid_BT]
        assert torch.equal(recorded.ids_NLK.long().sort(-1).values, want.sort(-1).values), \
            f"{what}, packed: recorded routing"
        forced = dense_cache(ref["forced_ids_BTLK"][rows], valid_BT, policy.preset.num_experts)
        for chunks in ([torch.arange(B)], [torch.arange(B)[1::2], torch.arange(B)[0::2]]):
            for part in chunks:
                with torch.no_grad(), replay_routing(policy, forced.select(part)):
                    got = policy.logits(tokens_BT[part], valid_BT[part])
                torch.testing.assert_close(
                    got[valid_BT[part]], ref["forced_logits"][rows][part][valid_BT[part]],
                    atol=ATOL, rtol=RTOL,
                    msg=lambda m: f"{what}, packed: replayed logits of rows {part}: {m}")
    finally:
        policy.pack = False
