"""``procs.steady_heap``: glibc's malloc thresholds fixed in a training process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# a fresh process: 20 MiB malloc'd, where it lies, freed; the heap's end after the free
_PROBE = r"""
import ctypes, json, sys
from leto.backends.gloo.procs import steady_heap
took = steady_heap() if sys.argv[1] == "1" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            a, b = line.split()[0].split("-")
            return int(a, 16), int(b, 16)
    return 0, 0
n = 20 << 20
p = libc.malloc(n)
lo, hi = heap()
in_heap = lo <= p and p + n <= hi
libc.free(p)
print(json.dumps({"took": took, "in_heap": in_heap, "kept": heap()[1] >= p + n}))
"""


def _probe(steady: bool) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, "1" if steady else "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return dict(json.loads(out))


def test_steady_heap_serves_a_large_block_from_the_heap_and_keeps_it_after_free() -> None:
    if sys.platform != "linux":
        pytest.skip("glibc on Linux only")
    before = _probe(False)
    # glibc's default: a 20 MiB block is mmap'd, and unmapped when freed
    assert before == {"took": None, "in_heap": False, "kept": False}
    assert _probe(True) == {"took": True, "in_heap": True, "kept": True}
