"""Learning curves: training and validation loss, task accuracy, and the learning rate, against tokens seen.

    python -m lm.plot runs/A [runs/B ...] [-o curves.png]

Several runs share the axes, one colour each: the training loss as a line, the validation loss
as dashed points; where a run scored train.eval_tasks, a panel of each task's accuracy (one marker
shape a task). Past six runs the legend names each run once, right of the panels, with a key to the line styles.
Needs matplotlib (pip install matplotlib, or the extra: pip install 'lm[plot]').
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import sys

from lm import storage
from lm.errors import ArgumentParser, UserError, cli
from lm.files import why_not_made
from lm.metrics import read_metrics
from lm.run_dir import RunDir, copy_of, holds_run

DPI = 100
SIZE = (1000, 700)  # pixels
FEW = 6  # runs whose lines each have a legend entry in their panel; more are named once each, beside the panels
MARKERS = "os^vDP*X"  # a task's accuracy points, one shape a task


def _no_config_dir_notes(record: logging.LogRecord) -> bool:
    """Drops the two warnings matplotlib logs on import where its config directory cannot be written (a read-only
    home, as in many containers): it works in a temporary one instead, and the run has nothing to do about it."""
    return not record.getMessage().startswith(("mkdir -p failed for path", "Matplotlib created a temporary"))


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _literal(text: str) -> str:
    """`text` as matplotlib draws it as written: its "$" escaped, which two of would start math ($5 or $6 drew as an
    italic "5or6", and $\\frac$ stopped the plot with a traceback)."""
    return text.replace("$", r"\$")


def _labels(run_dirs: list[str]) -> list[str]:
    """The runs' names in the legend: each one's directory name, or its path where two share a name."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    # Runs of the same name in different directories keep their paths apart.
    full = [storage.normalized(d) if storage.is_url(d) else os.path.normpath(d) for d in run_dirs]  # (s3://, not s3:/)
    return [_literal(n if names.count(n) == 1 else f) for n, f in zip(names, full)]


def _token_axis(train: list[dict]):
    """step -> tokens trained by then, from the logged rows' counts: linear between two rows (their steps train on
    one batch size unless a resume between them changed it) and past the last at its rate. A resume may change the
    batch, so no one tokens-per-step holds for the whole run."""
    steps, tokens = [0, *(r["step"] for r in train)], [0, *(r["tokens"] for r in train)]

    def at(step: int) -> float:
        i = next((i for i, s in enumerate(steps) if s >= step), len(steps) - 1)
        i = max(i, 1)
        (s0, t0), (s1, t1) = (steps[i - 1], tokens[i - 1]), (steps[i], tokens[i])
        return t0 + (step - s0) * (t1 - t0) / max(s1 - s0, 1)

    return at


def _color(i: int, n: int):
    """Run i's colour of n: matplotlib's ten (C0..C9) up to ten runs, beyond them n apart (C0 was run 0's and run 10's
    alike)."""
    if n <= 10:
        return f"C{i}"
    from matplotlib import colormaps

    return colormaps["tab20"](i) if n <= 20 else colormaps["turbo"](i / (n - 1))


