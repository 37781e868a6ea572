"""lm's sampler against Hugging Face `generate`, side by side in one run, on the same weights.

    pip install -e '.[bench]'
    python -m benchmarks.versus_hf [--batches 1 8] [--prompt 64] [--new-tokens 128] [--rounds 3] [--set KEY=VALUE ...]

The model is GPT-2 small's shape (configs/gpt2_small.yaml: 12 x 768, block 1024, vocabulary 50304)
in float32 with random weights, written once in Hugging Face's GPT-2 format (lm.hf.gpt2's exporter).
Rounds alternate between lm (`lm.sampling.generate`, greedy: prefill, then a jitted while_loop over
the KV cache) and transformers' `GPT2LMHeadModel.generate` (greedy, its KV cache, `torch.inference_mode`,
on the GPU where torch has CUDA), each in a fresh process: transformers loads the directory, lm builds the
same weights again.
Each process times a warm-up call, then the best of --repeat calls; a side's figure is the median of
its rounds, in generated tokens/s over all rows. Both sides generate exactly --new-tokens tokens a
row (no end-of-text stop), from the same random prompts; the JSON also says for how many leading
tokens the two agree (float32 rounding lets greedy paths part after a near-tie). Writes
benchmarks/results/versus_hf[_cuda][_NAME].json (--name NAME). --set changes the model's shape as train.py's
overrides do (e.g. `--set model.n_layer=2 model.n_embd=64`; tests/test_benchmarks.py runs it that small); the
vocabulary stays.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.report import RESULTS, command, need, positive, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 50304  # lm's rows (GPT-2's 50257 padded to a multiple of 64)
FIXED = ("model.dtype", "model.param_dtype", "model.vocab_size")  # (what lm_model sets)
N_IDS = VOCAB - 1  # ids either side may emit: lm's stand-in end-of-text is the last row, never drawn


def lm_model(overrides: Sequence[str] = ()):
    """(params, config): GPT-2 small in float32, with `overrides` (train.py's KEY=VALUE), in lm's random
    initialisation (seed 0)."""
    import flax.linen as nn
    import jax

    from lm import config as config_lib
    from lm.model import init_params

    cfg = config_lib.load("gpt2_small", list(overrides)).model
    cfg = dataclasses.replace(cfg, vocab_size=VOCAB, dtype="float32", param_dtype="float32")
    return jax.jit(lambda key: nn.unbox(init_params(cfg, key)))(jax.random.key(0)), cfg


def write_model(directory: str, overrides: Sequence[str] = ()) -> None:
    """lm_model(overrides) in Hugging Face's GPT-2 format, its first N_IDS vocabulary rows, with no end-of-text."""
    from lm.hf.files import write_json, write_weights
    from lm.hf.gpt2 import hf_gpt2_config, hf_gpt2_tensors

    params, cfg = lm_model(overrides)
    write_weights(hf_gpt2_tensors(params, cfg, N_IDS), directory)
    config = {**hf_gpt2_config(cfg, 0, 0, N_IDS), "bos_token_id": None, "eos_token_id": None}  # no special ids
    write_json(os.path.join(directory, "config.json"), config)


def prompts_for(batch: int, length: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(0, N_IDS, (batch, length))


def best(fn, repeat: int) -> tuple[float, object]:
    out = fn()  # warm-up: compiles (lm) or fills allocator caches (torch)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def child_lm(directory: str, batch: int, length: int, new: int, repeat: int, overrides: list[str]) -> dict:
    import jax

    from benchmarks.sample import StandIn
    from lm import sampling
    from lm.config import SampleConfig

    params, cfg = lm_model(overrides)
    tok = StandIn(n_vocab=N_IDS, eot=N_IDS)
    prompts = [list(map(int, p)) for p in prompts_for(batch, length)]
    settings = SampleConfig(max_new_tokens=new, temperature=0.0)

    def run():
        samples = sampling.generate(params, cfg, tok, prompts, settings, seed=0, stop=())
        return [list(s.tokens) for s in samples]

    seconds, tokens = best(run, repeat)
    assert all(len(t) == new for t in tokens), "a row stopped early"
    return {"seconds": seconds, "tokens": tokens, "version": jax.__version__}


def child_hf(directory: str, batch: int, length: int, new: int, repeat: int, overrides: list[str]) -> dict:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where lm runs too: JAX's GPU when there is one
    model = transformers.GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32).eval().to(device)
    prompts = torch.from_numpy(prompts_for(batch, length)).to(device)
    settings = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompts))

    def run():
        with torch.inference_mode():
            return model.generate(prompts, **settings)[:, length:].tolist()

    seconds, tokens = best(run, repeat)
    return {"seconds": seconds, "tokens": tokens, "version": f"transformers {transformers.__version__}, torch {torch.__version__}"}


