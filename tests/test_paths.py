"""Paths through one layer: lm.storage answers the same questions of a local path and of a bucket (s3://, the local
moto server of conftest.py), and the two objects that hold what differs for a bucket, RunDir (where a run trains and
how it is read) and PreparedDir (whether a prepared corpus is current, how it is read and written), decide it so
that their callers never ask which kind of path they hold."""

import json
import os

import numpy as np
import pytest

from helpers import Bucket


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The S3 test server's Bucket, its environment set in this process too (s3fs reads it)."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    return Bucket("s3", s3_server)


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    """A directory holding nothing yet: a local one, or a prefix of the S3 test bucket."""
    if request.param == "local":
        return str(tmp_path / "place")
    request.getfixturevalue("s3")
    return f"s3://runs/paths/{request.node.name.replace('[', '-').rstrip(']')}"


def test_storage_answers_alike_for_a_disk_and_a_bucket(place):
    from lm import storage

    storage.makedirs(f"{place}/sub")  # a disk needs its directories made; a bucket has none to make
    storage.write_bytes(f"{place}/a.bin", bytes(range(10)))
    storage.write_bytes(f"{place}/sub/b.txt", b"text")
    storage.write_bytes(f"{place}/a.bin", bytes(range(20)))  # replaced whole
    assert storage.isfile(f"{place}/a.bin") and not storage.isdir(f"{place}/a.bin")
    assert storage.isdir(f"{place}/sub") and not storage.isfile(f"{place}/missing")
    assert storage.size(f"{place}/a.bin") == 20 and storage.read_bytes(f"{place}/sub/b.txt") == b"text"
    assert storage.names(place) == ["a.bin", "sub"] and storage.names(f"{place}/missing") == []
    assert storage.walk_files(place, (".txt",)) == [f"{place}/sub/b.txt"]  # named as given, with the protocol
    for hidden in ("sub/.c.txt", "sub/.ipynb_checkpoints/b-checkpoint.txt", "sub/.git/d.txt"):  # (copies, .git)
        storage.makedirs(os.path.dirname(f"{place}/{hidden}"))
        storage.write_bytes(f"{place}/{hidden}", b"text")
    assert storage.walk_files(place, (".txt",)) == [f"{place}/sub/b.txt"]  # hidden files and directories left out
    assert storage.walk_files(f"{place}/sub/.git", (".txt",)) == [f"{place}/sub/.git/d.txt"]  # (one named is read)
    assert storage.glob(f"{place}/*.bin") == [f"{place}/a.bin"]
    # A glob leaves hidden names out, as the shell's does (it read macOS's binary ._ copies); one that says the dot
    # (.*), or names the hidden directory, reads them.
    assert storage.glob(f"{place}/sub/*.txt") == storage.glob(f"{place}/**/*.txt") == [f"{place}/sub/b.txt"]
    assert storage.glob(f"{place}/sub/*") == [f"{place}/sub/b.txt"]
    assert storage.glob(f"{place}/sub/.*.txt") == [f"{place}/sub/.c.txt"]
    assert storage.glob(f"{place}/sub/.git/*.txt") == [f"{place}/sub/.git/d.txt"]
    assert storage.read_ranges([f"{place}/a.bin"] * 2, [2, 15], [5, 17]) == [bytes([2, 3, 4]), bytes([15, 16])]
    with storage.open_bytes(f"{place}/a.bin") as f:
        f.seek(18)
        assert f.read() == bytes([18, 19])
    assert not [n for n in storage.names(place) if n.endswith(".tmp")]  # no write left a temporary file
    storage.remove(f"{place}/sub", recursive=True)
    assert storage.names(place) == ["a.bin"]


def test_a_local_run_trains_and_is_read_in_place(tmp_path):
    from lm.run_dir import RunDir

    path = str(tmp_path / "run")
    run = RunDir(path)
    assert not run.works_in_copy and run.local_dir == ""
    assert run.work == path and run.checkpoints == os.path.join(path, "checkpoints")
    assert run.for_training(lambda: []) is None  # nothing to pull or push
    assert run.read_copy() == path and run.summary_copy() == path
    assert run.shown(f"{path}/checkpoints/10") == f"{path}/checkpoints/10"


