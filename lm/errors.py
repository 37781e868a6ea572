"""How every command-line entry point behaves: user errors as one line, and the process-wide settings a command
(never an import of lm) makes."""

from __future__ import annotations

import _thread
import argparse
import atexit
import codecs
import contextlib
import errno
import functools
import logging
import os
import re
import signal
import sys
import threading
import warnings


class UserError(Exception):
    """A mistake the user can fix; the message is one line that says what is wrong and how to fix it."""


class ConfigError(UserError):
    """A user mistake in the configuration; its message is one line that says how to fix it."""


class PeerLostError(UserError):
    """Another process of a multi-process job is gone (peer_lost's line), found where an error is reported as a
    UserError (a checkpoint's save): the command line's own run ends at once after the line, exit code 1, as JAX's
    shutdown at exit would wait for the lost process at a barrier (90 s and more), then abort."""


class UnjoinedError(UserError):
    """A process that gave up waiting for the others to join its job: JAX still waits in a thread of its own, and
    the interpreter's exit would shut JAX's coordination service down under it (its log lines after the error
    line, seconds later), so the command line's own run ends at once after the line."""


def plural(n: int, one: str, many: str = "") -> str:
    """`n` and the noun that agrees with it, for messages: "1 file", "2 files", "3 batches" (many="batches")."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def first_line(e: BaseException, last: bool = False) -> str:
    """One line that says what an exception was: its message's first (or `last`) line, else its type's name."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return (lines[-1] if last else lines[0]).strip()


def said(e: BaseException) -> str:
    """What an error says, in one short line (without TensorStore's pointer to details it cannot print)."""
    return re.sub(r"\s*See full TensorStore details.*", "", first_line(e))[:200]


def cut_short(text: str, width: int) -> str:
    """`text` for an error line: at most `width` characters, ending in "..." where it was cut."""
    return text if len(text) <= width else text[: width - 3] + "..."


def _out_of_memory(e: BaseException) -> bool:
    """Whether `e` is running out of memory: XLA's error, which has no type of its own (its message begins
    RESOURCE_EXHAUSTED on every backend, at compilation or when a buffer is allocated; but a computation's output
    that XLA:CPU cannot allocate as it dispatches is 'INTERNAL: Error dispatching computation: Out of memory
    allocating N bytes'), or the host's MemoryError."""
    return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e) or "Out of memory allocating" in str(e)


@contextlib.contextmanager
def fits_in_memory(what: str, fix: str, needed: float = 0):
    """Running out of memory in the block is a UserError: '<what> does not fit in the device's memory (an
    allocation of 2.2 TiB failed); <fix>'. Where `needed` bytes, known beforehand, are more than JAX's first device
    has in all (its allocator's limit; a CPU's: the host's memory), the same error comes at once, before the block's
    work: '... memory (37.0 GiB of its 23.5 GiB); <fix>'."""
    if needed:
        total = _device_memory()
        if total is not None and needed > total:
            raise UserError(
                f"{what} does not fit in the device's memory ({memory_size(needed)} of its {memory_size(total)}); {fix}"
            )
    try:
        yield
    except Exception as e:
        # (a UserError already says what failed: a checkpoint's write to a full disk quotes tensorstore's
        # RESOURCE_EXHAUSTED, which is no memory)
        if isinstance(e, UserError) or not _out_of_memory(e):
            raise
        raise UserError(f"{what} does not fit in the device's memory{_failed_allocation(e)}; {fix}") from None


def _device_memory() -> int | None:
    """Bytes of this process's first device in all: its allocator's limit, or for a CPU the host's memory; None
    where an accelerator does not say (an allocator without statistics: nothing to check beforehand)."""
    import jax

    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return stats["bytes_limit"]
    return host_memory() if device.platform == "cpu" else None


def host_memory() -> int:
    """Bytes of this host's memory in all."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_size(n: float) -> str:
    """Bytes as a short size: 812 MiB, 2.2 TiB."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 1024**power:
            return f"{n / 1024**power:.{1 if power > 2 else 0}f} {unit}"
    return f"{int(n)} B"


