"""Soak test: one long run of the tiny preset with evaluation and checkpoints, watched from outside for
leaks of resident memory, file descriptors and threads.

    python -m benchmarks.soak [--steps 20000] [--interval 0.5] [--run-dir DIR] [key=value ...]

Runs `python train.py configs/tiny.yaml` as a child process (train.eval_every=500, train.ckpt_every=1000,
train.log_every=100, the default train.keep, no progress bar; extra key=value overrides are passed on, and
so is the environment, e.g. MALLOC_ARENA_MAX) and samples the child's resident memory (RSS), open file
descriptors and threads with psutil every --interval seconds, each with the step the run has reached
(the last step in RUN/metrics.jsonl, which has a row every log_every steps) and whether a checkpoint is
being written (an orbax temporary directory exists).

Warm-up ends at the later of 10% of the steps and the step by which the first evaluation and the first
checkpoint have both happened: from then on every kind of work has run at least once. The warm-up sample
is the first at or after that step, the end sample the last before the final step's row appears (so the
end-of-run evaluation, checkpoint wait and plotting are left out; samples after it are reported as
`shutdown`), both, where there is such a sample, outside evaluations and saves (its step is not an
evaluation or checkpoint step and no checkpoint is being written): a save's threads and open files come
and go within about a second.

Targets (issue 11): RSS at the end, and its maximum after warm-up, less than 5% above RSS at warm-up;
file descriptors at the end at most FD_SLACK more than at warm-up, threads at most THREAD_SLACK more (the
slack absorbs a save's last thread or file being closed at one sample; a leak of one per checkpoint or
evaluation after warm-up would exceed it). The figures and about 20 evenly spaced samples (--all-samples:
every one) are printed as JSON and written to benchmarks/results/soak.json (--name). The exit code is 0
whether the targets are met or not; the ones missed are printed on stderr.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

from benchmarks.report import command, positive, positive_float, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RSS_GROWTH_TARGET = 0.05  # fraction of RSS at warm-up end
FD_SLACK = 4
THREAD_SLACK = 2
MB = 1024 * 1024


class _MetricsTail:
    """The highest step logged so far in a growing metrics.jsonl, read incrementally."""

    def __init__(self, path: str):
        self.path, self.offset, self.partial = path, 0, ""
        self.step, self.eval_steps = 0, []

    def poll(self) -> int:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                text = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return self.step
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()  # an unfinished last line waits for the next poll
        for line in lines:
            if not line.strip():
                continue
            row = json.loads(line)
            self.step = max(self.step, row.get("step", 0))
            if "val_loss" in row:
                self.eval_steps.append(row["step"])
        return self.step


def _sample(proc: psutil.Process) -> dict | None:
    try:
        with proc.oneshot():
            if proc.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped: nothing left to measure
                return None
            mem = proc.memory_info()
            return {
                "rss_mb": mem.rss / MB,
                "rss_file_mb": mem.shared / MB,  # file-backed part (shared libraries, the token memmap)
                "fds": proc.num_fds(),
                "threads": proc.num_threads(),
                "children": len(proc.children(recursive=True)),
            }
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def _checkpoints(run_dir: str) -> tuple[int, bool]:
    """(complete checkpoints, whether one is being written) in the run's checkpoints/ directory."""
    try:
        names = os.listdir(os.path.join(run_dir, "checkpoints"))
    except FileNotFoundError:
        return 0, False
    return sum(d.isdigit() for d in names), any(".orbax-checkpoint-tmp" in d for d in names)


