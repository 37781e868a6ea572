"""What every benchmark does with its result: print it as JSON and keep it in benchmarks/results/."""

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys

# LM_BENCH_RESULTS: another directory (benchmarks.accelerator gives each device its own, results/<device>/).
RESULTS = os.environ.get("LM_BENCH_RESULTS") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def report(name: str, result: dict, path: str | None = None) -> None:
    """Print `result` and write it to `path`, by default benchmarks/results/<name>.json. A run under LM_PLATFORM
    (lm.platform's overrides) records them, so that its figures are not read as the platform's own."""
    if os.environ.get("LM_PLATFORM") and isinstance(result, dict):
        result = {**result, "LM_PLATFORM": os.environ["LM_PLATFORM"]}
    print(json.dumps(result, indent=2))
    path = path or os.path.join(RESULTS, f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def positive(text: str) -> int:
    """An argparse type: a count that must be a whole number >= 1 (a zero-sized measure would write 0 FLOP/s as a
    peak, no round no time, a negative count a traceback)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def non_negative(text: str) -> int:
    """An argparse type: a whole number >= 0 (where 0 has a meaning of its own: the default, no blocks)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return int(text)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0, such as seconds or GB (0 or less timed nothing and reported 0/s, or
    failed later with a traceback or a misleading error)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def missing(name: str) -> str:
    return f"{name} is not installed, and the peer needs it: pip install -e '.[bench]'"


def need(*modules: str) -> None:
    """Refuse, before any work, to run without a peer's packages (`torch`, `transformers`): a UserError (one line,
    exit 2 under `command`) naming the first one that is not installed. Imports none of them."""
    from lm.errors import UserError

    for name in modules:
        if importlib.util.find_spec(name) is None:
            raise UserError(missing(name))


def variants(given: list[str], taken: set[str]) -> dict[str, list[str]]:
    """--variant NAME:KEY=VALUE,... options as {NAME: [KEY=VALUE, ...]}; a UserError (one line, exit 2 under
    `command`) for one without a name or settings, or named as a run the benchmark makes itself (`taken`) or as
    another variant."""
    from lm.errors import UserError

    out = {}
    for value in given:
        name, _, extra = value.partition(":")
        settings = [s for s in extra.split(",") if s]
        if not name or not settings or not all("=" in s for s in settings):
            raise UserError(f"--variant {value}: give NAME:KEY=VALUE,..., e.g. --variant lr2:optim.lr=2e-3")
        if name in taken or name in out:
            raise UserError(f"--variant {value}: {name} is already a run of this benchmark or another --variant; "
                            "give it another name")  # fmt: skip
        out[name] = settings
    return out


def per_call(rows: list[dict]) -> list[float]:
    """tokens/s of each timed call in a run's metrics.jsonl rows: a call of several logged intervals
    (train.steps_per_call above train.log_every; lm.platform picks 10 on a CPU) logs a row for each, all with the
    call's figures (the same step_time), and counts once. Rows without a step_time (a peer's) each count."""
    out, last = [], None
    for r in rows:
        if "tokens_per_sec" not in r:
            continue
        step_time = r.get("step_time")
        if step_time is None or step_time != last:
            out.append(r["tokens_per_sec"])
        last = step_time
    return out


def steady_rates(rates: list[float], run: str) -> list[float]:
    """A run's tokens/s per call (per_call) after the first, which still warms up; a UserError (one line under
    `command`) where none is left."""
    from lm.errors import UserError

    if len(rates) < 2:
        raise UserError(f"{run} timed no call after the first two (one compiles, one warms up): give more --steps, "
                        "or a smaller train.steps_per_call")  # fmt: skip
    return rates[1:]


def refuse_own(settings: list[str], own: dict[str, str]) -> None:
    """A UserError for the first KEY=VALUE setting whose key the benchmark sets itself (`own`: key -> why)."""
    from lm.errors import UserError

    for setting in settings:
        key = setting.partition("=")[0]
        if key in own:
            raise UserError(f"{setting}: {own[key]}")


def command(main):
    """Run a benchmark's main() as its command line: a mistake in its arguments or settings that lm reports as a
    UserError (an unknown preset or config key, a bad value) is one line and exit code 2, as in lm's own commands,
    and so are a backend JAX cannot start (JAX_PLATFORMS=cuda on a CPU host) and a peer's package that is not
    installed. A child process run with check=True that fails (CalledProcessError) is one line too: a child that
    exited 2 made a mistake of the user's and has said so on the stderr it shares with this process (nothing is
    added; the exit code is 2), or said it in the stderr it was given (its last line is repeated); any other exit
    is '<command> failed (exit code N)' and that exit code, under the child's own output. `--debug` in the
    arguments, or LM_DEBUG=1, shows the traceback instead. Returns what main returns."""
    from lm.errors import UserError, backend_failure

    if "--debug" in sys.argv or os.environ.get("LM_DEBUG") == "1":
        sys.argv = [a for a in sys.argv if a != "--debug"]
        return main()
    try:
        return main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except ModuleNotFoundError as e:
        if e.name not in ("torch", "transformers"):
            raise
        print(f"error: {missing(e.name)}", file=sys.stderr)
        sys.exit(2)
    except subprocess.CalledProcessError as e:
        said = child_failed(e)
        if said:
            print(f"error: {said}", file=sys.stderr)
        sys.exit(exit_code(e.returncode))
    except Exception:
        said = backend_failure()
        if not said:
            raise
        print(f"error: {said}", file=sys.stderr)
        sys.exit(2)


def child_failed(e: subprocess.CalledProcessError) -> str:
    """The one line (without 'error: ') that a failed child process needs from its parent, or "" where the child
    has said it itself: it exited 2, lm's exit code for a mistake, on a stderr it shares with this process."""
    stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
    last = (stderr or "").strip().splitlines()[-1:]
    if e.returncode == 2 and stderr is None:
        return ""
    if e.returncode == 2 and last and last[0].startswith("error: "):
        return last[0].removeprefix("error: ")
    code = f"exit code {e.returncode}" if e.returncode >= 0 else f"signal {-e.returncode}"
    said = f": {last[0][:300]}" if last else "; its output is above" if stderr is None else ""
    return f"{child_name(e.cmd)} failed ({code}{said})"


def child_name(cmd) -> str:
    """What a child process ran, short: the module of `python -m X`, the script of `python X.py`, else the program."""
    if isinstance(cmd, str):
        return cmd[:100]
    cmd = [str(c) for c in cmd]
    if "-m" in cmd[:-1]:
        return cmd[cmd.index("-m") + 1]
    if len(cmd) > 1 and cmd[1].endswith(".py"):
        return os.path.basename(cmd[1])
    return os.path.basename(cmd[0]) if cmd else "a child process"


def exit_code(returncode: int) -> int:
    """This process's exit code for a child's: its own, or 128 + the signal that ended it."""
    return returncode if 0 < returncode < 256 else 128 - returncode if -128 < returncode < 0 else 1
