"""lm: a JAX/Flax trainer for decoder-only language models (pretrain, sample, fine-tune)."""

import ctypes
import os
import sys

# Keep memory that glibc's malloc would hand back to the system at the top of its heaps: without it
# every step of XLA:CPU frees its large temporary buffers, the heap is trimmed, and the next step
# faults those pages in again (a third of a small model's train step on CPU; benchmarks/README.md).
# Set before JAX allocates anything, hence here. LM_MALLOC_TOP_PAD=0 leaves malloc alone.
_TOP_PAD = int(os.environ.get("LM_MALLOC_TOP_PAD", 1 << 30))
if _TOP_PAD and sys.platform.startswith("linux"):
    try:
        ctypes.CDLL("libc.so.6").mallopt(-2, _TOP_PAD)  # -2 = M_TOP_PAD
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        pass
