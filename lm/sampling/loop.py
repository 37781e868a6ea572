"""The decoding loop: one prefill pass, then KV-cached steps inside one jitted loop; generate and stream.

How it runs. Prompts are strings (encoded with the checkpoint's tokenizer) or lists of token ids;
an empty prompt starts from the end-of-text token, like the start of a training document. The
prompts are right-padded to a power-of-two bucket and prefilled together in one forward pass that
fills the KV cache; each row then rewinds its cache to its own prompt length and draws its first
token from the logits at its last real position. A `jax.lax.while_loop` runs one cached step per
token until every row has stopped or max_new_tokens are out; rows stop independently and a
finished row emits -1. Compiled code depends on the batch size, the bucket, max_new_tokens rounded up to a
multiple of NEW_TOKENS_STEP (the loop stops at the number asked for) and the sampling rule's structure (greedy,
top-k, top-p on or off: lm.sampling.rules), so another prompt in the same bucket, another max_new_tokens in the same
step, or another temperature or top_p, reuses it (a notebook that asked for 1 to 10 new tokens compiled ten
times). Streaming runs the same step from a Python loop, one jitted call per token.

The context window. Each prompt plus max_new_tokens must fit in the model's max_seq_len. A longer
request is an error that names the lengths, never a silent cut of the prompt: what the model is
conditioned on stays what the user wrote. (sample.py, when --max-new-tokens is not given, lowers
the config's default to the room the prompt leaves.)

Randomness. Row r of a call with seed s draws from jax.random.key(s + r), folded with the index
of the token being drawn (lm.sampling.rules.draw), so a row's tokens depend on its prompt, its
seed and the settings only: not on the other rows of the batch, nor on streaming. `seed` may also
list one seed per row.

Stopping is lm.sampling.stops: the end-of-text token and single-token stop strings stop a row
inside the loop, longer stop strings are matched on the host.

Many hosts. With parameters laid out over a mesh that spans processes (lm.pretrained.load(..., mesh=...) in a
jax.distributed job), every process calls generate or stream with the same arguments: the rows are split over
the mesh's data axes, and every process gets every row's sample (gathered from the other processes).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from lm import platform as platform_lib
from lm import sharding
from lm.config import MAX_TEMPERATURE, ModelConfig, SampleConfig
from lm.errors import UserError
from lm.model import Transformer, init_cache
from lm.sampling import layout, rules
from lm.sampling.stops import Delta, RowText, Sample, row_sample
from lm.tokenizer import Tokenizer

PROGRESS_STEPS = 32  # decoding steps between progress reports, when asked for
FINISHED = -1  # what a finished row emits
MIN_BUCKET = 8  # shortest prompt bucket, so that short prompts share one compiled prefill
NEW_TOKENS_STEP = 64  # max_new_tokens is rounded up to a multiple of this in compiled shapes (the tokens, the cache)

Prompt = str | Sequence[int]


@flax.struct.dataclass
class DecodeState:
    step: jax.Array  # int32 []: tokens drawn so far by every row
    last_B: jax.Array  # int32: the token each row drew at the latest step (FINISHED if it had stopped before)
    tokens_BN: jax.Array  # int32 [B, max_new_tokens rounded up]: the tokens drawn, FINISHED after a row stops
    done_B: jax.Array  # bool: the row has stopped
    seeds_B: jax.Array  # uint32: each row's seed
    cache: Any  # the KV cache (lm.model)


@functools.partial(jax.jit, static_argnames=("model", "platform", "vocab", "cache_len", "max_new_tokens"))
def _prefill(
    params, prompts_BT, lengths_B, seeds_B, rule, stop_ids, *, model, platform, vocab, cache_len, max_new_tokens
):
    b = prompts_BT.shape[0]
    logits_B1V, cache = Transformer(model, platform=platform).apply(
        params, prompts_BT, cache=init_cache(model, b, cache_len), logits_at_B=lengths_B - 1
    )
    # Each row continues after its own prompt: decoding overwrites the padding's keys and values
    # slot by slot before any query can attend to them.
    cache = dict(cache, lengths=lengths_B)
    first_B = rules.draw(rule, logits_B1V[:, 0], vocab, seeds_B, 0)
    return DecodeState(
        step=jnp.int32(1),
        last_B=first_B,
        tokens_BN=jnp.full((b, max_new_tokens), FINISHED, jnp.int32).at[:, 0].set(first_B),
        done_B=jnp.isin(first_B, stop_ids),
        seeds_B=seeds_B,
        cache=cache,
    )


def _advance(
    params, state: DecodeState, rule, stop_ids, model: ModelConfig, platform, vocab: rules.Vocab
) -> DecodeState:
    """One cached step: feed every row's latest token, draw the next one."""
    # A finished row feeds token 0 instead of FINISHED; its outputs are ignored anyway.
    last_B1 = jnp.maximum(state.last_B, 0)[:, None]
    logits_B1V, cache = Transformer(model, platform=platform).apply(params, last_B1, cache=state.cache)
    token_B = rules.draw(rule, logits_B1V[:, 0], vocab, state.seeds_B, state.step)
    token_B = jnp.where(state.done_B, FINISHED, token_B)
    return state.replace(
        step=state.step + 1,
        last_B=token_B,
        tokens_BN=jax.lax.dynamic_update_slice(state.tokens_BN, token_B[:, None], (0, state.step)),
        done_B=state.done_B | jnp.isin(token_B, stop_ids),
        cache=cache,
    )


