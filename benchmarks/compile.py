"""Compile time of the jitted train step: the shakespeare_char preset, and the GPT-2-small shape with
and without scan_layers at 12 and 24 layers (with scan_layers it should not grow with depth).

    python -m benchmarks.compile [--repeats 3]

Times jax.jit(train_step).lower(...).compile() on abstract inputs (nothing is allocated, so the
GPT-2 shapes cost no memory), the best of --repeats cold compiles (the persistent compilation cache is
off here), after one compile of the tiny preset that pays the process's one-time costs; also the
optimised HLO's length. GPT-2 small uses a 4 x 128 batch: the step's code, not its data, sets the compile time.
Prints JSON and writes benchmarks/results/compile.json.
"""

import argparse
import dataclasses
import os
import platform
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks.report import command, positive, report
from lm import config as config_lib
from lm import sharding
from lm.model import init_params
from lm.optim import make_optimizer
from lm.steps import TrainState, make_train_step


def abstract_step_inputs(cfg: config_lib.Config):
    """(optimizer, train state, batch) as shapes only, to lower and compile the train step without allocating."""
    tx = make_optimizer(cfg.optim, cfg.train.steps)

    def init(rng):
        params = nn.unbox(init_params(cfg.model, rng))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng)

    state = jax.eval_shape(init, jax.random.PRNGKey(0))
    b, t = cfg.data.batch_size, cfg.data.block_size
    return tx, state, {k: jax.ShapeDtypeStruct((b, t), jnp.int32) for k in ("inputs", "targets")}


def compile_seconds(cfg: config_lib.Config, repeats: int) -> tuple[float, int]:
    """(best cold compile seconds, lines of the optimised HLO)."""
    tx, state, batch = abstract_step_inputs(cfg)
    best, lines = float("inf"), 0
    with sharding.activate(sharding.make_mesh(cfg.mesh)):
        for _ in range(repeats):
            jax.clear_caches()
            start = time.perf_counter()
            compiled = jax.jit(make_train_step(cfg, tx), donate_argnums=0).lower(state, batch).compile()
            best = min(best, time.perf_counter() - start)
            lines = len(compiled.as_text().splitlines())
    return best, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive, default=3)
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    tiny = config_lib.load("tiny")
    compile_seconds(dataclasses.replace(tiny, model=config_lib.resolve_model(tiny.model, 256, 32)), 1)  # one-time costs
    char = config_lib.load("shakespeare_char")
    char = dataclasses.replace(char, model=config_lib.resolve_model(char.model, 256, char.data.block_size))
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "jax": jax.__version__,
        "shakespeare_char_s": round(compile_seconds(char, args.repeats)[0], 2),
    }
    gpt2 = config_lib.load("gpt2_small", ["data.batch_size=4", "train.grad_accum=1", "data.block_size=128", "model.dtype=float32"])
    for scan in (True, False):
        for layers in (12, 24):
            model = dataclasses.replace(gpt2.model, n_layer=layers, scan_layers=scan)
            cfg = dataclasses.replace(gpt2, model=config_lib.resolve_model(model, 50304, 128))
            seconds, lines = compile_seconds(cfg, args.repeats)
            name = f"gpt2_small_{layers}_layers_{'scan' if scan else 'unrolled'}"
            result[f"{name}_s"], result[f"{name}_hlo_lines"] = round(seconds, 2), lines
            print(name, round(seconds, 2), lines, flush=True)
    result["scan_24_over_12"] = round(result["gpt2_small_24_layers_scan_s"] / result["gpt2_small_12_layers_scan_s"], 2)
    result["unrolled_24_over_12"] = round(
        result["gpt2_small_24_layers_unrolled_s"] / result["gpt2_small_12_layers_unrolled_s"], 2
    )
    report("compile", result)


if __name__ == "__main__":
    command(main)
