"""Object storage: a local S3 server (moto) and a local GCS server (fake-gcs-server), both started on 127.0.0.1
(tests/conftest.py), hold corpora, prepared data and runs; every test that needs a bucket runs against each. lm reads
and writes them through fsspec (s3fs, gcsfs) and orbax (gs:// natively) as it does local files: the same tokens,
the same training, runs killed and resumed, one-line errors."""

import contextlib
import copy
import gzip
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import Bucket, assert_same_losses, assert_user_error, load_tokens, losses, run_cli
from lm import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# gs:// (fake-gcs-server) runs in the slow tier (`pytest -m slow`, which .ci/run runs): every test again, for time.
@pytest.fixture(scope="module", params=["s3", pytest.param("gs", marks=pytest.mark.slow)])
def store(request, tmp_path_factory):
    """(environment that points the storage clients at the server, the server's Bucket, local copy of the corpus/
    folder of its bucket "bkt"), for S3 and for GCS."""
    server = request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    env, bucket = {**os.environ, **server}, Bucket(request.param, server)
    local = tmp_path_factory.mktemp("bucket") / "corpus"
    (local / "more").mkdir(parents=True)
    with open(config_lib.BUNDLED_CORPUS) as f:
        text = f.read()
    (local / "a.txt").write_text(text[:200_000])
    lines = "".join(json.dumps({"text": text[i : i + 4000]}) + "\n" for i in range(200_000, 300_000, 4000))
    (local / "more" / "b.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": [text[i : i + 3000] for i in range(300_000, 360_000, 3000)]}), local / "c.parquet")
    if bucket.fs.exists("bkt"):  # made again in this process (xdist ran the other server's tests between): empty
        bucket.fs.rm("bkt", recursive=True)
    bucket.fs.mkdir("bkt")
    for path in local.rglob("*"):
        if path.is_file():
            bucket.upload(str(path), f"bkt/corpus/{path.relative_to(local)}")
    return env, bucket, local


