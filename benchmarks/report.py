"""What every benchmark does with its result: print it as JSON and keep it in benchmarks/results/."""

import argparse
import json
import os
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


def command(main):
    """Run a benchmark's main() as its command line: a mistake in its arguments or settings that lm reports as a
    UserError (an unknown preset or config key, a bad value) is one line and exit code 2, as in lm's own commands,
    and so are a backend JAX cannot start (JAX_PLATFORMS=cuda on a CPU host) and a peer's package that is not
    installed; `--debug` in the arguments, or LM_DEBUG=1, shows the traceback instead. Returns what main returns."""
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
        print(f"error: {e.name} is not installed, and the peer needs it: pip install -e '.[bench]'", file=sys.stderr)
        sys.exit(2)
    except Exception:
        said = backend_failure()
        if not said:
            raise
        print(f"error: {said}", file=sys.stderr)
        sys.exit(2)
