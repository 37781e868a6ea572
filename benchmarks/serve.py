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
  sequential_one_slot   one after another again, to a second server of --max-batch 1: what serving without
               batching costs at its best (a one-row step is cheaper than a step over every slot)

speedup = concurrent tokens/s over sequential tokens/s (the issue's goal: >= 4x on the 2-core CPU);
speedup_vs_one_slot, over sequential_one_slot's.
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

from benchmarks.report import command, positive, report

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


def start_server(model: str, max_batch: int, *flags: str) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "lm.serve", model, "--port", "0", "--max-batch", str(max_batch), "--quiet", *flags]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    line = server.stdout.readline()
    if not line.startswith("serving "):
        try:  # (an empty line: it ended, having said why on the stderr it shares with this process)
            code = server.wait(timeout=10 if not line else 0.1)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            raise SystemExit(f"error: the server did not start: it printed {line[:300]!r}") from None
        # One line under benchmarks.report.command: none more after the server's own for a mistake (exit code 2,
        # a --model that is not there, say), else that the server failed and how.
        raise subprocess.CalledProcessError(code, command)
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


def one_at_a_time(port: int, bodies: list[dict]) -> tuple[list, float]:
    start = time.perf_counter()
    results = [complete(port, body) for body in bodies]
    return results, time.perf_counter() - start


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=60)


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
    parser.add_argument("--clients", type=positive, default=None, help="concurrent clients, one request each (32)")
    parser.add_argument("--tokens", type=positive, default=None, help="max_tokens of each request (128)")
    parser.add_argument("--max-batch", type=positive, default=16, help="the server's --max-batch (16)")
    parser.add_argument("--model", help="what to serve (default: random weights of configs/default.yaml's shape)")
    parser.add_argument("--quick", action="store_true", help="8 clients of 32 tokens")
    parser.add_argument("--out", help="where to write the JSON (default: benchmarks/results/serve.json)")
    args = parser.parse_args()
    args.clients = args.clients or (8 if args.quick else 32)  # (a number given wins over --quick's)
    args.tokens = args.tokens or (32 if args.quick else 128)

    bodies = [
        {"prompt": f"Request {i}: once upon a time", "max_tokens": args.tokens, "temperature": 1.0, "seed": i}
        for i in range(args.clients)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(tmp)
        server, port = start_server(model, args.max_batch)
        try:
            complete(port, {**bodies[0], "max_tokens": 4})  # compiles the prompt's bucket
            sequential, sequential_wall = one_at_a_time(port, bodies)
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
            stop_server(server)
        # The same requests one at a time to a server of one slot: a one-row step, as a server without batching has.
        server, port = start_server(model, 1)
        try:
            complete(port, {**bodies[0], "max_tokens": 4})
            one_slot, one_slot_wall = one_at_a_time(port, bodies)
        finally:
            stop_server(server)

    text = lambda result: result[0]["choices"][0]["text"]
    same = [text(a) == text(b) for a, b in zip(sequential, concurrent)]
    results = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": args.model or "random weights, configs/default.yaml's shape (4 x 128), window 256, bytes tokenizer",
        "clients": args.clients,
        "max_tokens": args.tokens,
        "max_batch": args.max_batch,
        "sequential": summary(sequential, sequential_wall),
        "sequential_one_slot": summary(one_slot, one_slot_wall),
        "concurrent": summary(concurrent, concurrent_wall),
        "same_texts": all(same),
        # One row decodes with another weight layout on a CPU (lm.sampling.layout): float rounding may differ.
        "same_texts_one_slot": sum(text(a) == text(b) for a, b in zip(sequential, one_slot)),
    }
    concurrent_rate = results["concurrent"]["tokens/s"]
    results["speedup"] = round(concurrent_rate / results["sequential"]["tokens/s"], 2)
    results["speedup_vs_one_slot"] = round(concurrent_rate / results["sequential_one_slot"]["tokens/s"], 2)
    report("serve", results, args.out)
    if not all(same):
        raise SystemExit(f"{same.count(False)} requests gave other texts concurrently than alone")


if __name__ == "__main__":
    command(main)