def _train(tmp_path, env, name, *overrides):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "tiny", f"run.dir={tmp_path / name}",
           f"data.cache_dir={tmp_path / 'cache'}", "logging.progress=false", "train.steps=3", "train.log_every=1",
           "train.eval_every=0", *overrides]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _losses(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


# slow: four training runs (about 50 s); .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_corpus_in_a_bucket_trains_like_its_local_copy(tmp_path, store):
    env, bucket, local = store
    corpus = bucket.url("bkt/corpus")
    remote = _train(tmp_path, env, "remote", f"data.path={corpus}")
    assert remote.returncode == 0, remote.stderr[-3000:]
    here = _train(tmp_path, env, "local", f"data.path={local}")
    assert here.returncode == 0, here.stderr[-3000:]
    assert _losses(tmp_path / "remote") == _losses(tmp_path / "local")  # the same tokens, in the same order
    prepared = [json.loads(p.read_text()) for p in (tmp_path / "cache").rglob("meta.json")]
    (meta,) = [m for m in prepared if any(i["path"].startswith(corpus) for i in m.get("inputs", []))]
    assert sorted(i["path"] for i in meta["inputs"]) == [
        f"{corpus}/a.txt",
        f"{corpus}/c.parquet",
        f"{corpus}/more/b.jsonl.gz",
    ]
    assert all(i["version"] for i in meta["inputs"])  # each object's ETag or generation: a new upload prepares again

    # data.cache_dir in the bucket too: prepared here, published there, trained on from there.
    cached = _train(tmp_path, env, "cached", f"data.path={corpus}", f"data.cache_dir={bucket.url('runs/cache')}")
    assert cached.returncode == 0, cached.stderr[-3000:]
    assert _losses(tmp_path / "cached") == _losses(tmp_path / "local")
    (prepared,) = {k.rsplit("/", 1)[0] for k in bucket.keys("runs/cache/") if k.endswith("/meta.json")}
    again = _train(tmp_path, env, "again", f"data.path={bucket.url('runs/' + prepared)}")  # that directory, by its URL
    assert again.returncode == 0, again.stderr[-3000:]
    assert _losses(tmp_path / "again") == _losses(tmp_path / "local")


def test_a_glob_in_a_bucket(tmp_path, store):
    env, bucket, local = store
    proc = subprocess.run(
        [sys.executable, "-m", "lm.data", "prepare", bucket.url("bkt/corpus/*.txt"), "--out", str(tmp_path / "out"), "--quiet"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert [i["path"] for i in meta["inputs"]] == [bucket.url("bkt/corpus/a.txt")]
    # The bytes tokenizer: a token a byte, and one end-of-text for the one document.
    assert (
        meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == len((local / "a.txt").read_bytes()) + 1
    )


# slow: about 21 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_fine_tune_examples_in_a_bucket_train_like_their_local_copy(tmp_path, store):
    """Task data (and preference pairs, read the same way) from object storage: it was "not found"."""
    env, bucket, local = store
    (local.parent / "ft").mkdir(exist_ok=True)
    examples = local.parent / "ft" / "pc.jsonl"
    examples.write_text("".join(json.dumps({"prompt": f"Q{i}:", "completion": f" A{i % 7}"}) + "\n" for i in range(40)))
    bucket.upload(str(examples), "bkt/ft/pc.jsonl")
    task = ["data.format=examples", "data.block_size=32", "data.batch_size=4"]
    remote = _train(tmp_path, env, "remote", f"data.path={bucket.url('bkt/ft/pc.jsonl')}", *task)
    assert remote.returncode == 0, remote.stderr[-3000:]
    here = _train(tmp_path, env, "local", f"data.path={examples}", *task)
    assert here.returncode == 0, here.stderr[-3000:]
    assert _losses(tmp_path / "remote") == _losses(tmp_path / "local")
    folder = _train(tmp_path, env, "folder", f"data.path={bucket.url('bkt/ft')}", *task)
    assert_user_error(folder, f"fine-tune examples '{bucket.url('bkt/ft')}' is a directory; give one .jsonl file")


@pytest.mark.parametrize(
    "path, fragments",
    [
        ("bkt/corpus/missing.txt", ["input '{scheme}://bkt/corpus/missing.txt' not found"]),
        ("no-such-bucket/corpus", ["not found"]),
    ],
)
def test_missing_objects_are_one_line(tmp_path, store, path, fragments):
    env, bucket, _ = store
    fragments = [f.format(scheme=bucket.scheme) for f in fragments]
    assert_user_error(_train(tmp_path, env, "run", f"data.path={bucket.url(path)}"), *fragments)
    assert not (tmp_path / "run" / "checkpoints").exists()


# slow: the clients' retries take about 10 s (botocore) and 35 s (gcsfs); .ci/run runs it after the default suite
@pytest.mark.slow
def test_an_unreachable_endpoint_is_one_line_not_a_hang(tmp_path, store):
    env, bucket, _ = store
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = {"s3": "AWS_ENDPOINT_URL", "gs": "STORAGE_EMULATOR_HOST"}[bucket.scheme]
    proc = _train(
        tmp_path, {**env, endpoint: f"http://127.0.0.1:{port}"}, "run", f"data.path={bucket.url('bkt/corpus')}"
    )
    # The first request, whichever it is (the prepared data's meta.json, the corpus), fails in one line.
    connect = {"s3": "Could not connect to the endpoint", "gs": "Cannot connect to host"}[bucket.scheme]
    assert_user_error(proc, f"cannot read {bucket.url('bkt/corpus')}", connect)


@contextlib.contextmanager
def _never_answers():
    """(an endpoint on 127.0.0.1 that takes connections and never answers, the connections it took)"""
    server, accepted = socket.socket(), []
    server.bind(("127.0.0.1", 0))
    server.listen(64)

    def take():
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:  # (closed)
                return

    threading.Thread(target=take, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    finally:
        server.close()
        for connection in accepted:
            connection.close()


def test_an_endpoint_that_never_answers_is_given_up_on(monkeypatch):
    """(An endpoint that takes connections and never answers held sample.py and train.py for over 10 minutes, with
    nothing said: s3fs tried botocore's 3 tries 5 times, each waiting 60 s.) A request is tried 3 x S3_TRIES times,
    then is one line; here each try waits 0.5 s."""
    from lm import storage
    from lm.errors import UserError

    options = copy.deepcopy(storage.OPTIONS)
    options["s3"]["config_kwargs"]["read_timeout"] = 0.5  # (also a new client: fsspec caches one per options)
    monkeypatch.setattr(storage, "OPTIONS", options)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    with _never_answers() as (endpoint, accepted):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        with pytest.raises(UserError, match=r"^cannot read s3a://bkt/x: Read timeout on endpoint URL"):
            storage.isfile("s3a://bkt/x")  # (s3a://: the same options; it had none)
        assert len(accepted) == 3 * storage.S3_TRIES == 6
        # A write (train.py's check that its run directory is writable) waited for good: for the "100 Continue"
        # that botocore asks of an upload, which aiohttp waits for with no timeout.
        with pytest.raises(UserError, match=r"^cannot write to s3a://bkt/y: Read timeout on endpoint URL"):
            storage.write_bytes("s3a://bkt/y", b"{}")
        assert len(accepted) == 12


def test_an_endpoint_that_is_no_url_is_one_line(monkeypatch):
    """(The S3 client is made as lm first names a bucket, to send uploads without "Expect: 100-continue": an
    AWS_ENDPOINT_URL botocore refuses was a traceback there, where a request's own error was one line.)"""
    from lm import storage
    from lm.errors import UserError

    options = copy.deepcopy(storage.OPTIONS)
    options["s3"]["config_kwargs"]["read_timeout"] = 0.25  # (a new client: fsspec caches one per options)
    monkeypatch.setattr(storage, "OPTIONS", options)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "not a url")
    with pytest.raises(UserError, match=r"^cannot connect to s3://bkt/x: Invalid endpoint: not a url; check the URL"):
        storage.isfile("s3://bkt/x")


# slow: gcsfs's 6 tries and their backoff, about 40 s; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_gcs_endpoint_that_never_answers_is_given_up_on(monkeypatch, capsys):
    """(gcsfs waited 5 minutes a try, 6 tries, then printed tracebacks of its own.) 20 s without a byte is a
    timeout (here 0.5 s), and the end is one line."""
    from lm import storage
    from lm.errors import UserError

    monkeypatch.setattr(storage, "GCS_TIMEOUTS", {**storage.GCS_TIMEOUTS, "sock_read": 0.5})
    with _never_answers() as (endpoint, _):
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
        start = time.monotonic()
        with pytest.raises(UserError, match=r"^cannot read gs://bkt/x: the endpoint did not answer in time; check"):
            storage.isfile("gs://bkt/x")
        assert time.monotonic() - start < 120
    assert "Traceback" not in capsys.readouterr().err


@pytest.fixture
def store_env(store, monkeypatch):
    """The storage server's environment in this process too, for in-process readers (s3fs and gcsfs read it when
    created, TensorStore when it opens a gs:// path)."""
    env, bucket, local = store
    for key in bucket.env:
        monkeypatch.setenv(key, env[key])
    return env, bucket, local


def _same_reads(url, local, block_size=32):
    """The windows, evenly spaced validation windows and token streams of prepared data at url and at local
    are the same."""
    import numpy as np

    from lm.data import loaders, meta as meta_lib

    for split in ("train", "val"):
        remote = loaders.Windows(url, meta_lib.load_meta(url), split, block_size, document_mask=True)
        here = loaders.Windows(local, meta_lib.load_meta(local), split, block_size, document_mask=True)
        assert remote.n_windows == here.n_windows > 1
        ids = np.random.default_rng(0).permutation(here.n_windows)[:16]
        for a, b in [(remote.batch(ids), here.batch(ids)), (remote.evenly_spaced(8), here.evenly_spaced(8))]:
            assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
        assert (load_tokens(url, split) == load_tokens(local, split)).all()


def test_prepared_shards_in_a_bucket_are_read_by_byte_ranges(tmp_path, store_env, monkeypatch):
    """prepare --out s3://... (gs://...): tokenized locally, published (meta.json last, recording each object's
    version), and read a window at a time by range requests; an object uploaded again is one line, and a new
    prepare replaces it."""
    import numpy as np

    from lm import storage
    from lm.data import meta as meta_lib
    from lm.data.prepare import prepare
    from lm.errors import UserError
    from lm.prepared_dir import PreparedDir

    env, bucket, local = store_env
    url, here = bucket.url("runs/prepared/a"), str(tmp_path / "a")
    args = dict(tokenizer="bytes", val_fraction=0.2, shard_mb=0.05, progress=False)
    meta = prepare([str(local / "a.txt")], out_dir=url, **args)
    assert meta == {**prepare([str(local / "a.txt")], out_dir=here, **args), "objects": meta["objects"]}
    assert len(meta["shards"]) >= 3 and sorted(meta["objects"]) == [s["name"] for s in meta["shards"]]
    assert not os.path.exists(PreparedDir(url).staging)  # the local staging copy is gone once published
    assert bucket.keys("runs/prepared/a/") == sorted(f"prepared/a/{n}" for n in [*meta["objects"], "meta.json"])
    for key, body in (("notes.txt", b"mine"), ("tokens-00099.bin", b"\0\0")):  # the user's (no meta.json lists them)
        bucket.put(f"runs/prepared/a/{key}", body)  # (put beside lm's: a prefix of the user's alone is refused)
    _same_reads(url, here)

    fs, ranges = storage.filesystem(url), []
    cat_file = fs._cat_file

    async def recorded(path, start=None, end=None, **kwargs):
        ranges.append((path, start, end))
        return await cat_file(path, start=start, end=end, **kwargs)

    monkeypatch.setattr(fs, "_cat_file", recorded)
    from lm.data import loaders

    windows = loaders.Windows(url, meta_lib.load_meta(url), "train", 32)
    batch = windows.batch(np.linspace(0, windows.n_windows - 1, 16).astype(np.int64))
    assert batch["inputs"].shape == (16, 32)
    # One request per window, of its 33 uint16 tokens only; over more than one shard.
    assert len(ranges) == 16 and all(end - start == 66 for _, start, end in ranges)
    assert len({path for path, _, _ in ranges}) > 1

    shard = meta["shards"][1]["name"]
    body = bucket.get(f"runs/prepared/a/{shard}")
    bucket.put(f"runs/prepared/a/{shard}", body[::-1])  # same size, other tokens
    with pytest.raises(UserError, match=f"{url}/{shard} is not the object meta.json records"):
        meta_lib.load_meta(url)
    prepare([str(local / "a.txt")], out_dir=url, **args)  # not up to date: prepared and published again
    assert bucket.get(f"runs/prepared/a/{shard}") == body
    (tmp_path / "short.txt").write_text("to be or not to be " * 20)  # one shard: the older ones go, no other object
    shorter = prepare([str(tmp_path / "short.txt")], out_dir=url, **args)
    assert bucket.keys("runs/prepared/a/") == sorted(
        f"prepared/a/{n}" for n in [*shorter["objects"], "meta.json", "notes.txt", "tokens-00099.bin"]
    )


def test_batches_from_a_bucket_are_the_local_ones_in_order_and_resume(tmp_path, store_env):
    """The train stream over shards in a bucket (several batches requested at once) gives the local stream's
    batches in order, and an iterator restored from its state goes on with the same ones."""
    from lm.data import loaders, meta as meta_lib
    from lm.data.prepare import prepare

    _, bucket, local = store_env
    url, here = bucket.url("runs/prepared/stream"), str(tmp_path / "stream")
    for out in (url, here):
        prepare([str(local / "a.txt")], "bytes", out, shard_mb=0.05, progress=False)

    def stream(directory):
        windows = loaders.Windows(directory, meta_lib.load_meta(directory), "train", 16)
        return loaders.train_iterator([windows], [1.0], 8, seed=3)

    remote, expected = stream(url), stream(here)
    for _ in range(5):
        assert (next(remote)["inputs"] == next(expected)["inputs"]).all()
    resumed = stream(url)
    resumed.set_state(remote.get_state())
    for _ in range(5):
        batch = next(expected)["inputs"]
        assert (next(resumed)["inputs"] == batch).all() and (next(remote)["inputs"] == batch).all()


def test_a_prepared_directory_uploaded_by_hand_is_read_in_place(tmp_path, store_env):
    """A directory prepared locally and copied to the bucket (no object versions recorded) is read where it
    is; its content checksums are checked by byte ranges, so a changed object is one line."""
    from lm.data import meta as meta_lib
    from lm.data.prepare import prepare
    from lm.errors import UserError

    env, bucket, local = store_env
    here = str(tmp_path / "prepared")
    prepare([str(local / "a.txt")], "bytes", here, shard_mb=0.1, progress=False)
    for name in os.listdir(here):
        bucket.upload(os.path.join(here, name), f"runs/by-hand/{name}")
    _same_reads(bucket.url("runs/by-hand"), here)
    body = (tmp_path / "prepared" / "tokens-00000.bin").read_bytes()
    bucket.put("runs/by-hand/tokens-00000.bin", body[::-1])
    with pytest.raises(UserError, match=f"{bucket.url('runs/by-hand/tokens-00000.bin')} does not match the checksum"):
        meta_lib.load_meta(bucket.url("runs/by-hand"))


RUN = ["train.steps=40", "train.ckpt_every=10", "train.eval_every=10", "train.eval_batches=2", "train.keep=2"]


# slow: two training runs and three samplings (about a minute); .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_run_in_a_bucket_is_killed_resumes_bit_for_bit_and_samples(tmp_path, store):
    """run.dir=s3://... (gs://...): SIGKILL once the bucket holds a committed checkpoint, then the same command
    again; the losses are those of the uninterrupted local run, the bucket keeps what orbax keeps, and sample.py,
    lm.eval, lm.export and init_from read it."""
    env, bucket, _ = store
    reference = _train(tmp_path, env, "reference", *RUN)
    assert reference.returncode == 0, reference.stderr[-3000:]

    url = bucket.url("runs/exp/r1")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "tiny", f"run.dir={url}",
           f"run.local_dir={tmp_path / 'work'}", f"data.cache_dir={tmp_path / 'cache'}", "logging.progress=false",
           "train.log_every=1", *RUN]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not bucket.keys("runs/exp/r1/committed/"):  # killed just after its first committed checkpoint (step 10)
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGSTOP)  # frozen, so the bucket's commit markers no longer change; a request already
    time.sleep(0.5)  # sent when it stopped is done by the server within this
    newest = max(int(key.rsplit("/", 1)[1]) for key in bucket.keys("runs/exp/r1/committed/"))
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    # An upload (or for gs://, orbax's own save) that a kill cut short: objects of a step without its commit
    # marker, deleted at the next start.
    bucket.put("runs/exp/r1/checkpoints/35/params/_METADATA", b"{")
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed {url} from step {newest}\n" in again.stdout, (newest, again.stdout)
    assert "35: it has no commit marker (its upload, or its deletion under train.keep, was interrupted)" in again.stderr
    assert f"finished {url} at step 40" in again.stdout

    kept = sorted(os.listdir(tmp_path / "reference" / "checkpoints"))
    assert bucket.keys("runs/exp/r1/committed/") == [f"exp/r1/committed/{s}" for s in kept]
    assert {k.split("/")[3] for k in bucket.keys("runs/exp/r1/checkpoints/")} == set(kept)
    assert bucket.keys("runs/exp/r1/pinned/") == []  # (no reading locks: a bucket's readers read copies of their own)
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    bucket.download("runs/exp/r1/metrics.jsonl", str(pulled / "metrics.jsonl"))
    assert_same_losses(losses(pulled), losses(tmp_path / "reference"))

    sample = [sys.executable, os.path.join(ROOT, "sample.py"), "--prompt", "ROMEO:", "--max-new-tokens", "12",
              "--temperature", "0"]  # fmt: skip
    texts = []
    # (its checkpoints/ directory, read as a local run's is: "holds no committed checkpoint" before)
    for target in (url, str(tmp_path / "reference"), f"{url}/checkpoints/40", f"{url}/checkpoints/"):
        done = subprocess.run([*sample[:2], target, *sample[2:]], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        named = target.split("/checkpoints")[0] + "/checkpoints/40"
        assert f"sampling {named}" in done.stderr
        texts.append(done.stdout)
    assert texts[0] == texts[1] == texts[2] == texts[3] and "ROMEO:" in texts[0]
    # lm.eval writes its results into the bucket run; lm.export reads the bucket run.
    (tmp_path / "held_out.txt").write_text("ROMEO: What light through yonder window breaks?\n" * 4)
    scored = subprocess.run([sys.executable, "-m", "lm.eval", url, "--text", str(tmp_path / "held_out.txt"), "-q"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert scored.returncode == 0, scored.stderr[-3000:]
    result = json.loads(bucket.get("runs/exp/r1/eval/step_40.json"))
    assert result["model"] == f"{url}/checkpoints/40" and result["texts"]["held_out.txt"]["tokens"] > 0
    exported = subprocess.run([sys.executable, "-m", "lm.export", url, str(tmp_path / "hf")], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").exists()
    # A new run starts from the bucket run's weights.
    tuned = _train(tmp_path, env, "tuned", f"init_from={url}", "train.steps=2")
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert f"initialised parameters from {url}" in tuned.stdout
    # The same command as the config in the bucket: a finished run says so and stays as it is.
    config = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"{url}/config.yaml"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert config.returncode == 0, config.stderr[-3000:]
    assert "from step 40" in config.stdout


# slow: a training run of 30 steps with three slowed uploads; .ci/run runs it after the default suite
@pytest.mark.slow
def test_training_goes_on_while_a_checkpoint_uploads(tmp_path, store_env, data_cache, monkeypatch):
    """Each checkpoint is uploaded (for gs://, its logs and commit marker) in the background: with a slow link
    (each push a second longer) the steps after a checkpoint are trained while it uploads, and the bucket still
    ends with every kept step."""
    from lm import run_dir
    from lm.train import train

    env, bucket, _ = store_env
    metrics, pushes = tmp_path / "work" / "metrics.jsonl", []
    push = run_dir.WorkingCopy.push

    def slow_push(self, local_steps):
        time.sleep(1.0)
        push(self, local_steps)
        pushes.append((local_steps, metrics.read_text().count('"loss"')))

    monkeypatch.setattr(run_dir.WorkingCopy, "push", slow_push)
    train(config_lib.load("tiny", [
        f"run.dir={bucket.url('runs/exp/background')}", f"run.local_dir={tmp_path / 'work'}", f"data.cache_dir={data_cache}",
        "logging.progress=false", "train.steps=30", "train.ckpt_every=10", "train.log_every=1", "train.eval_every=0",
    ]))  # fmt: skip
    # When the uploads of steps 10 and 20 ended, the next 10 steps had been trained (a push in the loop itself
    # would have ended with 10 and 20 logged).
    assert [after for _, after in pushes[:2]] == [20, 30], pushes
    assert bucket.keys("runs/exp/background/committed/") == [f"exp/background/committed/{s}" for s in (10, 20, 30)]


# slow: two training runs (about a minute); .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_damaged_checkpoint_in_a_gcs_bucket_is_set_aside(tmp_path, gcs_server, data_cache, monkeypatch):
    """gs:// checkpoints are restored from the bucket itself: one whose arrays were damaged there is moved aside
    in the bucket (STEP.unreadable, kept for inspection), and the run resumes from the step before."""
    from lm.train import train

    for key, value in gcs_server.items():
        monkeypatch.setenv(key, value)
    bucket, url = Bucket("gs", gcs_server), "gs://runs/exp/damaged"
    args = [f"run.dir={url}", f"run.local_dir={tmp_path / 'work'}", f"data.cache_dir={data_cache}",
            "logging.progress=false", "train.steps=40", "train.ckpt_every=10", "train.eval_every=0"]  # fmt: skip
    train(config_lib.load("tiny", args), stop_after=30)
    arrays = [k for k in bucket.keys("runs/exp/damaged/checkpoints/30/params/") if "/d/" in k]
    assert arrays
    for key in arrays:
        bucket.put(f"runs/{key}", bucket.get(f"runs/{key}")[:7])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "tiny", *args], cwd=tmp_path,
                          env={**os.environ}, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{url}/checkpoints/30 cannot be restored" in proc.stderr and f"resumed {url} from step 20" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert bucket.keys("runs/exp/damaged/checkpoints/30.unreadable/params/")  # kept, out of the way of the new 30
    assert [k.rsplit("/", 1)[1] for k in bucket.keys("runs/exp/damaged/committed/")] == ["20", "30", "40"]
    # The next start keeps it (it was deleted as an interrupted upload); a URL spelled otherwise is the same run; a
    # marker whose step is gone (a set-aside killed half-way) is passed over by readers.
    again = [a.replace(url, "gs://runs//exp/damaged/") for a in args]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "tiny", *again, "train.steps=41"],
                          cwd=tmp_path, env={**os.environ}, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "from step 40" in proc.stdout, proc.stderr[-3000:]
    assert bucket.keys("runs/exp/damaged/checkpoints/30.unreadable/params/")
    bucket.put("runs/exp/damaged/committed/50", b"")
    read = run_cli("sample.py", url, "--prompt", "a", "--max-new-tokens", "2", cwd=str(tmp_path), env={**os.environ})
    assert read.returncode == 0 and "checkpoints/41" in read.stderr, read.stderr[-3000:]
    # A write that fails in a bucket is no full disk (the line said "a full disk: free space" of a bad credentials file)
    from lm.checkpoint import Checkpoints

    ckpts = Checkpoints(f"{url}/checkpoints")
    said = str(ckpts._failed(RuntimeError("PERMISSION_DENIED: 403"), 42))
    ckpts.close()
    assert "Fix the cause (the bucket's credentials, permissions or endpoint)" in said and "disk" not in said, said


# slow: three training runs and a sampling (about 40 s); .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_damaged_checkpoint_in_an_s3_bucket_is_replaced(tmp_path, s3_server, data_cache, monkeypatch):
    """s3:// checkpoints are restored from the run's local copy of the bucket: one damaged there is set aside in
    the copy (and in the bucket: STEP.unreadable), the run resumes from the step before, and the step it writes
    again replaces the bucket's damaged copy (the bucket kept it, committed: every later run retrained it, and
    sample.py failed on it)."""
    from lm.train import train

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    bucket, url = Bucket("s3", s3_server), "s3://runs/exp/damaged"
    if not bucket.fs.exists("runs"):
        bucket.fs.mkdir("runs")
    args = [f"run.dir={url}", f"run.local_dir={tmp_path / 'work'}", f"data.cache_dir={data_cache}",
            "logging.progress=false", "train.steps=40", "train.ckpt_every=10", "train.eval_every=0"]  # fmt: skip
    train(config_lib.load("tiny", args))
    whole = _losses(tmp_path / "work")
    arrays = [k for k in bucket.keys("runs/exp/damaged/checkpoints/40/params/") if "/d/" in k]
    assert arrays
    for key in arrays:
        bucket.put(f"runs/{key}", bucket.get(f"runs/{key}")[:7])
    command = [sys.executable, os.path.join(ROOT, "train.py"), "tiny", *args]
    proc = subprocess.run(command, cwd=tmp_path, env={**os.environ}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{url}/checkpoints/40 cannot be restored" in proc.stderr and f"resumed {url} from step 30" in proc.stdout
    assert "Traceback" not in proc.stderr and "ignored error" not in proc.stderr, proc.stderr[-3000:]
    assert _losses(tmp_path / "work")[-10:] == whole[-10:]  # steps 31..40 again, as before
    assert [k.rsplit("/", 1)[1] for k in bucket.keys("runs/exp/damaged/committed/")] == ["20", "30", "40"]
    # The damaged copy is kept in the bucket, as a local run keeps it (it was deleted with the step it replaced)
    aside = arrays[0].replace("/checkpoints/40/", "/checkpoints/40.unreadable/")
    assert len(bucket.get(f"runs/{aside}")) == 7 and len(proc.stderr.splitlines()) < 20, proc.stderr[-3000:]
    again = subprocess.run(command, cwd=tmp_path, env={**os.environ}, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "cannot be restored" not in again.stderr, again.stderr[-3000:]  # replaced
    assert len(bucket.get(f"runs/{aside}")) == 7  # (still)
    arrays = [k for k in bucket.keys("runs/exp/damaged/checkpoints/40/params/") if "/d/" in k]  # (written anew)
    for key in arrays:  # damaged again: set aside beside the first, whose name the local copy no longer has
        bucket.put(f"runs/{key}", bucket.get(f"runs/{key}")[:5])
    third = subprocess.run(command, cwd=tmp_path, env={**os.environ}, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0 and "cannot be restored" in third.stderr, third.stderr[-3000:]
    second = arrays[0].replace("/checkpoints/40/", "/checkpoints/40.unreadable-2/")
    assert len(bucket.get(f"runs/{aside}")) == 7 and len(bucket.get(f"runs/{second}")) == 5
    read = run_cli("sample.py", url, "--prompt", "a", "--max-new-tokens", "2", cwd=str(tmp_path), env={**os.environ})
    assert read.returncode == 0, read.stderr[-3000:]


# slow: about 31 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_failed_push_is_tried_again_and_a_stopped_runs_copy_uploads_what_the_bucket_lacks(
    tmp_path, store_env, data_cache, monkeypatch, capsys
):
    """(A push that failed in the background, the bucket out of reach for a few seconds, stopped the run at the next
    checkpoint though the bucket was back; and the next start's pull deleted the local copy's newer complete steps
    and resumed from the bucket's older one: the steps between were trained again.)"""
    from lm import run_dir
    from lm.errors import UserError
    from lm.train import train

    _, bucket, _ = store_env
    common = [f"data.cache_dir={data_cache}", "logging.progress=false", "train.steps=50", "train.ckpt_every=10",
              "train.eval_every=0", "train.log_every=1", "train.keep=3"]  # fmt: skip
    train(config_lib.load("tiny", [*common, f"run.dir={tmp_path / 'reference'}"]))
    push, pushes, failing = run_dir.WorkingCopy.push, [], set()

    def flaky(self, local_steps):
        pushes.append(local_steps)
        if len(pushes) in failing:
            raise UserError(f"cannot list {self.url}/committed: Could not connect to the endpoint URL")
        push(self, local_steps)

    monkeypatch.setattr(run_dir.WorkingCopy, "push", flaky)
    committed = lambda name: [int(k.rsplit("/", 1)[1]) for k in bucket.keys(f"bkt/runs/{name}/committed/")]
    # Out of reach once (the push after step 20): a warning, and the next push brings the bucket up to date
    failing.update({2})
    url = bucket.url(f"bkt/runs/{tmp_path.name}-blip")
    train(config_lib.load("tiny", [*common, f"run.dir={url}", f"run.local_dir={tmp_path / 'blip'}"]))
    err = capsys.readouterr().err
    assert err.count("warning: a checkpoint's push to") == 1 and "Could not connect" in err
    assert committed(f"{tmp_path.name}-blip") == [30, 40, 50]
    assert_same_losses(losses(tmp_path / "blip"), losses(tmp_path / "reference"))
    if bucket.scheme != "s3":
        return  # (orbax writes gs:// checkpoints itself: a bucket out of reach for good stops its saves as well)
    # Out of reach for good after step 10: the run stops at its third failed push in a row, then resumes once the
    # bucket is back from its local copy's newest step, uploading what the bucket lacks first
    pushes.clear()
    failing.update(range(2, 100))
    url = bucket.url(f"bkt/runs/{tmp_path.name}-outage")
    args = [*common, f"run.dir={url}", f"run.local_dir={tmp_path / 'outage'}"]
    with pytest.raises(UserError, match=r"cannot push to .*at 3 checkpoints in a row; the local copy .*outage holds"):
        train(config_lib.load("tiny", args))
    assert committed(f"{tmp_path.name}-outage") == [10]
    # (the same command, as a new process: in this one, orbax's gs:// listings of the deleted steps are cached)
    again = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "tiny", *args], cwd=tmp_path,
                           env={**os.environ}, capture_output=True, text=True, timeout=600)  # fmt: skip
    out, err = again.stdout, again.stderr
    assert again.returncode == 0, err[-3000:]
    assert "holds steps 20, 30, 40, which" in err and f"resumed {url} from step 40" in out, (out, err[-2000:])
    assert committed(f"{tmp_path.name}-outage") == [30, 40, 50]
    assert_same_losses(losses(tmp_path / "outage"), losses(tmp_path / "reference"))
    # A run deleted from its bucket starts anew, though its local copy holds steps the bucket lacks (it was uploaded
    # again from the copy)
    bucket.fs.rm(f"bkt/runs/{tmp_path.name}-outage", recursive=True)
    again = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "tiny", *args, "train.steps=20"],
                           cwd=tmp_path, env={**os.environ}, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert again.returncode == 0 and "resumed" not in again.stdout and "which" not in again.stderr, again.stderr
    assert committed(f"{tmp_path.name}-outage") == [10, 20]


def test_set_aside_steps_are_uploaded_once_by_the_runs_of_one_local_copy(tmp_path, s3_server, monkeypatch):
    """(Which set-aside steps the bucket had was known to one process only: a run that kept its local copy (its
    push_if_ahead) uploaded the same one again, as STEP.unreadable-2, -3, ... gs:// steps are set aside in the
    bucket itself.)"""
    from lm.files import write_json
    from lm.run_dir import CHECKPOINTS, MARKER, SETTLED, WorkingCopy

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    bucket = Bucket("s3", s3_server)
    if not bucket.fs.exists("bkt"):
        bucket.fs.mkdir("bkt")
    url, local = bucket.url(f"bkt/runs/{tmp_path.name}-aside"), tmp_path / "copy"
    (local / CHECKPOINTS / "5.unreadable").mkdir(parents=True)
    (local / CHECKPOINTS / "5.unreadable" / "f").write_text("damaged")
    (local / MARKER).write_text(url.replace("s3://", "s3a://"))  # (as a run at s3a:// wrote it)
    write_json(str(local / SETTLED), {"steps": {}, "set_aside": []})
    for steps in ([10], [10, 20], [10, 20, 30]):  # three runs, each stopped after pushes that failed
        (local / CHECKPOINTS / str(steps[-1])).mkdir()
        (local / CHECKPOINTS / str(steps[-1]) / "f").write_text("step")
        assert WorkingCopy(url, str(local)).push_if_ahead(steps)
    names = {k.split("/")[3] for k in bucket.keys(f"bkt/runs/{tmp_path.name}-aside/{CHECKPOINTS}/")}
    assert names == {"5.unreadable", "10", "20", "30"}


def test_a_step_is_marked_committed_after_the_logs_that_reach_it(tmp_path, store_env):
    """A run killed the moment a step's commit marker is written resumes with every row it logged up to that
    step: a push uploads the run's other files (metrics.jsonl) before it marks the new steps committed."""
    from lm.run_dir import WorkingCopy

    env, bucket, _ = store_env
    local, url = tmp_path / "work", bucket.url("runs/exp/order")
    remote = WorkingCopy(url, str(local))
    remote.pull()
    (local / "checkpoints" / "10").mkdir(parents=True)
    (local / "checkpoints" / "10" / "state").write_bytes(b"step 10")
    rows = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 11))
    (local / "metrics.jsonl").write_text(rows)
    in_bucket, call = [], remote._call

    def watched(what, function, *args):
        if args and "/committed/" in str(args[0]):
            in_bucket.append(
                bucket.keys("runs/exp/order/metrics.jsonl") and bucket.get("runs/exp/order/metrics.jsonl").decode()
            )
        return call(what, function, *args)

    remote._call = watched
    remote.push([10])
    assert in_bucket == [rows]
    assert bucket.keys("runs/exp/order/committed/") == ["exp/order/committed/10"]


