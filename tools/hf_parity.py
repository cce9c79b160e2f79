"""Check your own Hugging Face MoE checkpoint against this project's megatron-core model.

Usage:
    python -m tools.hf_parity --hf-path /models/Qwen3-30B-A3B
    torchrun --nproc-per-node 2 -m tools.hf_parity --hf-path DIR --tp 2 --ep 2
    python -m tools.hf_parity --hf-path DIR --prompt "12+30=" --max-new-tokens 32 --tol 1e-3

Loads the folder into our model in the given layout (each rank reads only its shard), samples
greedily from our model, then runs transformers' model (rank 0 only, the whole model in float32
on the CPU: a 30B model needs ~120 GB of memory there; a smaller cousin checks the same mapping)
and compares:
- logits on prompt + our greedy continuation (teacher-forced, every real token, the tokenizer's
  vocabulary): the max abs difference;
- greedy generation, `--max-new-tokens` from each prompt: greedy_match is the fraction of
  generated positions where both picked the same token (a length difference counts as misses).
Prompts go through the tokenizer's chat template when it has one.

The last line is `max_abs_logit_diff=<x> greedy_match=<frac>`; the exit status is 1 when the
difference exceeds `--tol` or greedy_match is below `--min-greedy-match` (default 0: reported,
not enforced, since a near-tie may flip a greedy pick within tolerance), else 0; a bad folder,
config.json or layout is one line `hf_parity: error: ...` and status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")  # megatron's install notes at import: before the imports below

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_gspo.rollout.decoders import sample_prompts  # noqa: E402
from megatron_gspo.rollout.sampler import SamplingParams  # noqa: E402
from megatron_gspo.tasks.tokenizer import load_tokenizer  # noqa: E402
from moe.hf.config import preset_from_hf  # noqa: E402
from moe.hf.weights import load_hf_weights  # noqa: E402
from moe.platform.parallel import destroy_parallel, init_parallel  # noqa: E402
from moe.model.policy import MoEPolicy  # noqa: E402
from moe.model.settings import ParallelLayout  # noqa: E402

DEFAULT_PROMPTS = ("What is 12 + 30?", "Name three primary colors.", "The capital of France is")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-path", required=True, help="local Hugging Face model folder")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (SP is on for tp>1)")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--tol", type=float, default=1e-4, help="max abs logit diff allowed")
    p.add_argument("--min-greedy-match", type=float, default=0.0)
    return p.parse_args(argv)


def our_side(args, tokenizer, prompts):
    """Our greedy samples (all ranks take part) and our logits on them."""
    preset = preset_from_hf(args.hf_path)
    preset = preset.with_vocab(max(preset.vocab_size, tokenizer.vocab_size), 128 * args.tp)
    layout = ParallelLayout(tp=args.tp, ep=args.ep, sequence_parallel=args.tp > 1)
    policy = MoEPolicy.build(preset, layout, real_vocab=tokenizer.vocab_size, optim=None)
    load_hf_weights(policy.model.module, args.hf_path)
    policy.train(False)
    s = sample_prompts(policy, tokenizer, prompts,
                       SamplingParams(max_new_tokens=args.max_new_tokens, greedy=True))
    tokens_BT, valid_BT, response_BT = s.tokens_BT, s.valid_BT, s.response_BT

    with torch.no_grad():
        logits_BTV = policy.logits(tokens_BT, valid_BT)[..., :tokenizer.vocab_size]
    responses = [row[mask].tolist() for row, mask in zip(tokens_BT, response_BT)]
    return tokens_BT, valid_BT, logits_BTV, responses


def hf_side(args, tokenizer, prompts, tokens_BT, valid_BT):
    """transformers' logits on our sequences and its own greedy generations."""
    from transformers import AutoModelForCausalLM  # optional dependency ([hf] extra)

    hf = AutoModelForCausalLM.from_pretrained(args.hf_path, dtype=torch.float32,
                                              local_files_only=True).eval()
    with torch.no_grad():
        logits_BTV = hf(tokens_BT, attention_mask=valid_BT.long()).logits.float()
        generations = []
        for prompt in prompts:
            bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
            ids = torch.tensor([bos + tokenizer.encode(prompt)])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=args.max_new_tokens,
                              eos_token_id=sorted(tokenizer.stop_ids),
                              pad_token_id=tokenizer.pad_id)
            generations.append(out[0, ids.shape[1]:].tolist())
    return logits_BTV[..., :tokenizer.vocab_size], generations


def greedy_match(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Fraction of generated positions with the same token (length differences are misses)."""
    same = total = 0
    for a, b in zip(ours, theirs):
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
    return same / max(total, 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return check(args)
    except (FileNotFoundError, ValueError, KeyError) as e:  # a bad folder, config or layout
        if os.environ.get("RANK", "0") == "0":
            print(f"hf_parity: error: {e.args[0] if isinstance(e, KeyError) else e}",
                  file=sys.stderr, flush=True)
        return 2


def check(args: argparse.Namespace) -> int:
    """Both sides and the comparison (see the module docstring); the exit status."""
    ours_to_close = not dist.is_initialized()  # leave a caller's process group alone
    preset = preset_from_hf(args.hf_path)  # before any process group: a bad folder or layout
    preset.with_vocab(preset.vocab_size, args.tp).check_parallel(args.tp, args.ep)
    try:
        info = init_parallel(args.tp, args.ep)
    except ValueError as e:  # a world size the layout does not divide
        raise ValueError(f"--tp {args.tp} / --ep {args.ep}: {e} (torchrun --nproc-per-node N)"
                         ) from None
    tokenizer = load_tokenizer(args.hf_path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) or p
               for p in (args.prompt or DEFAULT_PROMPTS)]
    tokens_BT, valid_BT, ours_BTV, responses = our_side(args, tokenizer, prompts)
    status = 0
    if info.is_main:
        hf_BTV, generations = hf_side(args, tokenizer, prompts, tokens_BT, valid_BT)
        diff = (ours_BTV - hf_BTV)[valid_BT].abs().max().item()
        match = greedy_match(responses, generations)
        for prompt, a, b in zip(prompts, responses, generations):
            print(f"{'same' if a == b else 'DIFF'} {prompt!r}: ours {tokenizer.decode(a)!r} "
                  f"| transformers {tokenizer.decode(b)!r}")
        print(f"max_abs_logit_diff={diff:.3e} greedy_match={match:.4f}", flush=True)
        status = int(not (diff <= args.tol and match >= args.min_greedy_match))
    if ours_to_close:
        destroy_parallel()
    return status


if __name__ == "__main__":
    sys.exit(main())
