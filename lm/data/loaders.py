"""Batches for pretraining: random windows of a prepared train.bin, fixed windows of val.bin; the one grain
iterator that every training stream (these windows, packed examples) is served by.

Training batches are random windows of block_size + 1 tokens (inputs, and targets shifted by one) from
a memory-mapped train.bin; the start of each window is a hash of (seed, its row in the whole stream of
batches), so every process computes just its own rows of each global batch.

Checkpointing a train iterator (lm/checkpoint.py): `batch_iterator` returns a grain DatasetIterator whose
state is `{"next_index": batches_taken}`. With an orbax CheckpointManager, save it as one more item and
restore it into a fresh iterator built with the same arguments:

    manager.save(step, args=ocp.args.Composite(..., data=grain.checkpoint.CheckpointSave(iterator)))
    manager.restore(step, args=ocp.args.Composite(..., data=grain.checkpoint.CheckpointRestore(iterator)))

grain.checkpoint.CheckpointHandler writes one process_<i>-of-<n>.json per JAX process. Without orbax:
`json.dumps(iterator.get_state())`, then `iterator.set_state(json.loads(saved))`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import grain
import numpy as np

from lm.data.meta import load_meta
from lm.errors import UserError

ENDLESS = 1 << 40  # batches in the train stream: unbounded in practice


def train_iterator(
    data_dir: str,
    meta: dict,
    block_size: int,
    global_batch: int,
    seed: int,
    rows: np.ndarray | None = None,
) -> grain.DatasetIterator:
    """Endless batches {"inputs", "targets"}: int32 [len(rows), block_size], the given rows of each global
    batch (this process's, from lm.sharding.process_rows; all of them by default); windows depend only on
    the seed, the batch and the row."""
    rows = local_rows(global_batch, rows).astype(np.uint64)
    n_tokens = _check_length(meta, "train", block_size)
    path = os.path.join(data_dir, "train.bin")
    windows = _Windows(path, meta["dtype"], n_tokens, block_size, global_batch, seed, rows)
    return batch_iterator(windows)


def val_batches(
    data_dir: str,
    meta: dict,
    block_size: int,
    global_batch: int,
    n_batches: int,
    rows: np.ndarray | None = None,
) -> list[dict[str, np.ndarray]]:
    """The same n_batches every call: windows evenly spaced over the validation split (rows as above)."""
    rows = local_rows(global_batch, rows)
    n_tokens = _check_length(meta, "val", block_size)
    starts = np.linspace(0, n_tokens - block_size - 1, n_batches * global_batch).round().astype(np.int64)
    tokens = load_tokens(data_dir, "val", meta)
    return [_gather(tokens, batch[rows], block_size) for batch in starts.reshape(n_batches, global_batch)]


def load_tokens(data_dir: str, split: str, meta: dict | None = None) -> np.ndarray:
    """The token ids of a split, memory-mapped (read on demand, never loaded whole)."""
    meta = meta or load_meta(data_dir)
    if meta["splits"][split]["tokens"] == 0:
        return np.zeros(0, meta["dtype"])  # numpy cannot map an empty file
    return np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=meta["dtype"], mode="r")


def batch_iterator(make_batch: Callable[[int], dict], length: int = ENDLESS) -> grain.DatasetIterator:
    """A checkpointable iterator over make_batch(0), ..., make_batch(length - 1), prepared ahead in a thread."""
    dataset = grain.MapDataset.range(length).map(make_batch)
    return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)))


def splitmix64(seed: np.uint64, i: np.ndarray) -> np.ndarray:
    """Output i of the splitmix64 generator seeded with seed: random-access random numbers."""
    x = seed + (i + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class _Windows:
    """Batch i of random windows: a callable grain maps over batch indices, one numpy gather per batch."""

    def __init__(
        self, path: str, dtype: str, n_tokens: int, block_size: int, global_batch: int, seed: int, rows: np.ndarray
    ):
        self.path, self.dtype, self.n_tokens = path, dtype, n_tokens
        self.block_size, self.global_batch, self.rows = block_size, global_batch, rows
        self.seed = np.uint64(seed % (1 << 64))
        self._tokens = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}  # each worker process maps the file itself

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        rows = np.uint64(index * self.global_batch) + self.rows
        starts = splitmix64(self.seed, rows) % np.uint64(self.n_tokens - self.block_size)
        return _gather(self._tokens, starts.astype(np.int64), self.block_size)


def _gather(tokens: np.ndarray, starts: np.ndarray, block_size: int) -> dict[str, np.ndarray]:
    windows = tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def local_rows(global_batch: int, rows: np.ndarray | None) -> np.ndarray:
    """The rows of each global batch a process reads: those given, or all."""
    return np.arange(global_batch, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)


def _check_length(meta: dict, split: str, block_size: int) -> int:
    n_tokens = meta["splits"][split]["tokens"]
    if n_tokens < block_size + 1:
        fix = "lower data.block_size or raise data.val_fraction" if split == "val" else "lower data.block_size"
        raise UserError(
            f"{split} split has {n_tokens} tokens, needs at least block_size+1 = {block_size + 1}; {fix}"
        )
    return n_tokens