def test_a_cache_in_a_missing_bucket_is_one_line_before_tokenizing(tmp_path, store):
    env, bucket, _ = store
    proc = _train(tmp_path, env, "run", f"data.cache_dir={bucket.url('no-such-bucket/cache')}")
    assert_user_error(proc, f"cannot write to {bucket.url('no-such-bucket/cache/')}", "bucket no-such-bucket does not exist",
                      "fix data.cache_dir")  # fmt: skip
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_readers_download_one_step_once_and_delete_nothing(tmp_path, store_env, tiny_run):
    """sample.py, lm.eval, lm.export and init_from read a bucket run through RunDir.read_copy: the run's
    files and only the step they need (every step for --best), once per process; a step the bucket holds without
    its commit marker (a training run may be uploading it) is neither read nor deleted."""
    from lm import checkpoint as ckpt_lib
    from lm.errors import UserError
    from lm.run_dir import RunDir

    env, bucket, _ = store_env
    run = os.path.join(tiny_run, "checkpoints", "10")
    for step in (5, 10, 15):
        for root, _, names in os.walk(run):
            for name in names:
                key = f"runs/readers/checkpoints/{step}/{os.path.relpath(os.path.join(root, name), run)}"
                bucket.upload(os.path.join(root, name), key)
    for key in ("runs/readers/committed/5", "runs/readers/committed/10"):  # 15: still uploading
        bucket.put(key, b"")
    bucket.upload(os.path.join(tiny_run, "config.yaml"), "runs/readers/config.yaml")

    url = bucket.url("runs/readers")
    newest = RunDir(url).read_copy()
    assert sorted(os.listdir(os.path.join(newest, "checkpoints"))) == ["10"]
    assert os.path.isfile(os.path.join(newest, "config.yaml"))
    assert RunDir(url).read_copy() == newest  # downloaded once
    assert ckpt_lib.find(url) == (os.path.join(newest, "checkpoints"), 10)
    step_5 = RunDir(f"{url}/checkpoints/5").read_copy()
    assert step_5.endswith("/checkpoints/5") and os.listdir(os.path.dirname(step_5)) == ["5"]
    every = RunDir(url).read_copy(None, True)
    assert sorted(os.listdir(os.path.join(every, "checkpoints"))) == ["10", "5"]
    with pytest.raises(UserError, match=f"{url} holds no committed checkpoint 7; available: 5, 10"):
        RunDir(url).read_copy(7)
    assert any(
        k.startswith("readers/checkpoints/15/") for k in bucket.keys("runs/readers/")
    )  # a reader deletes nothing


