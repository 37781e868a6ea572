"""Sampling speed: lm.sampling's KV-cached decoding against recomputing the whole sequence for every
token. Prints JSON and writes it to benchmarks/results/sample.json.

    python -m benchmarks.sample [--quick] [--new-tokens 256] [--prompt 64] [--batches 1 8]

Models, with random weights: the model section of configs/default.yaml with a 1024-token vocabulary,
and GPT-2 small (configs/gpt2_small.yaml: 12 layers x 768, vocabulary 50304) in float32, also with
scan_layers. Each run also reports the bandwidth bound of a decode step: parameter bytes over the
read bandwidth of benchmarks/results/peak.json (python -m benchmarks.peak), and the loop's step time
over it (the target at batch 1 is <= 2). The window
(max_seq_len) is the prompt plus the new tokens for the first, 1024 for GPT-2. Sampling draws at
temperature 0.8 from the whole vocabulary; the stand-in tokenizer's end-of-text id is a padding id,
which is never drawn, so every row generates all its tokens.

For each model and batch size, after a warm-up call that compiles:
  cached       generate() end to end (prefill, then the jitted while_loop); tokens/s counts every row,
               loop_ms_per_step is its time over the new tokens
  first token  the prefill and the first draw (time to first token)
  per token    one jitted decode step called from Python, as streaming runs it: the mean of the first
               and of the last 16 steps (the cache has a fixed length, so a step costs the same early
               and late; a lone call also pays what the while_loop hoists out of its steps)
  recompute    a jitted forward over the whole sequence so far, then an argmax (timed on placeholder tokens).
               The sequence is padded to a multiple of 64 so that only a few shapes compile; each
               padded length is timed over --probe steps and the total is extrapolated over the
               lengths that generating all the new tokens passes through.
Each time is the best of --repeat runs, since other work on the machine only ever slows a run down.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import RESULTS, command, positive, report
from lm import config as config_lib
from lm import sampling
from lm.sampling import loop
from lm.model import Transformer, count_params, init_params
from lm.tokenizer import Tokenizer

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
PAD_TO = 64  # the recomputation pads its sequence to a multiple of this
EDGE = 16  # steps averaged for the per-token time at the start and at the end


@dataclasses.dataclass(frozen=True)
class StandIn:
    """A tokenizer for random-weight models: ids without text, and an end-of-text id that is never drawn."""

    n_vocab: int
    eot: int
    prefix: tuple = ()
    special_tokens: dict = dataclasses.field(default_factory=dict)
    unused_ids: frozenset = frozenset()
    control_ids: frozenset = frozenset()  # (special tokens that are no text: a sample leaves them out)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eot,)

    def encode(self, text: str) -> list[int]:
        return []

    def decode(self, ids) -> str:
        return ""

    spec = "stand-in"
    not_a_token = Tokenizer.not_a_token  # (what the sampler asks of a prompt: its n_vocab and unused_ids)


def models(prompt: int, new_tokens: int) -> dict[str, config_lib.ModelConfig]:
    default = config_lib.load(os.path.join(CONFIGS, "default.yaml")).model
    gpt2 = config_lib.load(os.path.join(CONFIGS, "gpt2_small.yaml")).model
    return {
        "default (configs/default.yaml, vocab 1024)": dataclasses.replace(
            default, vocab_size=1024, max_seq_len=prompt + new_tokens
        ),
        "gpt2-small (12x768, vocab 50304, float32)": dataclasses.replace(
            gpt2, vocab_size=50304, dtype="float32", param_dtype="float32"
        ),
        "gpt2-small, scan_layers=true": dataclasses.replace(
            gpt2, vocab_size=50304, dtype="float32", param_dtype="float32", scan_layers=True
        ),
        "gpt2-small, bfloat16 weights and compute": dataclasses.replace(
            gpt2, vocab_size=50304, dtype="bfloat16", param_dtype="bfloat16"
        ),
    }


def read_bandwidth() -> tuple[float, str]:
    """(bytes/s, where from): the results directory's peak.json (benchmarks.report.RESULTS) read bandwidth if it was
    measured on this kind of device, else measured now."""
    try:
        with open(os.path.join(RESULTS, "peak.json")) as f:
            peak = json.load(f)
        if peak["device"] == jax.devices()[0].device_kind:
            return peak["read_bytes_per_sec"], "benchmarks/results/peak.json"
    except (OSError, KeyError, ValueError):
        pass
    from benchmarks.peak import read_bandwidth as measure

    return measure(512 << 20, 5), "measured now"


def best_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def cached(params, cfg, tok, prompts, new_tokens: int, repeat: int) -> dict:
    settings = config_lib.SampleConfig(max_new_tokens=new_tokens, temperature=0.8, top_k=0, top_p=1.0)
    start = time.perf_counter()
    samples = sampling.generate(params, cfg, tok, prompts, settings, seed=0, stop=())
    compile_s = time.perf_counter() - start
    assert all(len(s.tokens) == new_tokens for s in samples)
    seconds = best_time(lambda: sampling.generate(params, cfg, tok, prompts, settings, seed=0, stop=()), repeat)
    args = (params, cfg, tok, prompts, settings, 0, ())
    first = best_time(lambda: loop._start(*args)[2], repeat)

    params, request, state = loop._start(*args)
    steps = []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        state = jax.block_until_ready(request.step(params, state))
        steps.append(time.perf_counter() - start)
    steps = steps[1:]  # the first call compiles
    tokens = len(prompts) * new_tokens
    return {
        "tokens/s": round(tokens / seconds, 1),
        "seconds": round(seconds, 3),
        "loop_ms_per_step": round(seconds / new_tokens * 1e3, 2),
        "first_call_seconds (compiles)": round(compile_s, 2),
        "time_to_first_token_ms": round(first * 1e3, 2),
        "stream_ms_per_step_start": round(float(np.mean(steps[:EDGE])) * 1e3, 2),
        "stream_ms_per_step_end": round(float(np.mean(steps[-EDGE:])) * 1e3, 2),
    }


def recompute(params, cfg, prompts: np.ndarray, new_tokens: int, probe: int) -> dict:
    forward = jax.jit(lambda p, tokens_BT, last: jnp.argmax(Transformer(cfg).apply(p, tokens_BT)[:, last], axis=-1))
    batch, length = prompts.shape
    padded = lambda n: -(-n // PAD_TO) * PAD_TO
    step_s = {}
    for width in sorted({padded(length + i) for i in range(new_tokens)}):
        tokens = np.zeros((batch, width), np.int32)
        tokens[:, :length] = prompts
        jax.block_until_ready(forward(params, tokens, width - 1))  # compiles
        step_s[width] = best_time(lambda: forward(params, tokens, width - 1), probe)
    seconds = sum(step_s[padded(length + i)] for i in range(new_tokens))
    return {
        "tokens/s (extrapolated)": round(batch * new_tokens / seconds, 1),
        "seconds (extrapolated)": round(seconds, 2),
        "per_token_ms_by_padded_length": {w: round(s * 1e3, 2) for w, s in step_s.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=positive, default=64, help="prompt tokens (64)")
    parser.add_argument("--new-tokens", type=positive, default=None, help="tokens generated per row (256)")
    parser.add_argument("--batches", type=positive, nargs="+", default=[1, 8], help="batch sizes (1 8)")
    parser.add_argument("--repeat", type=positive, default=None, help="runs of each timing, the best counts (2)")
    parser.add_argument("--probe", type=positive, default=None, help="timed recompute steps per padded length (2)")
    parser.add_argument("--quick", action="store_true", help="64 new tokens, one run of each timing")
    parser.add_argument("--models", nargs="*", help="only the models whose name contains one of these")
    parser.add_argument("--no-recompute", action="store_true", help="skip the (slow) full-recomputation baseline")
    parser.add_argument("--out", help="where to write the JSON (default: benchmarks/results/sample.json)")
    args = parser.parse_args()
    quick = lambda given, fast, full: given if given is not None else fast if args.quick else full  # (given wins)
    args.new_tokens, args.repeat, args.probe = (
        quick(args.new_tokens, 64, 256),
        quick(args.repeat, 1, 2),
        quick(args.probe, 1, 2),
    )
    if args.new_tokens <= 2 * EDGE:
        parser.error(
            f"--new-tokens {args.new_tokens} is too few to time the start and the end apart: give more than {2 * EDGE}"
        )
    names = list(models(args.prompt, args.new_tokens))
    if args.models and not any(m in name for m in args.models for name in names):
        parser.error(f"--models {' '.join(args.models)} names none of {', '.join(names)}")  # (it wrote no runs)

    bandwidth, bandwidth_from = read_bandwidth()
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "devices": [str(d) for d in jax.devices()],
            "platform": platform.platform(),
            "jax": jax.__version__,
        },
        "read_bytes_per_sec": bandwidth,
        "read_bandwidth_from": bandwidth_from,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new_tokens,
        "runs": [],
    }
    for name, cfg in models(args.prompt, args.new_tokens).items():
        if args.models and not any(m in name for m in args.models):
            continue
        params = jax.jit(lambda key: nn.unbox(init_params(cfg, key)))(jax.random.key(0))
        tok = StandIn(n_vocab=cfg.vocab_size - 1, eot=cfg.vocab_size - 1)
        for batch in args.batches:
            prompts = np.random.default_rng(batch).integers(0, tok.n_vocab, (batch, args.prompt), dtype=np.int32)
            run = {"model": name, "params": count_params(params), "batch": batch}
            run["cached"] = cached(params, cfg, tok, [list(p) for p in prompts], args.new_tokens, args.repeat)
            # A decode step reads every parameter once: at batch 1 that is the bound on its time.
            param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
            bound_ms = param_bytes / bandwidth * 1e3
            run["bandwidth_bound_ms_per_step"] = round(bound_ms, 2)
            run["loop_step_over_bound"] = round(run["cached"]["loop_ms_per_step"] / bound_ms, 2)
            if not args.no_recompute:
                run["recompute"] = recompute(params, cfg, prompts, args.new_tokens, args.probe)
                run["speedup"] = round(run["cached"]["tokens/s"] / run["recompute"]["tokens/s (extrapolated)"], 1)
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    report("sample", results, args.out)


if __name__ == "__main__":
    command(main)
