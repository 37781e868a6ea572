"""The sampling rules: how each row's next token is chosen from its logits.

    Greedy()                                  the most likely token
    Random(temperature, top_k=0, top_p=None)  a draw from softmax(logits / temperature), over the top_k most
                                              likely tokens (0 = all), then over their nucleus of mass top_p
                                              (None = all)

A rule is a frozen dataclass and a JAX pytree, passed to the jitted decoding functions as an ordinary
argument: its class, top_k and whether top_p is None are the tree's structure, so they select the compiled
code, while temperature and top_p are its leaves, traced arrays, so another temperature or top_p value runs
the same code. `from_settings` makes the rule of generate's settings and turns every filter that keeps all
tokens off, so that it compiles no filter.

`draw_rows` is the same choice with each row's own settings as arrays (temperature 0 = greedy, top_p 1 = off),
for a batch whose rows belong to different requests (lm.sampling.slots): a row draws exactly the token `draw`
gives under its settings' rule, whatever the other rows' settings are.

`penalized` is OpenAI's frequency and presence penalties and logit bias: each row's logits less what the tokens it
has drawn so far cost, plus its bias, applied before draw_rows.

`logprobs` is what a server reports of a drawn token: its log-probability under the model's distribution at that
step (log_softmax of the logits over the real ids, before temperature, top-k and top-p, as OpenAI and vLLM report
it), and the TOP_LOGPROBS most likely ids with theirs.

Randomness. Row r draws with jax.random.key(seeds_B[r]) folded with the index of the token being drawn, so
a row's tokens depend on its own seed and logits only, not on the other rows of the batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

NEG = float(np.finfo(np.float32).min)  # logit of a token that must not be drawn: finite, so no inf - inf
TOP_LOGPROBS = 20  # the most likely ids `logprobs` gives (OpenAI's most top_logprobs): a request takes its first N


@flax.struct.dataclass
class Greedy:
    """The most likely token (temperature 0), picked by jnp.argmax or by first_max (lm.platform's greedy)."""

    first_max: bool = flax.struct.field(pytree_node=False, default=False)


@flax.struct.dataclass
class Random:
    """A draw from softmax(logits / temperature), filtered by top_k (0 = off) and then top_p (None = off)."""

    temperature: Any  # float32 > 0
    top_p: Any = None  # float32 in [0, 1), or None
    top_k: int = flax.struct.field(pytree_node=False, default=0)


Rule = Greedy | Random


class Vocab(NamedTuple):
    """The ids a draw may give: those below `size` (the tokenizer's n_vocab; the rest of the model's vocabulary is
    padding) but `unused` (ids below n_vocab that are no token: a named tiktoken encoding's gaps). Hashable, so it
    is a static argument of the jitted decoding functions."""

    size: int
    unused: tuple[int, ...] = ()

    @classmethod
    def of(cls, tokenizer) -> Vocab:
        return cls(tokenizer.n_vocab, tuple(sorted(tokenizer.unused_ids)))

    def drawable(self, width: int) -> jax.Array:
        """bool [width]: the ids of a model's logits that may be drawn."""
        ok_V = jnp.arange(width) < self.size
        return ok_V.at[np.asarray(self.unused, np.int32)].set(False) if self.unused else ok_V


def from_settings(temperature: float, top_k: int, top_p: float, n_vocab: int, greedy: str = "argmax") -> Rule:
    """The rule of generate's settings (temperature 0 = greedy, top_k 0 = off, top_p 1 = off), for a
    tokenizer of n_vocab ids; `greedy` is the platform's pick (lm.platform.Platform.greedy). The values become
    float32 whatever the caller passed (1 or 1.0), as a leaf of another dtype would compile anew."""
    if np.float32(temperature) == 0:  # (1e-50 too: float32 has no such number)
        return Greedy(first_max=greedy == "first_max")
    return Random(
        temperature=np.float32(temperature),
        top_p=np.float32(top_p) if top_p < 1 else None,
        top_k=top_k_of(top_k, n_vocab),
    )


def top_k_of(top_k: int, n_vocab: int) -> int:
    """The top_k a rule compiles: 0 (off) where it keeps every token, so that the draw is the unfiltered one."""
    return 0 if top_k >= n_vocab else top_k


def candidates(logits_BV: jax.Array, top_k: int = 0, top_p: Any = None) -> tuple[jax.Array, jax.Array]:
    """(logits_BK, ids_BK): the tokens top-k then top-p sampling may draw, most likely first.

    top_k keeps the k largest logits (0 = all). top_p then keeps the shortest run of most likely
    tokens whose probability reaches top_p, the token that crosses it included (so always at
    least one); the logits of the others become NEG. None skips top-p.
    """
    logits_BK, ids_BK = jax.lax.top_k(logits_BV, top_k or logits_BV.shape[-1])
    if top_p is not None:
        probs_BK = jax.nn.softmax(logits_BK, axis=-1)
        before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK  # mass of the more likely tokens
        # The first is kept explicitly: a top_p below float32's smallest normal number becomes 0.
        keep_BK = (before_BK < top_p) | (jnp.arange(logits_BK.shape[-1]) == 0)
        logits_BK = jnp.where(keep_BK, logits_BK, NEG)
    return logits_BK, ids_BK


def first_max(x_BV: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first largest value, or the first NaN), as int32. XLA:CPU runs
    argmax as one reduction of (value, index) pairs that it does not vectorise: over GPT-2's 50,304
    logits it took 0.24 ms for one row and 0.92 ms for eight, against 0.06 and 0.25 ms for a max and
    then the least index that holds it."""
    top_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
    ids_V = jnp.arange(x_BV.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where((x_BV == top_B1) | jnp.isnan(x_BV), ids_V, x_BV.shape[-1]), axis=-1)


def draw(rule: Rule, logits_BV: jax.Array, vocab: Vocab, seeds_B: jax.Array, step) -> jax.Array:
    """Each row's next token, from its last-position logits and its own key for this step. Only the ids of
    `vocab` are drawn: never the padding of a model's vocabulary nor a tokenizer's unused ids."""
    real_V = vocab.drawable(logits_BV.shape[-1])
    if isinstance(rule, Greedy):
        logits_BV = jnp.where(real_V, logits_BV, NEG)
        return first_max(logits_BV) if rule.first_max else jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    keys_B = jax.vmap(lambda seed: jax.random.fold_in(jax.random.key(seed), step))(seeds_B)
    return _pick(keys_B, _scaled(logits_BV, real_V, rule.temperature), rule.top_k, rule.top_p)


def _pick(keys_B: jax.Array, logits_BV: jax.Array, top_k: int, top_p) -> jax.Array:
    """Each row's draw with its key from its scaled logits, among the candidates of top_k and top_p."""
    ids_BK = None
    if top_k or top_p is not None:
        logits_BV, ids_BK = candidates(logits_BV, top_k, top_p)
    pick_B = jax.vmap(jax.random.categorical)(keys_B, logits_BV).astype(jnp.int32)
    return pick_B if ids_BK is None else jnp.take_along_axis(ids_BK, pick_B[:, None], axis=1)[:, 0]


def _scaled(logits_BV: jax.Array, real_V: jax.Array, temperature) -> jax.Array:
    """logits / temperature over the real ids, less their largest first: a tiny temperature (1e-38) then makes
    the others -inf, not the largest +inf (a draw of the first id with a positive logit). NEG for the padding,
    set after the scaling: NEG / a temperature below 1 would overflow to -inf."""
    top_B1 = jnp.max(jnp.where(real_V, logits_BV, -jnp.inf), axis=-1, keepdims=True)
    return jnp.where(real_V, (logits_BV - top_B1) / temperature, NEG)


def draw_rows(
    logits_BV: jax.Array,
    vocab: Vocab,
    temperature_B,
    top_p_B,
    seeds_B,
    steps_B,
    nucleus: bool,
    greedy: str = "argmax",
    top_k: int = 0,
) -> jax.Array:
    """Each row's next token under its own settings: float32 temperature_B (0 = greedy) and top_p_B (1 = off),
    its own seed and the index of the token it draws. The token `draw` gives with that row's rule, whose top_k
    is `top_k` (static, every sampled row's; 0 = off); `nucleus` (static) compiles the top-p filter, which rows
    with top_p 1 skip even then, so that a row's draw does not depend on whether another row of the batch needs
    the filter; `greedy` is the platform's pick (as in from_settings)."""
    real_V = vocab.drawable(logits_BV.shape[-1])
    greedy_B = draw(Greedy(first_max=greedy == "first_max"), logits_BV, vocab, seeds_B, 0)
    sampled_B = temperature_B > 0
    logits_BV = _scaled(logits_BV, real_V, jnp.where(sampled_B, temperature_B, 1)[:, None])
    keys_B = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(seeds_B, steps_B)
    pick_B = _pick(keys_B, logits_BV, top_k, None)
    if nucleus:
        pick_B = jnp.where(top_p_B < 1, _pick(keys_B, logits_BV, top_k, top_p_B[:, None]), pick_B)
    return jnp.where(sampled_B, pick_B, greedy_B)


def penalized(logits_BV: jax.Array, counts_BV: jax.Array, frequency_B, presence_B, bias_BV: jax.Array) -> jax.Array:
    """OpenAI's logits[j] - count[j] * frequency - (count[j] > 0) * presence + bias[j], each row with its own
    penalties (float32 [B]), counts of the tokens it has drawn (int32 [B, V]) and bias (float32 [B, V])."""
    counts_BV = counts_BV.astype(logits_BV.dtype)
    used_BV = (counts_BV > 0).astype(logits_BV.dtype)
    return logits_BV - counts_BV * frequency_B[:, None] - used_BV * presence_B[:, None] + bias_BV


class Logprobs(NamedTuple):
    """Each row's drawn token's log-probability, and its TOP_LOGPROBS most likely ids with theirs, most likely
    first (an id that is no token has -inf: where the vocabulary has fewer)."""

    chosen_B: jax.Array  # float32
    top_BK: jax.Array  # float32
    ids_BK: jax.Array  # int32


def logprobs(logits_BV: jax.Array, vocab: Vocab, token_B: jax.Array) -> Logprobs:
    """The model's log-probabilities of each row's drawn token and its most likely ids: log_softmax of the logits
    over the ids of `vocab` (the padding and unused ids have none), in float32, before any sampling setting."""
    real_V = vocab.drawable(logits_BV.shape[-1])
    logprobs_BV = jax.nn.log_softmax(jnp.where(real_V, logits_BV.astype(jnp.float32), -jnp.inf), axis=-1)
    chosen_B = jnp.take_along_axis(logprobs_BV, token_B[:, None], axis=1)[:, 0]
    top_BK, ids_BK = jax.lax.top_k(logprobs_BV, min(TOP_LOGPROBS, logits_BV.shape[-1]))
    return Logprobs(chosen_B, top_BK, ids_BK.astype(jnp.int32))