def _failed_allocation(e: BaseException) -> str:
    """What XLA's message says of the memory: ' (an allocation of 2.2 TiB failed)' ('allocating N bytes' on a CPU,
    'trying to allocate N bytes' on a GPU), ' (it needs 16.52G of the device's 15.48G)' (a TPU's compiler), or ''."""
    found = re.search(r"allocat\w* (\d+) ?(?:bytes|B\b)", str(e))
    if found:
        return f" (an allocation of {memory_size(int(found.group(1)))} failed)"
    found = re.search(r"allocat\w* ([\d.]+ ?[KMGT]i?B)\b", str(e))  # an allocator's own size: "allocate 1.50GiB"
    if found:
        return f" (an allocation of {found.group(1)} failed)"
    found = re.search(r"Used (\S+) of (\S+) hbm", str(e))
    return f" (it needs {found.group(1)} of the device's {found.group(2)})" if found else ""


class Stopped(BaseException):
    """A signal (SIGTERM, Ctrl-C) ended a command before it had anything to save. A BaseException, so that no
    `except Exception` on the way (one that skips a damaged checkpoint, say) mistakes it for a failure."""

    def __init__(self, signal_name: str, message: str):
        super().__init__(message)
        self.signal_name = signal_name


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, timeout, docker stop, SLURM) or SIGHUP (the terminal closed) that ends a command which has no
    checkpoint to write (train.py's own are lm.loop.Signals'): raised as a Ctrl-C is, so that the same clean-up
    runs (prepare's workers stopped, an export's staging directory removed), then one line and 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def catch_stop_signals(handler, names=("SIGTERM", "SIGINT", "SIGHUP")) -> dict:
    """handler for the stop signals named (those this platform has); the handlers it replaced, to put back. A SIGHUP
    ignored by whoever started the command (`nohup`) stays ignored. Signals are the main thread's: elsewhere, none."""
    previous = {}
    for name in names:
        sig = getattr(signal, name, None)
        if sig is None or name == "SIGHUP" and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            break
    return previous


def terminal_gone() -> None:
    """After a SIGHUP: stdout and stderr that were its terminal write nowhere from now on (writing there fails);
    ones that go to a file or a pipe go on."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # (a stream without a descriptor: left as it is)
            if os.isatty(stream.fileno()):  # (what is still buffered goes nowhere too)
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def _terminated(signum, frame):
    if signum == getattr(signal, "SIGHUP", None):
        terminal_gone()
    raise Terminated(signum)


@contextlib.contextmanager
def stop_signals_kill():
    """Within it, SIGTERM and SIGHUP that cli turns into Terminated end the process by that signal, their default:
    for a server whose own handlers stop it and then raise the signal again (a service manager reads the signal)."""
    caught = [sig for sig in (getattr(signal, name, None) for name in ("SIGTERM", "SIGHUP"))
              if sig is not None and signal.getsignal(sig) is _terminated
              and threading.current_thread() is threading.main_thread()]  # fmt: skip
    for sig in caught:
        signal.signal(sig, signal.SIG_DFL)
    try:
        yield
    finally:
        for sig in caught:
            signal.signal(sig, _terminated)


_STOP_NOTE: list = []  # what a stopped command says it kept (when_stopped)


def when_stopped(note: str) -> None:
    """What the command says after `interrupted` (or `stopped by SIGTERM`) if a signal stops it from now on: what
    it kept and how to go on."""
    _STOP_NOTE[:] = [note]


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C that stopped a run cleanly, after its checkpoint (the command that resumes it printed): raised by
    lm.train.train once the run has stopped, so that a notebook's or script's loop of runs stops too (train()
    returned, and the loop started its next run). train.py's own command ends with 0, as after SIGTERM."""

    def __init__(self, run_dir: str):
        super().__init__(f"stopped with a checkpoint: {run_dir}")
        self.run_dir = run_dir


