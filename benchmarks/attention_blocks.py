"""Causal attention by query blocks (Platform.attention_block) against all queries at once, and PyTorch's fused
attention on the same shapes, side by side in one process: one layer's forward and backward.

    python -m benchmarks.attention_blocks [--blocks 0 32 64 128 256 512] [--reps 20] [--rounds 3]

lm.model.einsum_attention with `block` computes each block of queries over the keys up to its last position
only, skipping the masked blocks above the diagonal: (1 + 1/c) / 2 of the logits for c blocks, in smaller
matmuls and a concatenation; a --blocks setting runs as the blocks it makes (at most four; one of a shape's
length or more is the whole). All queries at once (`whole`, --blocks 0) always runs, given or not: `whole_over`
gives every run against it. Shapes: the two CPU presets' (shakespeare_char: batch 12 x 64 positions, 4 heads of
32; shakespeare_char_large: 32 x 256, 6 heads of 64) and GPT-2 small's attention at batch 4 (4 x 1024, 12 heads
of 64), float32, no dropout. Each round times every variant in turn (median of --reps calls after a warm-up); a
variant's figure is the median over rounds, so that the machine's swings fall on all of them. The host allocator
keeps freed memory (LM_MALLOC=keep, the calls run one at a time), so that no call faults its temporaries in
afresh, as in a training run's calls of several steps.
Prints JSON and writes benchmarks/results/attention_blocks.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from lm import platform

os.environ.setdefault("LM_MALLOC", "keep")
platform.tune_host_allocator()  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.report import command, non_negative, positive, report  # noqa: E402
from lm.model import ATTENTION_BLOCKS, einsum_attention  # noqa: E402

SHAPES = {
    "shakespeare_char": (12, 64, 4, 32),
    "shakespeare_char_large": (32, 256, 6, 64),
    "gpt2_small_batch_4": (4, 1024, 12, 64),
}


def lm_step(block: int):
    """Forward and backward of one layer's attention, queries [B, T, N, H] and keys/values heads first."""

    def loss(q, k, v, w):
        return jnp.sum(einsum_attention(q, k, v, None, block=block) * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def torch_step(q, k, v, w):
    import torch

    q, k, v = (torch.tensor(np.asarray(x)).requires_grad_() for x in (q, k, v))
    w = torch.tensor(np.asarray(w))

    def run():
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
        (out.transpose(1, 2) * w).sum().backward()

    return run


def timed(run, reps: int) -> float:
    run()  # compiles / warms up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=non_negative, nargs="+", default=[0, 32, 64, 128, 256, 512],
                        help="query rows a block; 0: all at once (always run, the baseline)")  # fmt: skip
    parser.add_argument("--reps", type=positive, default=20)
    parser.add_argument("--rounds", type=positive, default=3)
    args = parser.parse_args()
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # the bench extra: without it, lm's variants only
        torch_version = None
    result = {
        "malloc": platform.malloc_mode,
        "shapes": {},
        "torch": torch_version,
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
    }
    for name, (b, t, n, h) in SHAPES.items():
        rng = np.random.default_rng(0)
        q, w = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(2))
        k, v = (jnp.asarray(rng.standard_normal((b, n, t, h)), jnp.float32) for _ in range(2))
        runs = {}
        # Each setting by the blocks it makes (einsum_attention takes at most ATTENTION_BLOCKS): one run a layout.
        # The whole is always run: every run's figure is given against it (whole_over).
        for rows in sorted({0} | {max(x, -(-t // ATTENTION_BLOCKS)) for x in args.blocks if 0 < x < t}):
            step = lm_step(rows)
            label = f"{-(-t // rows)}_blocks_of_{rows}" if rows else "whole"
            runs[label] = lambda step=step: jax.block_until_ready(step(q, k, v, w))
        if torch_version:
            runs["torch_sdpa"] = torch_step(q, k, v, w)
        ms = {run: [] for run in runs}
        for _ in range(args.rounds):
            for run, fn in runs.items():
                ms[run].append(timed(fn, args.reps))
        med = {run: statistics.median(x) for run, x in ms.items()}
        result["shapes"][name] = {
            "batch_positions_heads_width": [b, t, n, h],
            "ms": {run: round(m, 2) for run, m in med.items()},
            "ms_per_round": {run: [round(x, 2) for x in xs] for run, xs in ms.items()},
            "whole_over": {run: round(med["whole"] / m, 3) for run, m in med.items()},
        }
    report("attention_blocks", result)


if __name__ == "__main__":
    command(main)