@functools.partial(jax.jit, static_argnames=("model", "platform", "vocab"), donate_argnames="state")
def _decode(params, state: DecodeState, rule, stop_ids, until, *, model, platform, vocab):
    """Cached steps until every row has stopped or `until` tokens are drawn (at most max_new_tokens)."""
    running = lambda s: (s.step < until) & ~jnp.all(s.done_B)
    return jax.lax.while_loop(running, lambda s: _advance(params, s, rule, stop_ids, model, platform, vocab), state)


_step = jax.jit(_advance, static_argnames=("model", "platform", "vocab"), donate_argnames="state")


def check_settings(
    model_cfg: ModelConfig, sample: SampleConfig, stop: Sequence[str] = (), names: Mapping[str, str] | None = None
) -> None:
    """Raise UserError for settings no sampler can use; `names` maps a setting to what the user wrote for it
    (sample.py's flags: {"top_p": "--top-p"}). Whether max_new_tokens fits the model's window with the prompts is
    check_fits' (a bound without them, the window less one token, was refused again for a longer prompt)."""
    names = names or {}
    shown = lambda name: names.get(name, name)
    if not isinstance(sample, SampleConfig):  # (a dict of settings, a run's whole Config)
        raise UserError(f"sample settings are a lm.config.SampleConfig, not {type(sample).__name__}; "
                        "e.g. SampleConfig(temperature=0.8)")  # fmt: skip
    max_new_tokens, temperature, top_k, top_p = sample.max_new_tokens, sample.temperature, sample.top_k, sample.top_p
    for name, value, kind in [("max_new_tokens", max_new_tokens, numbers.Integral), ("top_k", top_k, numbers.Integral),
                              ("temperature", temperature, numbers.Real), ("top_p", top_p, numbers.Real)]:  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, kind):  # (from Python: SampleConfig(max_new_tokens=1e3))
            what = "an integer" if kind is numbers.Integral else "a number"
            raise UserError(f"{shown(name)} must be {what}, got {value!r}")
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise UserError(
            f"{shown('temperature')} must be >= 0 (0 = greedy) and at most {MAX_TEMPERATURE:.3g}, got {temperature}"
        )
    if not 0 <= top_p <= 1:  # (0: the most likely token only, as OpenAI's API and transformers take it)
        raise UserError(f"{shown('top_p')} must be in [0, 1] (1 = off), got {top_p}")
    if top_k < 0:
        raise UserError(f"{shown('top_k')} must be >= 0 (0 = off), got {top_k}")
    if max_new_tokens < 1:
        raise UserError(f"{shown('max_new_tokens')} must be >= 1, got {max_new_tokens}")
    if "" in stop:
        raise UserError(f"{names.get('stop', 'stop strings')} must not be empty (it matches everywhere); give the "
                        "text to stop at, or leave it out")  # fmt: skip