DEBUG_NOTE = "--debug (or LM_DEBUG=1): a mistake shows its full traceback, not one line."


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are UserErrors: '<what argparse says>[; hint] (see python PROG --help)'."""

    def __init__(self, *args, hint: str = "", **kwargs):
        kwargs.setdefault("epilog", DEBUG_NOTE)
        named = "prog" in kwargs or args
        super().__init__(*args, **kwargs)
        run_as = _run_as()
        if os.path.basename(sys.argv[0]).startswith("lm-"):  # a console script (lm-train, ...): as it was run
            self.prog = os.path.basename(sys.argv[0])
        elif not named or run_as.startswith("python -m lm."):  # a script without a name of its own
            self.prog = run_as  # (configs/make_*.py; `python -m lm.train`, not train.py): as it was run
        self.hint = hint

    def add_checkpoint_choice(self) -> None:
        """--step N or --best: which checkpoint of a run (lm.pretrained.checkpoint_source)."""
        which = self.add_mutually_exclusive_group()
        which.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
        which.add_argument("--best", action="store_true", help="the checkpoint with the lowest validation loss")

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, but where a flag is mistyped and arguments are missing too, the mistyped flag is the mistake
        said (`python -m lm.export --bogus` said that its run_dir and out_dir were required)."""
        args = sys.argv[1:] if args is None else list(args)
        try:
            return super().parse_known_args(args, namespace)
        except UserError as missing:
            required = [action for action in self._actions if action.required]
            for action in required:
                action.required = False
            try:
                unknown = [a for a in super().parse_known_args(args)[1] if a.startswith("-") and a != "-"]
            except UserError:
                unknown = []
            finally:
                for action in required:
                    action.required = True
            if unknown:
                self.error(f"unrecognized arguments: {' '.join(unknown)}")
            raise missing

    def error(self, message):
        command = self.prog if self.prog.startswith(("python", "lm-")) else f"python {self.prog}"
        raise UserError(f"{message}{'; ' + self.hint if self.hint else ''} (see {command} --help)")


