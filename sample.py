"""python sample.py [RUN_DIR] --prompt "ROMEO:" [--stream] ...  (see lm/sampling/)"""

if __name__ == "__main__":  # the import waits, as in train.py
    import sys

    from lm.scripts import sample

    sys.exit(sample())
