"""lm's training speed against the PyTorch peer (benchmarks/peer.py), side by side in one run.

    pip install -e '.[bench]'   # on a machine without a GPU, the CPU build of torch first (check_torch_build)
    python -m benchmarks.versus_torch [--presets shakespeare_char shakespeare_char_large] [--rounds 3]
        [--steps N] [--compile] [key=value ...]

For each preset, rounds alternate between lm (`python train.py PRESET`, the real command line, with
evaluation and checkpoints only at the end) and the peer (the same model shape, batch, block, corpus
and optimizer in PyTorch), each in a fresh process. A side's figure is the median tokens/s of the
logged intervals after the first (which still compiles or warms up), over its rounds; the ratio is
lm's over the peer's (`--variant` adds lm runs with other settings to each round; an upper-case setting,
`LM_MALLOC=keep`, is an environment variable; `--checkout NAME:DIR` adds lm runs of another checkout's
train.py, such as a worktree of the commit before a change: `git worktree add /tmp/before HEAD~1`). The
machine's speed swings from hour to hour, so only the ratio of one run says anything. Prints JSON and writes
benchmarks/results/versus_torch[_<device>].json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

from benchmarks.report import RESULTS, command, non_negative, per_call, positive, refuse_own, report, steady_rates
from benchmarks.report import variants
from lm import config as config_lib
from lm.errors import UserError
from lm.tokenizer import get_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "lm", "assets", "tinyshakespeare.txt")


def peer_settings(cfg, steps: int, compile_: bool) -> dict:
    """The shape, batch and optimizer of an lm config, as the peer's JSON argument."""
    n_vocab = get_tokenizer(cfg.data.tokenizer).n_vocab
    m = config_lib.resolve_model(cfg.model, n_vocab, cfg.data.block_size)
    o = cfg.optim
    return {
        "n_vocab": n_vocab,  # the ids lm's loss is over (its padded rows, model.vocab_multiple, left out)
        **{k: getattr(m, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "max_seq_len", "dropout", "attn_dropout")},
        "hidden": m.hidden,
        **{k: getattr(o, k) for k in ("lr", "min_lr", "warmup_steps", "b1", "b2", "eps", "weight_decay", "grad_clip")},
        "batch_size": cfg.data.batch_size,
        "block_size": cfg.data.block_size,
        "steps": steps,
        "log_every": cfg.train.log_every,
        "corpus": CORPUS,
        "compile": compile_,
    }


# Settings each lm run has from the benchmark itself: a run's own given as well made lm train another number of steps
# than the peer (or a traceback: a run.dir elsewhere left no metrics where they are read).
OWN = {"train.steps": "the runs' steps are --steps; give --steps", "run.dir": "each run has its own temporary "
       "directory (metrics are read from it); leave run.dir out"}  # fmt: skip


def peer_unlike(cfg, backend: str) -> list[str]:
    """What of an lm config benchmarks/peer.py does not do as lm would (GPT-2's architecture with GELU and a tied
    head, AdamW with a cosine schedule, float32 on a CPU), as key=value: the peer would time another model,
    optimizer or precision. `backend` is jax's, where lm runs. (On a GPU the peer autocasts to bfloat16 and a
    float32 lm is slower, not flattered; a TPU's lm is timed against a peer on its host's CPU, by design.)"""
    from lm.hf.gpt2 import gpt2_incompatible

    m, o, t = cfg.model, cfg.optim, cfg.train
    on_cpu = backend == "cpu"
    return [f"model.{p}" for p in gpt2_incompatible(m)] + [problem for ok, problem in [
        (m.mlp != "relu", "model.mlp=relu"),  # (gpt2_incompatible names the others)
        (not t.z_loss, f"train.z_loss={t.z_loss}"),  # (the peer's loss is the plain cross-entropy)
        (not t.label_smoothing, f"train.label_smoothing={t.label_smoothing}"),
        (not cfg.data.document_mask, "data.document_mask=true"),  # (its attention is causal over the whole row)
        (t.grad_accum == 1, f"train.grad_accum={t.grad_accum}"),  # (one micro-batch a step)
        (m.tie_embeddings, "model.tie_embeddings=false"),
        (o.name == "adamw", f"optim.name={o.name}"),
        (o.decay == "cosine", f"optim.decay={o.decay}"),
        (not on_cpu or m.dtype == "float32", f"model.dtype={m.dtype} on a CPU"),  # (its float32 is the peer's)
        (not on_cpu or m.param_dtype == "float32", f"model.param_dtype={m.param_dtype} on a CPU"),
    ] if not ok]  # fmt: skip


@functools.cache
def lm_backend() -> str:
    """jax's backend where lm's runs run, asked of a child process: this one initialising it would hold GPU memory
    that the runs need."""
    probe = "import jax; print(jax.default_backend())"
    return subprocess.run([sys.executable, "-c", probe], check=True, stdout=subprocess.PIPE, text=True).stdout.strip()