def test_a_run_in_s3_trains_in_a_local_copy_and_pushes_it(tmp_path, s3):
    from lm.run_dir import RunDir

    url, work = "s3://runs/paths/run", tmp_path / "work"
    run = RunDir(url, str(work))
    assert run.works_in_copy and run.work == str(work) and run.checkpoints == str(work / "checkpoints")
    assert RunDir(url).local_dir == RunDir(url).work != ""  # by default in the temp dir, named by the URL
    steps = []
    uploads = run.for_training(lambda: steps)
    assert uploads is not None and os.path.isdir(work)  # pulled: a new run's copy is empty but for its marker
    (work / "checkpoints" / "10").mkdir(parents=True)
    (work / "checkpoints" / "10" / "state").write_bytes(b"step 10")
    (work / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 1.0}) + "\n")
    steps.append(10)
    uploads.finish()
    assert s3.keys("runs/paths/run/") == [
        "paths/run/checkpoints/10/state", "paths/run/committed/10", "paths/run/metrics.jsonl"]  # fmt: skip
    copy = RunDir(url).read_copy()
    assert copy != str(work) and open(os.path.join(copy, "checkpoints", "10", "state"), "rb").read() == b"step 10"
    assert RunDir(url).shown(os.path.join(copy, "checkpoints", "10")) == f"{url}/checkpoints/10"
    assert [r.path for r in RunDir("s3://runs/paths").runs()] == [url]


def test_a_run_in_gs_writes_its_checkpoints_into_the_bucket(tmp_path):
    from lm.run_dir import RunDir

    run = RunDir("gs://bkt/runs/a/", str(tmp_path / "work"))
    assert run.checkpoints == "gs://bkt/runs/a/checkpoints" and run.work == str(tmp_path / "work")


def test_runs_are_listed_under_a_directory_or_as_themselves(tmp_path):
    from lm.run_dir import RunDir

    for name, file in (("b", "metrics.jsonl"), ("a", "config.yaml"), ("notes", "readme.txt")):
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_text("")
    (tmp_path / "loose.txt").write_text("")
    assert [r.path for r in RunDir(str(tmp_path)).runs()] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert [r.path for r in RunDir(str(tmp_path / "a")).runs()] == [str(tmp_path / "a")]
    assert RunDir(str(tmp_path / "missing")).runs() == []


def _meta(tokens: int) -> dict:
    return {"dtype": "uint16", "shards": [{"name": "tokens-00000.bin", "tokens": tokens}]}


def test_a_local_prepared_dir_is_built_in_place_and_stale_when_a_shard_changes(tmp_path):
    from lm.prepared_dir import PreparedDir

    path = str(tmp_path / "prepared")
    prepared = PreparedDir(path)
    assert not prepared.shared and prepared.read_ahead == 1

    def tokenize(directory):
        os.makedirs(directory)
        np.arange(8, dtype=np.uint16).tofile(os.path.join(directory, "tokens-00000.bin"))
        return _meta(8)

    meta = prepared.build(
        tokenize, lambda staging, meta=None: pytest.fail("a local directory has no staging copy"), "fingerprint", False
    )
    assert meta == _meta(8) and prepared.problem(meta) is None
    shards = prepared.shards(["tokens-00000.bin"], "uint16")
    assert shards.windows(np.array([0, 0]), np.array([1, 5]), 3).tolist() == [[1, 2, 3], [5, 6, 7]]
    np.arange(9, dtype=np.uint16).tofile(os.path.join(path, "tokens-00000.bin"))
    assert prepared.problem(meta) == f"{path}/tokens-00000.bin has 18 bytes where meta.json records 16"


def test_a_prepared_dir_in_s3_is_staged_published_and_stale_when_an_object_is_uploaded_again(tmp_path, s3):
    from lm.files import read_json
    from lm.prepared_dir import PreparedDir

    url = "s3://runs/paths/prepared"
    prepared = PreparedDir(url)
    assert prepared.shared and prepared.read_ahead > 1
    staged = []

    def tokenize(directory):
        staged.append(directory)
        os.makedirs(directory, exist_ok=True)  # (build made it, to record the shards it replaces)
        np.arange(8, dtype=np.uint16).tofile(os.path.join(directory, "tokens-00000.bin"))
        with open(os.path.join(directory, "meta.json"), "w") as f:
            json.dump(_meta(8), f)
        return _meta(8)

    meta = prepared.build(tokenize, lambda staging, meta=None: None, "fingerprint", False)
    assert staged == [prepared.staging] and not os.path.exists(prepared.staging)  # tokenized here, then published
    assert read_json(f"{url}/meta.json") == meta and sorted(meta["objects"]) == ["tokens-00000.bin"]
    assert prepared.problem(meta) is None
    windows = prepared.shards(["tokens-00000.bin"], "uint16").windows(np.array([0]), np.array([4]), 4)
    assert windows.tolist() == [[4, 5, 6, 7]]
    body = s3.get("runs/paths/prepared/tokens-00000.bin")
    s3.put("runs/paths/prepared/tokens-00000.bin", body[::-1])  # same size, another ETag
    assert (
        prepared.problem(meta) == f"{url}/tokens-00000.bin is not the object meta.json records (it was uploaded again)"
    )
    s3.put("runs/paths/prepared/tokens-00000.bin", body + body)
    assert prepared.problem(meta) == f"{url}/tokens-00000.bin has 32 bytes where meta.json records 16"
    os.makedirs(prepared.staging)  # a prepare tokenized, then was killed while publishing: published from there
    np.arange(8, dtype=np.uint16).tofile(os.path.join(prepared.staging, "tokens-00000.bin"))
    again = prepared.build(
        lambda directory: pytest.fail("tokenized again"), lambda staging, meta=None: _meta(8), "fingerprint", False
    )
    assert prepared.problem(again) is None and s3.get("runs/paths/prepared/tokens-00000.bin") == body