def cache_bytes(cfg, rows: int, length: int, mesh=None) -> int:
    """Bytes of the KV cache of `rows` rows of `length` positions of model `cfg` that one device holds: the rows
    split over `mesh`'s data axes where they divide (as _batch_sharding places them), else all of them."""
    per_token = 2 * cfg.n_layer * cfg.kv_heads * cfg.head_size * jnp.dtype(cfg.dtype).itemsize
    return per_token * rows_here(rows, mesh) * length


def rows_here(rows: int, mesh=None) -> int:
    """How many of `rows` batch rows one device holds: split over `mesh`'s data axes where they divide (as
    _batch_sharding places them), else all of them."""
    shards = sharding.batch_shards(mesh) if mesh is not None else 1
    return rows // shards if rows % shards == 0 else rows


def check_fits(
    prompt_len: int,
    max_new_tokens: int,
    window: int,
    no_prompt: bool = False,
    which: str = "the prompt",
    name: str = "max_new_tokens",
    templated: bool = False,
) -> None:
    """A prompt of prompt_len tokens (`no_prompt`: the end-of-text token a sample without one starts from) and
    max_new_tokens fit the model's window; `which` names the prompt ("prompt 2 of 3"), `name` the setting.
    `templated`: the prompt is a chat message in its template, whose tokens the user did not type: the message
    is what they shorten, by a count of tokens."""
    if prompt_len + max_new_tokens > window:
        what = "with no prompt, generation starts from 1 token (end-of-text)" if no_prompt else (
            f"{which} is {prompt_len} token{'' if prompt_len == 1 else 's'}")  # fmt: skip
        room, shorten = window - prompt_len, "the message" if templated else "the prompt"
        if room >= 1:
            fix = f"{'' if no_prompt else f'shorten {shorten} or '}lower {name} to at most {room}"
        elif max_new_tokens < window:  # (no room for one token: a lower max_new_tokens would not fit either)
            fix = (f"shorten the message by {prompt_len + max_new_tokens - window} tokens" if templated
                   else f"shorten the prompt to at most {window - max_new_tokens} tokens")  # fmt: skip
        else:
            fix = f"shorten {shorten} and lower {name}, to {window} tokens together"
        raise UserError(
            f"{what}; with {name}={max_new_tokens} that makes {prompt_len + max_new_tokens}, more than the "
            f"model's context window of {window}; {fix}"
        )


def longest_prompt(ids: Sequence[Sequence[int]]) -> tuple[int, str]:
    """The longest prompt's length, and its name in an error line ("the prompt", or "prompt 2 of 3" in a batch)."""
    lengths = [len(x) for x in ids]
    longest = max(lengths)
    return longest, "the prompt" if len(ids) == 1 else f"prompt {lengths.index(longest) + 1} of {len(ids)}"


def bucket(length: int, window: int) -> int:
    """The padded prompt length: the next power of two (at least MIN_BUCKET), at most the window."""
    return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), window)


def _shown(value: Any) -> str:
    """A caller's value in an error line: its repr on one line (a 2-D array's spans several), at most 60 characters."""
    return " ".join(repr(value).split())[:60]


def _prompt_ids(tokenizer: Tokenizer, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Each prompt's ids: a text encoded, or its token ids (a list, or a row of an integer array)."""
    if not isinstance(prompts, (Sequence, np.ndarray, jax.Array)):  # (a generator, a set, None: no len or no order)
        raise UserError(
            f"prompts is a list of prompts (texts or lists of token ids), not {type(prompts).__name__}; "
            "give a list, e.g. list(prompts)"
        )
    if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], numbers.Integral)):
        what = "text" if isinstance(prompts, str) else "token ids"
        raise UserError(f"prompts is a list of prompts, and this is one prompt's {what}; wrap it in a list")
    if not len(prompts):
        raise UserError("no prompts given")
    rows = []
    for prompt in prompts:
        given = None if isinstance(prompt, str) else np.asarray(prompt)
        if given is None:
            ids = tokenizer.encode_context(prompt).tolist()
        elif given.ndim == 1 and (np.issubdtype(given.dtype, np.integer) or not given.size):
            ids = given.astype(np.int64).tolist()
        else:  # (a float 65.7 would have been token 65)
            raise UserError(f"a prompt is text or a sequence of integer token ids, not {_shown(prompt)}")
        if why := tokenizer.not_a_token(ids):
            raise UserError(f"prompt {why}")
        rows.append(ids or [tokenizer.eot])
    return rows


