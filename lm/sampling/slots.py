"""Decoding over a fixed number of slots whose rows start and stop on their own: the device side of a server's
continuous batching (lm.serve.scheduler decides which request holds which slot).

    slots = Slots(params, model_cfg, rules.Vocab.of(tokenizer), rows=16)
    first = slots.admit(slot=3, prompt=ids, seed=7, temperature=0.8, top_p=1.0)   # prefill; the first token
    tokens_B = slots.step(live_B)                                                 # one token for every live slot
    slots.logprobs    # the tokens' rules.Logprobs, where a row admitted with logprobs=True drew one; else None
    slots.admit(slot=4, prompt=ids, seed=1, temperature=0, top_p=1.0, presence_penalty=2.0, logit_bias={50256: -100})
    slots.admit(slot=5, prompt=ids, seed=2, temperature=0, top_p=1.0, score=True)  # slots.scored: as score(ids)
    slots.score(ids)  # the rules.Logprobs of the prompt's tokens after its first (an API's echo), no slot taken

Each slot holds a row of one KV cache as long as the window (the model's, or a shorter one given: a row's prompt
and new tokens must fit in it, and a step's attention reads all of it), the row's latest token, how many tokens it
has drawn, and its sampling settings as arrays (temperature, top_p, seed; a top_k is every slot's), so rows of
different requests share one compiled step: a step is one jitted call over all the slots whatever they hold (idle
slots compute and are ignored, and their cache does not move), compiled once, plus once more with the top-p filter
for while a live row uses top-p, and with the logprobs for while a live row asks for them (rules.logprobs: a
log_softmax and a top-k over the vocabulary, which a step without them does not compute), and with the penalties
for while a live row has a frequency or presence penalty or a logit bias (rules.penalized: a Penalties of [rows,
vocabulary] counts and bias, made with the slots, so that a server's memory is taken at its start, not by its first
request that asks for them; a step without them neither reads nor keeps them, and a row without them draws from
its logits as they are). Admitting a request
prefills its prompt alone, right-padded to generate's power-of-two bucket, into a fresh cache as wide as the
bucket, copies that into its slot's row, and draws its first token: compiled once per bucket (and top-p filter);
it computes the first token's logprobs whether or not the row asks (one row's log_softmax), and writes the slot's
penalties, zero for a row without them, so that rows of one bucket with and without them share the compiled
admission and none waits for another compile. Both calls donate the state, so the cache is updated in place.
Scoring a prompt (its tokens' logprobs, each under the logits at the position before it: an API's echo) takes the
hidden states at every position of its prefill, and the head's logits of a chunk of positions at a time, as the
loss's (those of a long prompt's every position, in float32, would take gigabytes beside the cache): an admission
with score=True draws its first token from the same prefill (the prompt runs once, not once to score and once to
admit), and score() alone, for a row that draws nothing, is a call of its own; each is compiled once per bucket the
first time it runs. A prefill without them computes the logits at the
prompt's last position only, and nothing else pays for the logits at every position.

A row draws token i with jax.random.key(seed) folded with i (lm.sampling.rules.draw_rows), as generate's row of
that seed does: a row's tokens depend on its prompt, its seed and its settings, not on what the other slots
hold, nor on when it was admitted.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from lm import platform as platform_lib
from lm.config import ModelConfig
from lm.model import Transformer, head_logits, init_cache
from lm.sampling import layout, rules
from lm.sampling.loop import _batch_placement, _batch_sharding, bucket, rows_here


@flax.struct.dataclass
class SlotState:
    cache: Any  # the KV cache (lm.model), [rows, ..., window, ...]
    last_B: jax.Array  # int32: each slot's latest token
    drawn_B: jax.Array  # int32: tokens the slot's row has drawn (the index its next draw folds into its key)
    seeds_B: jax.Array  # uint32
    temperature_B: jax.Array  # float32: 0 = greedy
    top_p_B: jax.Array  # float32: 1 = off


def penalties_bytes(cfg: ModelConfig, rows: int, mesh=None) -> int:
    """Bytes of the Penalties of `rows` slots of model `cfg` that one device holds (its rows, as cache_bytes's)."""
    return rows_here(rows, mesh) * (cfg.vocab_size * 8 + 8)  # (int32 counts and float32 bias by id; 2 float32)


@flax.struct.dataclass
class Penalties:
    """Each slot's frequency and presence penalties and logit bias (rules.penalized), and the tokens its row has
    drawn, by id: a slot's are its row's while the row uses them, left as they were while it does not."""

    counts_BV: jax.Array  # int32: how many times the row drew each id (its prompt's not counted)
    bias_BV: jax.Array  # float32: the row's logit bias
    frequency_B: jax.Array  # float32
    presence_B: jax.Array  # float32


def _row(x_B: jax.Array, slot, value) -> jax.Array:
    return x_B.at[slot].set(jnp.asarray(value, x_B.dtype))


@functools.partial(
    jax.jit,
    static_argnames=("model", "platform", "vocab", "nucleus", "top_k", "score"),
    donate_argnames=("state", "penalties"),
)
def _admit(
    params, state: SlotState, penalties: Penalties, slot, prompt_1T, length, seed, temperature, top_p, frequency,
    presence, bias_V, *, model, platform, vocab, nucleus, top_k, score,
):  # fmt: skip
    if score:  # (the hidden states at every position, from the one prefill: the prompt's scores, and the draw's)
        x_1TD, row = _prefill(params, prompt_1T, model, platform, head=False)
        logits_11V = head_logits(params, model, platform, jax.lax.dynamic_slice_in_dim(x_1TD, length - 1, 1, axis=1))
    else:
        logits_11V, row = _prefill(params, prompt_1T, model, platform, length[None] - 1)
    # (the row has drawn nothing yet: of its penalties, only the bias applies; a row without them has a bias of 0)
    first_1 = rules.draw_rows(
        logits_11V[:, 0] + bias_V[None], vocab, temperature[None], top_p[None], seed[None], jnp.zeros(1, jnp.int32),
        nucleus, platform.greedy, top_k,
    )
    # The prompt's keys and values into the slot's row; the padding after them is overwritten by decoding
    # before any query can attend to it, as in generate.
    write = lambda buf, new: jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), (slot, 0, 0, 0))
    cache = {"layers": jax.tree.map(write, state.cache["layers"], row["layers"])}
    cache["lengths"] = _row(state.cache["lengths"], slot, length)
    state = state.replace(
        cache=cache,
        last_B=_row(state.last_B, slot, first_1[0]),
        drawn_B=_row(state.drawn_B, slot, 1),
        seeds_B=_row(state.seeds_B, slot, seed),
        temperature_B=_row(state.temperature_B, slot, temperature),
        top_p_B=_row(state.top_p_B, slot, top_p),
    )
    penalties = penalties.replace(  # (a row without them: read by no step, while its penalized_B is False)
        counts_BV=penalties.counts_BV.at[slot].set(jnp.zeros_like(penalties.counts_BV[0]).at[first_1[0]].set(1)),
        bias_BV=penalties.bias_BV.at[slot].set(bias_V),
        frequency_B=_row(penalties.frequency_B, slot, frequency),
        presence_B=_row(penalties.presence_B, slot, presence),
    )
    return (
        state,
        penalties,
        first_1[0],
        rules.logprobs(logits_11V[:, 0], vocab, first_1),
        _scores(params, x_1TD, prompt_1T, model, platform, vocab) if score else None,
    )


