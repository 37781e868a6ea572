"""lm: a JAX/Flax trainer for decoder-only language models (pretrain, sample, fine-tune).

Importing lm changes no process-wide state; the command-line entry points (lm.errors.cli) do that.
"""
