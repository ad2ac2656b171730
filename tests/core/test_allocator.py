"""dpltm.allocator: the CLI's processes keep large freed blocks for reuse; a user's own choice of
allocator is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dpltm.allocator import USER_CHOICES, keep_freed_blocks

PROBE = """
import ctypes, sys
from dpltm.allocator import keep_freed_blocks
changed = keep_freed_blocks()
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
block = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB: above glibc's largest mmap threshold
print(changed, libc.mallinfo2().hblkhd >= (64 << 20))
"""


def _probe(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", PROBE], env=env, text=True, capture_output=True,
                          check=True).stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_blocks_come_from_the_heap_not_a_fresh_mmap() -> None:
    env = {k: v for k, v in os.environ.items() if k not in USER_CHOICES}
    assert _probe(env) == ["True", "False"]  # tuned: the 64 MiB block is not an mmap
    assert _probe({**env, "MALLOC_ARENA_MAX": "4"}) == ["False", "True"]  # the user's tuning wins: glibc's default


def test_the_users_allocator_choice_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so")
    assert keep_freed_blocks() is False
