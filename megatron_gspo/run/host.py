"""Host memory allocator settings for a training process (glibc's malloc).

A training step allocates and frees activations of a few MB each, thousands of times per
iteration (on CPU all of them; on a GPU the host side's staging buffers). glibc serves blocks
above its mmap threshold with fresh `mmap`ed pages and gives the top of its heap back to the
kernel once more than the trim threshold is free there; both thresholds start small (128 KiB)
and the mmap one only grows as such blocks are freed (glibc's dynamic rule, which then sets
the trim threshold to twice it). Either way a freed block comes back as
new pages, and every first touch of a page is a page fault served by the kernel (thousands
per CPU training iteration of the throughput bench; its tokens/s with and without this module's
setting: experiments/throughput/README.md, "the host allocator").

`tune_malloc` fixes the mmap threshold at glibc's largest (32 MiB on 64-bit) and the trim
threshold at 1 GiB: freed blocks stay in the heap for the next step. The cost is resident
memory: up to 1 GiB of freed memory per malloc arena kept mapped instead of returned, so the
resident size tends to stay at its high-water mark (peak use is unchanged). The
same setting PyTorch's CPU tuning guides reach with jemalloc / tcmalloc, without a preload.

Left alone when the user chose for themselves: `MEGATRON_GSPO_MALLOC=system` (glibc's own
behaviour, e.g. to measure the difference), one of glibc's threshold variables
(`USER_VARIABLES`) or their `glibc.malloc.*` tunables in `GLIBC_TUNABLES` (`USER_TUNABLES`;
glibc read them at start-up) or another allocator in `LD_PRELOAD`; and where the C library is
not glibc. Other variables and tunables (`MALLOC_ARENA_MAX`, `glibc.malloc.hugetlb`) do not
touch the thresholds: the tuning applies with them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2); larger is refused
TRIM_THRESHOLD = 1 << 30
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_")
USER_TUNABLES = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")  # glibc.malloc.*


def malloc_tuning_skipped(environ=os.environ, libc_name: str | None = None) -> str | None:
    """Why `tune_malloc` leaves the allocator alone (a sentence), or None when it applies."""
    libc_name = platform.libc_ver()[0] if libc_name is None else libc_name
    if libc_name != "glibc":
        return f"C library {libc_name or 'unknown'!r}, not glibc"
    if environ.get("MEGATRON_GSPO_MALLOC", "tuned") == "system":
        return "MEGATRON_GSPO_MALLOC=system"
    chosen = [name for name in USER_VARIABLES if name in environ]
    if chosen:
        return f"set by the environment ({', '.join(chosen)})"
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(f"glibc.malloc.{name}=" in tunables for name in USER_TUNABLES):
        return f"set by the environment (GLIBC_TUNABLES={tunables})"
    preload = environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return f"another allocator preloaded (LD_PRELOAD={preload})"
    return None


# what the last `tune_malloc` call in this process did: None before any call, else a sentence
# (`malloc_state` reads it, e.g. for a benchmark's report)
_last_outcome: str | None = None


def tune_malloc() -> bool:
    """Apply the thresholds above to this process (idempotent). Returns whether they are in
    force: False where `malloc_tuning_skipped` gives a reason or glibc refused a value."""
    global _last_outcome
    reason = malloc_tuning_skipped()
    if reason is not None:
        _last_outcome = f"untuned: {reason}"
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) \
        and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    _last_outcome = (f"tuned (mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold "
                     f"{TRIM_THRESHOLD >> 30} GiB)") if applied \
        else "untuned: glibc refused mallopt"
    return applied


def malloc_state() -> str:
    """This process's host allocator setting as `tune_malloc` left it (a sentence for
    reports): tuned, untuned with the reason, or not tuned by this process yet."""
    return _last_outcome or "glibc defaults (tune_malloc not called in this process)"