def run_steps(preset: str, cfg, steps: int) -> int:
    """The steps of each run of `preset` (its config `cfg`): --steps, or 0 for 300 on a small step and 30 on a
    large one. A run must log at least three intervals: lm gives no tokens/s for the first when it is one call
    (it compiles; train.steps_per_call as large as train.log_every), and the first rated one, which still warms
    up, is left out. Fewer is a UserError (one line under `command`), before anything runs."""
    steps = steps or (300 if cfg.data.batch_size * cfg.data.block_size < 4096 else 30)
    if steps < 3 * cfg.train.log_every:
        raise UserError(
            f"--steps {steps} gives {preset} fewer than three logged intervals of train.log_every="
            f"{cfg.train.log_every}; give --steps {3 * cfg.train.log_every} or more"
        )
    return steps


def config_settings(overrides: list[str]) -> list[str]:
    """The config settings among a run's overrides: not the environment variables (an upper-case NAME=VALUE)."""
    return [o for o in overrides if not o.partition("=")[0].isupper()]


def check_runs(presets: list[str], overrides: list[str], given: dict[str, list[str]], steps: int) -> tuple[dict, dict]:
    """({preset: its config under `overrides`, the peer's shape}, {preset: the steps of its runs}), after checking
    that every --variant's settings make a config of each preset too, one that logs enough intervals in those
    steps: a mistake in any of them is a UserError, one line before anything runs (it failed that variant's
    run after the rounds before it had run)."""
    refuse_own(config_settings([*overrides, *(s for extra in given.values() for s in extra)]), OWN)
    configs = {preset: config_lib.load(preset, config_settings(overrides)) for preset in presets}
    backend = lm_backend()
    for preset, cfg in configs.items():
        unlike = peer_unlike(cfg, backend)
        if unlike:
            raise UserError(f"{preset} with {' '.join(overrides)}: the PyTorch peer has no {', '.join(unlike)}; it "
                            "would time another model or optimizer (give lm's side those with --variant)")  # fmt: skip
    steps_of = {preset: run_steps(preset, cfg, steps) for preset, cfg in configs.items()}
    for name, extra in given.items():
        for preset in presets:
            try:
                run_steps(preset, config_lib.load(preset, config_settings([*overrides, *extra])), steps_of[preset])
            except UserError as e:
                raise UserError(f"--variant {name}:{','.join(extra)} ({preset}): {e}") from None
    return configs, steps_of


def run_lm(
    preset: str, steps: int, overrides: list[str], root: str = ROOT, timeout: float | None = None
) -> list[float]:
    """tokens/s of each logged interval of `root`'s train.py (with `root`'s lm first on the path), which must end
    within `timeout` seconds; an override NAME=VALUE with an upper-case NAME (LM_MALLOC=keep) is an environment
    variable of the run, not a config setting (XLA_FLAGS=... adds to the flags this process has)."""
    settings = config_settings(overrides)
    variables = [o for o in overrides if o not in settings]
    env = {**os.environ, **dict(v.split("=", 1) for v in variables)}
    if any(v.startswith("XLA_FLAGS=") for v in variables):
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {env['XLA_FLAGS']}".strip()
    if root != ROOT:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    overrides = settings
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, os.path.join(root, "train.py"), preset, f"run.dir={tmp}/run",
            f"train.steps={steps}", "train.eval_every=0", "train.ckpt_every=0", "train.eval_batches=1",
            "logging.progress=false", *overrides,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=root, stdout=subprocess.DEVNULL, env=env, timeout=timeout)
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            return per_call([json.loads(line) for line in f])


def commit(root: str) -> str:
    """The commit a checkout is at, with '+changes' when its tracked files differ from it ('unknown' outside git)."""
    git = lambda *args: subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    head = git("rev-parse", "HEAD").stdout.strip()
    if not head:
        return "unknown"
    return head + ("+changes" if git("diff", "--quiet", "HEAD").returncode != 0 else "")


def check_torch_build():
    """torch, if it is the build a user would train with here: on a machine without a GPU, the CPU build. A CUDA
    build of torch runs on a CPU too, but measured ~1.45x slower than the CPU build there (issue 35), which would
    flatter lm. The bench extra cannot pick the build; install the CPU one first (README, Performance)."""
    import torch  # the bench extra; fail here, before any run, without it

    if not torch.cuda.is_available() and torch.version.cuda:
        raise UserError(
            f"torch {torch.__version__} is a CUDA build and this machine has no GPU: the peer would run slower "
            "than a PyTorch user's; install the CPU build (pip install torch --index-url "
            "https://download.pytorch.org/whl/cpu), then run this again"
        )
    return torch


