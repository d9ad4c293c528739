"""The heap of a long-lived process: buffers of a request's size go back to the system when freed.

glibc's malloc serves a buffer of 128 KiB or more from a mapping of its own, which ``free`` unmaps; but
once such a buffer is freed it raises that threshold to the buffer's size (up to 32 MiB, its "dynamic
mmap threshold"), and from then on serves buffers of that size from the heap, where the holes they leave
between long-lived objects are kept. In hmad such buffers are shaped by the requests (frames up to the
frame limit, a step's logits at 1 MiB a row on the numpy backend, numpy temporaries), so the heap's
high-water mark crept up with the mix of requests seen. hmad fixes the threshold at 1 MiB here (fixing it
also turns the dynamic raising off); the measurement behind it is in docs/tuning.md. Elsewhere than glibc
(musl, macOS) nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("hmad.heap")

M_MMAP_THRESHOLD = -3  # glibc malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20


def map_large_buffers(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation of ``threshold`` bytes or more from its own mapping, for the process's life.
    Returns whether the C library took the setting (False where it is not glibc)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, threshold) == 1
    log.debug("malloc mmap threshold %d bytes: %s", threshold, "set" if ok else "not set")
    return ok
