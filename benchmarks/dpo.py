"""The DPO step against a supervised step of the same tokens, side by side in one process, full fine-tuning and LoRA.

    python -m benchmarks.dpo [--layers 4] [--embd 256] [--vocab 8192] [--block 128] [--pairs 8] [--rounds 8]
        [--lora-rank 8]

The supervised step (train.objective=cross_entropy) takes 2 x --pairs rows of --block tokens, its loss on the
second half of each row; the DPO step (train.objective=dpo) takes --pairs pairs of the same rows, so both see the
same tokens. DPO's step adds the reference model's forward pass (the frozen copy in a full fine-tune, the base
with the adapters off under LoRA) to the policy's forward and backward passes: about 4/3 of the supervised
step's work. Each is lm.steps.Trainer's jitted step on random tokens and random weights; after one warm-up
step each, --rounds rounds time one step of each, interleaved, so that a busy machine slows both alike. Prints
JSON (median step times and their ratio, for each of full and lora, with the adapters' --lora-rank) and writes
benchmarks/results/dpo.json.
"""

import argparse
import os
import platform
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import command, positive, report
from lm import config as config_lib
from lm import sharding
from lm.model import init_params
from lm.steps import Trainer


def configs(args, lora: bool) -> dict[str, config_lib.Config]:
    common = [
        f"model.n_layer={args.layers}", f"model.n_embd={args.embd}", f"model.n_head={max(1, args.embd // 64)}",
        f"model.vocab_size={args.vocab}", f"data.block_size={args.block}", "init_from=random-weights",
        "optim.warmup_steps=0", *([f"lora.rank={args.lora_rank}"] if lora else []),
    ]  # fmt: skip
    sft = config_lib.load(None, [*common, f"data.batch_size={2 * args.pairs}"])
    dpo = config_lib.load(
        None, [*common, f"data.batch_size={args.pairs}", "data.format=preference", "train.objective=dpo"]
    )
    return {
        name: config_lib.replace(cfg, model=config_lib.resolve_model(cfg.model, args.vocab, args.block))
        for name, cfg in (("sft", sft), ("dpo", dpo))
    }


def batches(args) -> dict[str, dict[str, np.ndarray]]:
    """The same rows for both: a prompt half without loss, a response half with it."""
    tokens = np.random.default_rng(0).integers(0, args.vocab, (2 * args.pairs, args.block + 1), dtype=np.int32)
    mask = np.zeros((2 * args.pairs, args.block), np.float32)
    mask[:, args.block // 2 :] = 1.0
    rows = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}
    return {"sft": rows, "dpo": {k: v.reshape(args.pairs, 2, args.block) for k, v in rows.items()}}


def compare(args, lora: bool) -> dict:
    cfgs, data = configs(args, lora), batches(args)
    mesh = sharding.make_mesh(cfgs["sft"].mesh)
    base = nn.unbox(init_params(cfgs["sft"].model, jax.random.key(1)))
    steps, states, placed = {}, {}, {}
    for name, cfg in cfgs.items():
        # The frozen base of LoRA; in a full DPO fine-tune the reference, a frozen copy of the starting weights.
        frozen = base if lora else (jax.tree.map(jnp.copy, base) if name == "dpo" else None)
        trainer, state = Trainer.create(cfg, mesh, args.vocab, frozen=frozen)
        if not lora:  # the starting weights, laid out as the state's (a copy: the state is donated to each step)
            state = state.replace(
                params=jax.tree.map(lambda p, b: jax.device_put(np.asarray(b), p.sharding), state.params, base)
            )
        placed[name] = sharding.global_batch(data[name], mesh, cfg.data.batch_size)
        steps[name], states[name] = (trainer, frozen), state
    times = {name: [] for name in cfgs}
    with sharding.activate(mesh):
        for round_ in range(-1, args.rounds):
            for name in cfgs:
                trainer, frozen = steps[name]
                start = time.perf_counter()
                states[name], metrics = trainer.train_step(states[name], placed[name], frozen)
                jax.block_until_ready(metrics)
                if round_ >= 0:  # the warm-up step compiled
                    times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "sft_step_s": round(median["sft"], 4),
        "dpo_step_s": round(median["dpo"], 4),
        "dpo_over_sft": round(median["dpo"] / median["sft"], 3),
        "sft_step_s_all": [round(t, 4) for t in times["sft"]],
        "dpo_step_s_all": [round(t, 4) for t in times["dpo"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=positive, default=4)
    parser.add_argument("--embd", type=positive, default=256)
    parser.add_argument("--vocab", type=positive, default=8192)
    parser.add_argument("--block", type=positive, default=128)
    parser.add_argument("--pairs", type=positive, default=8)
    parser.add_argument("--lora-rank", type=positive, default=8, help="the adapters' rank in the LoRA comparison (8)")
    parser.add_argument("--rounds", type=positive, default=8)
    args = parser.parse_args()
    heads = max(1, args.embd // 64)  # (lm's line named model.n_head and head_dim, neither an option here)
    if args.embd % heads:
        parser.error(f"argument --embd: {args.embd} is split into {args.embd} // 64 = {heads} heads, and is no "
                     f"multiple of {heads}; give a multiple of 64, say")  # fmt: skip
    for lora in (False, True):  # a shape or setting lm refuses is one line before either comparison runs
        configs(args, lora)
    result = {
        "model": {"n_layer": args.layers, "n_embd": args.embd, "vocab_size": args.vocab},
        "pairs": args.pairs,
        "block_size": args.block,
        "tokens_per_step": 2 * args.pairs * args.block,
        "rounds": args.rounds,
        "full": compare(args, lora=False),
        "lora": {"rank": args.lora_rank, **compare(args, lora=True)},
        "device": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "jax": jax.__version__,
    }
    report("dpo", result)


if __name__ == "__main__":
    command(main)
