"""bench.gpu_stages on a tiny preset on CPU: every stage runs end to end and the report renders
what it wrote (the engine, which needs CUDA, is recorded as not run, with why)."""

import json

import pytest
import torch

from bench import gpu_stages

TINY = ["--preset", "qwen3-moe-tiny", "--layers", "2"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run")
def test_rollout_and_train_stages_write_what_the_report_renders(tmp_path, single_process):
    out = str(tmp_path)
    rc = gpu_stages.main(["rollout", "--out", out, *TINY, "--batch", "2", "--prompt-len", "4",
                         "--new-tokens", "3", "--backends", "lean,megatron_engine"])
    assert rc == 0
    r = json.loads((tmp_path / "rollout.json").read_text())
    lean = r["backends"]["lean"]
    assert lean["tokens_per_s"] > 0 and len(lean["vs_trainer"]["set"]) == 2
    assert "CUDA" in r["backends"]["megatron_engine"]["error"]
    assert gpu_stages.main(["train", "--out", out, *TINY, "--lengths", "8,16", "--tokens", "16",
                           "--iterations", "1", "--warmup", "0", "--top", "4", "--micro", "1,3",
                           "--long-tail", "6"]) == 0
    t = json.loads((tmp_path / "train.json").read_text())
    assert [(x["micro"], x["B"], x["T"]) for x in t["rows"]] == [(1, 2, 8), (1, 1, 16),
                                                                   (3, 2, 8)]
    assert t["rows"][2]["tokens_per_s"] == pytest.approx(48 / t["rows"][2]["step_s"])
    assert len(t["profile"]["rows"]) == 4 and len(t["profile"]["copies"]) == 2
    lt = t["long_tail"]
    assert lt["real_tokens"] < 6 * 16 and lt["packed"]["forwards"] <= lt["padded"]["forwards"]
    assert lt["packed"]["real_tokens_per_s"] == pytest.approx(lt["real_tokens"]
                                                              / lt["packed"]["step_s"])
    assert t["optimizer_loops"] == "foreach"  # what the optimizer ran, read back from megatron
    with pytest.raises(SystemExit) as e:  # megatron's own loops allocate on CUDA
        gpu_stages.parse_args(["train", "--out", out, "--megatron-loops"])
    assert e.value.code == 2
    assert gpu_stages.main(["report", "--out", out]) == 0
    text = (tmp_path / "README.md").read_text()
    assert "| packed |" in text and "packed / padded, real tokens/s" in text
    assert "| 1 x 2 x 8 |" in text and "| 3 x 2 x 8 |" in text and "| lean |" in text and "megatron_engine | did not run" in text


def test_unknown_backend_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_stages.parse_args(["rollout", "--out", "x", "--backends", "lean,vllm"])
    assert e.value.code == 2 and "'vllm'" in capsys.readouterr().err
