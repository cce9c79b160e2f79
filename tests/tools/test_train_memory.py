"""tools/train_memory.py: the analytic bytes per parameter and a measured step."""

import pytest

from tools import train_memory as tm


def test_bytes_per_param_match_megatron_accounting():
    assert tm.bytes_per_param("fp32") == 16
    assert tm.bytes_per_param("bf16 + fp32 masters") == 18
    assert tm.bytes_per_param("fp32", 8, distributed=True) == 8 + 8 / 8
    assert tm.bytes_per_param("bf16 + fp32 masters", 64, distributed=True) == 6 + 12 / 64
    assert tm.bytes_per_param("bf16 + fp32 masters", 64) == 18  # replicated: d does not matter
    text = tm.table("qwen3-30b-a3b", [1, 8, 64])
    row = next(ln for ln in text.splitlines() if ln.startswith("bf16 + fp32 masters")
               and "distributed" in ln)
    n = 30532122624
    assert f"{(6 + 12 / 8) * n / tm.GIB:.1f}" in row and f"{(6 + 12 / 64) * n / tm.GIB:.1f}" in row


_MEASURE = """
import json, os
os.environ.pop("RANK", None); os.environ.pop("WORLD_SIZE", None)
from moe.platform.parallel import init_parallel
from tools import train_memory as tm
init_parallel(1, 1, seed=0)
print(json.dumps([tm.measure_one("qwen3-moe-tiny-deep", d, batch=8, seq=32)
                  for d in ("fp32", "bf16")]))
"""


