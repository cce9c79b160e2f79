"""megatron_gspo.run.host: when the malloc thresholds are tuned, and that tuned, freed blocks stay."""

import os
import platform
import subprocess
import sys

import pytest

from megatron_gspo.run import host
from megatron_gspo.run.host import malloc_tuning_skipped

GLIBC = malloc_tuning_skipped({}) is None
GLIBC_VERSION = tuple(int(v) for v in (platform.libc_ver()[1] or "0").split(".")[:2])

# One 20 MiB malloc and free in a fresh interpreter (no torch: nothing else large was freed
# before), read through glibc's mallinfo2: with glibc's thresholds the block is mmap'ed (hblkhd)
# and unmapped on free; tuned, it comes from the heap (arena) and stays mapped after the free.
# Either way the heap grows by about what is asked (no padding of the 1 GiB kept when freed).
PROBE = """
import ctypes
from megatron_gspo.run.host import tune_malloc
applied = tune_malloc()
fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
          "fordblks", "keepcost")
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in fields]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
block = libc.malloc(20 << 20)
ctypes.memset(block, 1, 20 << 20)
live = libc.mallinfo2()
libc.free(block)
freed = libc.mallinfo2()
print(applied, live.hblkhd >= 20 << 20, freed.arena >= 20 << 20, live.arena < 256 << 20)
"""


def probe(**env) -> list[str]:
    """(tuning applied, the live block is mmap'ed, the heap keeps it after the free, the heap is
    under 256 MiB) in a fresh process, the user's own malloc choices removed from its
    environment."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_")
             and k not in ("LD_PRELOAD", "MEGATRON_GSPO_MALLOC", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, env={**clean, **env},
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    return out.stdout.split()


def test_skipped_reasons_name_the_choice():
    assert malloc_tuning_skipped({}, libc_name="glibc") is None
    assert "musl" in malloc_tuning_skipped({}, libc_name="musl")
    assert "MALLOC_TRIM_THRESHOLD_" in malloc_tuning_skipped(
        {"MALLOC_TRIM_THRESHOLD_": "0"}, libc_name="glibc")
    assert "system" in malloc_tuning_skipped({"MEGATRON_GSPO_MALLOC": "system"},
                                             libc_name="glibc")
    assert "jemalloc" in malloc_tuning_skipped({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"},
                                               libc_name="glibc")
    assert "MALLOC_MMAP_MAX_" in malloc_tuning_skipped({"MALLOC_MMAP_MAX_": "0"},
                                                       libc_name="glibc")
    tunables = "glibc.malloc.trim_threshold=0:glibc.rtld.nns=4"
    assert tunables in malloc_tuning_skipped({"GLIBC_TUNABLES": tunables}, libc_name="glibc")
    # variables and tunables that leave the thresholds alone do not stop the tuning
    assert malloc_tuning_skipped(
        {"MALLOC_ARENA_MAX": "2", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.rtld.nns=4"},
        libc_name="glibc") is None


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only")
def test_malloc_state_reports_what_tune_malloc_did(monkeypatch):
    """Reports read the outcome of the process's own call, not the environment now."""
    monkeypatch.setattr(host, "_last_outcome", None)
    assert "not called" in host.malloc_state()
    monkeypatch.setenv("MEGATRON_GSPO_MALLOC", "system")
    assert host.tune_malloc() is False
    assert host.malloc_state() == "untuned: MEGATRON_GSPO_MALLOC=system"
    monkeypatch.delenv("MEGATRON_GSPO_MALLOC")
    assert host.malloc_state() == "untuned: MEGATRON_GSPO_MALLOC=system"  # until the next call


@pytest.mark.skipif(not GLIBC or GLIBC_VERSION < (2, 33), reason="glibc >= 2.33 (mallinfo2)")
def test_tuned_malloc_keeps_freed_blocks_in_the_heap():
    assert probe(MEGATRON_GSPO_MALLOC="system") == ["False", "True", "False", "True"]
    assert probe() == ["True", "False", "True", "True"]


@pytest.mark.parametrize("name, value", [
    ("MALLOC_MMAP_THRESHOLD_", "65536"), ("MALLOC_TRIM_THRESHOLD_", "0"),
    ("MALLOC_TOP_PAD_", "0"), ("MALLOC_MMAP_MAX_", "0"),
    ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536"),
    ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
    ("GLIBC_TUNABLES", "glibc.malloc.top_pad=0"), ("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0"),
    ("LD_PRELOAD", "/usr/lib/libjemalloc.so.2"), ("LD_PRELOAD", "/usr/lib/libtcmalloc.so.4"),
    ("LD_PRELOAD", "/usr/lib/libmimalloc.so.2"),
])
def test_every_threshold_choice_of_the_user_is_left_alone(name, value):
    """Each of glibc's threshold variables and tunables, and each other allocator, stops the
    tuning (the user chose); the reason names it."""
    reason = malloc_tuning_skipped({name: value}, libc_name="glibc")
    assert reason is not None and (name if name.startswith("MALLOC_") else value) in reason
