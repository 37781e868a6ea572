"""The console scripts (pyproject's [project.scripts]), train.py and sample.py: each imports its command only
when it runs.

prepare's tokenizer workers are spawned processes, and a spawned process re-runs its parent's main script
(lm/encode_workers.py): a script that imported lm.train at its top would load JAX into every worker. The import
takes a second or two (JAX); a Ctrl-C during it is held until the import is done (raised there, it could land in
a callback of JAX's that swallows it, and the command ran on) and then ends as one during the command does
("interrupted", 130), not in a traceback. The same holds for `python -m lm.X`, whose module imports JAX at its
top (hold_for_module).
"""

import importlib
import os
import shlex
import signal
import sys


def command_line(name: str) -> str:
    """How the user runs command `name` (train, sample) from where this process was started: `lm-NAME` under a
    console script, or where lm is installed without its checkout (`python -m lm.train`, the Python API: there is
    no NAME.py to run), else `python NAME.py`."""
    console = os.path.basename(sys.argv[0]).startswith("lm-")
    if console or not _in_checkout(name):
        return f"lm-{name}"
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), f"{name}.py")
    here = os.path.isfile(f"{name}.py") and os.path.samefile(f"{name}.py", script)
    return f"python {name}.py" if here else f"python {shlex.quote(script)}"  # a command that runs where it is pasted


def _in_checkout(name: str) -> bool:
    """Whether lm runs from its checkout, which holds NAME.py beside lm/."""
    return os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), f"{name}.py"))


_HELD: dict = {}  # while a command imports: the Ctrl-C handler hold_interrupts replaced, and whether one came


def hold_interrupts() -> None:
    """Hold a Ctrl-C until release_interrupts (the command's import is done). A second one while held ends the
    process at once, as "interrupted" with 130: an import that hangs can still be stopped. (Raised as
    KeyboardInterrupt, it landed in JAX's callbacks, which swallowed it, or in a traceback from an import.)
    Nothing is written before the command runs, so there is nothing to clean up."""
    if "previous" in _HELD:
        return

    def held(signum, frame):
        if _HELD.get("came"):
            os.write(2, b"interrupted\n")
            os._exit(130)
        _HELD["came"] = True

    _HELD["previous"] = signal.signal(signal.SIGINT, held)


def release_interrupts() -> bool:
    """Ctrl-C handled as before hold_interrupts again; whether one came while held."""
    if "previous" not in _HELD:
        return False
    signal.signal(signal.SIGINT, _HELD.pop("previous"))
    return bool(_HELD.pop("came", False))


def hold_for_module() -> None:
    """Under `python -m lm.X` (called by lm/__init__.py while Python locates the module, before the module's own
    imports run): hold a Ctrl-C until the command's entry point (lm.errors.cli) starts, which then ends it as
    "interrupted" with 130. Any other process that imports lm is left alone."""
    if sys.argv[:1] != ["-m"]:  # (Python's sys.argv while it locates a -m module)
        return
    args = sys.orig_argv
    flag = next((i for i, a in enumerate(args) if a.startswith("-m")), None)
    if flag is None:
        return
    module = args[flag][2:] or (args[flag + 1] if flag + 1 < len(args) else "")
    if module.startswith("lm."):
        hold_interrupts()


def _command(module: str) -> int:
    hold_interrupts()
    try:
        main = importlib.import_module(module).main
    finally:
        interrupted = release_interrupts()
    if interrupted:
        print("interrupted", file=sys.stderr)
        return 130
    return main()


def train() -> int:
    return _command("lm.train")


def sample() -> int:
    return _command("lm.sampling.cli")


def export() -> int:
    return _command("lm.export")


def serve() -> int:
    return _command("lm.serve.cli")
