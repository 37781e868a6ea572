"""lm: a JAX/Flax trainer for decoder-only language models (pretrain, sample, fine-tune).

Importing lm changes no process-wide state; the command-line entry points (lm.errors.cli) do that. The one
exception is `python -m lm.X`, whose module imports JAX before its entry point runs: a Ctrl-C is held from here
until then (lm.scripts.hold_for_module).
"""

from lm.scripts import hold_for_module as _hold_for_module

_hold_for_module()
