"""Does the input pipeline ever make the device wait? The train step fed as the training loop feeds it
(the grain iterator over the prepared corpus, placed on the mesh, metrics fetched one step behind)
against the same step fed one constant batch already on the device.

    python -m benchmarks.stall [--preset shakespeare_char] [--steps 300] [key=value ...]

The two feeds alternate in blocks of 50 steps (--steps of each: the last block of each the rest, when
--steps is not a multiple of 50), so that other work on the machine slows both alike;
the figure is the ratio of their median step times (target: real data within 5% of the constant
batch). Prints JSON and writes benchmarks/results/stall.json.
"""

import argparse
import dataclasses
import os
import platform
import statistics
import tempfile
import time

import jax

from benchmarks.report import command, positive, report
from lm import config as config_lib
from lm import sharding
from lm.data import prepare_for_training
from lm.optim import make_optimizer
from lm.steps import create_state, make_train_step

BLOCK = 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="shakespeare_char")
    parser.add_argument("--steps", type=positive, default=300,
                        help=f"timed steps of each feed, {BLOCK} or more, in alternating blocks of {BLOCK} (the last "
                        f"block of each feed the rest when it is not a multiple of {BLOCK})")  # fmt: skip
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.steps < BLOCK:
        parser.error(f"--steps {args.steps}: each feed is timed in blocks of {BLOCK} steps; give --steps {BLOCK} or more")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_lib.load(args.preset, [f"data.cache_dir={tmp}", "logging.progress=false", *args.overrides])
        data = prepare_for_training(cfg.data, cfg.seed, progress=False)
        tok = data.tokenizer
        cfg = dataclasses.replace(cfg, model=config_lib.resolve_model(cfg.model, tok.n_vocab, cfg.data.block_size))
        mesh = sharding.make_mesh(cfg.mesh)
        tx = make_optimizer(cfg.optim, cfg.train.steps)
        state, state_sh = create_state(cfg, tx, mesh)
        d = cfg.data
        batches = data.train_iterator(d, cfg.seed, sharding.process_rows(mesh, d.batch_size))
        step = jax.jit(
            make_train_step(cfg, tx),
            in_shardings=(state_sh, sharding.batch_sharding(mesh), None),
            out_shardings=(state_sh, sharding.replicated(mesh)),
            donate_argnums=0,
        )
        real = lambda: sharding.global_batch(next(batches), mesh, d.batch_size)
        constant_batch = jax.block_until_ready(real())
        constant = lambda: constant_batch
        times = {"real": [], "constant": []}
        with sharding.activate(mesh):
            state, metrics = step(state, constant_batch, None)  # compiles
            jax.block_until_ready(metrics)
            # Both feeds time --steps steps: whole blocks, then what is left in a shorter one each.
            sizes = [BLOCK] * (args.steps // BLOCK) + ([args.steps % BLOCK] if args.steps % BLOCK else [])
            for size in sizes:
                for name, feed in (("real", real), ("constant", constant)):
                    pending = None
                    start = time.perf_counter()
                    for _ in range(size):
                        state, metrics = step(state, feed(), None)
                        if pending is not None:
                            jax.device_get(pending)  # what the loop does: the previous step's scalars
                        pending = metrics
                        now = time.perf_counter()
                        times[name].append(now - start)
                        start = now
                    jax.block_until_ready(pending)
    assert len(times["real"]) == len(times["constant"]) == args.steps
    real_s, constant_s = (statistics.median(times[k][1:]) for k in ("real", "constant"))
    result = {
        "preset": args.preset,
        "overrides": args.overrides,
        "steps_per_feed": len(times["real"]),
        "real_data_step_ms": round(real_s * 1e3, 3),
        "constant_batch_step_ms": round(constant_s * 1e3, 3),
        "real_over_constant": round(real_s / constant_s, 4),
        "target": "<= 1.05",
        "device": jax.devices()[0].device_kind,
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "jax": jax.__version__,
    }
    report("stall", result)


if __name__ == "__main__":
    command(main)
