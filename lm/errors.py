"""User errors: one clear line on stderr and a non-zero exit instead of a traceback."""

from __future__ import annotations

import functools
import os
import sys


class UserError(Exception):
    """A mistake the user can fix; the message is one line that says what is wrong and how to fix it."""


def cli(main):
    """Wrap a command-line entry point: UserError (and Ctrl-C) become one line and exit code 2 (130).

    `--debug` anywhere on the command line, or LM_DEBUG=1, shows the full traceback instead.
    """

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in argv or os.environ.get("LM_DEBUG") == "1"
        argv = [a for a in argv if a != "--debug"]
        try:
            return main(argv) or 0
        except UserError as e:
            if debug:
                raise
            print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            if debug:
                raise
            print("interrupted", file=sys.stderr)
            return 130

    return wrapper
