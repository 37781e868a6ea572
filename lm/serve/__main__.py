"""python -m lm.serve: see lm.serve.cli."""

import sys

from lm.serve.cli import main

sys.exit(main())
