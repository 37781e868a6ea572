"""How fast a decoding step's matmuls read their weights as the batch grows, in jax.jit and in PyTorch.

    python -m benchmarks.matmul_rows [--rows 1 2 4 8 16 64] [--repeat 15]

A decoding step multiplies each row's activations by every weight matrix once. This times a chain of 24
GPT-2-small MLP kernels ([768, 3072] float32, 226 MB together, so none stays in cache) applied to
`rows` rows, each product feeding the next, in one jitted function and in PyTorch eager (the weights'
bytes over the median time: GB/s read, and GFLOP/s). With one row the product is a matrix-vector
product that streams the weights; with 2 or more, XLA:CPU (YNNPACK) and PyTorch run matrix-matrix
kernels, which read the same bytes more slowly until the rows are enough to make them compute-bound.
It says what caps batch-8 decoding (benchmarks/README.md). Writes benchmarks/results/matmul_rows.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import command, positive, report

LAYERS, D_IN, D_OUT = 24, 768, 3072


def timed(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def chain(x, weights, matmul):
    """Each product's first D_IN columns feed the next, so that no product can be skipped or reordered."""
    total = 0.0
    for w in weights:
        y = matmul(x, w)[:, :D_IN]
        total = total + y
        x = x + 1e-3 * y
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=positive, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--repeat", type=positive, default=15)
    args = parser.parse_args()
    import torch

    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((D_IN, D_OUT), np.float32) * 0.02 for _ in range(LAYERS)]
    jax_weights = [jnp.asarray(w) for w in weights]
    torch_weights = [torch.from_numpy(w) for w in weights]
    run_jax = jax.jit(lambda x, ws: chain(x, ws, jnp.matmul))
    gbytes = LAYERS * D_IN * D_OUT * 4 / 1e9
    result = {"layers": LAYERS, "kernel": [D_IN, D_OUT], "rows": {}}
    for rows in args.rows:
        x = rng.standard_normal((rows, D_IN), np.float32)
        jx, tx = jnp.asarray(x), torch.from_numpy(x)
        with torch.inference_mode():
            seconds = {
                "jax": timed(lambda: run_jax(jx, jax_weights).block_until_ready(), args.repeat),
                "torch": timed(lambda: chain(tx, torch_weights, torch.matmul), args.repeat),
            }
        gflop = 2 * rows * LAYERS * D_IN * D_OUT / 1e9
        result["rows"][rows] = {
            side: {"ms": round(s * 1e3, 2), "gb_per_s": round(gbytes / s, 1), "gflop_per_s": round(gflop / s, 1)}
            for side, s in seconds.items()
        }
        result["rows"][rows]["torch_over_jax_time"] = round(seconds["torch"] / seconds["jax"], 2)
    result.update(jax=jax.__version__, torch=torch.__version__, torch_threads=torch.get_num_threads())
    report("matmul_rows", result)


if __name__ == "__main__":
    command(main)
