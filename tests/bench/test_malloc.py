"""bench/malloc.py: fresh children alternate glibc's thresholds and the tuned ones."""

import re

import pytest

from megatron_gspo.run.host import malloc_tuning_skipped
from bench import malloc as bench_malloc


@pytest.mark.skipif(malloc_tuning_skipped({}) is not None, reason="glibc malloc only")
def test_children_alternate_the_two_settings_and_the_table_reports_both(capsys, monkeypatch):
    monkeypatch.delenv("MEGATRON_GSPO_MALLOC", raising=False)
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    settings = []
    real = bench_malloc.child
    monkeypatch.setattr(bench_malloc, "child", lambda args, setting: settings.append(setting)
                        or real(args, setting))
    assert bench_malloc.main(["--prompts", "1", "--group-size", "4", "--max-new-tokens", "4",
                              "--iterations", "1", "--rounds", "1"]) == 0
    assert settings == ["system", "tuned"]
    out = capsys.readouterr().out
    for setting in ("system", "tuned"):
        assert re.search(rf"\| {setting} \| \d+\.\d{{3}} \| \d+\.\d{{3}} \| \d+ \|", out)
    assert re.search(r"system / tuned: \d+\.\d\d", out)