def _prefill(params, prompt_1T, model, platform, logits_at_B=None, head=True):
    """(logits, or the hidden states without the head; the prompt's row of the KV cache): a prefill as wide as the
    prompt's bucket."""
    cache = init_cache(model, 1, prompt_1T.shape[1])
    return Transformer(model, platform=platform).apply(
        params, prompt_1T, cache=cache, logits_at_B=logits_at_B, head=head
    )


def _scores(params, x_1TD, prompt_1T, model, platform, vocab) -> rules.Logprobs:
    """The logprobs of the prompt's tokens after its first, each under the logits at the position before it
    (causal: the padding after the prompt changes no position before it), from the prefill's hidden states
    x_1TD: the head computes the logits of a chunk of positions at a time (the platform's loss_chunk, within
    lm.platform's LOSS_CHUNK_BYTES), so that those of the whole prompt never exist at once (float32: 2.4 GiB for
    4096 positions of a 150,000-token vocabulary, and as much again for their log_softmax)."""

    def one(position):
        x_D, next_id = position
        logits_V = head_logits(params, model, platform, x_D[None, None])[0, 0]
        return jax.tree.map(lambda a: a[0], rules.logprobs(logits_V[None], vocab, next_id[None]))

    chunk = platform_lib.auto_loss_chunk(platform, 1, model.vocab_size, "float32")
    return jax.lax.map(one, (x_1TD[0, :-1], prompt_1T[0, 1:]), batch_size=chunk)


