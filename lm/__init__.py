"""lm: a JAX/Flax trainer for decoder-only language models (pretrain, sample, fine-tune)."""

import ctypes
import os
import sys


def _keep_freed_memory() -> None:
    """Keep memory that glibc's malloc would hand back to the system at the top of its heaps: without it
    every step of XLA:CPU frees its large temporary buffers, the heap is trimmed, and the next step faults
    those pages in again (a third of a small model's train step on CPU; benchmarks/README.md). Set
    before JAX allocates anything, hence here. LM_MALLOC_TOP_PAD sets the pad in bytes; 0 leaves malloc alone.
    """
    setting = os.environ.get("LM_MALLOC_TOP_PAD", str(1 << 30))
    try:
        pad = int(setting)
    except ValueError:
        pad = -1
    if pad < 0:
        print(f"warning: LM_MALLOC_TOP_PAD={setting!r} is not a byte count; malloc left alone", file=sys.stderr)
        return
    if pad and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").mallopt(-2, pad)  # -2 = M_TOP_PAD
        except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
            pass


_keep_freed_memory()
