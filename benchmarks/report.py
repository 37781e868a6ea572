"""What every benchmark does with its result: print it as JSON and keep it in benchmarks/results/."""

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


def command(main):
    """Run a benchmark's main() as its command line: a mistake in its arguments or settings that lm reports as a
    UserError (an unknown preset or config key, a bad value) is one line and exit code 2, as in lm's own commands;
    `--debug` in the arguments, or LM_DEBUG=1, shows the traceback instead. Returns what main returns."""
    from lm.errors import UserError

    if "--debug" in sys.argv or os.environ.get("LM_DEBUG") == "1":
        sys.argv = [a for a in sys.argv if a != "--debug"]
        return main()
    try:
        return main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
