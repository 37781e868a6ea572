"""python train.py [configs/X.yaml] [section.key=value ...]  (see lm/train.py)"""

import sys

from lm.train import main

if __name__ == "__main__":
    sys.exit(main())