def _legend_beside(fig, runs: list[tuple[str, object]], tasks: list[str]) -> None:
    """The legend of many runs, right of the panels: each run once, by its colour, then what each line style is
    (training loss, validation loss, a task's accuracy by its marker)."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=color, lw=2, label=label) for label, color in runs]
    handles += [Line2D([], [], color="grey", lw=1.2, label="train loss"),
                Line2D([], [], color="grey", ls="--", marker="o", ms=4, label="val loss")]  # fmt: skip
    handles += [Line2D([], [], color="grey", lw=1.2, marker=MARKERS[j % len(MARKERS)], ms=4,
                       label=f"{_literal(task)} accuracy")
                for j, task in enumerate(tasks)]  # fmt: skip
    fig.legend(handles=handles, loc="outside right upper", fontsize="small", ncols=1 + (len(handles) - 1) // 40)


def plot_runs(run_dirs: list[str], out_path: str, shown: list[str] | None = None) -> str:
    """Draw the runs' curves into `out_path` (.png, .pdf, .svg, ...; SIZE pixels at 100 dpi); return it.
    `shown`: the runs as the user named them (a bucket's URL, not the local copy read), in labels and errors."""
    if isinstance(run_dirs, (str, os.PathLike)):  # (its characters were read as runs: "r has no metrics.jsonl")
        raise UserError(f"run_dirs is a list of run directories, not one; write [{str(run_dirs)!r}]")
    shown = shown or run_dirs
    if not available():
        raise UserError("plotting needs matplotlib: pip install matplotlib (or pip install 'lm[plot]')")
    # The object-oriented API on an Agg canvas: no display needed, and pyplot's global backend
    # (a notebook's, say) stays as it was.
    matplotlib_log = logging.getLogger("matplotlib")
    matplotlib_log.addFilter(_no_config_dir_notes)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter
    finally:
        matplotlib_log.removeFilter(_no_config_dir_notes)

    runs = []
    for run_dir, name in zip(run_dirs, shown):
        # (a run that has logged nothing yet has none, and is drawn as one with an empty file: not at all)
        if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")) and not holds_run(run_dir):
            storage.names(run_dir)  # (one that cannot be read says so, not that it has no metrics.jsonl)
            missing = "does not exist" if not os.path.exists(run_dir) else "has no metrics.jsonl"
            raise UserError(f"{name} {missing}; pass run directories (runs/NAME)")
        runs.append(read_metrics(run_dir))
    if not any("tokens" in r for rows in runs for r in rows):
        raise UserError(f"no training steps logged yet in {', '.join(shown)}; plot once a run has logged")

    fig = Figure(figsize=(SIZE[0] / DPI, SIZE[1] / DPI), dpi=DPI, layout="constrained")
    canvas = FigureCanvasAgg(fig)
    fmt = os.path.splitext(out_path)[1].lstrip(".").lower()
    if not fmt and (storage.is_stream(out_path) or storage.is_stdout(out_path)):
        fmt = "png"  # (a device or pipe, `-o /dev/stdout`, has no suffix to name a format: PNG, as curves.png)
    if fmt not in canvas.get_supported_filetypes():
        raise UserError(f"cannot write {out_path}: unknown image format; end the name in .png, .pdf or .svg")
    tasks = sorted({k.removeprefix("acc/") for rows in runs for r in rows for k in r if k.startswith("acc/")})
    if tasks:
        loss_ax, acc_ax, lr_ax = fig.subplots(3, 1, sharex=True, height_ratios=[3, 2, 1])
    else:
        (loss_ax, lr_ax), acc_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1]), None
    drawn = []  # (label, colour) of each run drawn: a legend of many runs names them
    for i, (label, rows) in enumerate(zip(_labels(shown), runs)):
        color = _color(i, len(runs))
        train = [r for r in rows if "tokens" in r and "loss" in r]
        if not train:
            continue
        drawn.append((label, color))
        tokens_at = _token_axis(train)  # (validation rows carry no token count)
        val = [r for r in rows if "val_loss" in r]
        tokens = [r["tokens"] for r in train]
        one = {"marker": "o", "ms": 4} if len(train) == 1 else {}  # (a line through one point draws nothing)
        loss_ax.plot(tokens, [r["loss"] for r in train], color=color, lw=1.2, label=f"{label} train", **one)
        if val:
            loss_ax.plot(
                [tokens_at(r["step"]) for r in val],
                [r["val_loss"] for r in val],
                color=color,
                ls="--",
                marker="o",
                ms=4,
                label=f"{label} val",
            )
        for j, task in enumerate(tasks):
            scored = [r for r in rows if f"acc/{task}" in r]
            if scored:
                acc_ax.plot(
                    [tokens_at(r["step"]) for r in scored],
                    [r[f"acc/{task}"] for r in scored],
                    color=color,
                    marker=MARKERS[j % len(MARKERS)],
                    ms=4,
                    label=f"{label} {_literal(task)}",
                )
        lr_ax.plot(tokens, [r["lr"] for r in train], color=color, lw=1.2, **one)
    # DPO's loss is a pair's -log sigmoid(margin), not a token's cross-entropy (its rows log reward_margin)
    dpo = [any("reward_margin" in r for r in rows) for rows in runs]
    loss_ax.set_ylabel("DPO loss (nats/pair)" if all(dpo) else "loss (nats/token; DPO: nats/pair)" if any(dpo) else
                       "loss (nats/token)")  # fmt: skip
    if len(runs) <= FEW:
        loss_ax.legend()
    else:  # (two entries a run, in the panel, covered the curves and ran off its bottom past ten runs)
        _legend_beside(fig, drawn, tasks)
    loss_ax.grid(alpha=0.3)
    if acc_ax is not None:
        acc_ax.set_ylabel("task accuracy")
        if len(runs) <= FEW:
            acc_ax.legend()
        acc_ax.grid(alpha=0.3)
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("tokens seen")
    lr_ax.grid(alpha=0.3)
    lr_ax.xaxis.set_major_formatter(EngFormatter())
    image = io.BytesIO()
    fig.savefig(image, format=fmt, dpi=DPI)
    try:
        storage.makedirs(os.path.dirname(storage.absolute(out_path)))  # (-o plots/c.png, as lm.eval's --output)
        storage.write_bytes(out_path, image.getvalue())
    except OSError as e:
        why = e.strerror or e if storage.is_url(out_path) else why_not_made(out_path, e)
        raise UserError(f"cannot write {out_path}: {why}; give a path in a writable directory") from None
    return out_path


@cli
def main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="python -m lm.plot",
        description="Plot learning curves against tokens seen, one colour per run: training and validation loss, "
        "task accuracy (where a run scored train.eval_tasks) and the learning rate.",
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (runs/NAME), or their s3:// or gs:// URLs"
    )
    parser.add_argument(
        "-o", "--out", default="curves.png",
        help="image to write, a path or a URL; .png, .pdf or .svg (default: curves.png)",
    )  # fmt: skip
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    args = parser.parse_args(argv)
    if "" in args.run_dirs:  # (an unset shell variable: it plotted the working directory, or named no run)
        raise UserError("a run given is empty ''; give run directories (runs/NAME)")
    if not args.out:
        raise UserError("-o/--out is empty; give the image to write (curves.png, or a .pdf or .svg)")
    if storage.isdir(args.out):  # (it said "unknown image format", of a directory)
        inside = os.path.join(args.out, "curves.png")
        raise UserError(f"-o {args.out} is a directory; give an image in it, e.g. {inside}")
    # a run given twice (runs/a and runs/a/, or two globs that overlap; a bucket run's URL in two spellings, or
    # beside its local copy, run.local_dir) is drawn once
    chosen: dict[str, str] = {}
    for run_dir in args.run_dirs:
        same = storage.normalized(run_dir) if storage.is_url(run_dir) else copy_of(run_dir) or os.path.realpath(run_dir)
        chosen.setdefault(same, run_dir)
    runs = list(chosen.values())
    plot_runs([RunDir(d).summary_copy() for d in runs], args.out, shown=runs)
    if not args.quiet:  # (not into the image, where it went to stdout: `-o /dev/stdout | display`)
        print(f"wrote {args.out}", file=sys.stderr if storage.is_stdout(args.out) else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
