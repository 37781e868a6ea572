"""python sample.py [RUN_DIR] --prompt "ROMEO:" [--stream] ...  (see lm/sampling.py)"""

import sys

from lm.sampling import main

if __name__ == "__main__":
    sys.exit(main())
