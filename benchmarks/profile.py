"""Where a train step's time goes: a jax.profiler trace of a few steps, its XLA ops summed by kind.

    python -m benchmarks.profile [--preset shakespeare_char] [--steps 10] [key=value ...]

Runs the preset's jitted train step on a random batch under `jax.profiler.trace` (the trace is kept in
--trace-dir for Perfetto or TensorBoard), then sums the duration of every XLA op event by its name
without the trailing number (`ynn_fusion.12` -> `ynn_fusion`: the matmul fusions on CPU). Prints
milliseconds per step and the share of all op time for each kind, and writes
benchmarks/results/profile_<preset>.json.
"""

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import tempfile

import jax
import numpy as np

from benchmarks.report import report
from lm import config as config_lib
from lm import sharding
from lm.model import flops_per_token
from lm.optim import make_optimizer
from lm.steps import create_state, make_train_step

NOT_OPS = ("$", "Thunk", "Pjit", "Common", "Parse")  # Python frames and runtime wrappers, not XLA ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="shakespeare_char")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--trace-dir", default=os.path.join(tempfile.gettempdir(), "lm-profile"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = config_lib.load(args.preset, args.overrides)
    vocab = 256 if cfg.data.tokenizer == "bytes" else 50304
    cfg = dataclasses.replace(cfg, model=config_lib.resolve_model(cfg.model, vocab, cfg.data.block_size))
    mesh = sharding.make_mesh(cfg.mesh)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    state, _ = create_state(cfg, tx, mesh)
    shape = (cfg.data.batch_size, cfg.data.block_size)
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, vocab, shape).astype(np.int32) for k in ("inputs", "targets")}
    step = jax.jit(make_train_step(cfg, tx), donate_argnums=0)
    with sharding.activate(mesh):
        state, metrics = step(state, batch)  # compiles
        jax.block_until_ready(metrics)
        with jax.profiler.trace(args.trace_dir, create_perfetto_trace=True):
            for _ in range(args.steps):
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
    path = sorted(glob.glob(os.path.join(args.trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total = collections.Counter()
    wall_us = 0.0
    for event in events:
        if event.get("ph") != "X":
            continue
        name = event["name"]
        if name == "ThunkExecutor::Execute (wait for completion)":
            wall_us += event.get("dur", 0)
        if not name.startswith(NOT_OPS) and not name.startswith("end:"):
            total[re.sub(r"\.\d+$", "", name)] += event.get("dur", 0)
    op_us = sum(total.values())
    flops = flops_per_token(cfg.model, cfg.data.block_size) * shape[0] * shape[1]
    result = {
        "preset": args.preset,
        "overrides": args.overrides,
        "trace": path,
        "step_ms": round(wall_us / args.steps / 1e3, 2),
        "op_ms_per_step (all threads)": round(op_us / args.steps / 1e3, 2),
        "model_gflop_per_step": round(flops / 1e9, 3),
        "ops": {
            kind: {"ms_per_step": round(us / args.steps / 1e3, 3), "share": round(us / op_us, 3)}
            for kind, us in total.most_common(15)
        },
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
    }
    report(f"profile_{args.preset}", result)


if __name__ == "__main__":
    main()
