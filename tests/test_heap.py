"""The server's heap bound (``mlxformer.server.heap``), seen through glibc's own accounting: after
a large block is freed, glibc's default moves a 1 MiB allocation into the heap (kept after free);
with the bound it stays a separate mapping, returned to the system when freed."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only (Linux)")

PROBE = """
import ctypes, json, sys
from mlxformer.server.heap import bound_heap_growth

class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
bounded = bound_heap_growth() if sys.argv[1] == "bound" else False
libc.free(libc.malloc(8 * 2**20))  # glibc's default: the mmap threshold rises to 8 MiB
before = libc.mallinfo2().hblkhd
block = libc.malloc(2**20)
mapped = libc.mallinfo2().hblkhd - before  # bytes of the 1 MiB block in its own mapping
libc.free(block)
print(json.dumps({"bounded": bounded, "mapped": mapped}))
"""


def probe(mode: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=environment,
                            check=True, timeout=60)
    return json.loads(result.stdout)


def test_the_bound_keeps_large_blocks_out_of_the_heap():
    plain, bound = probe("plain"), probe("bound")
    assert plain == {"bounded": False, "mapped": 0}  # glibc's default: into the heap
    assert bound["bounded"] and bound["mapped"] >= 2**20


def test_the_users_own_malloc_tuning_is_left_alone():
    assert probe("bound", MALLOC_ARENA_MAX="4") == {"bounded": False, "mapped": 0}
