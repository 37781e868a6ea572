"""python train.py [configs/X.yaml] [section.key=value ...]  (see lm/train.py)"""

if __name__ == "__main__":  # the import waits: prepare's spawned workers re-run this file (lm/encode_workers.py)
    import sys

    from lm.scripts import train

    sys.exit(train())
