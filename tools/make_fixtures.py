"""Write the GSM8K-style fixture: word problems as verl-schema JSONL and a small BPE tokenizer.

Usage:
    python tools/make_fixtures.py                          # -> tests/fixtures/gsm_tiny
    python tools/make_fixtures.py --out DIR --n-train 180 --n-test 20

Nothing is downloaded. Problems come from 10 templates of grade-school arithmetic (one to three
steps, integer or decimal answers) filled with seeded random names and numbers; each row has a
worked solution ending in "#### <answer>" (the SFT target, `extra_info.answer`) and the bare
answer as `reward_model.ground_truth`, as verl's examples/data_preprocess/gsm8k.py writes GSM8K.
The tokenizer is a byte-level BPE trained on those texts with `tokenizers` (vocab 512, ChatML
chat template, eos = <|im_end|>, pad = <|endoftext|>, no bos), saved as tokenizer.json +
tokenizer_config.json, loadable by `megatron_gspo.tasks.tokenizer.load_tokenizer(DIR)`.

Output is byte-for-byte deterministic for the same seed and `tokenizers` version
(tests/tools/test_make_fixtures.py regenerates and compares).
"""

from __future__ import annotations

import argparse
import json
import os
import random

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                   "fixtures", "gsm_tiny")
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NAMES = ["Ava", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jamal",
         "Kira", "Leo", "Maya", "Noah", "Olga", "Pablo"]
ITEMS = ["apple", "marble", "sticker", "pencil", "cookie", "card"]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _problem(kind: int, r: random.Random) -> tuple[str, str, str]:
    """(question, worked solution without the final line, answer) of template `kind`."""
    n, m, item = r.choice(NAMES), r.choice(NAMES), r.choice(ITEMS)
    if kind == 0:
        a, b, c = r.randint(2, 30), r.randint(2, 9), r.randint(2, 12)
        ans = a + b * c
        return (f"{n} has {a} {item}s. {n} buys {b} packs with {c} {item}s in each pack. How "
                f"many {item}s does {n} have now?",
                f"The packs hold {b} * {c} = {b * c} {item}s. {n} now has {a} + {b * c} = {ans} "
                f"{item}s.", _num(ans))
    if kind == 1:
        a, b, c = r.randint(8, 25), r.randint(2, 8), r.randint(2, 6)
        ans = a * b * c
        return (f"{n} earns ${a} an hour and works {b} hours a day. How much does {n} earn in "
                f"{c} days?",
                f"In one day {n} earns {a} * {b} = {a * b} dollars. In {c} days that is "
                f"{a * b} * {c} = {ans} dollars.", _num(ans))
    if kind == 2:
        b, each = r.randint(2, 9), r.randint(2, 12)
        a = b * each
        return (f"{n} bakes {a} cookies and shares them equally among {b} friends. How many "
                f"cookies does each friend get?",
                f"Each friend gets {a} / {b} = {each} cookies.", _num(each))
    if kind == 3:
        a, b, c = r.randint(20, 60), r.randint(2, 19), r.randint(2, 15)
        ans = a - b + c
        return (f"A tank holds {a} liters of water. {n} drains {b} liters and then adds {c} "
                f"liters. How many liters are in the tank now?",
                f"After draining, the tank holds {a} - {b} = {a - b} liters. After adding, it "
                f"holds {a - b} + {c} = {ans} liters.", _num(ans))
    if kind == 4:
        a, b = 2 * r.randint(5, 30), r.randint(1, 20)
        ans = a // 2 + b
        return (f"{n} had {a} {item}s and gave half of them to {m}. Then {n} found {b} more. "
                f"How many {item}s does {n} have now?",
                f"{n} gave away {a} / 2 = {a // 2} {item}s and kept {a // 2}. Then {n} has "
                f"{a // 2} + {b} = {ans} {item}s.", _num(ans))
    if kind == 5:
        a = r.choice([x for x in range(5, 60) if x % 4])
        ans = a / 4
        return (f"{n} and three friends split a ${a} bill equally. How many dollars does each "
                f"person pay?",
                f"Four people share the bill, so each pays {a} / 4 = {_num(ans)} dollars.",
                _num(ans))
    if kind == 6:
        a, b, c = r.randint(2, 9), r.randint(3, 12), r.randint(2, 9)
        ans = a * b * c
        return (f"A farm has {a} rows of trees with {b} trees in each row. Each tree gives {c} "
                f"baskets of fruit. How many baskets does the farm get?",
                f"There are {a} * {b} = {a * b} trees. They give {a * b} * {c} = {ans} baskets.",
                _num(ans))
    if kind == 7:
        a, days = r.randint(5, 25), r.randint(3, 12)
        b = a * days
        return (f"{n} reads {a} pages a day. How many days does {n} need to read a {b}-page "
                f"book?", f"{n} needs {b} / {a} = {days} days.", _num(days))
    if kind == 8:
        a, b, c = r.randint(5, 40), r.randint(2, 15), r.randint(1, 10)
        ans = a + b + c
        return (f"{n} is {a} years old. {m} is {b} years older than {n}. How old will {m} be in "
                f"{c} years?",
                f"{m} is {a} + {b} = {a + b} years old now. In {c} years {m} will be "
                f"{a + b} + {c} = {ans}.", _num(ans))
    price, pct = 10 * r.randint(2, 20), r.choice([10, 20, 25, 50])
    off = price * pct // 100
    return (f"A jacket costs ${price}. It is on sale for {pct}% off. What is the sale price in "
            f"dollars?",
            f"The discount is {price} * {pct} / 100 = {off} dollars. The sale price is "
            f"{price} - {off} = {price - off} dollars.", _num(price - off))


