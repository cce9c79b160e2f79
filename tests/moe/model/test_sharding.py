"""moe.model.sharding on a hand-made TP=2 x EP=2 parameter set, in one process.

The parameters carry the attributes megatron-core puts on real ones (`tensor_model_parallel`,
`partition_dim`, `partition_stride`) and the `is_moe_expert` tag, so the expected slices are
written out by hand here instead of coming from a model (the 2-process checks of the same code
are in tests/moe/platform/test_parallel.py).
"""

import pytest
import torch

from moe.model import sharding

TP, EP, E_LOCAL = 2, 2, 2
EXPERT = "decoder.layers.0.mlp.experts.linear_fc1.weight"  # stacked: [E, 6, 4]
# name: (full shape, tensor_model_parallel, partition_dim, partition_stride)
SPEC = {
    "embedding.word_embeddings.weight": ((8, 4), True, 0, 1),
    "decoder.layers.0.self_attention.linear_proj.weight": ((4, 6), True, 1, 1),
    "decoder.layers.0.mlp.shared_experts.linear_fc1.weight": ((8, 4), True, 0, 2),  # [gate; up]
    "decoder.final_layernorm.weight": ((4,), False, 0, 1),
    EXPERT: ((EP * E_LOCAL, 6, 4), True, 1, 1),
}


def _full() -> dict[str, torch.Tensor]:
    """Every entry distinct, so a wrong slice or a wrong expert is never equal by chance."""
    out, start = {}, 0
    for name, (shape, *_) in SPEC.items():
        n = torch.Size(shape).numel()
        out[name] = torch.arange(start, start + n, dtype=torch.float64).reshape(shape)
        start += n
    return out


def _expected_local(full: dict, tp_rank: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """Rank (tp_rank, ep_rank)'s tensors, sliced by hand."""
    r = tp_rank
    fc1 = full["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"]
    local = {
        "embedding.word_embeddings.weight":
            full["embedding.word_embeddings.weight"][4 * r:4 * r + 4],
        "decoder.layers.0.self_attention.linear_proj.weight":
            full["decoder.layers.0.self_attention.linear_proj.weight"][:, 3 * r:3 * r + 3],
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight":
            torch.cat([fc1[2 * r:2 * r + 2], fc1[4 + 2 * r:4 + 2 * r + 2]]),
        "decoder.final_layernorm.weight": full["decoder.final_layernorm.weight"],
    }
    local[EXPERT] = full[EXPERT][ep_rank * E_LOCAL:(ep_rank + 1) * E_LOCAL]
    return local


class _Model:
    """What moe.model.sharding reads of a model: `named_parameters()` with megatron's attributes."""

    def __init__(self, local: dict[str, torch.Tensor]):
        self.params = {}
        for name, tensor in local.items():
            expert = ".mlp.experts." in name
            _, tp_split, dim, stride = SPEC[name]
            p = torch.nn.Parameter(tensor.clone(), requires_grad=False)
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = tp_split, dim, stride
            p.is_moe_expert = expert
            self.params[name] = p

    def named_parameters(self):
        return iter(self.params.items())


@pytest.mark.parametrize("tp_rank, ep_rank", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_shard_from_full_gives_each_rank_its_slices(tp_rank, ep_rank):
    """TP params split along their partition dim (a gated fc1 per half), stacked experts split
    along their expert dim by EP rank (never by TP), the rest replicated."""
    full = _full()
    want = _expected_local(full, tp_rank, ep_rank)
    got = sharding.shard_from_full(_Model(want), full, tp_rank, TP, ep_rank, EP)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_merge_inverts_take():
    """Merging every rank's `take` gives back the full tensor (plain and gated TP splits, the
    EP split of the experts)."""
    full = _full()
    for name, (_, _, dim, stride) in SPEC.items():
        if name == EXPERT:
            dim, stride = 0, 1
        shard = sharding.Shard(dim, 0, TP, glu=stride == 2)
        parts = [sharding.Shard(dim, r, TP, glu=stride == 2).take(full[name])
                 for r in range(TP)]
        assert torch.equal(shard.merge(parts), full[name]), name


def test_shard_from_full_names_missing_and_misshapen_entries():
    full = _full()
    model = _Model(_expected_local(full, 0, 1))
    del full[EXPERT]
    with pytest.raises(KeyError, match=r"no entry 'decoder.layers.0.mlp.experts.linear_fc1"):
        sharding.shard_from_full(model, full, 0, TP, 1, EP)
    full = _full()
    full["decoder.final_layernorm.weight"] = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"final_layernorm.weight: shard shape \(5,\) != param "
                                         r"shape \(4,\)"):
        sharding.shard_from_full(model, full, 0, TP, 1, EP)
    full = _full()
    full[EXPERT] = full[EXPERT][:3]  # 3 experts cannot split 2 ways into the model's 2
    with pytest.raises(ValueError, match=r"linear_fc1.weight: shard shape \(1, 6, 4\)"):
        sharding.shard_from_full(model, full, 0, TP, 1, EP)


def test_gather_full_params_reassembles_tp_and_ep_shards(monkeypatch):
    """From TP rank 0 / EP rank 0: TP params gathered and merged, every EP rank's experts
    stacked in EP rank order (the collectives replaced by the other ranks' known slices)."""
    from megatron.core import parallel_state as ps

    full = _full()
    ranks = {(t, e): _expected_local(full, t, e) for t in range(TP) for e in range(EP)}
    model = _Model(ranks[(0, 0)])

    def all_gather(parts, tensor, group):
        name = next(n for n, p in model.params.items() if p.data_ptr() == tensor.data_ptr())
        for r, part in enumerate(parts):
            part.copy_(ranks[(r, 0) if group == "tp" else (0, r)][name])

    for fn, value in [("get_tensor_model_parallel_world_size", TP),
                      ("get_expert_model_parallel_world_size", EP),
                      ("get_tensor_model_parallel_rank", 0),
                      ("get_expert_model_parallel_rank", 0),
                      ("get_tensor_model_parallel_group", "tp"),
                      ("get_expert_model_parallel_group", "ep")]:
        monkeypatch.setattr(ps, fn, lambda v=value: v)
    monkeypatch.setattr(sharding.dist, "all_gather", all_gather)
    got = sharding.gather_full_params(model)
    assert got.keys() == full.keys()
    for name in full:
        assert torch.equal(got[name], full[name]), name
