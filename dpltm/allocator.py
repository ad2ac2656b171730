"""Keep freed large blocks for reuse (glibc's malloc), for the processes dpltm owns: its CLI and benchmarks.

PyTorch's CPU allocator asks malloc for every tensor, and glibc serves blocks over 32 MiB with a
fresh mmap and returns them to the system on free. A DP step on a batch of 4096 scattering feature
rows makes several tensors of 65 MB (the gathered batch, its square), so every step paid for
faulting in ~50k fresh pages: 45 ms a step instead of 29 ms on 2 cores
(`benchmarks/bench_masked_head.py`, MALLOC_MMAP_MAX_=0 against glibc's default). PyTorch's own
performance guide recommends a caching allocator (jemalloc, tcmalloc) for the same reason; this does
the least intrusive version of that in-process: no mmap for large blocks (they come from the heap
and are reused), and the heap's free top is returned to the system only above 1 GiB.

Only for dpltm's own entry points (`dpltm.cli.main`, `benchmarks/`): importing the library never changes
the process's allocator. Skipped where the user chose the allocator themselves (GLIBC_TUNABLES,
MALLOC_*_ variables, LD_PRELOAD) and off glibc. API users can call `keep_freed_blocks()` themselves,
or set MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""mallopt parameters (glibc's malloc.h)."""

TRIM_THRESHOLD_BYTES = 1 << 30

USER_CHOICES = ("GLIBC_TUNABLES", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                "MALLOC_ARENA_MAX", "LD_PRELOAD")
"""Environment variables that mean the allocator was chosen or tuned by the user: left as it is."""


def keep_freed_blocks() -> bool:
    """Tune glibc's malloc to reuse large freed blocks; False (nothing changed) off glibc or where the
    user set the allocator up themselves."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in USER_CHOICES):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
