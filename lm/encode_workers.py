"""prepare's tokenizer pools: worker processes (a spawn-context ProcessPoolExecutor whose workers hold the
tokenizer) for large inputs, this process's threads for small ones and for one worker.

Processes, not threads: tiktoken releases the GIL, yet threads in one process scale far worse than
processes (figures in benchmarks/README.md). Spawned, not forked: a child forked from a process whose JAX
threads are running can deadlock. A spawned worker imports this module (numpy, tiktoken, lm.tokenizer:
never JAX or grain) and, as multiprocessing does, re-runs the caller's main script, which is why train.py,
sample.py and the console scripts (lm/scripts.py) import their command only when run (`python -m lm.data`'s
main module is never re-run). The tokenizer reaches each worker once, through the pool's initializer,
pickled as tiktoken pickles an Encoding, so every kind (named, bytes, bpe:N, rank files) is rebuilt
exactly, with no rank file to find.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from lm.errors import UserError
from lm.tokenizer import Tokenizer

# Signals that reach the workers with their parent, which ends them itself (SIGTERM is how the pool ends a worker)
STOPS = {signal.SIGINT, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])}
# SIGTERM reaches the whole process group too (SLURM's scancel and time limit, `kill -TERM -PGID`, systemd): workers
# that died of it, one while it sent a result, left prepare's `stopped by SIGTERM` waiting for that result for good.
# A worker holds it blocked and ends on one from its parent only (the pool's terminate(): see _watch_parent).
TERM = {signal.SIGTERM} if hasattr(signal, "sigtimedwait") else set()
WATCH_S = 1.0  # how often a wait for a worker's result checks that every worker is still running


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


class Processes:
    """`workers` worker processes that encode pieces of text; submit returns a callable that waits for the ids.

    Raises OSError where the workers cannot start (no processes allowed, a worker that fails before it has
    built the tokenizer). A worker that dies later ends in a UserError; close() (also on leaving a with
    block, for any reason) cancels what is queued and waits for every worker to exit (no zombies).
    """

    def __init__(self, tok: Tokenizer, dtype, workers: int):
        self.workers = workers
        # (made with SIGHUP blocked, which multiprocessing's resource tracker, started here, keeps: it ignores SIGINT
        # and SIGTERM only, and a closed terminal's SIGHUP to the process group killed it, its replacement printing
        # a KeyError traceback per semaphore under "stopped by SIGHUP"; one here is held until it has started)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
        try:
            self.executor = ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(tok.spec, tok.encoding, tok.hf, np.dtype(dtype).name, os.getpid()),
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.results = getattr(self.executor, "_result_queue", None)  # (close() closes it once the pool has ended)
        others, self.processes = set(multiprocessing.active_children()), []
        try:  # start every worker now, so that one that cannot start sends prepare to threads before any work
            # Started with Ctrl-C (and SIGHUP) blocked (a mask a child keeps across exec): a Ctrl-C, which reaches
            # the whole process group, while a worker imports and unpickles its tokenizer, before _start_worker
            # ignores it, printed that worker's traceback. Here it is held until the workers are started, then raised.
            # (SIGTERM too: a worker keeps it blocked, in every thread, from its start.)
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS | TERM)
            try:
                hellos = [self.executor.submit(_hello) for _ in range(workers)]  # each submit starts a worker
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            self.processes = [p for p in multiprocessing.active_children() if p not in others]
            answers = {hello.result() for hello in hellos}
        except (BrokenProcessPool, OSError) as e:
            self.close()
            raise OSError(f"a worker process failed to start: {e}") from None
        except BaseException:
            self.close()
            raise
        if answers != {(tok.n_vocab, tok.eot)}:
            self.close()
            raise OSError(f"a worker built a tokenizer other than {tok.spec}'s")

    def submit(self, pieces: list[tuple[str, bool]], where: str) -> Callable[[], np.ndarray]:
        """Queue pieces of text (from the file `where`); call the result for their ids."""
        try:
            future = self.executor.submit(_encode, pieces)
        except BrokenProcessPool:
            self._died(where)

        def result() -> np.ndarray:
            while True:
                try:
                    return future.result(timeout=WATCH_S)
                except BrokenProcessPool:
                    self._died(where)
                except TimeoutError:
                    # The pool fails every pending future once a worker dies, except one submitted while it does
                    # so (CPython 3.11's manager thread clears its table of futures without a lock): that one
                    # would wait forever. A dead worker is reason enough; none exits while the pool runs.
                    if any(process.exitcode is not None for process in self.processes):
                        self._died(where)

        return result

    def _died(self, where: str):
        deadline = time.monotonic() + 10
        for process in self.processes:
            process.join(timeout=max(deadline - time.monotonic(), 0))  # the pool ends the others once one has died
        # The pool's thread may be reaping the dead worker at this moment (a join here then reads no exit code yet,
        # which made the error "code unknown" about one time in four): asked again for up to 2 s.
        asked_until = time.monotonic() + 2
        while not (codes := [p.exitcode for p in self.processes if p.exitcode not in (None, 0, -signal.SIGTERM)]):
            if time.monotonic() > asked_until:
                break
            time.sleep(0.02)
        # SIGTERM is how the pool ends the others; where no worker ended otherwise, this process sent one a SIGTERM.
        codes = codes or [p.exitcode for p in self.processes if p.exitcode == -signal.SIGTERM]
        for process in self.processes:
            if process.exitcode is None:  # where the pool did not get to it: no worker outlives the pool
                process.kill()
                process.join()
        self._unblock_results()
        raise UserError(
            f"tokenizer worker exited with code {_describe(codes[0] if codes else None)} while encoding {where}; "
            "rerun, or set data.workers=1 (--workers 1) to tokenize in this process"
        ) from None

    def _unblock_results(self) -> None:
        """With every worker gone: a worker that died while it sent its result left half a message, and the pool's
        thread waits for the rest; close() and the interpreter's exit, which join that thread, waited with it for
        good (CPython 3.11 to 3.13). Closing this process's end of the results' pipe, the last writer, ends that."""
        results = getattr(self.results, "_writer", None)
        if results is not None:
            results.close()

    def close(self) -> None:
        """Cancel what is queued and wait for the workers to exit. Interrupted while it waits (a Ctrl-C as prepare
        ends, or a second one), it ends them at once: they ignore SIGINT, and the command exits without waiting
        for them either. So too where a worker dies while it waits (the OOM killer, as prepare stops with results
        on their way): one that died while it sent its result left the pool's thread, and this wait, waiting for the
        rest of it for good."""
        pool_thread = getattr(self.executor, "_executor_manager_thread", None)  # (None: not known, or never started)
        try:
            self.executor.shutdown(wait=pool_thread is None, cancel_futures=True)
            while pool_thread is not None and pool_thread.is_alive():
                pool_thread.join(WATCH_S)
                if any(process.exitcode not in (None, 0) for process in self.processes):
                    self._end(pool_thread)
            self._close_results()
            return
        except BaseException as e:
            # (Without the frames it came through: they hold the pool's thread, and through it the pool's queues.)
            error = e.with_traceback(None)
        self._end(pool_thread)
        # The pool's thread then finds the workers dead and ends, and its queues are released here: the command exits
        # at once after (os._exit), and their semaphores, left, had the resource tracker print a warning of
        # "leaked semaphore objects" under `interrupted`.
        self.executor.shutdown(wait=True)
        self._close_results()
        del pool_thread  # (it holds the pool's queues too)
        gc.collect()  # (some of them in reference cycles)
        raise error

    def _close_results(self) -> None:
        if self.results is not None:  # (as shutdown(wait=True) does; here after one that did not wait)
            self.results.close()
        self.results = None  # (nor held: its semaphores go with it)

    def _end(self, pool_thread) -> None:
        """Kill every worker and let the pool's thread end, even one reading half of a dead worker's result."""
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.join(timeout=10)
        self._unblock_results()
        if pool_thread is not None:
            pool_thread.join(timeout=10)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _describe(code: int | None) -> str:
    if code is None:
        return "unknown"
    if code < 0 and -code in signal.valid_signals():
        return f"{code} ({signal.Signals(-code).name}{', out of memory?' if code == -signal.SIGKILL else ''})"
    return str(code)


class Threads:
    """Encoding in this process's threads (tiktoken releases the GIL), with the interface of Processes."""

    def __init__(self, tok: Tokenizer, dtype, workers: int):
        self.tok, self.dtype, self.workers = tok, dtype, workers
        self.executor = ThreadPoolExecutor(workers)

    def submit(self, pieces: list[tuple[str, bool]], where: str) -> Callable[[], np.ndarray]:
        return self.executor.submit(encode_pieces, self.tok, pieces, self.dtype).result

    def __enter__(self) -> Threads:
        return self

    def __exit__(self, *exc) -> None:
        self.executor.shutdown(cancel_futures=True)


