"""Memory per device and step time for each mesh, on 8 simulated CPU devices.

    python -m benchmarks.sharding [--devices 8] [--steps 10]

For the GPT-2-small shape: bytes of parameters + AdamW state held by each device under each mesh,
from the shardings lm would create (nothing is allocated), against full replication. For a small
model: median train-step time under each mesh. Prints JSON; writes benchmarks/results/sharding.json.
"""

import argparse
import os
import sys
import time

from benchmarks.report import command, positive, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=positive, default=8, help="a multiple of 4")
    parser.add_argument("--steps", type=positive, default=10)
    args = parser.parse_args()
    if "jax" in sys.modules:
        raise SystemExit("run this as a script: the device count must be set before JAX starts")
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import flax.linen as nn
    import jax
    import numpy as np

    from lm import config as config_lib
    from lm import sharding
    from lm.model import init_params
    from lm.optim import make_optimizer
    from lm.steps import create_state, make_train_step

    n = args.devices
    meshes = {
        "replicated (data)": (n, 1, 1),
        "fsdp": (1, n, 1),
        "tensor": (1, 1, n),
        "fsdp x tensor": (1, n // 2, 2),
        "data x fsdp x tensor": (2, n // 4, 2),
    }

    gpt2 = config_lib.load("gpt2_small", ["model.vocab_size=50304", "model.dtype=float32"]).model
    gpt2_cfg = config_lib.replace(config_lib.Config(), model=gpt2)
    memory = {}
    for name, (d, f, t) in meshes.items():
        mesh = sharding.make_mesh(config_lib.MeshConfig(data=d, fsdp=f, tensor=t))
        tx = make_optimizer(gpt2_cfg.optim, 1000)
        boxed = jax.eval_shape(lambda r: init_params(gpt2, r), jax.random.PRNGKey(0))
        params_sh = sharding.param_shardings(boxed, mesh)
        params = nn.unbox(boxed)
        opt = jax.eval_shape(tx.init, params)
        opt_sh = sharding.opt_state_shardings(opt, params_sh, mesh)

        def per_device(tree, shardings):
            return sum(
                int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
                for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))
            )

        total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves((params, opt)))
        held = per_device(params, params_sh) + per_device(opt, opt_sh)
        memory[name] = {
            "mesh": {"data": d, "fsdp": f, "tensor": t},
            "bytes_per_device": held,
            "fraction_of_replicated": held / total,
        }

    small = config_lib.load("tiny", ["model.n_layer=4", "model.n_head=8", "model.n_embd=256", "data.block_size=128"])
    small = config_lib.replace(small, model=config_lib.resolve_model(small.model, 1024, 128), data={"batch_size": 32})
    tokens = jax.random.randint(jax.random.PRNGKey(0), (32, 129), 0, 1000)
    batch_host = {"inputs": np.asarray(tokens[:, :-1]), "targets": np.asarray(tokens[:, 1:])}
    step_times = {}
    for name, (d, f, t) in meshes.items():
        mesh = sharding.make_mesh(config_lib.MeshConfig(data=d, fsdp=f, tensor=t))
        tx = make_optimizer(small.optim, 1000)
        state, state_sh = create_state(small, tx, mesh)
        batch = sharding.global_batch(batch_host, mesh, 32)
        with sharding.activate(mesh):
            step = jax.jit(
                make_train_step(small, tx),
                in_shardings=(state_sh, sharding.batch_sharding(mesh)),
                out_shardings=(state_sh, sharding.replicated(mesh)),
                donate_argnums=0,
            )
            state, m = step(state, batch)
            jax.block_until_ready(m)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                state, m = step(state, batch)
                jax.block_until_ready(m)
                times.append(time.perf_counter() - t0)
        step_times[name] = {"mesh": {"data": d, "fsdp": f, "tensor": t}, "step_time_median_s": sorted(times)[len(times) // 2]}

    result = {
        "devices": n,
        "gpt2_small_params_plus_adamw_bytes_replicated": memory["replicated (data)"]["bytes_per_device"],
        "memory": memory,
        "small_model": {"n_layer": 4, "n_head": 8, "n_embd": 256, "block_size": 128, "batch_size": 32},
        "step_time": step_times,
        "note": "simulated devices share this machine's cores: step times compare communication overhead, not speed-up",
    }
    report("sharding", result)


if __name__ == "__main__":
    command(main)