def soak(run_dir: str, data_dir: str, log_path: str, steps: int, interval: float, eval_every: int, ckpt_every: int,
         log_every: int, overrides: list[str]) -> tuple[list[dict], dict, float, int]:
    """Run the child (its output into `log_path`) and sample it; return (samples, settings, wall seconds, exit code)."""
    settings = {
        "train.steps": steps,
        "train.eval_every": eval_every,
        "train.ckpt_every": ckpt_every,
        "train.log_every": log_every,
        "logging.progress": "false",
        "resume": "never",
        "run.dir": run_dir,
        "data.cache_dir": data_dir,
    }
    args = [f"{k}={v}" for k, v in settings.items()] + overrides
    tail = _MetricsTail(os.path.join(run_dir, "metrics.jsonl"))
    samples = []
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "train.py", "configs/tiny.yaml", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        proc = psutil.Process(child.pid)
        while child.poll() is None:
            s = _sample(proc)
            if s is not None:
                kept, saving = _checkpoints(run_dir)
                s.update(t=time.perf_counter() - t0, step=tail.poll(), checkpoints=kept, saving=saving)
                samples.append(s)
            time.sleep(interval)
        wall = time.perf_counter() - t0
    tail.poll()
    settings["evaluations"] = len(tail.eval_steps)
    return samples, settings, wall, child.returncode


def _round(x: float) -> float:
    return round(x, 1)


