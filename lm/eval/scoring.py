"""Log-likelihoods of token sequences under a model, batched, padded and jitted: what every score of lm.eval
(multiple-choice accuracy, perplexity, the lm-evaluation-harness adapter) is computed from.

    scorer = Scorer(params, model_cfg, batch_size=16, mesh=mesh, n_vocab=tokenizer.n_vocab)
    [(logprob, top), ...] = scorer.score([Request(tokens, n_scored), ...])

A Request is a token sequence whose last `n_scored` tokens are scored: log p(token | every token before it),
summed; `top` says whether each of them was also the model's most likely next token (lm-eval's is_greedy).
Requests are sorted longest first and run `batch_size` rows at a time (fewer requests than that: as many rows as
they need up to a power of two, whole on every device), each batch right-padded to one of four lengths an octave
(padded_length: 160, 192, 224, 256, 320, ...), so that a whole task compiles a few shapes and pads at most a quarter
of its positions (powers of two, which pad up to half, were 19% slower on a HellaSwag-like task:
benchmarks/eval_scoring.py); padding sits after a row's tokens, where a causal model's earlier positions cannot see
it, and short batches are filled with empty rows. A row's result therefore does not depend on the batch size, the
padding or its neighbours (up to float32 rounding of differently shaped matmuls). The head and its log-softmax run a
chunk of positions at a time (lm.loss.chunked_token_scores): the float32 logits of a whole batch never exist at once.

The window: a model sees at most max_seq_len tokens, so a request has at most max_seq_len + 1 (the first is
only ever a condition). `fit` truncates the way lm-evaluation-harness does: the last max_seq_len + 1 tokens
of context + continuation are kept, so a long context loses its beginning; a continuation that alone is
longer than the window cannot be scored and is an error. `rolling` splits a long text into windows that
score every token once (perplexity).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lm import platform, sharding
from lm.config import ModelConfig
from lm.errors import UserError
from lm.loss import chunked_token_scores
from lm.model import Transformer, head_kernel

MIN_LENGTH = 16  # the shortest padded length


def padded_length(n: int, window: int) -> int:
    """n rounded up to the next of four lengths an octave (multiples of a quarter of n's power of two), at least
    MIN_LENGTH and at most the window."""
    step = max(MIN_LENGTH // 4, (1 << (max(n, 1).bit_length() - 1)) // 4)
    return min(window, max(MIN_LENGTH, -(-n // step) * step))


@dataclasses.dataclass(frozen=True)
class Request:
    tokens: tuple[int, ...]  # the condition, then the scored tokens; at most window + 1
    n_scored: int  # how many of the last tokens are scored (>= 1, < len(tokens))


def fit(context: Sequence[int], continuation: Sequence[int], window: int, where: str = "") -> Request:
    """The request scoring `continuation` after `context` (at least one token), truncated on the left to the
    last window + 1 tokens as lm-evaluation-harness does. `where` names the record in the error a continuation
    longer than the window raises."""
    if not context:
        raise ValueError("a request needs at least one context token")
    if not continuation:
        raise UserError(f"{where}: a choice encodes to no tokens; give every choice some text")
    if len(continuation) > window:
        raise UserError(
            f"{where}: a choice is {len(continuation)} tokens, longer than the model's window of {window}; "
            "shorten it or drop the record"
        )
    return Request(tuple([*context, *continuation][-(window + 1) :]), len(continuation))


def rolling(tokens: Sequence[int], first: int, window: int, stride: int = 0) -> list[Request]:
    """Requests that score every token of `tokens` once, the first conditioned on `first` (end-of-text or BOS:
    the start of a document). Each request holds up to window + 1 tokens and scores the `stride` tokens after
    the previous one's, conditioned on the window's tokens before them (stride = window, the default 0: disjoint
    windows, lm-eval's loglikelihood_rolling; a smaller stride gives every token more context, at more cost)."""
    stride = stride or window
    if not 1 <= stride <= window:
        raise UserError(
            f"the stride must be in [1, {window}] (the model's window; 0, the default, is the window), got {stride}"
        )
    seq = [first, *tokens]
    requests, end = [], 1  # seq[:end] is scored (the first token is only a condition)
    while end < len(seq):
        new_end = min(len(seq), window + 1 if end == 1 else end + stride)
        requests.append(Request(tuple(seq[max(0, new_end - window - 1) : new_end]), new_end - end))
        end = new_end
    return requests


def _scores(model_cfg: ModelConfig, merge, n_vocab, params, frozen, inputs_BT, targets_BT, mask_BT):
    """(sum of the masked tokens' log-probabilities [B], whether each was the most likely token [B]), over the
    tokenizer's `n_vocab` ids."""
    if merge is not None:
        params = merge(params, frozen)
    x_BTD = Transformer(model_cfg, deterministic=True).apply(params, inputs_BT, head=False)
    # Positions whose float32 logits exist at once (lm.loss), within the platform's bound for the whole batch's rows
    rows, n_positions = x_BTD.shape[:2]
    chunk = platform.auto_loss_chunk(platform.current(), rows, model_cfg.vocab_size, "float32") or n_positions
    kernel = head_kernel(params, model_cfg)
    ce_BT, top_BT = chunked_token_scores(x_BTD, kernel, targets_BT, chunk, model_cfg.dtype, n_vocab)
    return -(ce_BT * mask_BT).sum(axis=1), jnp.all(top_BT | (mask_BT == 0), axis=1)


class Scorer:
    """Scores Requests with one model's parameters.

    `mesh`: the parameters' mesh (as lm.pretrained.load or the train state lay them out); the rows of each batch
    are split over its data axes, and every process of a multi-host run must call score() with the same
    requests. `frozen` and `merge`: a LoRA run's base model and how the trained adapters merge into it
    (lm.steps.model_params); the parameters are then the adapters. `n_vocab` (required: a
    library caller who left it out scored over the padding too): the tokenizer's ids; the vocabulary's padding
    beyond them (model.vocab_multiple) is left out of every softmax, so that a score is the model's over its
    tokens, as the model exported to Hugging Face format gives it."""

    def __init__(
        self,
        params: Any,
        model_cfg: ModelConfig,
        batch_size: int = 16,
        mesh=None,
        frozen: Any = None,
        merge: Callable | None = None,
        *,
        n_vocab: int,
    ):
        if batch_size < 1:
            raise UserError(f"the batch size must be >= 1, got {batch_size}")
        if not 1 <= n_vocab <= model_cfg.vocab_size:  # (ids beyond the model's rows were scored as nan)
            raise UserError(f"n_vocab={n_vocab}: the tokenizer has {n_vocab} ids but the model only "
                            f"{model_cfg.vocab_size}; give its own tokenizer's (n_vocab=tok.n_vocab)")  # fmt: skip
        self.params, self.model_cfg, self.mesh, self.frozen, self.n_vocab = params, model_cfg, mesh, frozen, n_vocab
        self.window = model_cfg.max_seq_len
        self.shards = 1 if mesh is None else sharding.batch_shards(mesh)
        self.batch_size = -(-batch_size // self.shards) * self.shards  # whole rows on every device
        out = None if mesh is None else sharding.replicated(mesh)
        self._fn = jax.jit(functools.partial(_scores, model_cfg, merge, n_vocab), out_shardings=out)

    def _place(self, arrays: dict[str, np.ndarray], batch_size: int) -> dict:
        if self.mesh is None:
            return arrays
        rows = sharding.process_rows(self.mesh, batch_size)
        return sharding.global_batch({k: v[rows] for k, v in arrays.items()}, self.mesh, batch_size)

    def score(
        self, requests: Sequence[Request], progress: Callable[[int], None] | None = None, params: Any = None
    ) -> list[tuple[float, bool]]:
        """(log-likelihood, whether every scored token was the most likely) per request, in their order.
        `progress(rows)` is called after each batch with the number of requests it scored. `params`: score with
        these instead of the scorer's own (a training run passes its current ones)."""
        params = self.params if params is None else params
        # Compared first: a request refused below on one process alone left the others waiting in this collective
        if sharding.spans_processes(self.mesh):  # (its argument alone: ~0.1 s of a core a million tokens)
            sharding.same_on_every_process(
                self.mesh, "Scorer.score", requests=[(list(map(int, r.tokens)), int(r.n_scored)) for r in requests]
            )
        for r in requests:
            if not 1 <= r.n_scored < len(r.tokens) or len(r.tokens) > self.window + 1:
                raise ValueError(f"a request of {len(r.tokens)} tokens scoring {r.n_scored} does not fit")
            bad = next((t for t in r.tokens if not 0 <= t < self.n_vocab), None)  # (scored as -inf or nan otherwise)
            if bad is not None:
                raise UserError(
                    f"a request holds token id {bad}, which is not in the tokenizer's range [0, {self.n_vocab})"
                )
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        # Fewer requests than a batch fill only the rows they need, up to a power of two (a text of one window
        # scored 16 rows, or --batch-size's thousands): every batch of the call keeps this one size, and calls of
        # other counts compile a few sizes at most.
        rows = 1 << max(len(requests) - 1, 0).bit_length()
        batch_size = min(self.batch_size, -(-rows // self.shards) * self.shards)
        for first in range(0, len(order), batch_size):
            chosen = order[first : first + batch_size]
            width = padded_length(len(requests[chosen[0]].tokens) - 1, self.window)
            arrays = {k: np.zeros((batch_size, width), np.int32) for k in ("inputs", "targets")}
            arrays["mask"] = np.zeros((batch_size, width), np.float32)
            for row, i in enumerate(chosen):
                tokens = requests[i].tokens
                n = len(tokens) - 1
                arrays["inputs"][row, :n] = tokens[:-1]
                arrays["targets"][row, :n] = tokens[1:]
                arrays["mask"][row, n - requests[i].n_scored : n] = 1.0
            with sharding.activate(self.mesh) if self.mesh is not None else contextlib.nullcontext():
                placed = self._place(arrays, batch_size)
                logprob_B, top_B = self._fn(params, self.frozen, placed["inputs"], placed["targets"], placed["mask"])
            logprob_B, top_B = np.asarray(logprob_B, np.float64), np.asarray(top_B)
            for row, i in enumerate(chosen):
                results[i] = (float(logprob_B[row]), bool(top_B[row]))
            if progress is not None:
                progress(len(chosen))
        return results

