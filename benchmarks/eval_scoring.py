"""Multiple-choice scoring speed: lm.eval's Scorer against Hugging Face transformers doing what
lm-evaluation-harness's `hf` model does, side by side on the same weights and the same requests.

    pip install -e '.[bench]'
    python -m benchmarks.eval_scoring [--examples 8] [--choices 4] [--batch-size 16] [--rounds 2] [--repeat 1]

The model is GPT-2 small's shape in float32 with lm's random weights, written once in Hugging Face's format
(benchmarks.versus_hf.write_model). The task is synthetic and HellaSwag-like: each example a context of 64
to 192 random tokens and --choices endings of 8 to 32 tokens. lm scores it with lm.eval.scoring.Scorer
(requests sorted longest first, --batch-size rows a batch padded to one of four lengths an octave, chunked
head); the peer with `GPT2LMHeadModel` under `torch.inference_mode` (on the GPU where torch has CUDA), as
lm-eval's HFLM does: the same order and batches, right-padded to the batch's longest row, a full forward
pass, log-softmax, the continuation's tokens gathered.
Rounds alternate the two in fresh processes; each times a warm-up call (compiling, for lm) and then the best
of --repeat calls. A side's figure is the median over rounds, in examples per second. The JSON also gives the
largest difference between the two sides' log-likelihoods and whether they pick the same choice everywhere.
Writes benchmarks/results/eval_scoring[_cuda].json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks.report import RESULTS, command, need, positive, report
from benchmarks.versus_hf import N_IDS, ROOT, best, lm_model, write_model


def task(examples: int, choices: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) token pairs, `choices` consecutive ones per example."""
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(examples):
        context = rng.integers(0, N_IDS, rng.integers(64, 193)).tolist()
        pairs += [(context, rng.integers(0, N_IDS, rng.integers(8, 33)).tolist()) for _ in range(choices)]
    return pairs


def child_lm(pairs, batch_size: int, repeat: int) -> dict:
    import jax

    from lm.eval.scoring import Scorer, fit

    params, cfg = lm_model()
    scorer = Scorer(params, cfg, batch_size, n_vocab=N_IDS)  # as lm.eval scores: over the ids the HF model has
    requests = [fit(c, x, cfg.max_seq_len) for c, x in pairs]
    seconds, scores = best(lambda: [lp for lp, _ in scorer.score(requests)], repeat)
    return {"seconds": seconds, "logprobs": scores, "version": f"jax {jax.__version__}"}


def child_hf(directory: str, pairs, batch_size: int, repeat: int) -> dict:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where lm runs too: JAX's GPU when there is one
    model = transformers.GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32).eval().to(device)
    rows = [c + x for c, x in pairs]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))

    def run():
        out = [0.0] * len(rows)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                chosen = order[start : start + batch_size]
                width = len(rows[chosen[0]]) - 1
                inputs = torch.zeros((len(chosen), width), dtype=torch.long, device=device)
                for r, i in enumerate(chosen):
                    inputs[r, : len(rows[i]) - 1] = torch.tensor(rows[i][:-1])
                logprobs = torch.log_softmax(model(inputs).logits.float(), dim=-1)
                for r, i in enumerate(chosen):
                    n, k = len(rows[i]) - 1, len(pairs[i][1])
                    targets = torch.tensor(rows[i][-k:], device=device)
                    out[i] = float(logprobs[r, n - k : n].gather(-1, targets[:, None]).sum())
        return out

    seconds, scores = best(run, repeat)
    return {"seconds": seconds, "logprobs": scores, "version": f"transformers {transformers.__version__}, torch {torch.__version__}"}


def run_child(side: str, directory: str, args) -> dict:
    cmd = [
        sys.executable, "-m", "benchmarks.eval_scoring", "--child", side, "--dir", directory,
        "--examples", str(args.examples), "--choices", str(args.choices), "--batch-size", str(args.batch_size),
        "--repeat", str(args.repeat),
    ]  # fmt: skip
    out = subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def picks(logprobs: list[float], choices: int) -> list[int]:
    return [int(np.argmax(logprobs[i : i + choices])) for i in range(0, len(logprobs), choices)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=positive, default=8)
    parser.add_argument("--choices", type=positive, default=4)
    parser.add_argument("--batch-size", type=positive, default=16)
    parser.add_argument("--rounds", type=positive, default=2)
    parser.add_argument("--repeat", type=positive, default=1, help="timed calls per process after the warm-up, the best counts")
    parser.add_argument("--child", choices=["lm", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        pairs = task(args.examples, args.choices)
        if args.child == "lm":
            out = child_lm(pairs, args.batch_size, args.repeat)
        else:
            out = child_hf(args.dir, pairs, args.batch_size, args.repeat)
        print(json.dumps(out), flush=True)
        os._exit(0)  # nothing left to clean up; skips slow interpreter teardown

    need("torch", "transformers")  # the bench extra: the peer's child imports both; refused before any work
    import torch

    lm_rates, hf_rates = [], []
    with tempfile.TemporaryDirectory() as directory:
        write_model(directory)
        for r in range(args.rounds):
            ours, theirs = run_child("lm", directory, args), run_child("hf", directory, args)
            lm_rates.append(args.examples / ours["seconds"])
            hf_rates.append(args.examples / theirs["seconds"])
            print(f"round {r + 1}: lm {lm_rates[-1]:.2f} examples/s, hf {hf_rates[-1]:.2f}", file=sys.stderr)
    lm_med, hf_med = statistics.median(lm_rates), statistics.median(hf_rates)
    a, b = np.asarray(ours["logprobs"]), np.asarray(theirs["logprobs"])
    result = {
        "examples": args.examples,
        "choices": args.choices,
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "lm_examples_per_sec": [round(x, 2) for x in lm_rates],
        "hf_examples_per_sec": [round(x, 2) for x in hf_rates],
        "ratio": round(lm_med / hf_med, 3),
        "max_abs_logprob_difference": float(np.abs(a - b).max()),
        "same_choice_picked": picks(ours["logprobs"], args.choices) == picks(theirs["logprobs"], args.choices),
        "lm": ours["version"],
        "hf": theirs["version"],
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
    }
    name = "eval_scoring_cuda" if torch.cuda.is_available() else "eval_scoring"
    report(name, result, os.path.join(RESULTS, f"{name}.json"))


if __name__ == "__main__":
    command(main)
