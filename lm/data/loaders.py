"""Batches for pretraining: every window of the prepared shards once per epoch in a seeded order, sources mixed
by weight; fixed windows of the validation split; and the one grain iterator every training stream (these
windows, packed examples) is served by.

A split of a prepared directory is ranges of its token shards (lm/data/meta.py). Its windows are the
non-overlapping runs of block_size + 1 tokens (inputs, and targets shifted by one) of each range, counted
from the range's start; a window never crosses a shard. Training reads a stream of rows, global batch after
global batch: row i belongs to a source (Mixture: by weight, deterministically) and is that source's k-th
row; its window is entry k of the source's endless order, grain's shuffle of its windows that draws another
permutation for each epoch (a random-access permutation: no index the size of the corpus is held). So each
epoch of a source visits each of its windows exactly once, and every process computes just its own rows of
each global batch, reading only those windows' bytes: from memory-mapped shards, or as byte ranges (one
request each, all at once) from shards in object storage.

Checkpointing a train iterator (lm/checkpoint.py): `batch_iterator` returns a grain DatasetIterator whose
state is `{"next_index": batches_taken}`. With an orbax CheckpointManager, save it as one more item and
restore it into a fresh iterator built with the same arguments:

    manager.save(step, args=ocp.args.Composite(..., data=grain.checkpoint.CheckpointSave(iterator)))
    manager.restore(step, args=ocp.args.Composite(..., data=grain.checkpoint.CheckpointRestore(iterator)))

grain.checkpoint.CheckpointHandler writes one process_<i>-of-<n>.json per JAX process. Without orbax:
`json.dumps(iterator.get_state())`, then `iterator.set_state(json.loads(saved))`.

A stream's batches are counted from an Origin: batch i holds the global batch of rows from row
origin.row + (i - origin.index) * global_batch. It is (0, 0) but where a resume changed data.batch_size: the
stream then goes on from the first row the run has not trained on (lm.train keeps it in each checkpoint). Where a
resume changed a mixture's weights, the new weights' pattern starts at that row, each source going on from the
rows it had given (Origin.mix_row, Origin.bases).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import grain
import numpy as np

from lm.errors import UserError
from lm.prepared_dir import PreparedDir

ENDLESS = 1 << 40  # batches in the train stream: unbounded in practice


@dataclasses.dataclass(frozen=True)
class Origin:
    """Batch `index` of a training stream begins at the stream's row `row` (see the module's docstring). Rows are
    a token stream's windows, a preference stream's pairs, or fine-tune examples' packed rows, epoch after epoch
    (each epoch's own rows, not the empty ones that fill up its last batch)."""

    index: int = 0
    row: int = 0
    # A mixture whose weights a resume changed goes on from stream row `mix_row` with the new weights' pattern, each
    # source from the rows it had given by then (`bases`, in source order; () = none: the run's own weights).
    mix_row: int = 0
    bases: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "bases", tuple(int(b) for b in self.bases))  # (a list, as a checkpoint stores it)

    def first_row(self, index: int, global_batch: int) -> int:
        """The stream row batch `index` begins at (a token or preference stream's)."""
        return self.row + (index - self.index) * global_batch
MIX_PERIOD = 1 << 14  # a mixture's sources take their shares of every MIX_PERIOD rows exactly


