"""The PyTorch peer checked against the project it stands for: lm, benchmarks/peer.py and karpathy/nanoGPT's own
train.py, side by side in one run on the same shapes.

    python -m benchmarks.versus_nanogpt --nanogpt /path/to/nanoGPT [--presets shakespeare_char ...] [--rounds 2]

nanoGPT is not part of lm and is not copied into it: give a checkout of it (git clone
https://github.com/karpathy/nanoGPT, outside this repository). Its character-level data is made by its own
data/shakespeare_char/prepare.py from the bundled corpus (copied in as its input.txt, so nothing is
downloaded). Its train.py then runs each preset's shape on the CPU as its README says to (`--device=cpu
--compile=False`, float32), with biases (lm's presets have them) and the preset's batch, block, dropout, learning
rates and steps; its own per-iteration times give its tokens/s. Its vocabulary is the corpus's 65 characters
where lm's bytes tokenizer has 256 ids: the head is 0.2% of the small shape's FLOPs.

Each round runs the three in fresh processes, one after another; a side's figure is the median over its rounds
of the median tokens/s of its steady iterations. Prints JSON and writes benchmarks/results/versus_nanogpt.json:
lm over the peer, lm over nanoGPT, and the peer over nanoGPT (the peer is honest where that is about 1).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from benchmarks.report import command, non_negative, positive, report
from benchmarks.versus_torch import CORPUS, ROOT, check_torch_build, commit, peer_settings, run_lm, run_peer, run_steps
from lm import config as config_lib
from lm.errors import UserError

SKIP = 5  # nanoGPT iterations that still warm up (its own MFU estimate skips as many)


def check_nanogpt(nanogpt: str) -> None:
    """A UserError unless `nanogpt` is a checkout of nanoGPT outside this repository."""
    if os.path.commonpath([nanogpt, ROOT]) == ROOT:
        raise UserError(f"--nanogpt {nanogpt}: keep the nanoGPT checkout outside this repository")
    for name in ("train.py", os.path.join("data", "shakespeare_char", "prepare.py")):
        if not os.path.isfile(os.path.join(nanogpt, name)):
            raise UserError(f"--nanogpt {nanogpt} is not a nanoGPT checkout (no {name}); give a clone of "
                            "https://github.com/karpathy/nanoGPT")  # fmt: skip


def prepare_nanogpt(nanogpt: str) -> None:
    """nanoGPT's shakespeare_char data, made by its own prepare.py from the bundled corpus."""
    check_nanogpt(nanogpt)
    data = os.path.join(nanogpt, "data", "shakespeare_char")
    shutil.copyfile(CORPUS, os.path.join(data, "input.txt"))
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, stdout=subprocess.DEVNULL)


def run_nanogpt(nanogpt: str, cfg, steps: int) -> list[float]:
    """tokens/s of each of nanoGPT's iterations after the first SKIP, training the shape of `cfg` on the CPU."""
    m, d, o = cfg.model, cfg.data, cfg.optim
    settings = dict(
        device="cpu", compile=False, dtype="float32", bias=True, dataset="shakespeare_char",
        n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout,
        batch_size=d.batch_size, block_size=d.block_size, gradient_accumulation_steps=1,
        learning_rate=o.lr, min_lr=o.min_lr, beta2=o.b2, warmup_iters=o.warmup_steps, weight_decay=o.weight_decay,
        grad_clip=o.grad_clip, max_iters=steps, lr_decay_iters=steps,
        eval_interval=10**9, eval_iters=1, log_interval=1, always_save_checkpoint=False,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        args = [f"--{k}={v}" for k, v in settings.items()] + [f"--out_dir={out}"]
        done = subprocess.run(
            [sys.executable, "train.py", "config/train_shakespeare_char.py", *args],
            cwd=nanogpt, check=True, capture_output=True, text=True,
        )  # fmt: skip
    times = [float(t) for t in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", done.stdout, re.M)]
    if len(times) <= SKIP:
        raise UserError(f"nanoGPT printed {len(times)} iterations, not the 'iter N: loss L, time Tms' lines of "
                        f"karpathy/nanoGPT's train.py; its output ended with {done.stdout[-300:]!r}")
    return [d.batch_size * d.block_size / (t / 1e3) for t in times[SKIP:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanogpt", required=True, help="a checkout of karpathy/nanoGPT (outside this repository)")
    parser.add_argument("--presets", nargs="+", default=["shakespeare_char", "shakespeare_char_large"])
    parser.add_argument("--rounds", type=positive, default=2)
    parser.add_argument("--steps", type=non_negative, default=0, help="steps per run; 0 = 300 (small) or 30 (large)")
    args = parser.parse_args()
    nanogpt = os.path.abspath(args.nanogpt)
    check_nanogpt(nanogpt)
    configs = {preset: config_lib.load(preset) for preset in args.presets}
    steps_of = {preset: run_steps(preset, cfg, args.steps) for preset, cfg in configs.items()}  # all checked first
    torch = check_torch_build()
    prepare_nanogpt(nanogpt)
    result = {"rounds": args.rounds, "torch": torch.__version__, "nanogpt_commit": commit(nanogpt), "presets": {}}
    for preset, cfg in configs.items():
        steps = steps_of[preset]
        rates = {"lm": [], "peer": [], "nanogpt": []}
        for r in range(args.rounds):
            rates["lm"].append(statistics.median(run_lm(preset, steps, [])[1:]))
            rates["peer"].append(statistics.median(run_peer(peer_settings(cfg, steps, False))["tokens_per_sec"][1:]))
            rates["nanogpt"].append(statistics.median(run_nanogpt(nanogpt, cfg, steps)))
            line = ", ".join(f"{name} {rs[-1]:.0f}" for name, rs in rates.items())
            print(f"{preset} round {r + 1} (tokens/s): {line}", file=sys.stderr)
        med = {name: statistics.median(rs) for name, rs in rates.items()}
        result["presets"][preset] = {
            "steps": steps,
            "tokens_per_sec": {name: [round(x) for x in rs] for name, rs in rates.items()},
            "median": {name: round(x) for name, x in med.items()},
            "lm_over_peer": round(med["lm"] / med["peer"], 3),
            "lm_over_nanogpt": round(med["lm"] / med["nanogpt"], 3),
            "peer_over_nanogpt": round(med["peer"] / med["nanogpt"], 3),
        }
    report("versus_nanogpt", result)


if __name__ == "__main__":
    command(main)