@functools.partial(
    jax.jit,
    static_argnames=("model", "platform", "vocab", "nucleus", "top_k", "logprobs"),
    donate_argnames=("state", "penalties"),
)
def _step(
    params, state: SlotState, penalties: Penalties | None, live_B, penalized_B, *, model, platform, vocab, nucleus,
    top_k, logprobs,
):  # fmt: skip
    logits_B1V, cache = Transformer(model, platform=platform).apply(params, state.last_B[:, None], cache=state.cache)
    drawn_BV = logits_B1V[:, 0]
    if penalties is not None:  # (a row without penalties draws from its logits as they are, whatever its slot held)
        p = penalties
        adjusted_BV = rules.penalized(drawn_BV, p.counts_BV, p.frequency_B, p.presence_B, p.bias_BV)
        drawn_BV = jnp.where(penalized_B[:, None], adjusted_BV, drawn_BV)
    token_B = rules.draw_rows(
        drawn_BV, vocab, state.temperature_B, state.top_p_B, state.seeds_B, state.drawn_B, nucleus,
        platform.greedy, top_k,
    )
    # An idle slot stays where it is, so that it never runs past the end of its row.
    cache = dict(cache, lengths=jnp.where(live_B, cache["lengths"], state.cache["lengths"]))
    state = state.replace(
        cache=cache, last_B=jnp.where(live_B, token_B, state.last_B), drawn_B=state.drawn_B + live_B.astype(jnp.int32)
    )
    if penalties is not None:
        drew_B = (live_B & penalized_B).astype(jnp.int32)
        counts_BV = penalties.counts_BV.at[jnp.arange(token_B.shape[0]), token_B].add(drew_B)
        penalties = penalties.replace(counts_BV=counts_BV)
    return state, penalties, rules.logprobs(logits_B1V[:, 0], vocab, token_B) if logprobs else None


@functools.partial(jax.jit, static_argnames=("model", "platform", "vocab"))
def _score(params, prompt_1T, *, model, platform, vocab) -> rules.Logprobs:
    # (the prefill an echo's admission scores its prompt with: the same scores, with or without new tokens)
    x_1TD = _prefill(params, prompt_1T, model, platform, head=False)[0]
    return _scores(params, x_1TD, prompt_1T, model, platform, vocab)