def test_measured_state_is_near_the_analytic_bytes_and_bf16_peaks_lower():
    """In a fresh process (CPU: glibc's bytes in use, which memory freed by earlier tests in a
    shared pytest process skews; CUDA: the allocator's). Persistent state is the analytic
    bytes/param plus buffers and Python objects (measured ~+4.6 B/param here)."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True,
                         check=True, timeout=600, env={**os.environ, **tm.CHILD_ENV}).stdout
    fp32, bf16 = json.loads(out.strip().splitlines()[-1])
    for r, analytic in ((fp32, 16), (bf16, 18)):
        assert analytic <= r["persistent_bytes"] / r["params"] <= analytic + 8, r
        assert r["peak_bytes"] > r["persistent_bytes"], r
    activations = [r["peak_bytes"] - r["persistent_bytes"] for r in (fp32, bf16)]
    assert activations[1] < 0.8 * activations[0], activations


def test_old_bf16_setting_is_10_bytes_and_never_distributed():
    """bf16 param 2 + fp32 grad 4 + bf16 Adam m+v 4 = 10 B/param; the table has no distributed
    row for it (megatron does not offer it), so 5 settings rows in all."""
    assert tm.bytes_per_param("bf16, no masters (old)") == 10
    rows = tm.table("qwen3-30b-a3b", [1, 8]).splitlines()
    assert "(30.53 B params;" in rows[0]
    assert [ln.split("  ")[0] for ln in rows[2:]] == ["fp32", "fp32", "bf16 + fp32 masters",
                                                      "bf16 + fp32 masters",
                                                      "bf16, no masters (old)"]
    assert "replicated" in rows[-1] and "10.00" in rows[-1]


def test_report_by_hand():
    """2 Mi params: fp32 peak 100 MiB, persistent 40 MiB (20 B/param, analytic 16); bf16 peak
    60 MiB (x0.600), persistent 44 MiB (22 B/param, analytic 18), activations 60 - 44 = 16."""
    mib = tm.MIB
    rows = [{"dtype": "fp32", "recompute": "off", "device": "cpu (oneDNN False)",
             "params": 2 << 20, "persistent_bytes": 40 * mib, "peak_bytes": 100 * mib},
            {"dtype": "bf16", "recompute": "off", "device": "cpu (oneDNN False)",
             "params": 2 << 20, "persistent_bytes": 44 * mib, "peak_bytes": 60 * mib},
            {"dtype": "bf16", "recompute": "full", "device": "cpu (oneDNN False)",
             "params": 2 << 20, "persistent_bytes": 44 * mib, "peak_bytes": 48 * mib}]
    lines = tm.report(rows, "p", batch=8, seq=32).splitlines()
    assert lines[0] == ("measured on cpu (oneDNN False): one train step of p (2,097,152 params), "
                        "batch 8 x 32 tokens")
    assert lines[1].split() == "fp32 peak 100.0 MiB (x1.000 of fp32); persistent 40.0 MiB = 20.00 \
B/param (analytic 16); activations + temporaries 60.0 MiB".split()
    assert lines[2].split() == "bf16 peak 60.0 MiB (x0.600 of fp32); persistent 44.0 MiB = 22.00 \
B/param (analytic 18); activations + temporaries 16.0 MiB".split()
    assert lines[3].startswith("  bf16 + recompute full ") and "(x0.480 of fp32)" in lines[3]
    assert "(analytic 18)" in lines[3]
    assert lines[4] == "  peak bf16 / fp32 = 0.600"


def test_measure_runs_each_variant_in_a_child_and_fails_on_a_child_error(monkeypatch):
    """fp32 and bf16 (+ selective and full recompute), --onednn passed on, MKL's fast memory
    manager off in the child; a failing child is an error, not a missing row."""
    import json
    import types

    cmds, rc = [], [0]

    def run(cmd, **kw):
        cmds.append(cmd)
        assert kw["env"]["MKL_DISABLE_FAST_MM"] == "1" and kw["cwd"] == tm.ROOT
        row = {"dtype": cmd[cmd.index("--child") + 1],
               "recompute": cmd[cmd.index("--recompute") + 1]}
        return types.SimpleNamespace(returncode=rc[0], stdout="noise\n" + json.dumps(row),
                                     stderr="boom")
    monkeypatch.setattr(tm, "subprocess", types.SimpleNamespace(run=run))
    rows = tm.measure("p", 8, 32)
    assert [(r["dtype"], r["recompute"]) for r in rows] == [("fp32", "off"), ("bf16", "off")]
    assert cmds[0][-6:] == ["--preset", "p", "--batch", "8", "--seq", "32"]
    rows = tm.measure("p", 8, 32, onednn=True, with_recompute=True)
    assert [(r["dtype"], r["recompute"]) for r in rows][2:] == [("bf16", "selective"),
                                                                ("bf16", "full")]
    assert all(c[-1] == "--onednn" for c in cmds[2:])
    rc[0] = 1
    with pytest.raises(SystemExit, match="measuring fp32 off failed:\nboom"):
        tm.measure("p", 8, 32)


@pytest.mark.parametrize("argv", [["--dp", "1", "0"], ["--batch", "0"], ["--seq", "1"]])
def test_main_rejects_bad_sizes(argv, monkeypatch):
    """dp >= 1, batch >= 1, seq >= 2 (the loss drops the first token)."""
    monkeypatch.setattr(tm, "measure", lambda *a: pytest.fail("measured"))
    with pytest.raises(SystemExit) as e:
        tm.main(argv + ["--no-measure"])
    assert e.value.code == 2


def test_main_measures_unless_told_not_to(monkeypatch, capsys):
    """--no-measure prints the table only; otherwise the measured report follows it."""
    seen = []
    monkeypatch.setattr(tm, "measure", lambda *a: seen.append(a) or ["ROWS"])
    monkeypatch.setattr(tm, "report", lambda rows, *a: f"REPORT {rows} {a}")
    assert tm.main(["--no-measure", "--dp", "2"]) == 0
    assert seen == [] and capsys.readouterr().out.strip() == tm.table("qwen3-30b-a3b", [2])
    assert tm.main(["--batch", "4", "--seq", "8", "--with-recompute"]) == 0
    assert seen == [("qwen3-moe-tiny-deep", 4, 8, False, True)]
    assert capsys.readouterr().out.strip().endswith(
        "REPORT ['ROWS'] ('qwen3-moe-tiny-deep', 4, 8)")


def test_malloc_in_use_counts_a_large_mmapped_block():
    """A 64 MiB malloc is above glibc's largest mmap threshold (32 MiB): counted as hblkhd."""
    import ctypes

    in_use = tm._malloc_in_use()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    before = in_use()
    block = libc.malloc(64 * tm.MIB)
    try:
        assert in_use() - before >= 64 * tm.MIB
    finally:
        libc.free(block)
    assert in_use() - before < 64 * tm.MIB


@pytest.mark.parametrize("dtype,recompute,onednn", [("bf16", "full", False),
                                                    ("fp32", "off", True)])
def test_measure_one_builds_the_asked_policy_and_restores_onednn(monkeypatch, dtype, recompute,
                                                                 onednn):
    """The dtype and recompute reach MoEPolicy.build, oneDNN is as asked during the step and as
    before afterwards, and params counts the built model's parameters."""
    import torch

    from moe.model.policy import MoEPolicy
    from moe.model.settings import Recompute

    built, real_build = [], MoEPolicy.build.__func__

    def build(cls, *a, **kw):
        policy = real_build(cls, *a, **kw)
        built.append((kw["dtype"], kw["recompute"], torch.backends.mkldnn.enabled, policy))
        return policy
    monkeypatch.setattr(MoEPolicy, "build", classmethod(build))
    was = torch.backends.mkldnn.enabled
    r = tm.measure_one("tiny", dtype, batch=2, seq=4, onednn=onednn, recompute=recompute)
    assert torch.backends.mkldnn.enabled == was
    (got_dtype, got_recompute, got_onednn, policy), = built
    assert got_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert got_recompute == Recompute(None if recompute == "off" else recompute)
    assert got_onednn is onednn
    assert r["params"] == sum(p.numel() for p in policy.model.module.parameters()) > 0
    assert (r["dtype"], r["recompute"], r["device"]) == (dtype, recompute,
                                                        f"cpu (oneDNN {onednn})")
