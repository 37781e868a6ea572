"""What this machine can do: matmul FLOP/s (float32, bfloat16) through XLA, and memory bandwidth (copy, read).

    python -m benchmarks.peak [--n 2048] [--repeats 10]

Each figure is the best of --repeats timed runs (other work only ever slows a run down). Prints JSON
and writes benchmarks/results/peak.json; the other benchmarks report their speeds as fractions of it.
"""

import argparse
import os
import platform

import jax
import jax.numpy as jnp

from benchmarks.report import command, positive, report
from lm.metrics import best_seconds, measure_matmul_flops


def copy_bandwidth(n_bytes: int, repeats: int) -> float:
    """Bytes per second moved by a large array copy (each byte read once and written once)."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    return 2 * n_bytes / best_seconds(jax.jit(lambda x: x + 0), x, repeats=repeats)


def read_bandwidth(n_bytes: int, repeats: int) -> float:
    """Bytes per second read by a large array sum (each byte read once, almost nothing written): the
    rate a batch-1 decode step reads the parameters at, so its bound is parameter bytes / this."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    return n_bytes / best_seconds(jax.jit(jnp.sum), x, repeats=repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=positive, default=2048, help="matmul size n x n x n")
    parser.add_argument("--repeats", type=positive, default=10)
    parser.add_argument("--mb", type=positive, default=512, help="array size for the bandwidth copy")
    args = parser.parse_args()
    result = {
        "device": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "jax": jax.__version__,
        "matmul_n": args.n,
        "float32_flops": measure_matmul_flops(args.n, args.repeats, jnp.float32),
        "bfloat16_flops": measure_matmul_flops(args.n, args.repeats, jnp.bfloat16),
        "copy_bytes_per_sec": copy_bandwidth(args.mb << 20, args.repeats),
        "read_bytes_per_sec": read_bandwidth(args.mb << 20, args.repeats),
    }
    report("peak", result)


if __name__ == "__main__":
    command(main)