class Windows:
    """The windows of block_size + 1 tokens of one split of a prepared directory, numbered 0..n_windows-1
    range after range; local shards are memory-mapped when first read, shards in object storage read by byte
    ranges."""

    def __init__(self, directory: str, meta: dict, split: str, block_size: int, document_mask: bool = False):
        prepared = PreparedDir(directory)
        self.shards = prepared.shards([shard["name"] for shard in meta["shards"]], meta["dtype"])
        self.read_ahead = prepared.read_ahead
        self.dtype, self.eot, self.document_mask = meta["dtype"], meta["eot"], document_mask
        self.span = block_size + 1
        self.ranges = np.array(meta["splits"][split]["ranges"], np.int64).reshape(-1, 3)
        lengths = self.ranges[:, 2] - self.ranges[:, 1]
        self.first = np.concatenate([[0], np.cumsum(lengths // self.span)])  # first window of each range
        self.n_windows = int(self.first[-1])
        self.slots = np.concatenate([[0], np.cumsum(np.maximum(lengths - block_size, 0))])  # possible starts
        if self.n_windows == 0:
            n_tokens = meta["splits"][split]["tokens"]
            if n_tokens >= self.span:
                raise UserError(
                    f"no shard of the {split} split holds block_size+1 = {self.span} tokens; "
                    "prepare with larger shards (data.shard_mb; a directory prepared by hand: python -m lm.data "
                    "prepare's --shard-mb) or lower data.block_size"
                )
            total = sum(meta["splits"][s]["tokens"] for s in ("train", "val"))
            if split == "val" and meta.get("val_fraction") == 0:  # (prepared by hand with --val-fraction 0)
                fix = (f"{directory} was prepared without a validation split (--val-fraction 0), which no "
                       "data.val_fraction or data.block_size changes; prepare it again with --val VAL_TEXT or "
                       "--val-fraction")  # fmt: skip
            elif total < 2 * self.span:  # no split of it can hold a window each
                fix = f"the whole input is {total} tokens: give more text or lower data.block_size"
            elif split == "val":
                fix = "lower data.block_size or " + (
                    "give longer validation inputs" if meta.get("val_fraction") is None else "raise data.val_fraction"
                )
            else:
                fix = "lower data.block_size"
            raise UserError(f"{split} split has {n_tokens} tokens, needs at least block_size+1 = {self.span}; {fix}")

    def batch(self, window_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The windows with these numbers as a batch."""
        r = np.searchsorted(self.first, window_ids, side="right") - 1
        return self._gather(r, self.ranges[r, 1] + (window_ids - self.first[r]) * self.span)

    def evenly_spaced(self, n: int) -> dict[str, np.ndarray]:
        """n windows whose starts are evenly spaced over every place a window fits (they may overlap)."""
        slots = np.linspace(0, self.slots[-1] - 1, n).round().astype(np.int64)
        r = np.searchsorted(self.slots, slots, side="right") - 1
        return self._gather(r, self.ranges[r, 1] + slots - self.slots[r])

    def _gather(self, ranges: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
        windows = self.shards.windows(self.ranges[ranges, 0], starts, self.span)
        out = {"inputs": windows[:, :-1], "targets": windows[:, 1:]}
        if self.document_mask:
            out.update(document_segments(out["inputs"], self.eot))
        return out


def document_segments(inputs: np.ndarray, eot: int) -> dict[str, np.ndarray]:
    """segment_ids (1, 2, ... per row: a document from each end-of-text token on) and positions restarting at 0
    with each document, for attention that stays within a document (data.document_mask).

    The end-of-text token opens the document after it, at position 0: its target is that document's first token,
    predicted from the end-of-text alone, as a document scored by itself (and sampling from an empty prompt)
    starts. Closing the document before it instead, it predicted the next document's first token from the whole
    of the one before."""
    starts = inputs == eot
    starts[:, 0] = True
    index = np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape)
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return {"segment_ids": np.cumsum(starts, axis=1, dtype=np.int32), "positions": (index - first).astype(np.int32)}


def mixture_quota(weights: Sequence[float]) -> np.ndarray:
    """Rows of each source in every MIX_PERIOD rows of a mixture: its weight's share, rounded to whole rows (the
    largest remainders round up); a source whose share rounds to none is refused."""
    w = np.asarray(weights, np.float64)
    exact = w / w.sum() * MIX_PERIOD
    quota = np.floor(exact).astype(np.int64)
    quota[np.argsort(quota - exact, kind="stable")[: MIX_PERIOD - quota.sum()]] += 1  # largest remainders
    if (quota == 0).any():
        raise UserError(
            f"a data source's weight {w[np.argmin(quota)]:g} is below 1/{MIX_PERIOD} of the total; "
            "raise it or leave that source out"
        )
    return quota


class Mixture:
    """Which source each row of the training stream comes from, by weight, and which of that source's rows it
    is: the rows of every MIX_PERIOD follow one seeded pattern in which source s has its share (its weight
    over the total, rounded to whole rows) exactly, so any stretch of rows follows the weights closely."""

    def __init__(self, weights: Sequence[float], seed: int):
        self.quota = quota = mixture_quota(weights)
        self.pattern = np.random.default_rng(seed % (1 << 64)).permutation(np.repeat(np.arange(len(quota)), quota))
        self.rank = np.zeros(MIX_PERIOD, np.int64)  # row o of the pattern is its source's rank[o]-th there
        self.before = np.zeros((len(quota), MIX_PERIOD + 1), np.int64)  # rows of each source before offset o
        for s in range(len(quota)):
            mine = self.pattern == s
            self.rank[mine] = np.arange(quota[s])
            self.before[s, 1:] = np.cumsum(mine)

    def locate(self, rows: np.ndarray, origin: Origin = Origin()) -> tuple[np.ndarray, np.ndarray]:
        """(source, row within that source) of these rows of the stream, from `origin` on (its mix_row, where these
        weights began, and each source's rows before it)."""
        period, offset = np.divmod(rows - origin.mix_row, MIX_PERIOD)
        source = self.pattern[offset]
        return source, self._bases(origin)[source] + period * self.quota[source] + self.rank[offset]

    def rows_of(self, n: int, origin: Origin = Origin()) -> np.ndarray:
        """Rows each source holds among the first n rows of the stream (n at least origin.mix_row)."""
        period, offset = divmod(n - origin.mix_row, MIX_PERIOD)
        return self._bases(origin) + period * self.quota + self.before[:, offset]

    def _bases(self, origin: Origin) -> np.ndarray:
        return np.array(origin.bases, np.int64) if origin.bases else np.zeros(len(self.quota), np.int64)


class _Rows:
    """Batch i of the training stream: the given rows of global batch i, each from its source's epoch order."""

    def __init__(
        self, sources: list[Windows], mixture: Mixture, global_batch: int, seed: int, rows: np.ndarray, origin: Origin
    ):
        self.sources, self.mixture, self.global_batch, self.rows = sources, mixture, global_batch, rows
        self.origin = origin
        self.orders = []
        for s, windows in enumerate(sources):
            if windows.n_windows >= 1 << 32:
                raise UserError(
                    f"a data source has {windows.n_windows:,} windows, more than the 2^32 an epoch order can "
                    "number; split it into several sources"
                )
            source_seed = int(splitmix64(np.uint64(seed % (1 << 64)), np.array([s], np.uint64))[0]) % (1 << 32)
            self.orders.append(grain.MapDataset.range(windows.n_windows).shuffle(seed=source_seed))

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        source, k = self.mixture.locate(self.origin.first_row(index, self.global_batch) + self.rows, self.origin)
        parts = []
        for s in np.unique(source):
            mine = np.flatnonzero(source == s)
            order, n = self.orders[s], self.sources[s].n_windows
            ids = np.array([order[int(i)] % n for i in k[mine]], np.int64)
            parts.append((mine, self.sources[s].batch(ids)))
        if len(parts) == 1:
            return parts[0][1]
        out = {key: np.empty((len(self.rows), *value.shape[1:]), value.dtype) for key, value in parts[0][1].items()}
        for mine, batch in parts:
            for key, value in batch.items():
                out[key][mine] = value
        return out


def train_iterator(
    sources: Sequence[Windows],
    weights: Sequence[float],
    global_batch: int,
    seed: int,
    rows: np.ndarray | None = None,
    origin: Origin = Origin(),
) -> grain.DatasetIterator:
    """Endless batches {"inputs", "targets"} (and "segment_ids", "positions" with a document mask): int32
    [len(rows), block_size], the given rows of each global batch (this process's, from
    lm.sharding.process_rows; all of them by default), from the train Windows of each source by weight;
    they depend only on the seed, the batch, the row and the origin."""
    rows = local_rows(global_batch, rows)
    make = _Rows(list(sources), Mixture(weights, seed), global_batch, seed, rows, origin)
    return batch_iterator(make, threads=max(w.read_ahead for w in sources))


def val_batches(windows: Windows, global_batch: int, n_batches: int, rows: np.ndarray | None = None) -> list[dict]:
    """The same n_batches every call: windows evenly spaced over the validation split (rows as above)."""
    rows = local_rows(global_batch, rows)
    every = windows.evenly_spaced(n_batches * global_batch)
    return [
        {key: value.reshape(n_batches, global_batch, -1)[b][rows] for key, value in every.items()}
        for b in range(n_batches)
    ]


def batch_iterator(make_batch: Callable[[int], dict], length: int = ENDLESS, threads: int = 1) -> grain.DatasetIterator:
    """A checkpointable iterator over make_batch(0), ..., make_batch(length - 1), in order, prepared ahead in
    `threads` threads."""
    dataset = grain.MapDataset.range(length).map(make_batch)
    options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(4, 2 * threads))
    return iter(dataset.to_iter_dataset(options))


def splitmix64(seed: np.uint64, i: np.ndarray) -> np.ndarray:
    """Output i of the splitmix64 generator seeded with seed: random-access random numbers."""
    x = seed + (i + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def local_rows(global_batch: int, rows: np.ndarray | None) -> np.ndarray:
    """The rows of each global batch a process reads: those given, or all."""
    return np.arange(global_batch, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
