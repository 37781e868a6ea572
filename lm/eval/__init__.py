"""Evaluation beyond validation loss: multiple-choice accuracy, perplexity and bits per byte, in training or after.

    python -m lm.eval RUN_DIR|hf:DIR --task arc_easy.jsonl --text wiki.txt       # a table, and the JSON
    python train.py ... train.eval_tasks=[arc_easy.jsonl]                       # accuracy at every evaluation
    python -m lm.eval.harness --model lm --model_args path=RUN_DIR --tasks ...  # EleutherAI's lm-evaluation-harness

The package, one job a module:
    scoring.py    log-likelihoods of token sequences, batched, padded and jitted; the window's truncation
    tasks.py      task files (JSONL), their accuracy and length-normalised accuracy; perplexity of text
    harness.py    the lm-evaluation-harness model class (optional extra: pip install 'lm[eval]') and its CLI
    __main__.py   the python -m lm.eval command line
"""
