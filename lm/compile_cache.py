"""JAX's persistent compilation cache as lm's commands use it (train.py's train.compile_cache; sample.py's,
lm.serve's and lm.eval's --compile-cache; ~/.cache/lm/jax by default): a rerun, resume or restart reads its
compiled programs instead of compiling them again.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from collections.abc import Callable

import jax
from jax.experimental.compilation_cache import compilation_cache

from lm import storage
from lm.config import TrainConfig
from lm.errors import UserError, at_end
from lm.files import probe_writable, why_not_made


def use(directory: str, setting: str = "train.compile_cache") -> None:
    """Keep compiled programs in `directory`, so that resuming or rerunning a run (or sampling or serving a model
    again) does not compile them again; "" keeps none (the process's own setting, JAX_COMPILATION_CACHE_DIR's,
    stands). `setting`: the option that names it, in the lines that say what is wrong.

    JAX opens its cache once, at the first compile after its directory is set: another run of the same process
    (from Python) that names another directory, or none, resets it (JAX's own reset_cache), to be opened again.
    Programs that compile in under half a second are not kept, unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS
    says otherwise. A directory that cannot be written (a read-only home, as in many containers) is one warning, and
    the run compiles without it (JAX warned at every compile, with its source line)."""
    current = jax.config.jax_compilation_cache_dir
    wanted = storage.user_path(directory)  # (~/x, file:///x)
    if directory:
        try:
            if storage.is_url(wanted):  # (JAX reads and writes a bucket itself: no local directory of that name)
                storage.check_writable(wanted, setting, f"-{jax.process_index()}")
            else:
                probe_writable(wanted)
        except (OSError, UserError) as e:
            if jax.process_index() == 0:
                why = str(e) if isinstance(e, UserError) else why_not_made(wanted, e)
                print(f"warning: {setting}={directory} cannot be written ({why}): "
                      f"compiling without it; set {setting} to a writable directory, or '' for none",
                      file=sys.stderr)  # fmt: skip
            directory = ""
    floor = jax.config.jax_persistent_cache_min_compile_time_secs
    _STATE["setting"] = setting
    if directory:
        _STATE.setdefault("before", current)
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            _STATE.setdefault("floor", floor)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_FLOOR_S)  # only what is worth a file
    else:
        wanted = _STATE.get("before", current)
        if "floor" in _STATE and floor == CACHE_FLOOR_S:  # lm's floor, unchanged since: the process's own again
            jax.config.update("jax_persistent_cache_min_compile_time_secs", _STATE.pop("floor"))
    if wanted != current:
        jax.config.update("jax_compilation_cache_dir", wanted)
        compilation_cache.reset_cache()
    if directory and not storage.is_url(wanted) and not hasattr(warnings.showwarning, "lm_compile_cache"):
        warnings.showwarning = _damaged_entries_removed(warnings.showwarning)
    if directory and not storage.is_url(wanted) and jax.config.jax_compilation_cache_max_size > 0:
        _access_times_given(wanted)


def _access_times_given(directory: str) -> None:
    """Give each entry of a local compilation cache that JAX bounds (JAX_COMPILATION_CACHE_MAX_SIZE) and that has no
    access time (an entry kept while the cache was unbounded, as lm keeps it by default) its modification time as
    one: JAX's eviction reads every entry's, and one missing failed every later write, each a warning that lm
    turned into "cannot keep PROGRAM ...: free space there" and a program compiled again at every run."""
    with contextlib.suppress(OSError):  # (a directory gone or unreadable: JAX's own warnings say so)
        for entry in os.scandir(directory):
            stamp = os.path.join(directory, entry.name.removesuffix("-cache") + "-atime")
            # (an entry another run removed meanwhile, or gave an access time, is left as it is)
            with contextlib.suppress(FileNotFoundError, FileExistsError):
                if entry.name.endswith("-cache") and not os.path.exists(stamp):
                    written = entry.stat().st_mtime_ns
                    with open(stamp, "xb") as f:
                        f.write(written.to_bytes(8, "little"))


_DAMAGED = re.compile(r"Error (reading|writing) persistent compilation cache entry for '([^'/]+)': (.*)", re.S)


def _damaged_entries_removed(show: Callable) -> Callable:
    """warnings.showwarning, but JAX's warning that an entry of the local compilation cache cannot be read (a file
    cut short) or written (a full disk, which leaves it cut short) removes that program's entries and is one line:
    JAX compiles it again and, the entry gone, keeps it anew where it can (it never writes over an entry, so every
    later run compiled it again, each with JAX's two-line warning)."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        found, directory = _DAMAGED.fullmatch(str(message)), jax.config.jax_compilation_cache_dir
        if not found or not directory or storage.is_url(directory) or not os.path.isdir(directory):
            return show(message, category, filename, lineno, file, line)
        doing, name, why = found.groups()
        entry = re.compile(re.escape(name) + r"(-[0-9a-f]{64})?-cache")
        entries = list(filter(entry.fullmatch, os.listdir(directory)))
        if doing == "reading" and not entries:  # (named otherwise than JAX 0.10 and 0.11 name them: left to JAX)
            return show(message, category, filename, lineno, file, line)
        for file_name in entries:
            with contextlib.suppress(FileNotFoundError):  # (another run removed it first)
                os.remove(os.path.join(directory, file_name))
        if jax.process_index() == 0:
            option = _STATE.get("setting", "train.compile_cache")
            said = (f"held a damaged entry for {name} ({why.splitlines()[0]}): removed, compiled again"
                    if doing == "reading" else f"cannot keep {name} ({why.splitlines()[0]}): compiled without it; "
                    f"free space there, or set {option} to another directory, or '' for none")  # fmt: skip
            print(f"warning: the compilation cache {directory} {said}", file=sys.stderr)

    showwarning.lm_compile_cache = True  # type: ignore[attr-defined]
    return showwarning


_STATE: dict = {}  # "before", "floor": JAX's cache directory and its minimum compile time before a command of
# this process first set them; "setting": the option that named the cache last; "command": both as they were before
# the running command (for_command), given back as it ends
CACHE_FLOOR_S = 0.5  # the compile time below which a program is not kept (JAX's own floor: 1 s)


def for_command(directory: str, setting: str = "--compile-cache") -> None:
    """`use` for a command's run (sample.py's, lm.serve's, lm.eval's): once the command ends, the process's cache
    settings are as they were before it, so that its main called from Python leaves them as it found them."""
    config = jax.config
    _STATE.setdefault("command", (config.jax_compilation_cache_dir, config.jax_persistent_cache_min_compile_time_secs))
    at_end(_command_ended)
    use(directory, setting)


def _command_ended() -> None:
    before = _STATE.pop("command", None)
    if before is None:
        return
    directory, floor = before
    if jax.config.jax_persistent_cache_min_compile_time_secs != floor:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", floor)
    if jax.config.jax_compilation_cache_dir != directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        compilation_cache.reset_cache()


def add_option(parser) -> None:
    """A command's --compile-cache DIR (sample.py's, lm.serve's, lm.eval's): `use`'s directory, train.compile_cache's
    default."""
    parser.add_argument(
        "--compile-cache", metavar="DIR", default=TrainConfig.compile_cache,
        help=f"keep compiled programs here (a local directory or a bucket's URL), so that the next run reads them "
        f"instead of compiling again; '' = off ({TrainConfig.compile_cache}, as train.compile_cache)",
    )  # fmt: skip
