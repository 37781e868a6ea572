"""The tied head's layout in decoding: the sampler's [D, V] copy (lm.model.untied) against the [V, D] embedding.

    python -m benchmarks.head_layout [--batches 1 4 8] [--rounds 8] [--new-tokens 128] [--prompt 64]

On a CPU, lm.sampling decodes a batch of rows with a tied head's own [D, V] copy of the embedding
(XLA:CPU's matmul of a few rows reads that layout faster). This times `lm.sampling.generate` (greedy)
on GPT-2 small's shape (float32, random weights, benchmarks.versus_hf's model and prompts) in one
process, alternating rounds between the sampler as it is and the sampler with the copy turned off,
and reports each side's best and the ratio per round (tied over untied milliseconds a token: above 1
is the copy's gain). Both sides must generate the same tokens. One row never takes the copy, so batch 1
times the same code on both sides: the noise floor. Writes benchmarks/results/head_layout.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import jax

from benchmarks.report import report
from benchmarks.sample import StandIn
from benchmarks.versus_hf import N_IDS, lm_model, prompts_for
from lm import sampling
from lm.sampling import loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=64)
    args = parser.parse_args()
    params, cfg = lm_model()
    tok = StandIn(n_vocab=N_IDS, eot=N_IDS)
    sides = {"untied": loop.untied, "tied": lambda p, c: (p, c)}

    def run(side: str, prompts) -> tuple[float, list]:
        with mock.patch.object(loop, "untied", sides[side]):
            start = time.perf_counter()
            samples = sampling.generate(params, cfg, tok, prompts, max_new_tokens=args.new_tokens, temperature=0.0)
            return (time.perf_counter() - start) / args.new_tokens * 1e3, [list(s.tokens) for s in samples]

    result = {"new_tokens": args.new_tokens, "prompt_tokens": args.prompt, "batches": {}}
    for batch in args.batches:
        prompts = [list(map(int, p)) for p in prompts_for(batch, args.prompt)]
        tokens = {side: run(side, prompts)[1] for side in sides}  # compiles both
        assert tokens["tied"] == tokens["untied"], "the head's layout changed the greedy tokens"
        ms = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side in sides:
                ms[side].append(round(run(side, prompts)[0], 2))
        result["batches"][str(batch)] = {
            "ms_per_token_step": ms,
            "best": {side: min(v) for side, v in ms.items()},
            "tied_over_untied": round(min(ms["tied"]) / min(ms["untied"]), 3),
            "per_round": [round(t / u, 3) for t, u in zip(ms["tied"], ms["untied"])],
            "median_per_round": round(statistics.median(t / u for t, u in zip(ms["tied"], ms["untied"])), 3),
        }
    result["device"] = jax.devices()[0].device_kind
    report("head_layout", result)


if __name__ == "__main__":
    main()
