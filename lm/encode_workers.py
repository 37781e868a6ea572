"""Tokenizer worker processes for prepare: pieces of text in, token ids out, over pipes.

tiktoken releases the GIL, yet two threads encoding in one process run only 1.3-1.45x one thread on a
2-core machine, where two processes run 1.95x. A worker is a fresh interpreter running this module,

    python -P -m lm.encode_workers

which imports numpy, tiktoken and lm.tokenizer, never JAX or grain: not the caller's __main__ (a
multiprocessing pool would re-import train.py, and JAX with it, in every worker), and not forked from a
process whose JAX threads are running (subprocess execs at once). The parent sends it the tokenizer itself
pickled as tiktoken pickles it (a registered encoding by name, any other by its split pattern, ranks and
special tokens), so every kind of tokenizer (named, bytes, bpe:N, rank files) is rebuilt exactly, with no
rank file to find. The worker then answers tasks in order until its input ends.

The pipes carry, little-endian (a message is a uint64 byte count, then a pickle):
    setup   a message: {spec, dtype, the tiktoken Encoding}
    hello   uint64 n_vocab, uint64 eot: the worker's answer once it has built the tokenizer
    task    a message: the pieces, [(text, ends a document), ...]
    result  uint64 byte count, then the token ids as dtype (an EOT after each piece that ends a document)
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

import numpy as np

from lm.errors import UserError
from lm.tokenizer import Tokenizer

# The package's parent directory: workers import this lm, wherever the caller runs from.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A worker runs one encoding at a time: libraries that start thread pools of their own are held to one
# thread, and lm's malloc setting for XLA (lm/__init__.py) is not needed.
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RAYON_NUM_THREADS": "1",
    "LM_MALLOC_TOP_PAD": "0",
}
HELLO = struct.Struct("<QQ")
SIZE = struct.Struct("<Q")


def encode_pieces(tok: Tokenizer, pieces: list[tuple[str, bool]], dtype) -> np.ndarray:
    """The token ids of pieces of text, with the end-of-text token after each piece that ends a document;
    shared by threads and worker processes, so both write the same tokens."""
    eot = np.array([tok.eot], np.uint32)
    ids = []
    for text, ends_document in pieces:
        ids.append(tok.encode_array(text))
        if ends_document:
            ids.append(eot)
    return np.concatenate(ids).astype(dtype)


def message(obj) -> bytes:
    """obj as the pipes carry it: the byte count of its pickle, then the pickle."""
    body = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    return SIZE.pack(len(body)) + body


def setup_message(tok: Tokenizer, dtype) -> bytes:
    """The setup a worker needs: the tokenizer's spec, the token dtype and the tiktoken Encoding itself."""
    return message({"spec": tok.spec, "dtype": np.dtype(dtype).name, "encoding": tok.encoding})


