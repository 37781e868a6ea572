"""The chunked loss (train.loss_chunk) against the whole batch's logits: GPT-2 small (12 x 768, vocabulary
50,304, float32, tied head) at 8 x 1024 tokens a step on the CPU.

    python -m benchmarks.loss_chunk [--chunks 0 128] [--batch 8] [--block 1024] [--accum 2] [--steps 3] [--no-head]

Each train.loss_chunk of --chunks (the first is "before", the last "after"; by default 0, the whole rows,
and the backend's own chunk, lm.platform's: 128) runs in a fresh process, so that
its peak resident memory (VmHWM) is its own. There: the compiled memory (`memory_analysis()`: temporaries,
arguments, outputs) of the whole 8 x 1024 step, compiled on abstract inputs; then the train step that
lm.steps.Trainer builds with train.grad_accum=--accum, run on random tokens: its compiled memory, the median
time of --steps steps after one warm-up step, the first step's loss (the variants must agree) and the peak
memory. The timed step takes the 8 x 1024 tokens in micro-batches because the whole step does not fit this
machine's 23 GiB either way: 24 GiB of temporaries unchunked, 21.6 GiB chunked, nearly all of it the
layers' (1.8 GiB each, model.remat=full or not; one [8, 12, 1024, 1024] float32 array of attention scores
is 384 MiB).

A last process times the gradient of the head and the loss alone (8 x 1024 tokens, interleaved) three ways:
the whole logits, lm.loss's custom_vjp (each chunk's gradient computed in the forward pass), and a scan whose
body is under jax.checkpoint (each chunk's logits recomputed in the backward pass): the measurement behind
lm.loss's choice. Prints JSON and writes benchmarks/results/loss_chunk.json.
"""

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.compile import abstract_step_inputs
from benchmarks.report import command, positive, report
from lm import config as config_lib
from lm import platform as lm_platform
from lm import sharding
from lm.loss import chunked_loss_sums, token_losses
from lm.steps import Trainer, make_train_step

N_VOCAB = 50257  # GPT-2's tokenizer; the model pads it to 50,304 rows


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM): its own, not a parent's at fork as ru_maxrss may be."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return round(kb / 1024, 1)


def memory_mb(compiled) -> dict:
    m = compiled.memory_analysis()
    mb = lambda n: round(n / 2**20, 1)
    return {
        "temp_mb": mb(m.temp_size_in_bytes),
        "temp_bytes": m.temp_size_in_bytes,
        "argument_mb": mb(m.argument_size_in_bytes),
        "output_mb": mb(m.output_size_in_bytes),
        "alias_mb": mb(m.alias_size_in_bytes),
    }


def whole_batch_memory(cfg: config_lib.Config) -> dict:
    """The compiled memory of the step without gradient accumulation, compiled on abstract inputs (nothing
    is allocated): on this machine the unchunked one needs more than its 23 GiB to run."""
    cfg = config_lib.replace(cfg, train={"grad_accum": 1})
    tx, state, data = abstract_step_inputs(cfg)
    with sharding.activate(sharding.make_mesh(cfg.mesh)):
        return memory_mb(jax.jit(make_train_step(cfg, tx), donate_argnums=0).lower(state, data).compile())


def step_variant(chunk: int, batch: int, block: int, accum: int, steps: int) -> dict:
    """One train.loss_chunk: the compiled step's memory, its step time, the process's peak memory."""
    overrides = [
        f"data.batch_size={batch}",
        f"data.block_size={block}",
        f"train.grad_accum={accum}",
        "model.dtype=float32",
        f"train.loss_chunk={chunk}",
    ]
    cfg = config_lib.load("gpt2_small", overrides)
    cfg = dataclasses.replace(cfg, model=config_lib.resolve_model(cfg.model, N_VOCAB, block))
    whole = whole_batch_memory(cfg)
    mesh = sharding.make_mesh(cfg.mesh)
    trainer, state = Trainer.create(cfg, mesh, N_VOCAB)
    tokens = np.random.default_rng(0).integers(0, N_VOCAB, (batch, block + 1), dtype=np.int32)
    data = sharding.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh, batch)
    with sharding.activate(mesh):
        start = time.perf_counter()
        compiled = trainer.train_step.lower(state, data, None).compile()
        compile_s = time.perf_counter() - start
        times, loss = [], None
        for _ in range(1 + steps):
            start = time.perf_counter()
            state, metrics = compiled(state, data, None)
            metrics = jax.device_get(metrics)
            times.append(time.perf_counter() - start)
            loss = float(metrics["loss"]) if loss is None else loss
    return {
        "loss_chunk": chunk,
        "without_accum": whole,
        f"accum_{accum}": memory_mb(compiled),
        "peak_rss_mb": peak_rss_mb(),
        "step_s_median": round(statistics.median(times[1:]), 2),
        "step_s": [round(t, 2) for t in times],
        "compile_s": round(compile_s, 1),
        "first_loss": loss,
    }