def check_same_device(torch, backend: str) -> None:
    """A UserError where lm (on jax's `backend`) and the peer (on torch's GPU where it has one, else the CPU) would
    run on different devices: a GPU against a CPU is no comparison (a TPU's lm against its host's CPU peer is by
    design)."""
    if backend == "gpu" and not torch.cuda.is_available():
        raise UserError(f"lm runs on jax's GPU and torch {torch.__version__} sees no GPU: the peer would run on the "
                        "CPU; install torch's CUDA build (pip install torch), then run this again")  # fmt: skip
    if backend == "cpu" and torch.cuda.is_available():
        raise UserError("lm runs on jax's CPU and the peer would run on torch's GPU: install jax's CUDA build "
                        "(pip install -U 'jax[cuda12]') and leave JAX_PLATFORMS unset; then run this again")


def run_peer(settings: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer", json.dumps(settings)],
        check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["shakespeare_char", "shakespeare_char_large"])
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument("--steps", type=non_negative, default=0, help="steps per run; 0 = 300 (small) or 30 (large)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the peer")
    parser.add_argument("--name", default="", help="result file suffix")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
        help="also time lm with these config overrides, as NAME (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--checkout", action="append", default=[], metavar="NAME:DIR",
        help="also time the train.py of another checkout of lm (a git worktree), as NAME (repeatable)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="lm config overrides, for lm's side only")
    args = parser.parse_args()

    checkouts = {}
    given = variants(args.variant, {"lm", "peer"})
    taken = {"lm", "peer", *given}
    for value in args.checkout:
        name, _, d = value.partition(":")
        if not name or not d:
            raise UserError(f"--checkout {value}: give NAME:DIR, e.g. --checkout before:/tmp/before")
        root = os.path.abspath(d)
        if name in taken:
            raise UserError(f"--checkout {name}:{root}: {name} is already lm, the peer, a --variant or a --checkout")
        if not os.path.isfile(os.path.join(root, "train.py")):
            raise UserError(
                f"--checkout {name}:{root} has no train.py; give an lm checkout (git worktree add DIR REV)"
            )
        checkouts[name] = root
        taken.add(name)
    configs, steps_of = check_runs(args.presets, args.overrides, given, args.steps)  # all checked first
    torch = check_torch_build()
    check_same_device(torch, lm_backend())  # (check_runs asked it)
    result = {"presets": {}, "rounds": args.rounds, "peer_compiled": args.compile, "overrides": args.overrides}
    result["commit"] = commit(ROOT)  # lm's; a --checkout's is in its entry
    for preset, cfg in configs.items():
        steps = steps_of[preset]
        settings = peer_settings(cfg, steps, args.compile)
        runs = {"lm": args.overrides, **{name: [*args.overrides, *extra] for name, extra in given.items()}}
        runs.update({name: args.overrides for name in checkouts})
        rates = {name: [] for name in [*runs, "peer"]}
        for r in range(args.rounds):
            for name, overrides in runs.items():
                timed = run_lm(preset, steps, overrides, checkouts.get(name, ROOT))
                rates[name].append(statistics.median(steady_rates(timed, f"the {name} run of {preset}")))
            peer = run_peer(settings)
            rates["peer"].append(statistics.median(peer["tokens_per_sec"][1:]))
            line = ", ".join(f"{name} {rs[-1]:.0f}" for name, rs in rates.items())
            print(f"{preset} round {r + 1} (tokens/s): {line}", file=sys.stderr)
        peer_med = statistics.median(rates["peer"])
        entry = {
            "shape": {k: settings[k] for k in ("n_layer", "n_head", "n_embd", "vocab_size", "batch_size", "block_size")},
            "steps": steps,
            "peer_tokens_per_sec": [round(x) for x in rates["peer"]],
            "peer_median": round(peer_med),
        }
        for name, overrides in runs.items():
            med = statistics.median(rates[name])
            entry[name] = {
                "overrides": overrides,
                **({"checkout": checkouts[name], "commit": commit(checkouts[name])} if name in checkouts else {}),
                "tokens_per_sec": [round(x) for x in rates[name]],
                "median": round(med),
                "ratio_to_peer": round(med / peer_med, 3),
                "ratio_per_round": [round(a / b, 3) for a, b in zip(rates[name], rates["peer"])],
            }
        result["presets"][preset] = entry
    result.update(
        torch=torch.__version__,
        torch_build="cuda " + torch.version.cuda if torch.version.cuda else "cpu",
        torch_threads=peer["threads"],
        machine=f"{platform.machine()} {os.cpu_count()} cores",
    )
    device = "cuda" if torch.cuda.is_available() else ""
    name = "_".join(filter(None, ["versus_torch", device, args.name]))
    report(name, result, os.path.join(RESULTS, f"{name}.json"))


if __name__ == "__main__":
    command(main)
