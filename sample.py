"""python sample.py [RUN_DIR] --prompt "ROMEO:" [--stream] ...  (see lm/sampling/)"""

import sys

from lm.sampling.cli import main

if __name__ == "__main__":
    sys.exit(main())