def make_rows(n: int, split: str, seed: int) -> list[dict]:
    r, rows, seen = random.Random(seed), [], set()
    while len(rows) < n:
        question, steps, answer = _problem(len(rows) % 10, r)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"data_source": "gsm_tiny",
                     "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": answer},
                     "extra_info": {"split": split, "index": len(rows),
                                    "answer": f"{steps}\n#### {answer}"}})
    return rows


def train_tokenizer(texts: list[str], vocab_size: int, special_tokens: list[str] = SPECIAL):
    """A byte-level BPE trained on `texts` (tests/hf_fixtures.py builds its models' with it)."""
    # optional dependency (the [hf] extra): only the tokenizer fixture needs it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_fixtures(out: str, n_train: int = 180, n_test: int = 20, seed: int = 0,
                   vocab_size: int = 512) -> list[str]:
    """Write train.jsonl, test.jsonl, tokenizer.json, tokenizer_config.json; return the paths."""
    os.makedirs(out, exist_ok=True)
    rows = make_rows(n_train + n_test, "train", seed)
    splits = {"train.jsonl": rows[:n_train], "test.jsonl": rows[n_train:]}
    paths = []
    for name, part in splits.items():
        path = os.path.join(out, name)
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for i, row in enumerate(part):
                row["extra_info"].update(split=name[:-6], index=i)
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        paths.append(path)
    texts = [m["content"] for row in rows for m in row["prompt"]]
    texts += [row["extra_info"]["answer"] for row in rows]
    path = os.path.join(out, "tokenizer.json")
    train_tokenizer(texts, vocab_size).save(path)
    paths.append(path)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 1024,
              "chat_template": CHAT_TEMPLATE}
    path = os.path.join(out, "tokenizer_config.json")
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    paths.append(path)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--n-train", type=int, default=180)
    ap.add_argument("--n-test", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=512)
    args = ap.parse_args(argv)
    for path in write_fixtures(args.out, args.n_train, args.n_test, args.seed, args.vocab_size):
        print(f"{path}: {os.path.getsize(path)} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
