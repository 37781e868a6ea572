"""The console scripts (pyproject's [project.scripts]), train.py and sample.py: each imports its command only
when it runs.

prepare's tokenizer workers are spawned processes, and a spawned process re-runs its parent's main script
(lm/encode_workers.py): a script that imported lm.train at its top would load JAX into every worker. The import
takes a second or two (JAX); a Ctrl-C during it is held until the import is done (raised there, it could land in
a callback of JAX's that swallows it, and the command ran on) and then ends as one during the command does
("interrupted", 130), not in a traceback.
"""

import importlib
import os
import signal
import sys


def command_line(name: str) -> str:
    """How the user runs command `name` (train, sample) from where this process was started: `lm-NAME` under a
    console script (an installed lm, whose checkout's scripts may be nowhere near), else `python NAME.py`."""
    return f"lm-{name}" if os.path.basename(sys.argv[0]).startswith("lm-") else f"python {name}.py"


def _command(module: str) -> int:
    interrupted = []
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    try:
        main = importlib.import_module(module).main
    finally:
        signal.signal(signal.SIGINT, previous)
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
