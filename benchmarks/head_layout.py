"""The weight layouts the sampler decodes with on a CPU (lm.sampling.layout) against the parameters as they are.

    python -m benchmarks.head_layout [--batches 1 4 8] [--rounds 8] [--new-tokens 128] [--prompt 64]

On a CPU, lm.sampling decodes one row with every Linear kernel transposed, [outputs, inputs]
(lm.model.outputs_first), and several rows of a tied-head model with the head's own [D, V] copy of the
embedding (lm.model.untied). This times `lm.sampling.generate` (greedy) on GPT-2 small's shape (float32,
random weights, benchmarks.versus_hf's model and prompts) in one process, alternating rounds between
the sampler as it is ("laid_out") and the sampler given the parameters as they are ("plain"), and
reports each side's best and the ratio per round (plain over laid-out milliseconds a token: above 1 is
the layout's gain). Both sides must generate the same tokens. The layout is made once per set of
parameters and kept (lm.sampling.layout): the first call pays for it, and the JSON reports that cost
too ("make_seconds"). Writes benchmarks/results/head_layout.json.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import jax

from benchmarks.report import command, positive, report
from benchmarks.sample import StandIn
from benchmarks.versus_hf import N_IDS, lm_model, prompts_for
from lm import model, sampling
from lm.config import SampleConfig
from lm.sampling import layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=positive, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=positive, default=8)
    parser.add_argument("--new-tokens", type=positive, default=128)
    parser.add_argument("--prompt", type=positive, default=64)
    args = parser.parse_args()
    params, cfg = lm_model()
    tok = StandIn(n_vocab=N_IDS, eot=N_IDS)
    sides = ("laid_out", "plain")

    def run(side: str, prompts) -> tuple[float, list]:
        plain = lambda p, c, rows: model.unscanned(p, c)
        with mock.patch.object(layout, "for_decoding", plain) if side == "plain" else contextlib.nullcontext():
            start = time.perf_counter()
            settings = SampleConfig(max_new_tokens=args.new_tokens, temperature=0.0)
            samples = sampling.generate(params, cfg, tok, prompts, settings)
            return (time.perf_counter() - start) / args.new_tokens * 1e3, [list(s.tokens) for s in samples]

    result = {"new_tokens": args.new_tokens, "prompt_tokens": args.prompt, "batches": {}}
    for batch in args.batches:
        prompts = [list(map(int, p)) for p in prompts_for(batch, args.prompt)]
        make_seconds = []  # the layout alone: the first time (compiling its transposes), then again
        for _ in range(2):
            layout.forget()
            start = time.perf_counter()
            jax.block_until_ready(layout.for_decoding(params, cfg, batch))
            make_seconds.append(round(time.perf_counter() - start, 3))
        tokens = {side: run(side, prompts)[1] for side in sides}  # compiles both
        assert tokens["laid_out"] == tokens["plain"], "the layout changed the greedy tokens"
        ms = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side in sides:
                ms[side].append(round(run(side, prompts)[0], 2))
        result["batches"][str(batch)] = {
            "ms_per_token_step": ms,
            "best": {side: min(v) for side, v in ms.items()},
            "plain_over_laid_out": round(min(ms["plain"]) / min(ms["laid_out"]), 3),
            "per_round": [round(p / x, 3) for p, x in zip(ms["plain"], ms["laid_out"])],
            "median_per_round": round(statistics.median(p / x for p, x in zip(ms["plain"], ms["laid_out"])), 3),
            "make_seconds": make_seconds,
        }
    result["device"] = jax.devices()[0].device_kind
    report("head_layout", result)


if __name__ == "__main__":
    command(main)
