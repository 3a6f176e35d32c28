"""A process's resident memory from /proc (Linux), for the benches that measure host memory:
the current and peak figure, and a reset of the peak to the current one."""

from __future__ import annotations

import ctypes
import gc


def resident() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024
    return found["VmRSS"], found["VmHWM"]


def reset_peak() -> int:
    """Collect garbage, return glibc's free heap to the OS, set VmHWM to VmRSS; returns the
    resident bytes that a later peak is measured above."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return resident()[0]
