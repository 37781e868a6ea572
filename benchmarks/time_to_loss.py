"""Time to a target validation loss: lm with AdamW + cosine, AdamW + WSD and Muon, and the PyTorch peer with AdamW,
side by side in one run on one shape.

    python -m benchmarks.time_to_loss [--preset shakespeare_char] [--steps N] [--eval-every 100] [--target LOSS]
        [--variant NAME:KEY=VALUE,...] [--skip NAME] [--no-peer] [--name SUFFIX] [key=value ...]

Each lm run is `python train.py PRESET` (the real command line) for the same number of steps with a validation pass
every --eval-every steps; the peer (benchmarks/peer.py's model and AdamW, trained on lm's own batches and scored on
lm's own validation batches; on a GPU compiled, as peer.py's --compile runs there) runs in a child process the same
way. The target is --target, or else the AdamW + cosine baseline's final validation loss. For each run: the first
evaluated step at or below the target, its tokens, the run's median tokens/s (logged intervals after the first,
which compiles), and the training seconds to the target at that speed (compilation and evaluations left out). Ratios
are to the baseline. The goal (issue 37): Muon reaches the baseline's final loss in <= 0.75x its tokens at >= 0.9x
its tokens/s, as the ratio of tokens at the first evaluations at or below the target, each run's at its own tokens a
step (`tokens_ratio_interpolated` also places each crossing linearly between the evaluations either side of it).
Every run's settings are checked before any trains. Prints JSON and writes
benchmarks/results/time_to_loss[_SUFFIX].json, with the runs' curves (lm.plot) in time_to_loss[_SUFFIX].png beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.report import RESULTS, command, need, per_call, positive, refuse_own, report, steady_rates, variants
from lm import config as config_lib
from lm.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = "adamw_cosine"
PEER = "peer_adamw"
RUNS = {BASELINE: [], "adamw_wsd": ["optim.decay=wsd"], "muon": ["optim.name=muon"]}
# Settings each lm run has from the benchmark itself.
OWN = {
    "run.dir": "each run has a directory of its own (--keep DIR keeps them); leave run.dir out",
    "train.eval_every": "every run, the peer's too, evaluates every --eval-every steps; give --eval-every",
}


def lm_settings(steps: int, eval_every: int, overrides: list[str]) -> list[str]:
    """An lm run's overrides of its preset, as train.py is given them."""
    return [f"train.steps={steps}", f"train.eval_every={eval_every}", "train.ckpt_every=0", "logging.progress=false",
            "logging.tensorboard=false", *overrides]  # fmt: skip


def run_lm(name: str, preset: str, run_dir: str, settings: list[str]) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), preset, f"run.dir={run_dir}", *settings]
    _finished(name, subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL))


def run_peer(preset: str, run_dir: str, steps: int, eval_every: int, overrides: list[str]) -> None:
    spec = {"preset": preset, "run_dir": run_dir, "steps": steps, "eval_every": eval_every, "overrides": overrides}
    command = [sys.executable, "-m", "benchmarks.time_to_loss", "--peer-child", json.dumps(spec)]
    _finished(PEER, subprocess.run(command, cwd=ROOT))


def _finished(name: str, proc: subprocess.CompletedProcess) -> None:
    """A run that failed ends the benchmark with one line under the run's own (its exit code: 2 for a mistake)."""
    if proc.returncode:
        print(f"error: the {name} run failed (exit code {proc.returncode}; its error is above)", file=sys.stderr)
        sys.exit(proc.returncode if proc.returncode > 0 else 1)


