"""The console scripts (pyproject's [project.scripts]): each imports its command only when it runs.

prepare's tokenizer workers are spawned processes, and a spawned process re-runs its parent's main script
(lm/encode_workers.py): a script that imported lm.train at its top would load JAX into every worker.
"""


def train() -> int:
    from lm.train import main

    return main()


def sample() -> int:
    from lm.sampling.cli import main

    return main()


def export() -> int:
    from lm.export import main

    return main()


def serve() -> int:
    from lm.serve.cli import main

    return main()