def _one_token(tokenizer: Tokenizer, stop: str) -> int | None:
    """The id of a stop string that is one token (a special token's text, as --chat's end of turn), else None:
    one whose text is the stop string itself (not one that a tokenizer's normalisation makes of it, as NFC
    makes ";" of the Greek question mark, which text holding ";" does not contain)."""
    if stop in tokenizer.special_tokens:
        return tokenizer.special_tokens[stop]
    ids = tokenizer.encode(stop)
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == stop else None


def _seeds(seed: int | Sequence[int], rows: int) -> np.ndarray:
    """Row r's seed: seed + r for one integer (numpy's and JAX's too), else the r-th of a sequence of them; each
    taken modulo 2^32, which is all a row draws with."""
    if type(seed) is int or (isinstance(seed, (list, tuple)) and seed and all(type(s) is int for s in seed)):
        # Python's integers, of any size (numpy reads those past 2^63 as unsigned, floating or object)
        seeds = [seed + r for r in range(rows)] if type(seed) is int else list(seed)
    elif isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        raise UserError("a seed is an integer >= 0, or one per prompt, not a JAX PRNG key (row r draws with "
                        "jax.random.key(seed + r)); give an integer")  # fmt: skip
    else:
        given = None if seed is None or isinstance(seed, (str, bytes)) else np.asarray(seed)
        empty = given is not None and given.ndim == 1 and not given.size
        integers = given is not None and (np.issubdtype(given.dtype, np.integer) or empty)
        if not integers or given.ndim > 1:
            raise UserError(f"a seed is an integer >= 0, or a sequence of them, one per prompt; not {_shown(seed)}")
        seeds = [int(given) + r for r in range(rows)] if given.ndim == 0 else [int(s) for s in given.tolist()]
    if len(seeds) != rows:
        raise UserError(f"{len(seeds)} seeds for {rows} prompts; give one seed, or one per prompt")
    if min(seeds) < 0:
        raise UserError(f"seeds must be >= 0, got {min(seeds)}")
    return np.asarray([s % 2**32 for s in seeds], np.uint32)


def _params_mesh(params) -> Mesh | None:
    """The mesh the params are placed on, or None (the default device)."""
    placed = getattr(jax.tree.leaves(params)[0], "sharding", None)
    return placed.mesh if isinstance(placed, NamedSharding) else None


def _batch_sharding(params, rows: int) -> Callable[[int], NamedSharding] | None:
    """The sharding of a [rows, ...] array of `ndim` dimensions: split over the data axes of the params' mesh when
    it divides, else replicated over it; None where the params have no such mesh (the default device)."""
    mesh = _params_mesh(params)
    if mesh is None or not set(sharding.BATCH) <= set(mesh.axis_names):
        return None
    if rows % sharding.batch_shards(mesh):
        return lambda ndim: sharding.replicated(mesh)
    return lambda ndim: sharding.batch_sharding(mesh, ndim)