def _run_as() -> str:
    """How the running script was started: `python -m lm.configs.make_cloze_task` (whose usage and hints argparse
    named make_cloze_task.py, a file not in the directory where the user typed it), or the path they gave."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    script = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    if spec is not None and spec.name.rsplit(".", 1)[-1] == script and script != "__main__":
        return f"python -m {spec.name}"
    return f"python {sys.argv[0]}"


SIGPIPE_EXIT = 141  # 128 + SIGPIPE: the exit of a command whose reader went away


_AT_END: list = []  # what a command does as it ends (at_end)


def at_end(fn) -> None:
    """Call fn() once the command ends: as cli's wrapper returns (a command called from Python included), else as
    the process exits."""
    if fn not in _AT_END:
        _AT_END.append(fn)
        atexit.register(fn)


_AT_EXIT: list = []  # what the process does as it exits, also where a signal ends it (at_exit)


def at_exit(fn) -> None:
    """Call fn() as the process exits: at the interpreter's exit, or where a command ends it at once after a
    Ctrl-C or stop signal (_end), which no atexit function sees (a temporary directory stayed in /tmp)."""
    _AT_EXIT.append(fn)
    atexit.register(fn)


def cli(main):
    """Wrap a command-line entry point: UserError (and Ctrl-C) become one line and exit code 2 (130). Called with
    no arguments (the command line's own run), a Ctrl-C or stop signal ends the process at once (_end).

    `--debug` anywhere on the command line, or LM_DEBUG=1, shows the full traceback instead.
    """

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        if argv is None:  # the command line's own run
            return command(None)
        with _process_state_kept():  # a call from Python (a notebook, a script, a test)
            try:
                return command(argv)
            except SystemExit as e:  # argparse's own exit (--help): its code, not the end of the caller's process
                return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)

    def command(argv: list[str] | None) -> int:
        whole_process = argv is None
        if whole_process:
            _reopen_closed_streams()
            _escape_what_output_cannot_encode()
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in argv or os.environ.get("LM_DEBUG") == "1"
        argv = [a for a in argv if a != "--debug"]
        if not debug:
            _quiet_background_failures()
        from lm import platform, scripts  # import no JAX: the host allocator is set before JAX starts

        platform.tune_host_allocator()
        # SIGTERM and SIGHUP end the command as a Ctrl-C does (killed by them, it cleaned up nothing: prepare's
        # workers left their semaphores to the resource tracker's warning, a bucket run's copy stayed in /tmp)
        stops = catch_stop_signals(_terminated, ("SIGTERM", "SIGHUP")) if whole_process else {}
        _STOP_NOTE.clear()
        try:
            if scripts.release_interrupts():  # a Ctrl-C while `python -m lm.X` imported the command
                raise KeyboardInterrupt
            _check_working_directory()
            _check_arguments_decoded(argv)
            code = _then_at_end(main, argv) or 0
            sys.stdout.flush()  # (what a full disk refuses is said here, not by the interpreter's exit)
            return code
        except Stopped as e:
            print(str(e), file=sys.stderr)
            _silence_shutdown()
            return _end(0, whole_process)
        except UserError as e:
            if debug:
                raise
            print(f"error: {e}", file=sys.stderr)
            _silence_shutdown()
            if isinstance(e, PeerLostError):
                return _end(1, whole_process)
            return _end(2, whole_process) if isinstance(e, UnjoinedError) else 2
        except BrokenPipeError:  # what reads the output went away (`sample.py | head`): stop quietly, as Unix tools do
            _silence_shutdown()
            if whole_process:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is still buffered goes nowhere
            return _end(SIGPIPE_EXIT, whole_process)
        except OSError as e:  # (one that no part of lm turned into a UserError) where there is no room to write
            if debug or e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            print(f"error: cannot write {e.filename or 'the output'}: {e.strerror}; free space (or write elsewhere), "
                  "then run the command again", file=sys.stderr)  # fmt: skip
            _silence_shutdown()
            if whole_process:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is still buffered goes nowhere
            return 2
        except KeyboardInterrupt as e:
            if debug:
                raise
            said = f"stopped by {e.args[0]}" if isinstance(e, Terminated) else "interrupted"
            with contextlib.suppress(OSError):  # (a terminal gone since)
                print(said + "".join(f"; {note}" for note in _STOP_NOTE), file=sys.stderr)
            _silence_shutdown()
            return _end(128 + (e.signum if isinstance(e, Terminated) else signal.SIGINT), whole_process)
        except UnicodeError as e:  # non-ASCII text (a path, a prompt) where Python's locale encoding is ASCII
            if debug or not _narrow_encoding():
                raise
            print(f"error: {first_line(e)}: {_narrow_encoding()}", file=sys.stderr)
            _silence_shutdown()
            return 2
        except Exception as e:
            lost = peer_lost(e)
            failure = "" if debug or lost or "jax" not in sys.modules else backend_failure()
            if failure:  # what failed was starting JAX
                print(f"error: {failure}", file=sys.stderr)
                _silence_shutdown()
                return 2
            if debug or not lost:
                raise
            print(f"error: {lost}", file=sys.stderr)
            _silence_shutdown()
            # Ended here, not by the interpreter's exit: JAX's shutdown at exit waits for the lost process at a
            # barrier until its heartbeat times out (90 s and more), then aborts the process.
            return _end(1, whole_process)
        finally:
            _STOP_NOTE.clear()
            for sig, handler in stops.items():
                signal.signal(sig, handler)

    return wrapper


@contextlib.contextmanager
def ctrl_c_kept():
    """A Ctrl-C within the block ends the command (KeyboardInterrupt), also where code it lands in swallows the
    KeyboardInterrupt (JAX's callbacks) or reports it as another error: at the end of the block at the latest. (A
    server's start-up: one swallowed while it loaded or compiled left it serving.)"""
    came = []

    def handle(signum, frame):
        came.append(signum)
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, handle)
    except ValueError:  # not the main thread: signals are the main thread's
        yield
        return
    try:
        yield
    except BaseException:
        if came:
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if came:
        raise KeyboardInterrupt


QUIETED_LOGGERS = ("absl", "asyncio", "gcsfs")  # their error logs: see _quiet_background_failures


@contextlib.contextmanager
def _process_state_kept():
    """A command called from Python leaves the process's error reporting as it found it: the hooks and log levels
    that _quiet_background_failures and _silence_shutdown set for the command's own process (a notebook's
    threads' exceptions were swallowed after one failed command), and the warnings filters."""
    hooks = threading.excepthook, sys.unraisablehook
    levels = {name: logging.getLogger(name).level for name in QUIETED_LOGGERS}
    with warnings.catch_warnings():
        try:
            yield
        finally:
            threading.excepthook, sys.unraisablehook = hooks
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


def undecodable(text: str) -> bool:
    """Whether text (a path, an argument) holds bytes that the filesystem's encoding could not decode: Python keeps
    them as lone surrogates, which no UTF-8 file (a config, a checkpoint's metadata) can hold."""
    return any("\udc80" <= c <= "\udcff" for c in text)


def _check_working_directory() -> None:
    """Every relative path (runs/, the data cache, a prompt file) is taken from the working directory: one deleted
    under the shell is one line, not a FileNotFoundError wherever a path is first made absolute."""
    try:
        where = os.getcwd()
    except FileNotFoundError:
        raise UserError(
            "the current directory no longer exists (it was deleted while the shell was in it); cd into an existing "
            "directory and run the command again"
        ) from None
    if undecodable(where) and not _narrow_encoding():  # (an ASCII locale's: below)
        raise UserError(
            f"the current directory's path {ascii(where)} has bytes that are not UTF-8 in its name (lm writes its "
            "paths as UTF-8 text); rename it, or run from another directory"
        )


def _narrow_encoding() -> str:
    """Where Python reads paths, arguments and the environment in an encoding other than UTF-8 (a locale such as
    LC_ALL=C with PYTHONUTF8=0 and PYTHONCOERCECLOCALE=0, which holds ASCII only), what to do about it; else ""."""
    encoding = sys.getfilesystemencoding()
    if codecs.lookup(encoding).name == "utf-8":
        return ""
    return (
        f"Python runs here with the locale's {encoding} encoding, which cannot hold all text; run with PYTHONUTF8=1 "
        "(or in a UTF-8 locale, such as LC_ALL=C.UTF-8)"
    )


def _check_arguments_decoded(argv: list[str]) -> None:
    """An argument that the locale's encoding could not decode (Python keeps its bytes as surrogates, which no
    file, prompt or config can hold) is one line, before anything is written with it. (In UTF-8, such an argument
    is not text: a path may be so named, and a prompt's check says what is wrong with it.)"""
    if not _narrow_encoding():
        return
    for arg in argv:
        if undecodable(arg):
            shown = os.fsencode(arg).decode("utf-8", "replace")
            raise UserError(f"the argument {shown!r} is not {sys.getfilesystemencoding()} text: {_narrow_encoding()}")


def _escape_what_output_cannot_encode() -> None:
    """stdout and stderr in an encoding that cannot hold a character (an ASCII locale) write it as an escape
    (\\xe9) instead of raising in the middle of a sample or of an error message."""
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None)
        if encoding and codecs.lookup(encoding).name != "utf-8" and hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="backslashreplace")


