"""What a server's first requests wait for: `python -m lm.serve` started plainly and with --compile-all, each with
an empty compile cache, then --compile-all restarted on the cache its first start filled. Prints JSON and writes it
to benchmarks/results/serve_start.json.

    python -m benchmarks.serve_start [--model hf:DIR|RUN_DIR]

The model, unless --model names one: benchmarks.serve's (random weights of configs/default.yaml's shape, a 256-token
window). For each start: the seconds from launch to its "serving" line, and the latency of two requests that a plain
start has compiled nothing for (top-p 0.9 with logprobs, a prompt in the 128-token bucket, 8 tokens), one after the
other: the first compiles what it needs unless the start did, the second never does.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

from benchmarks.report import command, report
from benchmarks.serve import complete, make_model, start_server, stop_server


def one_start(model: str, cache: str, *flags: str) -> dict:
    start = time.perf_counter()
    server, port = start_server(model, 16, "--compile-cache", cache, *flags)
    started = time.perf_counter() - start
    body = {"prompt": "x" * 100, "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "logprobs": 5}
    try:
        _, first = complete(port, {**body, "seed": 1})
        _, again = complete(port, {**body, "seed": 2})
    finally:
        stop_server(server)
    return {"start_s": round(started, 2), "first_request_s": round(first, 3), "second_request_s": round(again, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="what to serve (default: random weights of configs/default.yaml's shape)")
    parser.add_argument("--out", help="where to write the JSON (default: benchmarks/results/serve_start.json)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(os.path.join(tmp, "model"))
        plain = one_start(model, os.path.join(tmp, "plain"))
        every = one_start(model, os.path.join(tmp, "every"), "--compile-all")
        restarted = one_start(model, os.path.join(tmp, "every"), "--compile-all")
    results = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": args.model or "random weights, configs/default.yaml's shape (4 x 128), window 256, bytes tokenizer",
        "plain": plain,
        "compile_all": every,
        "compile_all_restarted_on_its_cache": restarted,
    }
    report("serve_start", results, args.out)


if __name__ == "__main__":
    command(main)
