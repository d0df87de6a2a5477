"""Keep a long-running server's resident memory from creeping on Linux (glibc).

glibc serves a large allocation with its own ``mmap`` and returns it on ``free``, but after such a
block is freed it raises that threshold to the block's size, so later blocks of up to that size
come from the heap and its per-thread arenas, whose free space is kept. A server allocates
buffers of every size (prompts, KV blocks, activations) from several threads: over a 200-request
soak (``benchmarks/serve_soak.py``) the RSS less the KV bytes and MLX's buffer cache grew 10% after
warm-up with glibc's defaults and stayed within 0.2% with a fixed threshold and two arenas,
which is what ``bound_heap_growth`` sets. Elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

M_ARENA_MAX = -8  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 * 2**10  # glibc's default starting threshold, kept fixed
ARENA_MAX = 2
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX")  # the user's own tuning wins


def bound_heap_growth() -> bool:
    """Fix glibc's mmap threshold and arena count for this process (before its threads start);
    True if set. Does nothing off glibc, or where the environment already tunes them."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in ENVIRONMENT):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_ARENA_MAX, ARENA_MAX))