def head_variants(chunk: int, batch: int, block: int, rounds: int) -> dict:
    """Gradient of the head + loss alone ([B, T, D] hidden states, [V, D] tied weight), three ways."""
    d, v = 768, 50304
    chunk = min(chunk, block)  # as lm.loss takes a chunk longer than the rows
    kx, kw, kt = jax.random.split(jax.random.key(0), 3)
    x_BTD = jax.random.normal(kx, (batch, block, d), jnp.float32)
    w_VD = jax.random.normal(kw, (v, d), jnp.float32) * 0.02
    targets_BT = jax.random.randint(kt, (batch, block), 0, N_VOCAB)
    mask_BT = jnp.ones((batch, block), jnp.float32)

    def whole(x_BTD, w_VD):
        logits_BTV = (x_BTD.reshape(-1, d) @ w_VD.T).reshape(batch, block, v)
        return token_losses(logits_BTV, targets_BT)[0].sum()

    def custom_vjp(x_BTD, w_VD):
        return chunked_loss_sums(x_BTD, w_VD.T, targets_BT, mask_BT, chunk, "float32")[0]

    def checkpointed_scan(x_BTD, w_VD):
        @jax.checkpoint
        def chunk_sum(x_BCD, targets_BC):
            logits_BCV = (x_BCD.reshape(-1, d) @ w_VD.T).reshape(batch, chunk, v)
            return token_losses(logits_BCV, targets_BC)[0].sum()

        stack = lambda a: a.reshape(batch, block // chunk, chunk, *a.shape[2:]).swapaxes(0, 1)
        body = lambda total, xs: (total + chunk_sum(*xs), None)
        return jax.lax.scan(body, jnp.zeros(()), (stack(x_BTD), stack(targets_BT)))[0]

    variants = {"whole_logits": whole, "custom_vjp": custom_vjp, "checkpointed_scan": checkpointed_scan}
    compiled = {k: jax.jit(jax.value_and_grad(f, (0, 1))).lower(x_BTD, w_VD).compile() for k, f in variants.items()}
    times = {k: [] for k in variants}
    for r in range(1 + rounds):  # interleaved, so that other work on the machine slows all alike
        for name, c in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(c(x_BTD, w_VD))
            if r:
                times[name].append(time.perf_counter() - start)
    return {
        name: {
            "grad_s_median": round(statistics.median(t), 2),
            "grad_s": [round(s, 2) for s in t],
            **memory_mb(compiled[name]),
        }
        for name, t in times.items()
    }


def child(args: list[str]) -> dict:
    """Run one part in a fresh process; its result is the last line it prints."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.loss_chunk", *args], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(f"benchmarks.loss_chunk {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, lm_platform.current().loss_chunk])
    parser.add_argument("--batch", type=positive, default=8)
    parser.add_argument("--block", type=positive, default=1024)
    parser.add_argument("--accum", type=positive, default=2, help="train.grad_accum of the timed steps")
    parser.add_argument("--steps", type=positive, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--no-head", action="store_true", help="skip timing the head and loss alone")
    parser.add_argument("--part", choices=["step", "head"], help=argparse.SUPPRESS)  # a child's one job
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if any(chunk < 0 for chunk in args.chunks):
        parser.error(f"--chunks are positions (0 = the whole rows at once), got {args.chunks}")
    if not args.no_head and not args.part:  # the head is timed at the last of --chunks
        if args.chunks[-1] == 0:
            parser.error("the head is timed at the last of --chunks, which must be > 0; or give --no-head")
        if args.block % min(args.chunks[-1], args.block):
            parser.error(f"the head's scan takes whole chunks: give a --block that is a multiple of {args.chunks[-1]}")
    if args.part == "step":
        print(json.dumps(step_variant(args.chunk, args.batch, args.block, args.accum, args.steps)))
        return
    if args.part == "head":
        print(json.dumps(head_variants(args.chunk, args.batch, args.block, args.steps)))
        return
    shape = [f"--batch={args.batch}", f"--block={args.block}", f"--accum={args.accum}", f"--steps={args.steps}"]
    result = {
        "model": "gpt2_small shape: 12 layers, 12 heads, 768 wide, vocabulary 50,304, tied head, float32",
        "tokens_per_step": f"{args.batch} x {args.block}",
        "timed_with": f"train.grad_accum={args.accum} (micro-batches of {args.batch // args.accum} x {args.block})",
        "variants": [],
    }
    for chunk in args.chunks:
        result["variants"].append(child(["--part", "step", "--chunk", str(chunk), *shape]))
        print(json.dumps(result["variants"][-1]), flush=True)
    before, after = result["variants"][0], result["variants"][-1]
    accum = f"accum_{args.accum}"
    result["after_over_before"] = {
        "temp_without_accum": round(after["without_accum"]["temp_mb"] / before["without_accum"]["temp_mb"], 3),
        f"temp_{accum}": round(after[accum]["temp_mb"] / before[accum]["temp_mb"], 3),
        **{k: round(after[k] / before[k], 3) for k in ("peak_rss_mb", "step_s_median")},
    }
    if not args.no_head:
        chunk = args.chunks[-1]  # the "after"
        head = child(["--part", "head", "--chunk", str(chunk), *shape])
        result["head_and_loss_gradient"] = {"loss_chunk": chunk, **head}
    result.update(
        device=jax.devices()[0].device_kind,
        machine=f"{platform.machine()} {os.cpu_count()} cores",
        jax=jax.__version__,
    )
    report("loss_chunk", result)


if __name__ == "__main__":
    command(main)
