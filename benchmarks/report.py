"""What every benchmark does with its result: print it as JSON and keep it in benchmarks/results/."""

import json
import os

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
