"""The C heap while serving: memory a step frees stays in the process for the next step.

glibc's malloc (what torch's CPU tensors come from) serves a block above its mmap threshold
with a mapping of its own, unmapped on free, and gives the top of its heap back to the
kernel when more than its trim threshold lies free there; both thresholds move with the
sizes freed ("dynamic threshold"). Whether a step's large transient tensors (the LM head's
logits: 64 rows x 49152 x 4 bytes = 12.6 MB for SmolLM2) are handed back and faulted in
again on the next step then depends on where they fall in the heap, which differs from one
engine to the next and stays so: SmolLM2, W's 64-row decode on a 2-core AMX Xeon, 8 fresh
engines in one process: one took ~520 page faults a step in its logits (11.5 ms against
5.5, a step 44-47 ms against 37-40), the others none; with `keep_freed_memory` every engine
took none (35-39 ms).

`keep_freed_memory` fixes both thresholds (a fixed mmap threshold also stops their moving):
blocks up to MMAP_THRESHOLD come from the heap and freed memory is never trimmed below
TRIM_THRESHOLD, as tcmalloc and jemalloc keep theirs. NOTE: process-wide and for good; the
model's load runs before it (its transients are given back first, `malloc_trim`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Give back what is free now, then keep what is freed from now on (the module
    docstring); False where the C library is not glibc (nothing changed)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    kept = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 \
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not kept:
        logger.warning("mallopt refused the heap's thresholds; steps may fault pages in")
    return kept


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (it has gnu_get_libc_version)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    needed = ("gnu_get_libc_version", "mallopt", "malloc_trim")
    return libc if all(hasattr(libc, symbol) for symbol in needed) else None