# ---------------------------------------------------------------------------------------------- in a worker

_worker: tuple[Tokenizer, str] | None = None  # this worker's tokenizer and token dtype


def _start_worker(spec: str, encoding, hf: dict | None, dtype: str, parent: int) -> None:
    global _worker
    for sig in STOPS:  # Ctrl-C, and a closed terminal's SIGHUP, reach the whole process group: the parent ends us
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # (blocked while it started: see Processes)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    _worker = (Tokenizer(spec, encoding, hf=hf), dtype)  # (an imported tokenizer's extras: its eos, NFC, added tokens)


def _watch_parent(parent: int) -> None:
    """Exit once the process that started this worker has gone without ending it (SIGKILL, the OOM killer): the
    worker is then another process's child, and nothing else would end it (its queues' other ends stay open).

    And take the SIGTERMs that the worker holds blocked (TERM): one that its parent sent (the pool ending it) ends it
    as SIGTERM does; one from elsewhere went to the process group, whose parent stops on it and ends its workers."""
    while os.getppid() == parent:
        if not TERM:
            time.sleep(WATCH_S)
        elif (sent := signal.sigtimedwait(TERM, WATCH_S)) is not None and sent.si_pid == parent:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, TERM)
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # (its default: the worker dies of it)
    os._exit(1)


def _hello() -> tuple[int, int]:
    tok = _worker[0]
    return tok.n_vocab, tok.eot


def _encode(pieces: list[tuple[str, bool]]) -> np.ndarray:
    tok, dtype = _worker
    return encode_pieces(tok, pieces, dtype)