def _reopen_closed_streams() -> None:
    """A stdin, stdout or stderr the shell closed (`<&-`, `>&-`, `2>&-`) becomes /dev/null: Python left it None
    (the command did all its work, then failed on flushing stdout; `--prompt -` failed on reading stdin), and the
    file a command opened next would take the free descriptor, and be written by whatever writes there (XLA's
    logging)."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):  # (a closed stdin reads as empty)
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if opened != fd:  # (the lowest free descriptor, which another closed one may be)
                os.dup2(opened, fd)
                os.close(opened)
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))


def _then_at_end(main, argv: list[str]):
    try:
        return main(argv)
    finally:
        for fn in _AT_END:
            fn()


def backend_failure() -> str:
    """One line saying why JAX cannot start the backend JAX_PLATFORMS names (a GPU or TPU platform on a host
    without one, a platform whose plugin is not installed), else "". Starts the backend if nothing has yet: call it
    where an error may have come from starting JAX, before blaming what was being read (a checkpoint)."""
    import jax

    try:
        jax.devices()
    except Exception as e:  # RuntimeError "Unable to initialize backend ...", or a bare AssertionError for cuda
        said = str(e).strip().splitlines()[0].split(" (set JAX_PLATFORMS=")[0][:300] if str(e).strip() else ""
        return (
            f"JAX cannot start a backend for JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}"
            f"{f' ({said})' if said else ''}; set JAX_PLATFORMS to a platform this machine has (cpu, cuda with "
            "jax[cuda12] installed, tpu), or unset it to let JAX choose"
        )
    return ""


# What JAX's runtime says when a collective or the job's coordination lost a process (killed, crashed, or stopped
# on its own): Gloo's connection errors on CPUs, the coordination service's on any backend.
_PEER_LOST = re.compile(r"gloo|connection (reset|refused|closed)|heartbeat|incarnation|UNAVAILABLE|socket closed", re.I)


def peer_lost(e: BaseException) -> str:
    """The one line for an error of a multi-process job that says another of its processes is gone, else ""."""
    jax = sys.modules.get("jax")  # (imported only where a command has started JAX)
    if jax is None or not isinstance(e, jax.errors.JaxRuntimeError) or not jax.distributed.is_initialized():
        return ""
    if not _PEER_LOST.search(str(e)):
        return ""
    said = first_line(e)[:200]  # (a message that matched)
    return (
        f"another process of this job stopped or cannot be reached ({said}); stop every process and start them all "
        "again with the same command: they resume from the last complete checkpoint"
    )


def _quiet_background_failures() -> None:
    """Library threads that die (a checkpoint or TensorBoard writer on a full disk) get one warning line
    instead of a traceback; orbax's, asyncio's and gcsfs's error logs (a request it gave up on, with its traceback)
    are left out, as the error they lead to is reported."""
    for name in QUIETED_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)

    def excepthook(args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread else "a background thread"
        print(f"warning: {name} failed: {args.exc_type.__name__}: {args.exc_value}", file=sys.stderr)

    threading.excepthook = excepthook
    seen = set()

    def unraisablehook(unraisable) -> None:  # e.g. a writer's callback into an event loop already closed
        if isinstance(unraisable.exc_value, Stopped):
            return  # a start-up signal handled inside a finalizer, which cannot raise: start-up stops at its next check
        if isinstance(unraisable.exc_value, KeyboardInterrupt):  # a Ctrl-C inside a finalizer (JAX's GC callback)
            # Raised again in the main thread once this hook has returned (raised in it, it would be lost again):
            # the command stops, as it would have.
            threading.Timer(0.05, _thread.interrupt_main).start()
            return
        if unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed":
            return  # a storage client's connections closed after their event loop ended, at exit: nothing lost
        line = f"{unraisable.exc_type.__name__}: {said(unraisable.exc_value)}"  # (TensorStore's: 60 lines of spec)
        if line not in seen:
            seen.add(line)
            print(f"warning: ignored error in a background callback: {line}", file=sys.stderr)

    sys.unraisablehook = unraisablehook


def _end(code: int, whole_process: bool) -> int:
    """After a Ctrl-C, a stop signal during start-up or a reader gone: `code`, and in the command line's own run
    the end of the process here, once the command's own clean-up (its `finally` blocks: logs closed, checkpoints
    waited for) has run. An interrupt can leave XLA compiling on in a thread of its own (jaxlib waits for a
    compilation in a way a Ctrl-C interrupts) or a computation running; the interpreter's exit then tore JAX down
    under it, and the process died of SIGABRT or SIGSEGV after "interrupted" instead of exiting with 130. Nothing
    is left to write by then."""
    if not whole_process:
        return code
    for fn in _AT_EXIT:  # (os._exit runs no atexit function)
        with contextlib.suppress(Exception):
            fn()
    with contextlib.suppress(OSError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _silence_shutdown() -> None:
    """After the one error line, nothing more: background writers failing as the process exits stay quiet."""
    sys.unraisablehook = lambda unraisable: None
    threading.excepthook = lambda args: None
    # (an orbax save cut short leaves coroutines never awaited, which Python names as it exits)
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