def peer_child(spec: dict) -> None:
    """The peer's run: benchmarks/peer.py's GPT and AdamW on lm's training batches, scored every eval_every steps
    on lm's validation batches; its rows written as lm writes metrics.jsonl, so that lm.plot draws it too."""
    import numpy as np
    import torch

    from benchmarks import peer
    from benchmarks.versus_torch import peer_settings
    from lm import data as data_lib

    cfg = config_lib.load(spec["preset"], spec["overrides"])
    steps, eval_every = spec["steps"], spec["eval_every"]
    s = peer_settings(cfg, steps, compile_=False)
    data = data_lib.prepare_for_training(cfg.data, cfg.seed, progress=False)
    train_iter = data.train_iterator(cfg.data, cfg.seed, None, verbose=False)
    (val,) = data.val_batches(cfg.data, cfg.train.eval_batches, None, verbose=False).values()
    cuda = torch.cuda.is_available()  # then as peer.py trains there: bfloat16 autocast, fused AdamW, torch.compile
    device = "cuda" if cuda else "cpu"
    as_torch = lambda b: tuple(torch.from_numpy(np.asarray(b[k], np.int64)).to(device) for k in ("inputs", "targets"))
    torch.manual_seed(cfg.seed)
    model = peer.GPT(s).to(device)
    opt = peer.optimizer(model, s, fused=cuda)
    compiled = torch.compile(model) if cuda else model  # its first interval, which compiles, is not counted

    def forward(batch):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            return compiled(*as_torch(batch))

    tokens_per_step = s["batch_size"] * s["block_size"]
    rows, timed, since = [], 0.0, 0

    def evaluate(step):
        model.eval()
        with torch.no_grad():
            loss = sum(forward(b).item() for b in val) / len(val)  # equal batches: lm's mean over tokens
        model.train()
        rows.append({"step": step, "val_loss": loss})

    for step in range(steps):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = peer.lr_at(step, s)
        loss = forward(next(train_iter))
        loss.backward()
        if s["grad_clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        logged = done % cfg.train.log_every == 0 or done == steps
        value = loss.item() if logged else None  # synchronises, like lm's logged metrics
        timed, since = timed + time.perf_counter() - start, since + 1
        if logged:
            record = {"step": done, "loss": value, "lr": peer.lr_at(step, s), "tokens": done * tokens_per_step}
            rows.append({**record, "tokens_per_sec": since * tokens_per_step / timed})
            timed, since = 0.0, 0
        if done % eval_every == 0 or done == steps:
            evaluate(done)
    os.makedirs(spec["run_dir"], exist_ok=True)
    with open(os.path.join(spec["run_dir"], "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def read_run(run_dir: str) -> tuple[list[tuple[int, float]], float]:
    """(step, validation loss) of each evaluation after step 0, and the median tokens/s of the logged intervals
    after the first (which compiles or warms up)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r and r["step"] > 0]
    # a CPU run of a small model logs once per call of several steps (lm.platform's steps per call): each call
    # counts once, and every row of the first timed call is left out
    rates = steady_rates(per_call(rows), f"the {os.path.basename(run_dir)} run")
    return val, statistics.median(rates)


def summarise(run_dir: str, target: float, tokens_per_step: int) -> dict:
    """A run's figures against `target`, its tokens counted at its own tokens a step (a --variant may change the
    batch or the window)."""
    val, rate = read_run(run_dir)
    i = next((i for i, (_, loss) in enumerate(val) if loss <= target), None)
    out = {
        "final_val_loss": round(val[-1][1], 4),
        "val_loss": {step: round(loss, 4) for step, loss in val},
        "tokens_per_sec": round(rate),
        "tokens_per_step": tokens_per_step,
        "steps_to_target": None if i is None else val[i][0],
    }
    if i is not None:
        tokens = val[i][0] * tokens_per_step
        out.update(tokens_to_target=tokens, seconds_to_target=round(tokens / rate, 2))
        out["steps_to_target_interpolated"] = round(_crossing(val[i - 1] if i else None, val[i], target), 1)
        out["tokens_to_target_interpolated"] = round(out["steps_to_target_interpolated"] * tokens_per_step)
    return out


def _crossing(before: tuple[int, float] | None, at: tuple[int, float], target: float) -> float:
    """The step at which the validation loss crossed `target`, linear between the evaluation above it and the first
    at or below it (the first evaluated step where there is none above it)."""
    if before is None or before[1] <= at[1]:
        return at[0]
    (s0, l0), (s1, l1) = before, at
    return s0 + (s1 - s0) * (l0 - target) / (l0 - l1)


def goal(results: dict, runs: dict) -> dict:
    """Issue 37's goal over the Muon runs (the built-in one and every --variant with optim.name=muon): the best of
    them by tokens to the target (then tokens/s), and whether any one reached it in <= 0.75x the baseline's tokens
    at >= 0.9x its tokens/s."""
    met = lambda r: r.get("tokens_ratio") is not None and r["tokens_ratio"] <= 0.75 and r["tokens_per_sec_ratio"] >= 0.9
    muons = {n: results[n] for n, overrides in runs.items() if n in results and "optim.name=muon" in overrides}
    rank = lambda n: (muons[n].get("tokens_ratio") or float("inf"), -muons[n]["tokens_per_sec_ratio"])
    best = min(muons, key=rank, default=None)
    r = muons.get(best, {})
    return {
        "muon_run": best,
        "muon_tokens_ratio": r.get("tokens_ratio"),
        "muon_tokens_ratio_interpolated": r.get("tokens_ratio_interpolated"),
        "muon_tokens_per_sec_ratio": r.get("tokens_per_sec_ratio"),
        "met": any(met(m) for m in muons.values()),
    }


def _loss(text: str) -> float:
    """An argparse type: a validation loss to reach, a finite number >= 0 (NaN was written to the JSON)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite loss >= 0")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="shakespeare_char")
    parser.add_argument("--steps", type=int, default=0, help="steps of every run; 0 = the preset's train.steps")
    parser.add_argument("--eval-every", type=positive, default=100, help="steps between validation passes")
    parser.add_argument("--target", type=_loss, default=0.0, help="validation loss to reach; 0 = the baseline's final")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
        help="also run lm with these overrides, as NAME (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--skip", action="append", default=[], choices=[n for n in RUNS if n != BASELINE],
        help="leave out this lm run (repeatable)",
    )  # fmt: skip
    parser.add_argument("--no-peer", action="store_true", help="leave out the PyTorch peer")
    parser.add_argument("--keep", default="", help="keep the run directories in this new directory (default: a temporary one)")
    parser.add_argument("--name", default="", help="result file suffix")
    parser.add_argument("--peer-child", default="", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="lm config overrides for every run (the peer takes the shape)")
    args = parser.parse_args()
    if args.peer_child:
        return peer_child(json.loads(args.peer_child))

    if args.keep and os.path.exists(args.keep) and not (os.path.isdir(args.keep) and not os.listdir(args.keep)):
        parser.error(f"--keep {args.keep} exists and is not an empty directory (runs in it would resume instead of "
                     "training); give a new directory")  # fmt: skip
    cfg = config_lib.load(args.preset, args.overrides)
    steps = args.steps or cfg.train.steps
    if steps < 3 * cfg.train.log_every:  # lm's first interval compiles; of the rest, the first still warms up
        parser.error(f"--steps {steps} logs too few intervals of train.log_every={cfg.train.log_every} for a speed: "
                     f"give --steps {3 * cfg.train.log_every} or more, or a smaller train.log_every")  # fmt: skip
    runs = {name: [*args.overrides, *extra] for name, extra in RUNS.items() if name not in args.skip}
    for name, extra in variants(args.variant, {*RUNS, "peer"}).items():
        runs[name] = [*args.overrides, *extra]
    refuse_own([s for overrides in runs.values() for s in overrides], OWN)  # (run.dir: each run resumed the last)
    settings = {name: lm_settings(steps, args.eval_every, overrides) for name, overrides in runs.items()}
    tokens_per_step = {}  # every run's settings checked before any trains (a mistake in the last came after the rest)
    for name, given in [*settings.items(), *([] if args.no_peer else [(PEER, args.overrides)])]:
        try:
            run_cfg = config_lib.load(args.preset, given)
        except UserError as e:
            raise UserError(f"the {name} run's settings: {e}") from None
        tokens_per_step[name] = run_cfg.data.batch_size * run_cfg.data.block_size
    if not args.no_peer:
        need("torch")  # the peer's package, before the lm runs (it failed the peer's run after them)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        dirs = {}
        for name, overrides in runs.items():
            dirs[name] = os.path.join(root, name)
            print(f"{name}: {' '.join(overrides) or args.preset}", file=sys.stderr)
            run_lm(name, args.preset, dirs[name], settings[name])
        if not args.no_peer:
            dirs[PEER] = os.path.join(root, PEER)
            print(f"{PEER}: benchmarks/peer.py", file=sys.stderr)
            run_peer(args.preset, dirs[PEER], steps, args.eval_every, args.overrides)
        target = args.target or read_run(dirs[BASELINE])[0][-1][1]
        results = {name: summarise(d, target, tokens_per_step[name]) for name, d in dirs.items()}
        base = results[BASELINE]
        for r in results.values():
            r["tokens_per_sec_ratio"] = round(r["tokens_per_sec"] / base["tokens_per_sec"], 3)
            if r["steps_to_target"] is not None and base["steps_to_target"]:
                r["tokens_ratio"] = round(r["tokens_to_target"] / base["tokens_to_target"], 3)
                r["seconds_ratio"] = round(r["seconds_to_target"] / base["seconds_to_target"], 3)
                r["tokens_ratio_interpolated"] = round(
                    r["tokens_to_target_interpolated"] / base["tokens_to_target_interpolated"], 3
                )
        suffix = "_".join(filter(None, ["time_to_loss", args.name]))
        plot = os.path.join(RESULTS, f"{suffix}.png")
        from lm import plot as plot_lib

        result = {
            "preset": args.preset,
            "overrides": args.overrides,
            "steps": steps,
            "tokens_per_step": tokens_per_step[BASELINE],
            "eval_every": args.eval_every,
            "target_val_loss": target,
            "target_from": "--target" if args.target else f"{BASELINE} final",
            "runs": {name: {"overrides": runs.get(name, "benchmarks/peer.py"), **r} for name, r in results.items()},
            "goal": goal(results, runs),
            "plot": os.path.basename(plot) if plot_lib.available() else None,  # beside this file
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
        }
        report(suffix, result)  # first, so that the figures are kept whatever the plot does
        if plot_lib.available():
            plot_lib.plot_runs([dirs[n] for n in dirs], plot)  # within the run directories' lifetime


if __name__ == "__main__":
    command(main)