class Slots:
    """`rows` slots decoding with one set of parameters; see the module docstring. Not thread-safe: one caller."""

    def __init__(
        self,
        params: Any,
        model_cfg: ModelConfig,
        vocab: rules.Vocab,
        rows: int,
        window: int | None = None,
        top_k: int = 0,
    ):
        """`top_k`: every sampled row draws among its top_k most likely tokens (0 = all), as `generate` does with
        that top_k; a request's temperature and top_p are its own."""
        self.params, self.model = layout.for_decoding(params, model_cfg, rows)
        self.top_k = rules.top_k_of(top_k, vocab.size)  # (as generate's rule reads it)
        self.platform = platform_lib.of_arrays(self.params)  # the choices of the backend that holds them
        self.window, self.vocab, self.rows = (
            min(window or model_cfg.max_seq_len, model_cfg.max_seq_len),
            vocab,
            rows,
        )
        self._place = _batch_placement(self.params, rows)
        fresh = lambda: SlotState(
            cache=init_cache(self.model, self.rows, self.window),
            last_B=jnp.zeros(self.rows, jnp.int32),
            drawn_B=jnp.zeros(self.rows, jnp.int32),
            seeds_B=jnp.zeros(self.rows, jnp.uint32),
            temperature_B=jnp.zeros(self.rows, jnp.float32),
            top_p_B=jnp.ones(self.rows, jnp.float32),
        )
        # Made where it lives: each device allocates its own rows of the cache, none the whole of it first.
        shard = _batch_sharding(self.params, rows)
        out = None if shard is None else jax.tree.map(lambda x: shard(x.ndim), jax.eval_shape(fresh))
        self._fresh = jax.jit(fresh, out_shardings=out)
        width = self.model.vocab_size  # (the logits': the tokenizer's ids and the model's padding)
        no_penalties = lambda: Penalties(
            counts_BV=jnp.zeros((self.rows, width), jnp.int32),
            bias_BV=jnp.zeros((self.rows, width), jnp.float32),
            frequency_B=jnp.zeros(self.rows, jnp.float32),
            presence_B=jnp.zeros(self.rows, jnp.float32),
        )
        out = None if shard is None else jax.tree.map(lambda x: shard(x.ndim), jax.eval_shape(no_penalties))
        self._no_penalties = jax.jit(no_penalties, out_shardings=out)
        self.reset()

    def reset(self) -> None:
        """Every slot empty (also after a failed call, whose donated state may be gone)."""
        self.nucleus_B = np.zeros(self.rows, bool)  # the slot's row uses top-p
        self.logprobs_B = np.zeros(self.rows, bool)  # the slot's row asks for its tokens' logprobs
        self.penalized_B = np.zeros(self.rows, bool)  # the slot's row has penalties or a logit bias
        self.logprobs: rules.Logprobs | None = None  # those of the tokens the last admit or step drew, on the device
        self.scored: rules.Logprobs | None = None  # those of the prompt the last admit scored, on the device
        self.state = self._fresh()
        self.penalties = self._no_penalties()  # (penalties_bytes a device)

    def admit(
        self,
        slot: int,
        prompt: list[int],
        seed: int,
        temperature: float,
        top_p: float,
        logprobs: bool = False,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        score: bool = False,
    ) -> jax.Array:
        """Prefill `prompt` into `slot` (whatever it held) with these settings; its first token, on the device.
        `logprobs`: the row's tokens' logprobs are given (self.logprobs, row 0 here, the slot's after a step; else
        None: the admission computes its first token's anyway, the steps only while a live row asks).
        `score`: its prompt's are too, by the same prefill (self.scored, as score() gives them; else None).
        The penalties and `logit_bias` ({id: bias}) change the logits the row draws from (rules.penalized), not
        its logprobs. The caller checks the prompt's ids, the bias's, and that prompt plus its new tokens fit the
        window."""
        prompt_1T = self._padded(prompt)
        nucleus = bool(temperature > 0 and top_p < 1)
        penalized = bool(frequency_penalty or presence_penalty or any((logit_bias or {}).values()))
        self.nucleus_B[slot], self.logprobs_B[slot], self.penalized_B[slot] = nucleus, logprobs, penalized
        bias_V = np.zeros(self.model.vocab_size, np.float32)
        for token, bias in (logit_bias or {}).items():
            bias_V[token] = bias
        self.state, self.penalties, first, drawn, self.scored = _admit(
            self.params,
            self.state,
            self.penalties,
            np.int32(slot),
            prompt_1T,
            np.int32(len(prompt)),
            np.uint32(seed % 2**32),
            np.float32(temperature),
            np.float32(top_p),
            np.float32(frequency_penalty),
            np.float32(presence_penalty),
            bias_V,
            model=self.model,
            platform=self.platform,
            vocab=self.vocab,
            nucleus=nucleus,
            top_k=self.top_k,
            score=score,
        )
        self.logprobs = drawn if logprobs else None
        return first

    def score(self, prompt: list[int]) -> rules.Logprobs:
        """The logprobs of `prompt`'s tokens after its first (row i: token i + 1's, under the logits at position i),
        on the device; rows from len(prompt) - 1 on are padding's. The slots are left as they are."""
        prompt_1T = self._padded(prompt)
        return _score(self.params, prompt_1T, model=self.model, platform=self.platform, vocab=self.vocab)

    def _padded(self, prompt: list[int]) -> np.ndarray:
        """`prompt` as one row, right-padded to its bucket's width."""
        prompt_1T = np.zeros((1, bucket(len(prompt), self.window)), np.int32)
        prompt_1T[0, : len(prompt)] = prompt
        return prompt_1T

    def compile_all(self) -> int:
        """Run once every program a request can need, so that none waits for a compile (and, on a server, holds
        back every live row while it compiles): each prompt bucket's admission, with and without the top-p filter
        and scoring; score() of each bucket; the step with each of top-p, logprobs and penalties on and off. The
        slots are empty after it. The number of programs run."""
        ran = 0
        for length in _bucket_lengths(self.window - 1, self.window):  # (a row's prompt leaves room for a token)
            for nucleus, score in itertools.product((False, True), repeat=2):
                self.admit(0, [0] * length, seed=0, temperature=float(nucleus), top_p=0.5, score=score)
                ran += 1
        for length in _bucket_lengths(self.window, self.window):  # (an echo that draws nothing may fill the window)
            self.score([0] * length)
            ran += 1
        live_B = np.arange(self.rows) == 0
        for nucleus, logprobs, penalized in itertools.product((False, True), repeat=3):
            self.nucleus_B[0], self.logprobs_B[0], self.penalized_B[0] = nucleus, logprobs, penalized
            self.step(live_B)
            ran += 1
        jax.block_until_ready(self.state)
        self.reset()
        return ran

    def step(self, live_B: np.ndarray) -> jax.Array:
        """One token for every live slot (bool [rows]): the slots' latest tokens, on the device."""
        nucleus = bool((self.nucleus_B & live_B).any())
        penalized = bool((self.penalized_B & live_B).any())
        self.state, penalties, self.logprobs = _step(
            self.params,
            self.state,
            self.penalties if penalized else None,
            self._place(np.asarray(live_B, bool)),
            self._place(self.penalized_B.copy()) if penalized else None,
            model=self.model,
            platform=self.platform,
            vocab=self.vocab,
            nucleus=nucleus,
            top_k=self.top_k,
            logprobs=bool((self.logprobs_B & live_B).any()),
        )
        if penalized:
            self.penalties = penalties
        return self.state.last_B


def _bucket_lengths(longest: int, window: int) -> list[int]:
    """A prompt length in each bucket of `window` (lm.sampling.loop.bucket) that prompts of 1..longest tokens take."""
    lengths = [min(2**k, longest) for k in range(longest.bit_length() + 1)]
    return sorted({bucket(n, window): n for n in lengths}.values())