def test_an_export_to_a_bucket_is_the_local_export_uploaded(tmp_path, store_env, tiny_run):
    """(lm.export s3://bkt/hf said it wrote the bucket, and made a local directory named s3: instead.) It writes the
    local export's files into the bucket; a bucket directory with objects in it is refused, as a local one is. And
    lm.runs names a missing bucket, as it does a missing directory (it said "no runs", exit 0)."""
    env, bucket, _ = store_env
    export = lambda out: subprocess.run([sys.executable, "-m", "lm.export", tiny_run, out], cwd=tmp_path, env=env,
                                        capture_output=True, text=True, timeout=300)  # fmt: skip
    url = bucket.url("bkt/exports/hf")
    for out in (str(tmp_path / "hf"), url):
        done = export(out)
        assert done.returncode == 0 and done.stdout.startswith(f"wrote {out}: config.json"), done.stderr[-3000:]
    local = sorted(os.listdir(tmp_path / "hf"))
    assert sorted(k.rsplit("/", 1)[-1] for k in bucket.keys("bkt/exports/hf/")) == local
    assert all(bucket.get(f"bkt/exports/hf/{name}") == (tmp_path / "hf" / name).read_bytes() for name in local)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(bucket.url("")[:2])]  # (no local s3: or gs:)
    assert_user_error(export(url), f"{url} already exists and is not empty")
    # given as a run, it is named as a local export is (it said "holds no committed checkpoint")
    sampled = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), url, "--prompt", "a"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    sync = "gcloud storage rsync -r" if url.startswith("gs://") else "aws s3 sync"
    assert_user_error(sampled, f"{url} holds a model in Hugging Face format (config.json), not lm's checkpoints; "
                               f"download it ({sync} {url} DIR) and give it as hf:DIR")  # fmt: skip
    # a missing bucket is refused before the weights are read (it came after the export, a large model's minutes)
    nowhere = export(bucket.url("no-such-bucket/hf"))
    assert_user_error(nowhere, "bucket no-such-bucket does not exist")
    assert "exporting" not in nowhere.stdout + nowhere.stderr, nowhere.stderr
    missing = bucket.url("no-such-bucket/runs")
    listed = subprocess.run([sys.executable, "-m", "lm.runs", missing], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert_user_error(listed, f"{missing} does not exist")


def test_a_local_dir_with_other_files_is_never_emptied(tmp_path, store):
    env, bucket, _ = store
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    proc = _train(tmp_path, env, "unused", f"run.dir={bucket.url('runs/exp/other')}", f"run.local_dir={mine}")
    assert_user_error(proc, f"run.local_dir {mine} holds other files")
    assert (mine / "thesis.tex").read_text() == "precious"


# slow: about 12 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_run_in_a_missing_bucket_is_one_line(tmp_path, store):
    env, bucket, _ = store
    proc = _train(tmp_path, env, "unused", f"run.dir={bucket.url('no-such-bucket/run')}")
    assert_user_error(proc, "bucket no-such-bucket does not exist")
    never, nowhere = bucket.url("runs/never-trained"), bucket.url("no-such-bucket/run")
    for url, says in [(never, f"{never} holds no committed checkpoint"),
                      (nowhere, f"{nowhere}: bucket no-such-bucket does not exist")]:  # fmt: skip
        sample = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), url, "--prompt", "a"], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert_user_error(sample, says)


