"""Serving throughput: the same requests sent to `python -m lm.serve` by concurrent clients (continuous batching)
and one at a time. Prints JSON and writes it to benchmarks/results/serve.json.

    python -m benchmarks.serve [--clients 32] [--tokens 128] [--max-batch 16] [--model hf:DIR|RUN_DIR] [--quick]

The model, unless --model names one: random weights of configs/default.yaml's shape (4 layers x 128, learned
positions, GELU) with a 256-token window and the byte-level tokenizer, written as a Hugging Face directory. Each
of the --clients requests is a completion of --tokens tokens at temperature 1 with its own prompt and seed, over
plain HTTP (http.client, one thread per client: the client side costs the shared CPU little). A row may stop
early at end-of-text; both ways then stop at the same token (a seeded request's text does not depend on the
batch: the run checks it), so both do the same work. One server process serves both ways, warmed up first:

  sequential   the requests one after another: the time each takes, and all completion tokens over the total
  concurrent   every client sends at once: each request's time from its send to its whole response (latency),
               and all completion tokens over the wall time from the first send to the last response

speedup = concurrent tokens/s over sequential tokens/s (the issue's goal: >= 4x on the 2-core CPU).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from benchmarks.report import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(directory: str) -> str:
    """A random-weight model of configs/default.yaml's shape, as an hf: directory."""
    import flax.linen as nn
    import jax

    from lm import hf
    from lm.config import ModelConfig
    from lm.model import init_params
    from lm.tokenizer import get_tokenizer

    cfg = ModelConfig(n_layer=4, n_head=4, n_embd=128, pos="learned", mlp="gelu", vocab_size=257, max_seq_len=256)
    hf.export(nn.unbox(init_params(cfg, jax.random.key(0))), cfg, get_tokenizer("bytes"), directory)
    return f"hf:{directory}"


def start_server(model: str, max_batch: int) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "lm.serve", model, "--port", "0", "--max-batch", str(max_batch), "--quiet"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    line = server.stdout.readline()
    if not line.startswith("serving "):
        server.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return server, int(line.split("http://", 1)[1].split()[0].rsplit(":", 1)[1])


def complete(port: int, body: dict) -> tuple[dict, float]:
    """(the response, seconds) of one completion request."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    data = json.loads(response.read())
    connection.close()
    if response.status != 200:
        raise SystemExit(f"request failed: {data}")
    return data, time.perf_counter() - start


def summary(results: list[tuple[dict, float]], wall: float) -> dict:
    latencies = np.asarray([seconds for _, seconds in results])
    tokens = sum(data["usage"]["completion_tokens"] for data, _ in results)
    return {
        "completion_tokens": tokens,
        "seconds": round(wall, 3),
        "tokens/s": round(tokens / wall, 1),
        "requests/s": round(len(results) / wall, 2),
        "latency_p50_s": round(float(np.percentile(latencies, 50)), 3),
        "latency_p95_s": round(float(np.percentile(latencies, 95)), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients, one request each (32)")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of each request (128)")
    parser.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch (16)")
    parser.add_argument("--model", help="what to serve (default: random weights of configs/default.yaml's shape)")
    parser.add_argument("--quick", action="store_true", help="8 clients of 32 tokens")
    parser.add_argument("--out", help="where to write the JSON (default: benchmarks/results/serve.json)")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.tokens = 8, 32

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(tmp)
        server, port = start_server(model, args.max_batch)
        try:
            bodies = [
                {"prompt": f"Request {i}: once upon a time", "max_tokens": args.tokens, "temperature": 1.0, "seed": i}
                for i in range(args.clients)
            ]
            complete(port, {**bodies[0], "max_tokens": 4})  # compiles the prompt's bucket

            start = time.perf_counter()
            sequential = [complete(port, body) for body in bodies]
            sequential_wall = time.perf_counter() - start

            concurrent: list = [None] * len(bodies)

            def client(i: int) -> None:
                concurrent[i] = complete(port, bodies[i])

            threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            concurrent_wall = time.perf_counter() - start
        finally:
            server.terminate()
            server.wait(timeout=60)

    same = [a["choices"][0]["text"] == b["choices"][0]["text"] for (a, _), (b, _) in zip(sequential, concurrent)]
    results = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": args.model or "random weights, configs/default.yaml's shape (4 x 128), window 256, bytes tokenizer",
        "clients": args.clients,
        "max_tokens": args.tokens,
        "max_batch": args.max_batch,
        "sequential": summary(sequential, sequential_wall),
        "concurrent": summary(concurrent, concurrent_wall),
        "same_texts": all(same),
    }
    results["speedup"] = round(results["concurrent"]["tokens/s"] / results["sequential"]["tokens/s"], 2)
    report("serve", results, args.out)
    if not all(same):
        raise SystemExit(f"{same.count(False)} requests gave other texts concurrently than alone")


if __name__ == "__main__":
    main()
