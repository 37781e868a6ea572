"""Training speed and quality on a preset (default: shakespeare_char for its 2000 steps).

    python -m benchmarks.train [--preset shakespeare_char] [key=value ...]

Prints JSON and writes it to benchmarks/results/train_<preset>.json: final validation loss (nats per
token; with the bytes tokenizer that is nats per byte), bits per byte, median tokens/s and MFU over the
steady-state logged intervals, first-step compile time, wall time and peak resident memory.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import tempfile
import time

import jax

from benchmarks.report import command, report
from lm import config as config_lib
from lm.errors import UserError
from lm.metrics import peak_flops_per_device
from lm.train import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="shakespeare_char")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_lib.load(
            args.preset,
            [f"run.dir={tmp}/run", f"data.cache_dir={tmp}/data", "logging.progress=false", *args.overrides],
        )
        # The first interval has no tokens/s when it is the one call that compiles, and the first with one still
        # warms up: not counted.
        if cfg.train.steps < 3 * cfg.train.log_every:
            parser.error(
                f"train.steps={cfg.train.steps} logs fewer than three intervals of train.log_every="
                f"{cfg.train.log_every}; give train.steps={3 * cfg.train.log_every} or more, or a smaller train.log_every"
            )
        t0 = time.perf_counter()
        run_dir = train(cfg)
        wall = time.perf_counter() - t0
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    timed = [r for r in rows if "tokens_per_sec" in r]
    # The first timed call still warms up: all its rows (a call of several logged steps gives each the same figures).
    steady = [r for r in timed if r["step_time"] != timed[0]["step_time"]] if timed else []
    if not steady:
        raise UserError(
            f"train.steps={cfg.train.steps} timed no call after the first two (one compiles, one warms up); give "
            "more train.steps, or a smaller train.steps_per_call"
        )
    evals = [r for r in rows if "val_loss" in r]
    compile_rows = [r["compile_time"] for r in rows if "compile_time" in r]
    result = {
        "preset": args.preset,
        "overrides": args.overrides,
        "steps": cfg.train.steps,
        "final_val_loss": evals[-1]["val_loss"],
        "final_val_bpb": evals[-1]["val_bpb"],
        "tokens_per_sec_median": statistics.median(r["tokens_per_sec"] for r in steady),
        "mfu_median": statistics.median(r["mfu"] for r in steady),
        # (what the MFU is of: on a CPU a matmul measured once and cached, low if the machine was busy then)
        "peak_flops_per_device": peak_flops_per_device(cfg.train.peak_flops, cfg.model.dtype),
        "step_time_median_s": statistics.median(r["step_time"] for r in steady),
        "compile_time_s": compile_rows[0] if compile_rows else None,
        "wall_time_s": wall,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "device": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "jax": jax.__version__,
    }
    report(f"train_{args.preset}", result)


if __name__ == "__main__":
    command(main)