def run_child(side: str, directory: str, batch: int, args) -> dict:
    cmd = [
        sys.executable, "-m", "benchmarks.versus_hf", "--child", side, "--dir", directory,
        "--batches", str(batch), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
        "--repeat", str(args.repeat), "--set", *args.set,
    ]  # fmt: skip
    out = subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def agreement(a: list[list[int]], b: list[list[int]]) -> int:
    """The number of leading tokens on which every row of a and b agree."""
    n = 0
    while all(n < len(x) and n < len(y) and x[n] == y[n] for x, y in zip(a, b)):
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=positive, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=positive, default=64)
    parser.add_argument("--new-tokens", type=positive, default=128)
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument("--repeat", type=positive, default=2, help="timed calls per process, the best counts")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="the model's shape, as train.py's")
    parser.add_argument("--name", default="", help="result file suffix (versus_hf_NAME.json)")
    parser.add_argument("--child", choices=["lm", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        fn = child_lm if args.child == "lm" else child_hf
        out = fn(args.dir, args.batches[0], args.prompt, args.new_tokens, args.repeat, args.set)
        print(json.dumps(out), flush=True)
        sys.stdout.flush()
        os._exit(0)  # nothing left to clean up; skips slow interpreter teardown

    from lm import config as config_lib
    from lm.errors import UserError

    try:
        cfg = config_lib.load("gpt2_small", args.set)
    except UserError as e:  # a bad --set, before anything runs
        parser.error(f"--set: {e}")
    model = cfg.model
    context = model.max_seq_len or cfg.data.block_size
    if args.prompt + args.new_tokens > context:  # (the lm child's own line said "lower max_new_tokens", after a model)
        parser.error(f"--prompt {args.prompt} + --new-tokens {args.new_tokens} is more than the model's context of "
                     f"{context} tokens; lower them (or --set model.max_seq_len=N)")  # fmt: skip
    from lm.hf.gpt2 import gpt2_incompatible

    fixed = [key for key in config_lib.set_keys(None, args.set) if key in FIXED]
    if fixed:  # (both sides run float32 at the benchmark's vocabulary: a --set of them was run without, yet recorded)
        parser.error(f"--set: {', '.join(fixed)} is fixed here (float32, {VOCAB} ids, as transformers runs the same "
                     "weights); change only the GPT-2 shape (model.n_layer, model.n_embd, ...)")
    problems = gpt2_incompatible(model)
    if problems:  # (the exporter failed on it with a KeyError or ValueError)
        parser.error(f"--set: transformers' GPT-2 cannot express {', '.join(problems)}; change only the GPT-2 shape "
                     "(model.n_layer, model.n_head, model.n_embd, ...)")  # fmt: skip
    need("torch", "transformers")  # the bench extra: the peer's child imports both; refused before any work
    import torch

    from benchmarks.versus_torch import check_same_device, lm_backend

    check_same_device(torch, lm_backend())  # (transformers on torch's GPU against lm on jax's CPU, or the reverse)

    result = {
        "model": " ".join(["gpt2_small", *args.set]),
        "prompt_tokens": args.prompt,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "batches": {},
    }
    with tempfile.TemporaryDirectory() as directory:
        write_model(directory, args.set)
        for batch in args.batches:
            lm_rates, hf_rates = [], []
            for r in range(args.rounds):
                ours, theirs = run_child("lm", directory, batch, args), run_child("hf", directory, batch, args)
                lm_rates.append(batch * args.new_tokens / ours["seconds"])
                hf_rates.append(batch * args.new_tokens / theirs["seconds"])
                print(f"batch {batch} round {r + 1}: lm {lm_rates[-1]:.1f} tok/s, hf {hf_rates[-1]:.1f}", file=sys.stderr)
            lm_med, hf_med = statistics.median(lm_rates), statistics.median(hf_rates)
            result["batches"][str(batch)] = {
                "lm_tokens_per_sec": [round(x, 1) for x in lm_rates],
                "hf_tokens_per_sec": [round(x, 1) for x in hf_rates],
                "lm_ms_per_token_step": round(1e3 * batch / lm_med, 2),
                "hf_ms_per_token_step": round(1e3 * batch / hf_med, 2),
                "ratio": round(lm_med / hf_med, 3),
                "greedy_tokens_agree": agreement(ours["tokens"], theirs["tokens"]),
            }
    result.update(
        lm=f"jax {ours['version']}",
        hf=theirs["version"],
        torch_threads=torch.get_num_threads(),
        machine=f"{platform.machine()} {os.cpu_count()} cores",
    )
    name = ("versus_hf_cuda" if torch.cuda.is_available() else "versus_hf") + (f"_{args.name}" if args.name else "")
    report(name, result, os.path.join(RESULTS, f"{name}.json"))


if __name__ == "__main__":
    command(main)