def test_a_directory_of_inputs_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    """os.walk skips a subdirectory it cannot list without a word: its files were left out of the data. (As root,
    which reads any directory, the refusal to list it is made by hand.)"""
    from lm import storage
    from lm.errors import UserError

    (tmp_path / "corpus" / "closed").mkdir(parents=True)
    (tmp_path / "corpus" / "a.txt").write_text("text")
    (tmp_path / "corpus" / "closed" / "b.txt").write_text("more")
    listing = os.scandir

    def scandir(path="."):
        if os.fspath(path).endswith("closed"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return listing(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(UserError, match=f"cannot read directory {tmp_path}/corpus/closed under {tmp_path}/corpus: "
                       "Permission denied; make it readable or move it out"):  # fmt: skip
        storage.walk_files(str(tmp_path / "corpus"), (".txt",))


def test_paths_are_shown_from_the_working_directory_and_as_they_are_without_one(tmp_path, monkeypatch):
    """Log lines name a run under the working directory relative to it; with that directory deleted under a
    starting run, os.getcwd's FileNotFoundError was a traceback that marked the run failed."""
    from lm.files import shown

    monkeypatch.chdir(tmp_path)
    assert (shown(str(tmp_path / "runs" / "a")), shown("runs/a"), shown("s3://b/runs/a")) == ("runs/a", "runs/a",
                                                                                               "s3://b/runs/a")
    assert shown("/elsewhere/a") == "/elsewhere/a"

    def gone():
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(os, "getcwd", gone)
    assert shown(str(tmp_path / "runs" / "a")) == str(tmp_path / "runs" / "a")


def test_a_tilde_the_shell_left_is_the_home_directory_in_every_command(tmp_path, monkeypatch, tiny_run):
    """`lm.export RUN '~/out'`, `lm.eval --output=~/e.json` (quoted, or after =, where no shell expands it) wrote
    into a directory named ~ of the working directory, and `--text=~/t.txt`, `sample.py --prompt-file=~/p.txt`, a
    RUN_DIR '~/run' and a config '~/c.yaml' were not found, where `lm.data prepare` and the config's paths read ~
    as the home directory."""
    from lm import config as config_lib
    from lm.eval.__main__ import main as evaluate
    from lm.export import main as export
    from lm.sampling.cli import main as sample

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    os.symlink(tiny_run, home / "run")
    (home / "t.txt").write_text("to be or not to be " * 20)
    (home / "p.txt").write_text("to be")
    (home / "c.yaml").write_text("model: {n_layer: 1}\n")
    assert export(["~/run", "~/exp"]) == 0 and os.path.isfile(home / "exp" / "config.json")
    assert evaluate(["~/run", "--text=~/t.txt", "--output=~/e.json", "-q"]) == 0
    assert "t.txt" in json.load(open(home / "e.json"))["texts"].popitem()[0]
    assert sample(["~/run", "--prompt-file=~/p.txt", "--max-new-tokens", "1", "-q"]) == 0
    assert config_lib.find_preset("~/c.yaml") == str(home / "c.yaml")
    assert not os.path.exists(tmp_path / "~")


def test_a_file_url_is_the_local_path_in_every_command(tmp_path, monkeypatch, tiny_run):
    """file:///x was read by os as ./file:/x: run.dir=file://... and data.path=file://... were tracebacks,
    `lm.export RUN file:///out` wrote into a directory named file: of the working directory (saying it wrote
    file:///out), and a RUN_DIR, init_from or config file:///... was not found."""
    from lm import config as config_lib
    from lm.eval.__main__ import main as evaluate
    from lm.export import main as export
    from lm.sampling.cli import main as sample

    monkeypatch.chdir(tmp_path)
    url = lambda *parts: "file://" + str(tmp_path.joinpath(*parts))
    (tmp_path / "t.txt").write_text("to be or not to be " * 20)
    (tmp_path / "p.txt").write_text("to be")
    (tmp_path / "c.yaml").write_text("model: {n_layer: 1}\n")
    assert export([f"file://{tiny_run}", url("exp")]) == 0 and os.path.isfile(tmp_path / "exp" / "config.json")
    assert evaluate([f"file://{tiny_run}", f"--text={url('t.txt')}", f"--output={url('e.json')}", "-q"]) == 0
    assert os.path.isfile(tmp_path / "e.json")
    assert sample([f"file://{tiny_run}", f"--prompt-file={url('p.txt')}", "--max-new-tokens", "1", "-q"]) == 0
    assert sample([f"hf:{url('exp')}", f"--prompt-file={url('p.txt')}", "--max-new-tokens", "1", "-q"]) == 0
    assert config_lib.find_preset(url("c.yaml")) == str(tmp_path / "c.yaml")
    cfg = config_lib.load(None, [f"run.dir={url('r')}", f"data.path={url('t.txt')}", f"init_from=file://{tiny_run}"])
    assert (cfg.run.dir, cfg.data.path, cfg.init_from) == (str(tmp_path / "r"), str(tmp_path / "t.txt"), tiny_run)
    assert not os.path.exists(tmp_path / "file:")


@pytest.mark.parametrize("kind", ["loop", "loop/sub", "dangling", "long"])
def test_a_run_dir_no_directory_can_be_made_at_is_one_line(tmp_path, tiny_args, kind):
    """run.dir a link in a loop of links (or below one), or a name longer than 255 bytes, was a traceback from
    listing its checkpoints (OSError: Too many levels of symbolic links / File name too long); a link to nothing
    was "cannot write run directory LINK: File exists"."""
    from lm import config as config_lib
    from lm.errors import UserError
    from lm.train import train

    os.symlink(tmp_path / "b", tmp_path / "loop")
    os.symlink(tmp_path / "loop", tmp_path / "b")
    os.symlink(tmp_path / "missing", tmp_path / "dangling")
    run_dir = tmp_path / ("x" * 256 if kind == "long" else kind)
    expected = {"dangling": "is a link to .*missing, which does not exist",
                "long": r"cannot be used \(File name too long"}
    cfg = config_lib.load("tiny", [*tiny_args, f"run.dir={run_dir}", "train.steps=1"])
    with pytest.raises(UserError, match=expected.get(kind, "is in a loop of links")):
        train(cfg)
    assert sorted(os.listdir(tmp_path)) == ["b", "dangling", "loop"]


def test_a_run_directory_inside_a_corpus_directory_is_no_input(tmp_path, monkeypatch):
    """`data.path=corpus run.dir=corpus/run` (or data.path=. beside runs/): the run's metrics.jsonl became an input,
    and the same command, resuming it, stopped at "metrics.jsonl:1: no text field 'text'"; its checkpoints'
    commit_success.txt files were text to train on."""
    from lm.data.sources import expand

    corpus = tmp_path / "corpus"
    (corpus / "run" / "checkpoints" / "2").mkdir(parents=True)
    (corpus / "a.txt").write_text("to be or not to be")
    (corpus / "run" / "config.yaml").write_text("model: {}\n")
    (corpus / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (corpus / "run" / "checkpoints" / "2" / "commit_success.txt").write_text("Checkpoint successfully committed")
    (corpus / "notes").mkdir()
    (corpus / "notes" / "config.yaml").write_text("a: 1\n")  # (a config.yaml alone makes no run)
    (corpus / "notes" / "b.txt").write_text("that is the question")
    assert expand([str(corpus)]) == [str(corpus / "a.txt"), str(corpus / "notes" / "b.txt")]
    monkeypatch.chdir(corpus)
    assert expand(["."]) == [str(corpus / "a.txt"), str(corpus / "notes" / "b.txt")]


def test_a_new_run_from_a_checkpoint_is_advised_in_settings_a_shell_takes_as_they_are(tmp_path, tiny_run):
    """`start a new run from it: init_from=runs/a b $x 'q'/checkpoints/10 run.dir=NEW` named a run's path as it is,
    which pasted into a shell split at the space, expanded $x and left a quote open."""
    import shlex
    import shutil

    from lm import config as config_lib
    from lm.errors import UserError
    from lm.train import train

    run = str(tmp_path / "a b $x 'q'")
    shutil.copytree(tiny_run, run)
    cfg = config_lib.load(os.path.join(run, "config.yaml"), [f"run.dir={run}", "optim.name=muon", "train.steps=12"])
    with pytest.raises(UserError, match="other settings that change what it stores") as e:
        train(cfg)
    advice = shlex.split(str(e.value).partition("start a new run from it: ")[2])
    assert advice == [f"init_from={run}/checkpoints/10", "run.dir=NEW"]