class Processes:
    """`workers` worker processes, fed tasks in turn; the callables submit returns must be called in the
    order of submission (each reads the next result its worker sends).

    Raises OSError where the workers cannot start (no Python executable, no processes allowed, a worker that
    fails before it has built the tokenizer). A worker that dies later ends in a UserError; close() (also on
    leaving a with block, for any reason) kills and reaps every worker.
    """

    def __init__(self, tok: Tokenizer, dtype, workers: int):
        self.workers = workers
        self.dtype = np.dtype(dtype)
        self._procs: list[subprocess.Popen] = []
        self._turn = 0
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, **WORKER_ENV, "PYTHONPATH": path}
        setup = setup_message(tok, self.dtype)
        try:
            for _ in range(workers):
                # Errors go to an unnamed file (nothing to remove; a pipe left unread could block the worker).
                stderr = tempfile.TemporaryFile()
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-P", "-m", __name__],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=stderr,
                        env=env,
                    )
                except BaseException:
                    stderr.close()
                    raise
                proc.stderr = stderr  # read back by _last_line should the worker fail
                self._procs.append(proc)
            for proc in self._procs:  # they start side by side; each reads its setup once it has imported
                try:
                    proc.stdin.write(setup)
                    proc.stdin.flush()
                except BrokenPipeError:
                    pass  # it has exited: reported below
            for proc in self._procs:
                hello = _read_exactly(proc.stdout, HELLO.size)
                if hello is None:
                    raise OSError(f"a worker exited with code {_exit_code(proc)}: {_last_line(proc) or 'no message'}")
                if HELLO.unpack(hello) != (tok.n_vocab, tok.eot):
                    raise OSError(f"a worker built a tokenizer other than {tok.spec}'s")
        except BaseException:
            self.close()
            raise

    def submit(self, pieces: list[tuple[str, bool]], where: str) -> Callable[[], np.ndarray]:
        """Send pieces of text (from the file `where`) to the next worker; call the result for their ids."""
        proc = self._procs[self._turn]
        self._turn = (self._turn + 1) % len(self._procs)
        try:  # lone surrogates (JSON can escape them) pickle as they are, for encode_array to replace
            proc.stdin.write(message(pieces))
            proc.stdin.flush()
        except OSError:
            self._died(proc, where)
        return lambda: self._result(proc, where)

    def _result(self, proc: subprocess.Popen, where: str) -> np.ndarray:
        size = _read_exactly(proc.stdout, SIZE.size)
        data = _read_exactly(proc.stdout, SIZE.unpack(size)[0]) if size is not None else None
        if data is None:
            self._died(proc, where)
        return np.frombuffer(data, self.dtype)

    def _died(self, proc: subprocess.Popen, where: str):
        code = _exit_code(proc)
        last = _last_line(proc)
        raise UserError(
            f"tokenizer worker exited with code {code} while encoding {where}{f': {last}' if last else ''}; "
            "rerun, or set data.workers=1 (--workers 1) to tokenize in this process"
        )

    def close(self) -> None:
        """Kill and reap every worker (no zombies), and close the pipes."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    stream.close()
                except OSError:  # unsent bytes to a worker that is gone
                    pass
        self._procs = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _exit_code(proc: subprocess.Popen) -> str:
    """How a worker whose pipe has failed ended: its exit code, and the signal that killed it."""
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # its pipe failed, yet it runs on
        proc.kill()
        proc.wait()
        return "none (it stopped answering and was killed)"
    if code < 0 and -code in signal.valid_signals():
        return f"{code} ({signal.Signals(-code).name}{', out of memory?' if code == -signal.SIGKILL else ''})"
    return str(code)


def _read_exactly(stream, n: int) -> bytes | None:
    """n bytes from stream, or None if it ends first."""
    data = stream.read(n)
    return data if len(data) == n else None


def _last_line(proc: subprocess.Popen) -> str:
    """The last line a worker wrote to stderr (its error), if any."""
    try:
        proc.stderr.seek(0)
        lines = proc.stderr.read().decode(errors="replace").strip().splitlines()
    except (OSError, ValueError):
        return ""
    return lines[-1].strip() if lines else ""


# ---------------------------------------------------------------------------------------------- worker


def _read_message(stream):
    """The next message's object, or None if the stream ends first."""
    size = _read_exactly(stream, SIZE.size)
    body = _read_exactly(stream, SIZE.unpack(size)[0]) if size is not None else None
    return None if body is None else pickle.loads(body)  # from the process that started this one


def _read_tasks(stream, tasks: queue.Queue) -> None:
    """Read tasks as they arrive, so the parent's writes never wait on this worker's own writes."""
    while (pieces := _read_message(stream)) is not None:
        tasks.put(pieces)
    tasks.put(None)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent ends us
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the results
    setup = _read_message(stdin)
    if setup is None:
        return 1  # the parent is gone
    tok = Tokenizer(setup["spec"], setup["encoding"])
    dtype = setup["dtype"]
    tasks = queue.Queue()
    threading.Thread(target=_read_tasks, args=(stdin, tasks), daemon=True).start()
    try:
        stdout.write(HELLO.pack(tok.n_vocab, tok.eot))
        stdout.flush()
        while (pieces := tasks.get()) is not None:
            ids = encode_pieces(tok, pieces, dtype)
            stdout.write(SIZE.pack(ids.nbytes))
            stdout.write(memoryview(ids).cast("B"))
            stdout.flush()
    except BrokenPipeError:  # the parent is gone
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
