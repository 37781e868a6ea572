"""python -m lm.serve: see lm.serve.cli."""

import sys

from lm.scripts import serve

sys.exit(serve())