def _on_host(x: jax.Array) -> np.ndarray:
    """A decoding output's whole value on this process: gathered from the other processes where its rows are
    split over a mesh that spans several."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _batch_placement(params, rows: int):
    """Where a [rows, ...] input goes (_batch_sharding)."""
    shard = _batch_sharding(params, rows)
    return (lambda x: x) if shard is None else (lambda x: jax.device_put(x, shard(np.ndim(x))))


@dataclasses.dataclass(frozen=True)
class _Request:
    prompts: list[list[int]]
    stops: tuple[str, ...]
    model: ModelConfig
    platform: platform_lib.Platform  # the choices of the backend that holds the parameters
    vocab: rules.Vocab  # the ids that may be drawn
    rule: rules.Rule
    stop_ids: np.ndarray  # int32: the end-of-text token, the other stop tokens and the single-token stop strings
    stop_tokens: tuple[int, ...]  # the caller's own stop tokens (a chat template's end of turn)
    max_new_tokens: int

    @property
    def _static(self) -> dict:
        return dict(model=self.model, platform=self.platform, vocab=self.vocab)

    def decode(self, params, state: DecodeState, until: int | None = None) -> DecodeState:
        """Decoding until `until` tokens are drawn (max_new_tokens where None, the most), or every row stopped."""
        until = self.max_new_tokens if until is None else min(until, self.max_new_tokens)
        return _decode(params, state, self.rule, self.stop_ids, jnp.int32(until), **self._static)

    def step(self, params, state: DecodeState) -> DecodeState:
        return _step(params, state, self.rule, self.stop_ids, **self._static)


def _start(
    params, model_cfg, tokenizer, prompts, sample: SampleConfig, seed, stop, stop_tokens=()
) -> tuple[Any, _Request, DecodeState]:
    """Check a request and prefill it; (the parameters to decode with, the request, the decode state).
    The parameters returned are laid out for decoding (lm.sampling.layout)."""
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise UserError(f"stop takes a string or a list of strings, got {stop!r:.200}")
    stops = tuple(stops)
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in stop_tokens):
        raise UserError(f"stop_tokens takes token ids (integers), got {stop_tokens!r:.200}")
    check_settings(model_cfg, sample, stops)
    max_new_tokens = sample.max_new_tokens
    if tokenizer.n_vocab > model_cfg.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.n_vocab} ids but the model only {model_cfg.vocab_size}")
    ids = _prompt_ids(tokenizer, prompts)
    window = model_cfg.max_seq_len
    longest, which = longest_prompt(ids)
    # (an empty prompt is the end-of-text token alone: nothing the user gave to shorten)
    no_prompt = all(isinstance(p, str) and not p for p in prompts)
    check_fits(longest, max_new_tokens, window, no_prompt=no_prompt, which=which)
    seeds = _seeds(seed, len(ids))
    if sharding.spans_processes(mesh := _params_mesh(params)):  # (its arguments built only where compared)
        sharding.same_on_every_process(
            mesh, "generate (or stream)",
            prompts=[[int(t) for t in p] for p in ids],
            settings=(int(sample.max_new_tokens), float(sample.temperature), int(sample.top_k), float(sample.top_p)),
            seeds=seeds.tolist(), stop=stops,
            stop_tokens=[int(t) for t in stop_tokens],
        )  # fmt: skip
    params, model_cfg = layout.for_decoding(params, model_cfg, len(ids))
    plat = platform_lib.of_arrays(params)
    rule = rules.from_settings(sample.temperature, sample.top_k, sample.top_p, tokenizer.n_vocab, plat.greedy)
    stop_tokens = tuple(int(t) for t in stop_tokens)
    single = (t for t in (_one_token(tokenizer, stop) for stop in stops) if t is not None)
    stop_ids = list(dict.fromkeys([*tokenizer.stop_ids, *stop_tokens, *single]))
    # Padded with FINISHED (which only finished rows emit) to a power of two, so that a few more
    # single-token stop strings do not compile anew.
    stop_ids += [FINISHED] * ((1 << (len(stop_ids) - 1).bit_length()) - len(stop_ids))
    vocab = rules.Vocab.of(tokenizer)
    stop_ids = np.asarray(stop_ids, np.int32)
    request = _Request(ids, stops, model_cfg, plat, vocab, rule, stop_ids, stop_tokens, max_new_tokens)

    width = bucket(longest, window)
    room = -(-max_new_tokens // NEW_TOKENS_STEP) * NEW_TOKENS_STEP  # (decoding stops at max_new_tokens)
    prompts_BT = np.zeros((len(ids), width), np.int32)
    for row, p in zip(prompts_BT, ids):
        row[: len(p)] = p
    place = _batch_placement(params, len(ids))
    state = _prefill(
        params,
        place(prompts_BT),
        place(np.asarray([len(p) for p in ids], np.int32)),
        place(seeds),
        rule,
        request.stop_ids,
        model=model_cfg,
        platform=plat,
        vocab=request.vocab,
        cache_len=min(width + room, window),
        max_new_tokens=room,
    )
    # Waited for before decoding: a prefill that cannot allocate its cache fails here, at once. On XLA:CPU in
    # jaxlib 0.10 a decode dispatched on a failed prefill's outputs would hang instead (0.11.2 raises).
    jax.block_until_ready(state)
    return params, request, state


def generate(
    params: Any,
    model_cfg: ModelConfig,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    sample: SampleConfig = SampleConfig(),
    seed: int | Sequence[int] = 0,
    stop: str | Sequence[str] = (),
    progress: Callable[[int], None] | None = None,
    stop_tokens: Sequence[int] = (),
) -> list[Sample]:
    """One Sample per prompt, drawn with `sample`'s settings (max_new_tokens; temperature 0 is greedy; top_k 0
    and top_p 1 are off); `stop` is one stop string or several; `stop_tokens` are ids that end a row as the
    tokenizer's end-of-text does (a chat template's end of turn: the token, not its text, which a model may also
    spell in ordinary tokens). See the docstrings of lm.sampling's modules for the rest.

    `progress(steps_done)`, if given, is called every PROGRESS_STEPS decoding steps: the loop then
    returns to the host that often (as it does with stop strings, to match them; never otherwise), with the same
    tokens as a single loop.
    """
    params, request, state = _start(params, model_cfg, tokenizer, prompts, sample, seed, stop, stop_tokens)
    max_new_tokens = sample.max_new_tokens
    if progress is None and not request.stops:
        state = request.decode(params, state)
    else:  # (stop strings are matched on the host: a row that meets one stops within PROGRESS_STEPS, not at the end)
        step = int(state.step)
        while step < max_new_tokens and not bool(jnp.all(state.done_B)):
            state = request.decode(params, state, step + PROGRESS_STEPS)
            step = int(state.step)
            if progress is not None:
                progress(step)
            if request.stops:
                state = _mark_stopped(tokenizer, request, state, max_new_tokens)
    tokens_BN = _on_host(state.tokens_BN)
    samples = []
    for prompt, row in zip(request.prompts, tokens_BN):
        ids = [int(t) for t in row if t != FINISHED]
        samples.append(row_sample(tokenizer, prompt, ids, request.stops, max_new_tokens, request.stop_tokens))
    return samples


def _mark_stopped(tokenizer: Tokenizer, request: _Request, state: DecodeState, max_new_tokens: int) -> DecodeState:
    """The state with the rows whose text so far holds a stop string marked done, to draw no more."""
    done_B, tokens_BN = _on_host(state.done_B), _on_host(state.tokens_BN)
    stopped = done_B.copy()
    for b in np.flatnonzero(~done_B):
        ids = [int(t) for t in tokens_BN[b] if t != FINISHED]
        sample = row_sample(tokenizer, request.prompts[b], ids, request.stops, max_new_tokens, request.stop_tokens)
        stopped[b] = sample.finish == "stop"
    if (stopped == done_B).all():
        return state
    return state.replace(done_B=jax.device_put(stopped, state.done_B.sharding))


def stream(
    params: Any,
    model_cfg: ModelConfig,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    sample: SampleConfig = SampleConfig(),
    seed: int | Sequence[int] = 0,
    stop: str | Sequence[str] = (),
    stop_tokens: Sequence[int] = (),
) -> Iterator[list[Delta]]:
    """Like generate, but yields one Delta per prompt after every step, as the tokens are drawn.

    A row's deltas add up to its Sample: the tokens (None after it finished) to Sample.tokens, the
    texts to Sample.text.
    """
    params, request, state = _start(params, model_cfg, tokenizer, prompts, sample, seed, stop, stop_tokens)
    max_new_tokens = sample.max_new_tokens
    rows = [RowText(tokenizer, request.stops, request.stop_tokens) for _ in request.prompts]
    reported = 0  # rows finished on the host that the device knows about
    for step in range(max_new_tokens):
        if step:
            state = request.step(params, state)
        deltas = []
        for row, token in zip(rows, _on_host(state.last_B).tolist()):
            if row.finish:
                deltas.append(Delta(None, ""))
            else:
                deltas.append(Delta(token, row.push(token, last=step == max_new_tokens - 1)))
        yield deltas
        finished = np.asarray([row.finish is not None for row in rows])
        if finished.all():
            return
        if finished.sum() > reported:  # a multi-token stop string: stop drawing for that row
            state = state.replace(done_B=jax.device_put(finished, state.done_B.sharding))
            reported = int(finished.sum())