# slow: about 9 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_runs_table_and_plots_read_runs_in_a_bucket(tmp_path, store_env, tiny_run):
    """python -m lm.runs s3://.../runs and python -m lm.plot s3://.../run (gs:// alike) read each run's small
    files (never its checkpoints): the table names the runs by URL, and a plot may be written to the bucket too."""
    env, bucket, _ = store_env
    for run in ("a", "b"):
        for name in ("config.yaml", "metrics.jsonl", "status.json"):
            bucket.upload(os.path.join(tiny_run, name), f"runs/table/{run}/{name}")
    bucket.put("runs/table/a/committed/10", b"")
    bucket.put("runs/table/notes/readme.txt", b"not a run")
    table = bucket.url("runs/table")
    listed = subprocess.run([sys.executable, "-m", "lm.runs", table, "--json"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert listed.returncode == 0, listed.stderr[-3000:]
    rows = json.loads(listed.stdout)
    assert [(r["name"], r["path"], r["last_checkpoint"], r["step"]) for r in rows] == [
        ("a", f"{table}/a", 10, 10), ("b", f"{table}/b", None, 10)]  # fmt: skip
    assert rows[0]["status"] == "finished" and rows[0]["best_val_loss"] is not None
    pytest.importorskip("matplotlib")
    plot = [sys.executable, "-m", "lm.plot", f"{table}/a", tiny_run, "-q"]
    drawn = subprocess.run([*plot, "-o", f"{table}/curves.png"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert bucket.get("runs/table/curves.png")[:4] == b"\x89PNG"
    missing = subprocess.run([sys.executable, "-m", "lm.plot", f"{table}/notes"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert_user_error(missing, f"{table}/notes holds no run")


def test_no_runs_in_a_bucket_says_where_they_are(s3_env, capsys):
    """`lm.runs s3://bucket` of s3://bucket/runs/NAME, or of a run's checkpoints, said only "no runs in ..." (the
    hint was a local directory's only)."""
    from lm import runs

    _, bucket = s3_env
    for key in ("runs/a/config.yaml", "runs/a/metrics.jsonl", "runs/a/checkpoints/1/x", "notes/readme.txt"):
        bucket.put(f"runs/where/{key}", b"model: {}\n" if key.endswith(".yaml") else b"")
    assert runs.main(["s3://runs/where"]) == 0
    said = "no runs in s3://runs/where/; s3://runs/where/runs holds runs: python -m lm.runs s3://runs/where/runs\n"
    assert capsys.readouterr().out == said
    assert runs.main(["s3://runs/where/runs/a/checkpoints"]) == 0
    assert capsys.readouterr().out == "no runs in s3://runs/where/runs/a/checkpoints/; it is a run's checkpoints: " \
        "python -m lm.runs s3://runs/where/runs/a\n"
    assert runs.main(["s3://runs/where/notes"]) == 0
    assert capsys.readouterr().out == "no runs in s3://runs/where/notes/\n"


def test_storage_errors_name_the_package_or_the_protocol():
    from lm import storage
    from lm.errors import UserError

    assert (
        storage.is_url("s3://b/k")
        and storage.is_url("gs://b")
        and not storage.is_url("/data/x")
        and not storage.is_url("file:///x")
    )
    with pytest.raises(UserError, match=r"unknown storage protocol nosuch://"):
        storage.filesystem("nosuch://bucket/key")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match=r"reading gs://b/x needs gcsfs: pip install gcsfs"):
            storage.filesystem("gs://b/x")


@pytest.mark.parametrize("url, sync", [("s3://b/models/x", "aws s3 sync s3://b/models/x DIR"),
                                       ("gcs://b//models/x/", "gcloud storage rsync -r gs://b/models/x DIR")])
def test_hf_of_a_bucket_says_to_download_it(url, sync):
    """`sample.py hf:s3://...` (lm.export writes there) said "s3://... is not a directory", as if mistyped."""
    from lm import pretrained
    from lm.errors import UserError

    with pytest.raises(UserError, match=f"hf:DIR reads a directory on this machine, not {url}; download it first "
                                        rf"\({sync}\), then give hf:DIR$"):  # fmt: skip
        pretrained.hf_directory(f"hf:{url}")


@pytest.mark.parametrize("url", ["gs://runs/q?x", "gs://runs/hash#x/run"])
def test_a_gcs_run_whose_url_holds_a_query_or_fragment_is_refused(url):
    """TensorStore ends a gs:// path at '?' or '#': gs://runs/q?x said it finished, its arrays under gs://runs/q/,
    and no checkpoint of it could be read (two runs q?a and q?b wrote over each other's)."""
    from lm.errors import UserError
    from lm.run_dir import RunDir

    with pytest.raises(UserError, match=r"run.dir=gs://runs/(q\?x|hash#x/run) has '#' or '\?' in its URL.*never to be "
                                        r"read back; name the run without them"):
        RunDir(url).for_training(lambda: [])


@pytest.mark.parametrize("content, says", [
    (None, "File {path} was not found; point it at a credentials file"),
    ('{"type": "service_account", "project_id": "x"}', "Failed to load service account credentials from {path}: "
                                                       "Service account info was not in the expected format"),
])  # fmt: skip
def test_gcs_credentials_that_are_no_credentials_are_one_line(tmp_path, monkeypatch, content, says):
    """gcsfs read the bucket anonymously with such a file, passing the run's checks; TensorStore, which writes a
    gs:// run's checkpoints, failed on it at the first checkpoint, a ckpt_every of training later."""
    from lm import storage
    from lm.errors import UserError

    path = tmp_path / "key.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    storage._check_gcs_credentials.cache_clear()
    said = f"^GOOGLE_APPLICATION_CREDENTIALS={path}: " + re.escape(says.format(path=path))
    with pytest.raises(UserError, match=said):
        storage.filesystem("gs://bkt/run")
    storage._check_gcs_credentials.cache_clear()


def test_google_auths_warning_is_said_once(monkeypatch, caplog):
    """gcsfs asks google-auth for credentials in each filesystem it makes (one a thread): its warning that no metadata
    server answered came 141 times in a 6-step run in a bucket, inside the progress bars."""
    from lm import storage

    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    storage._check_gcs_credentials.cache_clear()
    storage.filesystem("gs://bkt/run")
    warned = logging.getLogger("google.auth._default")
    monkeypatch.setattr(warned, "handlers", [caplog.handler])  # (its parent "google" propagates to no handler)
    for message in ["no metadata server", "no metadata server", "another"]:
        warned.warning(message)
    assert [r.getMessage() for r in caplog.records if r.name == warned.name] == ["no metadata server", "another"]


def test_run_local_dir_without_a_bucket_run_is_a_config_error():
    from lm.errors import ConfigError

    with pytest.raises(ConfigError, match="run.local_dir is where a run.dir in object storage"):
        config_lib.load("tiny", ["run.local_dir=/tmp/copy"])
    assert config_lib.load("tiny", ["run.dir=s3://b/r", "run.local_dir=/tmp/copy"]).run.local_dir == "/tmp/copy"


def test_fine_tune_examples_in_a_bucket_cache_are_a_config_error():
    from lm.errors import ConfigError

    with pytest.raises(ConfigError, match="fine-tune examples are prepared on a local disk"):
        config_lib.load("tiny", ["data.format=examples", "data.path=x.jsonl", "data.cache_dir=s3://b/cache"])
    assert config_lib.load("tiny", ["data.cache_dir=s3://b/cache"]).data.cache_dir == "s3://b/cache"


def test_every_spelling_of_a_bucket_run_is_one_run(tmp_path):
    """(s3a://, which s3fs serves as s3://, had a lock and a working copy of its own: two runs trained into the same
    objects at once.)"""
    from lm.errors import UserError
    from lm.run_dir import RunDir

    name = f"runs/{tmp_path.name}"
    spellings = [RunDir(url) for url in (f"s3://b/{name}", f"s3a://b/{name}", f"S3://b//{name}/", f"s3a://b/{name}/")]
    assert {d.path for d in spellings} == {f"s3://b/{name}"} and len({d.local_dir for d in spellings}) == 1
    assert RunDir(f"gcs://b/{name}").path == f"gs://b/{name}"
    with spellings[0].lock():
        for other in spellings[1:]:
            with pytest.raises(UserError, match="another process .* is training s3://b/"):
                with other.lock():
                    pass


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The local S3 server's environment in this process too, and its Bucket."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    return s3_server, Bucket("s3", s3_server)


def test_a_run_local_dir_that_cannot_be_made_is_one_line(tmp_path, s3_env):
    """(A run.local_dir under a file, or one recorded in a bucket run's config.yaml by another machine that this
    user cannot write, was a NotADirectoryError or PermissionError traceback.)"""
    from lm.errors import UserError
    from lm.run_dir import WorkingCopy

    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(UserError, match=f"cannot make run.local_dir {tmp_path}/notes.txt/copy, the local copy of "
                                        "s3://runs/exp/unmade: Not a directory; set run.local_dir"):  # fmt: skip
        WorkingCopy("s3://runs/exp/unmade", str(tmp_path / "notes.txt" / "copy")).pull()
    assert (tmp_path / "notes.txt").read_text() == "precious"


def test_a_killed_bucket_runs_wall_time_ends_at_its_last_metrics_write(tmp_path, s3_env, tiny_run):
    """lm.runs ends a killed run's wall time at its last write to metrics.jsonl: for a run in a bucket, the object's,
    not the download of the table's copy (the time grew each time the table was printed)."""
    from lm import runs as runs_lib, storage
    from lm.run_dir import RunDir

    _, bucket = s3_env
    for name in ("config.yaml", "metrics.jsonl"):
        bucket.upload(os.path.join(tiny_run, name), f"runs/killed/{name}")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    started = time.time() - 30
    status = {"status": "running", "pid": int(dead.stdout), "host": socket.gethostname(), "started": started}
    bucket.put("runs/killed/status.json", json.dumps(status).encode())
    time.sleep(1.5)  # (an object's time is in seconds)
    written = storage.modified("s3://runs/killed/metrics.jsonl")
    copy = RunDir("s3://runs/killed").summary_copy()
    assert os.path.getmtime(os.path.join(copy, "metrics.jsonl")) == pytest.approx(written, abs=1e-3)
    (row,) = runs_lib.list_runs("s3://runs/killed")
    assert row.status == "killed" and row.wall_seconds == pytest.approx(written - started, abs=1e-3)


def test_plots_of_bucket_runs_name_them_by_their_urls(tmp_path, s3_env, tiny_run, capsys):
    """lm.plot named a bucket run by its temporary copy: in the legend where two runs share a name, and in its
    errors (a run with no metrics.jsonl yet); and it pointed at the URL above runs, which it does not take."""
    from lm import plot as plot_lib

    _, bucket = s3_env
    assert plot_lib._labels(["s3://runs/a//r1/", str(tmp_path / "r1")]) == ["s3://runs/a/r1", str(tmp_path / "r1")]
    bucket.upload(os.path.join(tiny_run, "config.yaml"), "runs/plotless/r/config.yaml")
    assert plot_lib.main(["s3://runs/plotless/r"]) == 2
    assert "error: s3://runs/plotless/r has no metrics.jsonl" in capsys.readouterr().err
    assert plot_lib.main(["s3://runs/plotless"]) == 2
    err = capsys.readouterr().err
    assert "s3://runs/plotless holds no run" in err and "above runs" not in err


# slow: about 27 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_refused_resume_of_a_bucket_run_names_its_url(tmp_path, s3_server, data_cache):
    """train.py's refusals of a resume named the bucket run's working copy in the temporary directory (and offered
    init_from= that copy) instead of its URL. The run's config.yaml resumes it on another machine, in that one's
    temporary directory: it recorded the first machine's working copy as run.local_dir."""
    url = "s3://runs/exp/refused"
    args = [f"run.dir={url}", f"data.cache_dir={data_cache}", "logging.progress=false", "train.steps=2",
            "train.ckpt_every=2", "train.eval_every=0"]  # fmt: skip
    env = {**os.environ, **s3_server, "TMPDIR": str(tmp_path / "first")}
    os.makedirs(env["TMPDIR"])
    done = run_cli("train.py", "tiny", *args, cwd=str(tmp_path), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    other = run_cli("train.py", "tiny", *args, "model.n_embd=64", cwd=str(tmp_path), env=env)
    assert_user_error(other, f"checkpoint {url}/checkpoints/2 was trained with a different model")
    done = run_cli("train.py", "tiny", *args, "train.steps=1", cwd=str(tmp_path), env=env)
    assert_user_error(done, f"{url} is at step 2, past train.steps=1")
    env["TMPDIR"] = str(tmp_path / "second")  # another machine's
    os.makedirs(env["TMPDIR"])
    done = run_cli("train.py", f"{url}/config.yaml", "train.steps=3", cwd=str(tmp_path), env=env)
    assert done.returncode == 0 and f"resumed {url} from step 2" in done.stdout, done.stderr[-3000:]
    saved = Bucket("s3", s3_server).get("runs/exp/refused/config.yaml").decode()
    assert os.listdir(tmp_path / "second" / "lm-runs") and "  local_dir: ''\n" in saved  # each machine's own


def test_a_bucket_runs_url_given_for_its_config_names_its_config(s3_env, tiny_run):
    """`train.py s3://BUCKET/runs/NAME` (the run, not its config.yaml) said "not found; give the URL of an existing
    file" of a run that is there; a local run directory is named as one, with the config.yaml to give."""
    from lm.errors import ConfigError

    _, bucket = s3_env
    bucket.upload(os.path.join(tiny_run, "config.yaml"), "runs/given/r/config.yaml")
    for url in ("s3://runs/given/r", "s3://runs/given/r/"):
        with pytest.raises(ConfigError, match=f"'{url}' is a run directory; to restart or resume that run give "
                                              "s3://runs/given/r/config.yaml$"):  # fmt: skip
            config_lib.find_preset(url)
    assert config_lib.find_preset("s3://runs/given/r/config.yaml").endswith("config.yaml")


def test_checkpoint_refusals_name_a_bucket_runs_url(tmp_path):
    from lm import checkpoint as ckpt_lib
    from lm.errors import UserError
    from lm.run_dir import MARKER

    (tmp_path / MARKER).write_text("s3://b/runs/r")  # a bucket run's working copy
    checkpoints = str(tmp_path / "checkpoints")
    with pytest.raises(UserError, match="checkpoint s3://b/runs/r/checkpoints/10 and the data use different"):
        ckpt_lib.check_tokenizer(checkpoints, 10, {"spec": "bytes"}, {"spec": "gpt2"})
    with pytest.raises(UserError, match="init_from=s3://b/runs/r/checkpoints/10 run.name=NEW"):
        ckpt_lib.check_dataset(checkpoints, 10, {"checksums": {"a": "1"}, "tokens": 5},
                               {"checksums": {"a": "2"}, "tokens": 5}, lambda name, digest: False)  # fmt: skip


def test_a_bucket_runs_wandb_run_is_named_by_its_url(tmp_path, s3_env, data_cache, monkeypatch):
    """W&B named a run in a bucket after its local copy ($TMPDIR/lm-runs/NAME-<hash>), not NAME."""
    import importlib.machinery

    from lm.train import train
    from test_runs import FakeWandb

    fake = FakeWandb()
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # (what the check that it is installed finds)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = ["run.dir=s3://runs/named/char", f"run.local_dir={tmp_path / 'copy'}", f"data.cache_dir={data_cache}",
            "logging.progress=false", "train.peak_flops=1e12", "train.steps=1", "train.eval_every=0",
            "logging.wandb=true"]  # fmt: skip
    train(config_lib.load("tiny", args))
    assert fake.runs[0].init["name"] == "char"


# slow: about 19 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_bucket_run_resumed_in_another_local_copy_keeps_its_wandb_run(tmp_path, s3_env, data_cache, monkeypatch,
                                                                         capsys):  # fmt: skip
    """A run in a bucket resumed in another run.local_dir (another machine's, or this one's under another $TMPDIR
    while the first copy is still there) was called "a copy" of the first local copy and logged as a new W&B run,
    which split its curve; a copy of the run in the bucket (another URL) is still a new one."""
    import importlib.machinery

    from lm.train import train
    from test_runs import FakeWandb

    fake = FakeWandb()
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = [f"data.cache_dir={data_cache}", "logging.progress=false", "train.peak_flops=1e12", "train.eval_every=0",
            "logging.wandb=true"]  # fmt: skip
    for steps, local in ((1, "one"), (2, "two"), (3, "one")):
        run = ["run.dir=s3://runs/wb/char", f"run.local_dir={tmp_path / local}", f"train.steps={steps}"]
        train(config_lib.load("tiny", args + run))
    assert len({r.init["id"] for r in fake.runs}) == 1 and "copy" not in capsys.readouterr().err
    _, bucket = s3_env
    bucket.fs.copy("runs/wb/char", "runs/wb/copied", recursive=True)
    train(config_lib.load("tiny", args + ["run.dir=s3://runs/wb/copied", "train.steps=4"]))
    assert fake.runs[-1].init["id"] != fake.runs[0].init["id"]
    assert "warning: s3://runs/wb/copied is a copy of s3://runs/wb/char," in capsys.readouterr().err


def test_a_reader_in_one_process_sees_steps_committed_since(tmp_path, store_env, tiny_run):
    """A notebook's process that read a bucket run's newest step reads the newer one the run committed since
    (it kept returning the first copy's step); with nothing new, the copy it has is reused."""
    from lm import checkpoint as ckpt_lib
    from lm.run_dir import RunDir

    env, bucket, _ = store_env
    run = os.path.join(tiny_run, "checkpoints", "10")

    def upload(step):
        for root, _, names in os.walk(run):
            for name in names:
                key = f"runs/growing/checkpoints/{step}/{os.path.relpath(os.path.join(root, name), run)}"
                bucket.upload(os.path.join(root, name), key)
        bucket.put(f"runs/growing/committed/{step}", b"")

    upload(5)
    bucket.upload(os.path.join(tiny_run, "config.yaml"), "runs/growing/config.yaml")
    url = bucket.url("runs/growing")
    assert ckpt_lib.find(url)[1] == 5
    first = RunDir(url).read_copy()
    assert RunDir(url).read_copy() == first  # nothing new: downloaded once
    upload(10)
    assert ckpt_lib.find(url)[1] == 10
    assert sorted(os.listdir(os.path.join(RunDir(url).read_copy(None, True), "checkpoints"))) == ["10", "5"]


def test_a_probe_removed_by_another_process_is_no_missing_bucket(monkeypatch):
    """(Two runs sharing train.compile_cache=gs://bucket/jax probe the same file: the one whose probe the other
    removed was told that the bucket does not exist.)"""
    from lm import storage

    written = storage.write_bytes

    def raced(path, data):
        written(path, data)
        storage.filesystem(path).rm(path)  # the other run's clean-up

    monkeypatch.setattr(storage, "write_bytes", raced)
    storage.check_writable("memory://h129-bucket/jax", "train.compile_cache", "-0")


def test_a_prefix_holding_other_objects_is_never_prepared_into(tmp_path, s3_env, capsys):
    """--out s3://... into a prefix of objects lm did not write was prepared into (its own tokens-00000.bin
    replaced); a local directory is refused. An empty "folder" object (a console's Create folder) is no stranger,
    and a prefix lm prepared is prepared again, deleting only its old shards."""
    from lm.data.__main__ import main

    _, bucket = s3_env
    (tmp_path / "a.txt").write_text("To be, or not to be " * 2000)
    prepare = lambda url, *more: main(["prepare", str(tmp_path / "a.txt"), "--out", url, "-q", *more])
    bucket.put("runs/theirs/thesis.tex", b"precious")
    bucket.put("runs/theirs/tokens-00000.bin", b"theirs")
    assert prepare("s3://runs/theirs") == 2
    assert "error: --out s3://runs/theirs holds files lm did not write (thesis.tex)" in capsys.readouterr().err
    assert bucket.keys("runs/theirs/") == ["theirs/thesis.tex", "theirs/tokens-00000.bin"]
    assert bucket.get("runs/theirs/tokens-00000.bin") == b"theirs"
    bucket.put("runs/folder/", b"")
    assert prepare("s3://runs/folder", "--shard-mb", "0.01") == 0
    shards = [k for k in bucket.keys("runs/folder/") if k.startswith("folder/tokens-")]
    assert len(shards) > 2
    bucket.put("runs/folder/notes.txt", b"mine")  # (beside lm's meta.json: the user's own, left alone)
    (tmp_path / "a.txt").write_text("short")
    assert prepare("s3://runs/folder") == 0
    assert bucket.keys("runs/folder/") == ["folder/", "folder/meta.json", "folder/notes.txt", "folder/tokens-00000.bin"]


def test_a_prefix_of_runs_given_as_a_run_names_one(tmp_path, s3_env, tiny_run):
    """sample.py s3://bucket/runs (a prefix of runs; lm.eval, lm.export, lm.serve and init_from alike) said only
    that it holds no committed checkpoint; a local directory of runs names the newest and lm.runs."""
    from lm.errors import UserError
    from lm.run_dir import RunDir

    _, bucket = s3_env
    for run in ("old", "new"):
        for name in ("config.yaml", "metrics.jsonl", "status.json"):
            bucket.upload(os.path.join(tiny_run, name), f"runs/several/{run}/{name}")
        bucket.put(f"runs/several/{run}/checkpoints/10/x", b"")
        bucket.put(f"runs/several/{run}/committed/10", b"")
        time.sleep(1.1)  # (an object's time is in seconds)
    said = ("s3://runs/several is a directory of runs, not a run; give one of them, e.g. s3://runs/several/new "
            "(2 runs there; `python -m lm.runs s3://runs/several` lists them)")  # fmt: skip
    for url in ("s3://runs/several", "s3://runs/several/"):
        with pytest.raises(UserError) as e:
            RunDir(url).read_copy()
        assert str(e.value) == said


def test_a_bucket_run_given_twice_is_drawn_once(tmp_path, s3_env, monkeypatch):
    """lm.plot drew a bucket run given in two spellings (s3://b/r and s3://b/r/, s3a://), or beside its local copy
    (run.local_dir), twice; a local run given twice is drawn once."""
    from lm import plot as plot_lib
    from lm.run_dir import WorkingCopy

    drawn = []
    monkeypatch.setattr(plot_lib, "plot_runs", lambda dirs, out, shown: drawn.append(shown))
    monkeypatch.setattr(plot_lib.RunDir, "summary_copy", lambda self: self.path)
    WorkingCopy("s3://runs/twice/r", str(tmp_path / "copy")).pull()
    given = ["s3://runs/twice/r", "s3://runs/twice/r/", "s3a://runs//twice/r", str(tmp_path / "copy")]
    assert plot_lib.main([*given, "-o", str(tmp_path / "c.png"), "-q"]) == 0
    assert drawn == [["s3://runs/twice/r"]]
