"""Worker for the 2-process Hugging Face tests (spawned like tests/moe/platform/test_parallel.py's).

For each (model, tp, ep, sp) layout: build our policy from the Hugging Face folder in that layout,
check its logits against transformers' (computed once by the parent, float32), check that this
rank read only its shard of the checkpoint, and that the full params gathered back from the layout
export to exactly the source tensors. Each rank writes what it measured to `<ref>.rank<r>.json`.
"""

import json
import os
import re
import warnings

import torch

warnings.filterwarnings("ignore")

TOL = 1e-4
_TP_SPLIT = ("q_proj.", "k_proj.", "v_proj.", "o_proj.", "embed_tokens.", "lm_head.",
             "shared_expert.gate_proj.", "shared_expert.up_proj.", "shared_expert.down_proj.")


def build_from_hf(folder: str, real_vocab: int, tp: int = 1, ep: int = 1, sp: bool = False,
                  dispatcher: str = "alltoall"):
    """Our policy (no optimizer) with `folder`'s weights in this layout, and the reader."""
    from moe.hf.config import preset_from_hf
    from moe.hf.weights import load_hf_weights
    from moe.model.policy import MoEPolicy
    from moe.model.settings import ParallelLayout

    preset = preset_from_hf(folder)
    preset = preset.with_vocab(max(preset.vocab_size, real_vocab), multiple=128 * tp)
    layout = ParallelLayout(tp=tp, ep=ep, sequence_parallel=sp, dispatcher=dispatcher)
    policy = MoEPolicy.build(preset, layout, real_vocab=real_vocab, optim=None)
    reader = load_hf_weights(policy.model.module, folder)
    return policy, reader


def logit_diff(ours_BTV, hf_BTV, valid_BT, real_vocab: int) -> float:
    """Max |ours - transformers| over real tokens and the real vocabulary; the padded vocab
    must be -inf (masked)."""
    assert torch.isinf(ours_BTV[..., real_vocab:]).all() and (ours_BTV[..., real_vocab:] < 0).all()
    diff_NV = (ours_BTV[..., :real_vocab] - hf_BTV[..., :real_vocab])[valid_BT]
    return diff_NV.abs().max().item()


def check_reads(reader, policy, info, hf_vocab: int) -> dict:
    """This rank read each tensor at most once, only its own experts, only its TP slices, and in
    all exactly the elements it holds (vocabulary padding aside)."""
    preset, tp, ep = policy.preset, info.tp, info.ep
    per = preset.num_experts // ep
    mine = range(info.ep_rank * per, (info.ep_rank + 1) * per)
    names = [r[0] for r in reader.reads]
    assert len(names) == len(set(names)), "a tensor was read twice"
    for name, dim, start, stop, _ in reader.reads:
        if (m := re.search(r"\.experts\.(\d+)\.", name)):
            assert int(m.group(1)) in mine, f"rank {info.rank} read {name}, not its expert"
            assert dim is None
        if tp > 1 and any(k in name for k in _TP_SPLIT):
            assert dim is not None and stop - start < reader.shape(name)[dim], \
                f"rank {info.rank} read all of {name}"
    params = dict(policy.model.module.named_parameters())
    held = sum(p.numel() for p in params.values())
    rows = preset.vocab_size // tp
    first = info.tp_rank * rows
    pad_rows = max(0, first + rows - max(first, hf_vocab))
    pad = pad_rows * preset.hidden_size * (1 if preset.tie_word_embeddings else 2)
    read = sum(r[-1] for r in reader.reads)
    assert read == held - pad, f"rank {info.rank} read {read} elements, holds {held - pad}"
    total = sum(torch.Size(reader.shape(n)).numel() for n in reader.names())
    return {"read_elements": read, "checkpoint_elements": total}


def export_matches_source(policy, folder: str) -> None:
    """Full params gathered from this layout export to exactly the source tensors."""
    from moe.hf.config import read_hf_config
    from moe.hf.io import SafetensorsReader
    from moe.hf.weights import hf_tensors
    from moe.model.sharding import gather_full_params

    full = gather_full_params(policy.model.module)  # collective
    if torch.distributed.get_rank() != 0:
        return
    out = hf_tensors(full, read_hf_config(folder))
    src = SafetensorsReader(folder)
    assert set(out) == src.names(), sorted(set(out) ^ src.names())
    for name, tensor in out.items():
        assert torch.equal(tensor, src.read(name)), f"export of {name} differs"


def worker(rank: int, world: int, port: int, ref_path: str, layouts: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from moe.platform.parallel import destroy_parallel, init_parallel

    ref = torch.load(ref_path, weights_only=False)
    results = []
    try:
        for key, tp, ep, sp in layouts:
            r = ref[key]
            info = init_parallel(tp=tp, ep=ep, seed=0)
            policy, reader = build_from_hf(r["dir"], r["real_vocab"], tp, ep, sp)
            rows = slice(None)
            if info.dp > 1:
                per = r["tokens"].shape[0] // info.dp
                rows = slice(info.dp_rank * per, (info.dp_rank + 1) * per)
            with torch.no_grad():
                ours = policy.logits(r["tokens"][rows], r["valid"][rows])
            diff = logit_diff(ours, r["hf_logits"][rows], r["valid"][rows], r["real_vocab"])
            what = f"{key} tp={tp} ep={ep} sp={sp} rank={rank}"
            assert diff <= TOL, f"{what}: max abs logit diff {diff} > {TOL}"
            reads = check_reads(reader, policy, info, r["hf_vocab"])
            export_matches_source(policy, r["dir"])
            results.append({"layout": what, "max_abs_logit_diff": diff, **reads})
    finally:
        with open(f"{ref_path}.rank{rank}.json", "w") as f:
            json.dump(results, f)
        destroy_parallel()