def summarize(samples: list[dict], steps: int, eval_every: int, ckpt_every: int, wall: float) -> dict:
    # The step by which the first evaluation and the first checkpoint have both run (an interval of 0 means
    # only at the end, which the figures leave out).
    warmup_step = max(-(-steps // 10), eval_every, ckpt_every)
    training = [s for s in samples if s["step"] < steps]  # before the final step's row: the loop still runs
    after = [s for s in training if s["step"] >= warmup_step]
    if not after:
        raise SystemExit(f"no sample between warm-up (step {warmup_step}) and the end; use more --steps")
    # Where possible not while a checkpoint is being written: its threads and open files come and go. The
    # step's row is written just before its evaluation and save start, so a sample that has seen it may
    # fall within them.
    def busy(s: dict) -> bool:
        return s["saving"] or any(every and s["step"] % every == 0 for every in (eval_every, ckpt_every))

    quiet = [s for s in after if not busy(s)] or after
    warm, end = quiet[0], quiet[-1]
    shutdown = [s for s in samples if s["step"] >= steps]

    def growth(x: float) -> float:
        return (x - warm["rss_mb"]) / warm["rss_mb"]

    after = [s for s in training if s["t"] >= warm["t"]]  # from the warm-up sample on, while the loop runs
    max_rss = max(s["rss_mb"] for s in after)
    fd_max = max(s["fds"] for s in after)
    thread_max = max(s["threads"] for s in after)
    steps_per_sec = (end["step"] - warm["step"]) / max(end["t"] - warm["t"], 1e-9)
    targets = {
        "rss_end_growth_lt_5pct": growth(end["rss_mb"]) < RSS_GROWTH_TARGET,
        "rss_max_growth_lt_5pct": growth(max_rss) < RSS_GROWTH_TARGET,
        f"fds_end_le_warmup_plus_{FD_SLACK}": end["fds"] <= warm["fds"] + FD_SLACK,
        f"threads_end_le_warmup_plus_{THREAD_SLACK}": end["threads"] <= warm["threads"] + THREAD_SLACK,
    }
    # About `n` evenly spaced samples over the whole run, with the warm-up and end samples among them.
    n = 20
    picked = sorted({round(i * (len(samples) - 1) / (n - 1)) for i in range(n)} | {samples.index(warm), samples.index(end)})
    series = [{k: (_round(v) if isinstance(v, float) else v) for k, v in samples[i].items()} for i in picked]
    return {
        "warmup_step": warmup_step,
        "warmup_sample": {"step": warm["step"], "t_s": _round(warm["t"])},
        "end_sample": {"step": end["step"], "t_s": _round(end["t"])},
        "rss_mb": {
            "file_backed_warmup": _round(warm["rss_file_mb"]),
            "file_backed_end": _round(end["rss_file_mb"]),
            "warmup": _round(warm["rss_mb"]),
            "end": _round(end["rss_mb"]),
            "max_after_warmup": _round(max_rss),
            "min_after_warmup": _round(min(s["rss_mb"] for s in after)),
            "peak_whole_run": _round(max(s["rss_mb"] for s in samples)),
            "growth_end_pct": round(100 * growth(end["rss_mb"]), 2),
            "growth_max_pct": round(100 * growth(max_rss), 2),
        },
        "fds": {"warmup": warm["fds"], "end": end["fds"], "max_after_warmup": fd_max, "slack": FD_SLACK},
        "threads": {"warmup": warm["threads"], "end": end["threads"], "max_after_warmup": thread_max,
                    "slack": THREAD_SLACK},
        "child_processes": {"warmup": warm["children"], "end": end["children"],
                            "max_after_warmup": max(s["children"] for s in after)},
        "shutdown": None if not shutdown else {
            "rss_mb_max": _round(max(s["rss_mb"] for s in shutdown)),
            "fds_max": max(s["fds"] for s in shutdown),
            "threads_max": max(s["threads"] for s in shutdown),
        },
        "steps_per_sec_after_warmup": round(steps_per_sec, 1),
        "steps_per_sec_overall": round(steps / wall, 1),
        "wall_time_s": _round(wall),
        "samples": len(samples),
        "targets": targets,
        "all_met": all(targets.values()),
        "series": series,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive, default=20000)
    parser.add_argument("--interval", type=positive_float, default=0.5, help="seconds between samples (> 0)")
    parser.add_argument("--eval-every", type=positive, default=500)
    parser.add_argument("--ckpt-every", type=positive, default=1000)
    parser.add_argument("--log-every", type=positive, default=100)
    parser.add_argument("--run-dir", default="", help="the run directory, kept afterwards (default: a temporary one)")
    parser.add_argument("--name", default="soak", help="results file benchmarks/results/NAME.json")
    parser.add_argument("--all-samples", action="store_true", help="put every sample in the JSON, not about 20")
    parser.add_argument("overrides", nargs="*", help="more section.key=value overrides for train.py")
    args = parser.parse_args()
    from lm import config as config_lib

    settings = [f"train.steps={args.steps}", f"train.eval_every={args.eval_every}",
                f"train.ckpt_every={args.ckpt_every}", f"train.log_every={args.log_every}"]  # fmt: skip
    config_lib.load("tiny", [*settings, *args.overrides])  # a mistake is one line here, not train.py's log after it
    tmp = tempfile.mkdtemp(prefix="lm-soak-")
    try:
        run_dir = args.run_dir or os.path.join(tmp, "run")
        log_path = os.path.join(tmp, "train.log")
        samples, settings, wall, code = soak(
            run_dir, os.path.join(tmp, "data"), log_path, args.steps, args.interval, args.eval_every, args.ckpt_every,
            args.log_every, args.overrides,
        )
        if code != 0 or not samples:
            with open(log_path) as f:
                sys.stderr.write(f.read()[-4000:])
            raise SystemExit(f"train.py exited with code {code}")
        result = {
            "preset": "tiny",
            "steps": args.steps,
            "settings": {k: v for k, v in settings.items() if k not in ("run.dir", "data.cache_dir")},
            "overrides": args.overrides,
            "interval_s": args.interval,
            **summarize(samples, args.steps, args.eval_every, args.ckpt_every, wall),
            "checkpoints_kept": _checkpoints(run_dir)[0],
            **({"all_samples": samples} if args.all_samples else {}),
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "python": platform.python_version(),
            "jax": importlib.metadata.version("jax"),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(args.name, result)
    missed = [name for name, ok in result["targets"].items() if not ok]
    if missed:
        print(f"soak: targets NOT met: {', '.join(missed)}", file=sys.stderr)
    else:
        print("soak: all targets met", file=sys.stderr)


if __name__ == "__main__":
    command(main)
