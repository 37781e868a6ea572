"""Sampling from a checkpoint: one prefill pass, then KV-cached decoding inside one jitted loop.

    params, model_cfg, tok = load("runs/NAME")
    samples = generate(params, model_cfg, tok, ["ROMEO:", "JULIET:"], max_new_tokens=100, temperature=0.8)
    for deltas in stream(params, model_cfg, tok, ["ROMEO:"], max_new_tokens=100):
        print(deltas[0].text, end="", flush=True)

    python sample.py [RUN_DIR] --prompt "ROMEO:" --num-samples 3 [--stream] [--stop STR]...

How it runs. Prompts are strings (encoded with the checkpoint's tokenizer) or lists of token ids;
an empty prompt starts from the end-of-text token, like the start of a training document. The
prompts are right-padded to a power-of-two bucket and prefilled together in one forward pass that
fills the KV cache; each row then rewinds its cache to its own prompt length and draws its first
token from the logits at its last real position. A `jax.lax.while_loop` runs one cached step per
token until every row has stopped or max_new_tokens are out; rows stop independently and a
finished row emits -1. Compiled code depends on the batch size, the bucket, max_new_tokens and
the sampling mode (greedy, top-k, top-p on or off), so another prompt in the same bucket reuses
it. Streaming runs the same step from a Python loop, one jitted call per token.

The context window. Each prompt plus max_new_tokens must fit in the model's max_seq_len. A longer
request is an error that names the lengths, never a silent cut of the prompt: what the model is
conditioned on stays what the user wrote. (sample.py, when --max-new-tokens is not given, lowers
the config's default to the room the prompt leaves.)

Randomness. Row r of a call with seed s draws from jax.random.key(s + r), folded with the index
of the token being drawn, so a row's tokens depend on its prompt, its seed and the settings only:
not on the other rows of the batch, nor on streaming. `seed` may also list one seed per row.

Stopping. A row stops at the end-of-text token or at the first occurrence of a stop string; its
text is cut before the stop string. Stop strings are matched in decoded text on the host: after
every step when streaming (the row is then marked done on the device), after the loop otherwise.
A stop string that is a single token also stops its row inside the device loop. Streaming holds
back text that may still turn into a stop string or complete a multi-byte character, so the
streamed text always equals the non-streamed text.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from tqdm import tqdm

from lm import checkpoint as ckpt_lib
from lm import runs as runs_lib
from lm import sharding
from lm.config import MeshConfig, ModelConfig
from lm.errors import ArgumentParser, UserError, cli
from lm.model import Transformer, init_cache, unscanned
from lm.pretrained import load
from lm.tokenizer import Tokenizer

PROGRESS_STEPS = 32  # decoding steps between progress reports, when asked for
NEG = float(np.finfo(np.float32).min)  # logit of a token that must not be drawn: finite, so no inf - inf
FINISHED = -1  # what a finished row emits
MIN_BUCKET = 8  # shortest prompt bucket, so that short prompts share one compiled prefill

Prompt = str | Sequence[int]


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt: list[int]  # the prompt's ids (the end-of-text token for an empty prompt)
    tokens: list[int]  # every id generated, including a final end-of-text token or the one completing a stop string
    text: str  # the generated text, cut before the first stop string
    finish: str  # "eot" (end-of-text token), "stop" (a stop string) or "length" (max_new_tokens reached)


@dataclasses.dataclass(frozen=True)
class Delta:
    token: int | None  # the id the row drew at this step; None once the row has finished
    text: str  # text that became final at this step ("" while a stop string or a character may be incomplete)


@dataclasses.dataclass(frozen=True)
class _Mode:
    """What the compiled code depends on besides array shapes."""

    model: ModelConfig
    n_vocab: int  # the tokenizer's ids; the rest of the model's vocabulary is padding, never drawn
    greedy: bool
    top_k: int  # 0 = off
    nucleus: bool  # whether top_p < 1


@flax.struct.dataclass
class DecodeState:
    step: jax.Array  # int32 []: tokens drawn so far by every row
    last_B: jax.Array  # int32: the token each row drew at the latest step (FINISHED if it had stopped before)
    tokens_BN: jax.Array  # int32 [B, max_new_tokens]: the tokens drawn, FINISHED after a row stops
    done_B: jax.Array  # bool: the row has stopped
    seeds_B: jax.Array  # uint32: each row's seed
    cache: Any  # the KV cache (lm.model)


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


def _draw(logits_BV, seeds_B, step, temperature, top_p, mode: _Mode) -> jax.Array:
    """Each row's next token, from its last-position logits and its own key for this step."""
    real_V = jnp.arange(logits_BV.shape[-1]) < mode.n_vocab
    if mode.greedy:
        return jnp.argmax(jnp.where(real_V, logits_BV, NEG), axis=-1).astype(jnp.int32)
    # Scaled before masking: NEG / a temperature below 1 would overflow to -inf.
    logits_BV = jnp.where(real_V, logits_BV / temperature, NEG)
    ids_BK = None
    if mode.top_k or mode.nucleus:
        logits_BV, ids_BK = candidates(logits_BV, mode.top_k, top_p if mode.nucleus else None)
    keys_B = jax.vmap(lambda seed: jax.random.fold_in(jax.random.key(seed), step))(seeds_B)
    pick_B = jax.vmap(jax.random.categorical)(keys_B, logits_BV).astype(jnp.int32)
    return pick_B if ids_BK is None else jnp.take_along_axis(ids_BK, pick_B[:, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames=("mode", "cache_len", "max_new_tokens"))
def _prefill(params, prompts_BT, lengths_B, seeds_B, temperature, top_p, stop_ids, *, mode, cache_len, max_new_tokens):
    b = prompts_BT.shape[0]
    logits_B1V, cache = Transformer(mode.model).apply(
        params, prompts_BT, cache=init_cache(mode.model, b, cache_len), logits_at_B=lengths_B - 1
    )
    # Each row continues after its own prompt: decoding overwrites the padding's keys and values
    # slot by slot before any query can attend to them.
    cache = dict(cache, lengths=lengths_B)
    first_B = _draw(logits_B1V[:, 0], seeds_B, 0, temperature, top_p, mode)
    return DecodeState(
        step=jnp.int32(1),
        last_B=first_B,
        tokens_BN=jnp.full((b, max_new_tokens), FINISHED, jnp.int32).at[:, 0].set(first_B),
        done_B=jnp.isin(first_B, stop_ids),
        seeds_B=seeds_B,
        cache=cache,
    )


def _advance(params, state: DecodeState, temperature, top_p, stop_ids, mode: _Mode) -> DecodeState:
    """One cached step: feed every row's latest token, draw the next one."""
    # A finished row feeds token 0 instead of FINISHED; its outputs are ignored anyway.
    logits_B1V, cache = Transformer(mode.model).apply(
        params, jnp.maximum(state.last_B, 0)[:, None], cache=state.cache
    )
    token_B = _draw(logits_B1V[:, 0], state.seeds_B, state.step, temperature, top_p, mode)
    token_B = jnp.where(state.done_B, FINISHED, token_B)
    return state.replace(
        step=state.step + 1,
        last_B=token_B,
        tokens_BN=jax.lax.dynamic_update_slice(state.tokens_BN, token_B[:, None], (0, state.step)),
        done_B=state.done_B | jnp.isin(token_B, stop_ids),
        cache=cache,
    )


@functools.partial(jax.jit, static_argnames="mode", donate_argnames="state")
def _decode(params, state: DecodeState, temperature, top_p, stop_ids, until=None, *, mode):
    """Cached steps until every row has stopped, max_new_tokens are drawn, or (if given) `until` are."""
    limit = state.tokens_BN.shape[1] if until is None else jnp.minimum(state.tokens_BN.shape[1], until)
    running = lambda s: (s.step < limit) & ~jnp.all(s.done_B)
    return jax.lax.while_loop(running, lambda s: _advance(params, s, temperature, top_p, stop_ids, mode), state)


_step = jax.jit(_advance, static_argnames="mode", donate_argnames="state")


def check_settings(
    model_cfg: ModelConfig, max_new_tokens: int, temperature: float, top_k: int, top_p: float, stop: Sequence[str] = ()
) -> None:
    """Raise UserError for settings no sampler can use."""
    if not temperature >= 0:
        raise UserError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise UserError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if top_k < 0:
        raise UserError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_new_tokens > model_cfg.max_seq_len:
        raise UserError(
            f"max_new_tokens={max_new_tokens} is more than the model's context window of "
            f"{model_cfg.max_seq_len} tokens; lower it"
        )
    if "" in stop:
        raise UserError("stop strings must not be empty")


def check_fits(prompt_len: int, max_new_tokens: int, window: int) -> None:
    if prompt_len + max_new_tokens > window:
        raise UserError(
            f"the prompt is {prompt_len} tokens; with max_new_tokens={max_new_tokens} that makes "
            f"{prompt_len + max_new_tokens}, more than the model's context window of {window}; "
            "shorten the prompt or lower max_new_tokens"
        )


def bucket(length: int, window: int) -> int:
    """The padded prompt length: the next power of two (at least MIN_BUCKET), at most the window."""
    return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), window)


def _prompt_ids(tokenizer: Tokenizer, prompts: Sequence[Prompt]) -> list[list[int]]:
    if isinstance(prompts, str):
        raise TypeError("prompts is a list of prompts; wrap a single prompt in a list")
    if not prompts:
        raise UserError("no prompts given")
    rows = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < tokenizer.n_vocab]
        if bad:
            raise UserError(f"prompt token id {bad[0]} is not in the tokenizer's range [0, {tokenizer.n_vocab})")
        rows.append(ids or [tokenizer.eot])
    return rows


def _seeds(seed: int | Sequence[int], rows: int) -> np.ndarray:
    seeds = [seed + r for r in range(rows)] if isinstance(seed, int) else [int(s) for s in seed]
    if len(seeds) != rows:
        raise UserError(f"{len(seeds)} seeds for {rows} prompts; give one seed, or one per prompt")
    if min(seeds) < 0:
        raise UserError(f"seeds must be >= 0, got {min(seeds)}")
    return np.asarray([s % 2**32 for s in seeds], np.uint32)


def _batch_placement(params, rows: int):
    """Where a [rows, ...] input goes: split over the data axes of the params' mesh when it divides."""
    placed = getattr(jax.tree.leaves(params)[0], "sharding", None)
    if not isinstance(placed, NamedSharding) or not set(sharding.BATCH) <= set(placed.mesh.axis_names):
        return lambda x: x
    mesh = placed.mesh
    if rows % math.prod(mesh.shape[a] for a in sharding.BATCH):
        return lambda x: jax.device_put(x, sharding.replicated(mesh))
    return lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim))


@dataclasses.dataclass(frozen=True)
class _Request:
    prompts: list[list[int]]
    stops: tuple[str, ...]
    mode: _Mode
    args: tuple  # the decode step's array arguments: temperature, top_p, stop ids


def _start(
    params, model_cfg, tokenizer, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop
) -> tuple[Any, _Request, DecodeState]:
    """Check a request and prefill it; (the parameters to decode with, the request, the decode state).

    A scan_layers model decodes unstacked (lm.model.unscanned): the parameters returned are those."""
    params, model_cfg = unscanned(params, model_cfg)
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    check_settings(model_cfg, max_new_tokens, temperature, top_k, top_p, stops)
    if tokenizer.n_vocab > model_cfg.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.n_vocab} ids but the model only {model_cfg.vocab_size}")
    ids = _prompt_ids(tokenizer, prompts)
    window = model_cfg.max_seq_len
    longest = max(map(len, ids))
    check_fits(longest, max_new_tokens, window)
    greedy = temperature == 0
    mode = _Mode(
        model=model_cfg,
        n_vocab=tokenizer.n_vocab,
        greedy=greedy,
        top_k=0 if greedy or top_k >= tokenizer.n_vocab else top_k,
        nucleus=not greedy and top_p < 1,
    )
    stop_ids = [tokenizer.eot, *(t[0] for t in map(tokenizer.encode, stops) if len(t) == 1)]
    # Padded with FINISHED (which only finished rows emit) to a power of two, so that a few more
    # single-token stop strings do not compile anew.
    stop_ids += [FINISHED] * ((1 << (len(stop_ids) - 1).bit_length()) - len(stop_ids))
    args = (np.float32(temperature), np.float32(top_p), np.asarray(stop_ids, np.int32))

    width = bucket(longest, window)
    prompts_BT = np.zeros((len(ids), width), np.int32)
    for row, p in zip(prompts_BT, ids):
        row[: len(p)] = p
    place = _batch_placement(params, len(ids))
    state = _prefill(
        params,
        place(prompts_BT),
        place(np.asarray([len(p) for p in ids], np.int32)),
        place(_seeds(seed, len(ids))),
        *args,
        mode=mode,
        cache_len=min(width + max_new_tokens, window),
        max_new_tokens=max_new_tokens,
    )
    return params, _Request(ids, stops, mode, args), state


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _settled(text: str, stops: Sequence[str]) -> int:
    """How much of a row's text so far no later token can change or cut."""
    end = len(text)
    if text.endswith("\ufffd"):  # maybe the first bytes of a character the next token completes
        end -= 1
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                end = min(end, len(text) - k)
                break
    return end


class _RowText:
    """One row's output as its tokens arrive: the final text so far, and why the row finished."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.text = ""
        self.finish: str | None = None

    def push(self, token: int, last: bool) -> str:
        """Take the next token (`last`: the final one max_new_tokens allows); return the new final text."""
        self.ids.append(token)
        if token == self.tokenizer.eot:
            self.finish = "eot"
            return self._extend(self.tokenizer.decode(self.ids[:-1]))
        text = self.tokenizer.decode(self.ids)
        cut = _first_stop(text, self.stops)
        if cut is not None:
            self.finish = "stop"
            return self._extend(text[:cut])
        if last:
            self.finish = "length"
            return self._extend(text)
        return self._extend(text[: _settled(text, self.stops)])

    def _extend(self, text: str) -> str:
        delta, self.text = text[len(self.text) :], text
        return delta


def _sample(tokenizer: Tokenizer, prompt: list[int], ids: list[int], stops: Sequence[str], n: int) -> Sample:
    """A finished row's Sample, from the ids the device loop drew for it."""
    ended = bool(ids) and ids[-1] == tokenizer.eot
    text = tokenizer.decode(ids[:-1] if ended else ids)
    if _first_stop(text, stops) is None:  # the common case, without decoding every prefix
        return Sample(prompt, ids, text, "eot" if ended else "length")
    row = _RowText(tokenizer, stops)
    for i, token in enumerate(ids):
        row.push(token, last=i == n - 1)
        if row.finish:
            break
    return Sample(prompt, row.ids, row.text, row.finish)


def generate(
    params: Any,
    model_cfg: ModelConfig,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    stop: str | Sequence[str] = (),
    progress: Callable[[int], None] | None = None,
) -> list[Sample]:
    """One Sample per prompt. temperature 0 is greedy; top_k 0 and top_p 1 are off; `stop` is one
    stop string or several. See the module docstring for the rest.

    `progress(steps_done)`, if given, is called every PROGRESS_STEPS decoding steps: the loop then
    returns to the host that often (never otherwise), with the same tokens as a single loop.
    """
    params, request, state = _start(
        params, model_cfg, tokenizer, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop
    )
    if progress is None:
        state = _decode(params, state, *request.args, mode=request.mode)
    else:
        step = int(state.step)
        while step < max_new_tokens and not bool(jnp.all(state.done_B)):
            state = _decode(params, state, *request.args, jnp.int32(step + PROGRESS_STEPS), mode=request.mode)
            step = int(state.step)
            progress(step)
    tokens_BN = np.asarray(state.tokens_BN)
    samples = []
    for prompt, row in zip(request.prompts, tokens_BN):
        ids = [int(t) for t in row if t != FINISHED]
        samples.append(_sample(tokenizer, prompt, ids, request.stops, max_new_tokens))
    return samples


def stream(
    params: Any,
    model_cfg: ModelConfig,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    stop: str | Sequence[str] = (),
) -> Iterator[list[Delta]]:
    """Like generate, but yields one Delta per prompt after every step, as the tokens are drawn.

    A row's deltas add up to its Sample: the tokens (None after it finished) to Sample.tokens, the
    texts to Sample.text.
    """
    params, request, state = _start(
        params, model_cfg, tokenizer, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop
    )
    rows = [_RowText(tokenizer, request.stops) for _ in request.prompts]
    reported = 0  # rows finished on the host that the device knows about
    for step in range(max_new_tokens):
        if step:
            state = _step(params, state, *request.args, mode=request.mode)
        deltas = []
        for row, token in zip(rows, np.asarray(state.last_B).tolist()):
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


# --- command line ---------------------------------------------------------------------------


SEPARATOR = "-" * 40


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="sample.py",
        description="Sample text from a trained model. Settings not given come from the checkpoint's "
        "config (its sample section).",
    )
    p.add_argument("run_dir", nargs="?", help="run, checkpoints or step directory (default: the newest run in runs/)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="text to continue; - reads stdin (default: start from end-of-text)")
    source.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--max-new-tokens", type=int, help="tokens per sample (default: the config's, as far as they fit)")
    p.add_argument("--temperature", type=float, help="0 = greedy")
    p.add_argument("--top-k", type=int, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]; 1 = off")
    p.add_argument("--num-samples", type=int, default=1, help="samples to draw; sample i uses seed + i")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="end a sample at this string; repeat for several (a newline in bash: $'\\n')",
    )
    p.add_argument("--stream", action="store_true", help="print text as it is generated, one sample at a time")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the samples: no notes on stderr")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    which.add_argument("--best", action="store_true", help="the checkpoint with the lowest validation loss")
    return p


def _read_prompt(args) -> str:
    """The prompt text; "" (start from end-of-text) only when no prompt is given, as an empty one given is a slip
    (an unset shell variable, an empty pipe)."""
    if args.prompt_file is None:
        if args.prompt is None:
            return ""
        text = sys.stdin.read() if args.prompt == "-" else args.prompt
        if not text:
            where = "standard input (--prompt -)" if args.prompt == "-" else "--prompt"
            raise UserError(f"the prompt from {where} is empty; give text, or drop --prompt to start from end-of-text")
        return text
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UserError(f"prompt file {args.prompt_file} is not UTF-8 (byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise UserError(f"cannot read prompt file {args.prompt_file}: {e.strerror or e}") from None
    if not text:
        raise UserError(f"prompt file {args.prompt_file} is empty; drop --prompt-file to start from end-of-text")
    return text


@cli
def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.num_samples < 1:
        raise UserError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.seed < 0:
        raise UserError(f"--seed must be >= 0, got {args.seed}")
    directory, step = ckpt_lib.find(args.run_dir or runs_lib.latest_run(), args.step, args.best)
    cfg = ckpt_lib.load_config(directory, step)
    pick = lambda given, default: default if given is None else given
    temperature = pick(args.temperature, cfg.sample.temperature)
    top_k, top_p = pick(args.top_k, cfg.sample.top_k), pick(args.top_p, cfg.sample.top_p)
    prompt = _read_prompt(args)
    tokenizer = ckpt_lib.load_tokenizer(directory, step)
    ids = tokenizer.encode(prompt) or [tokenizer.eot]
    window = cfg.model.max_seq_len
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = max(1, min(cfg.sample.max_new_tokens, window - len(ids)))
    # Checked before the parameters are read, which can take a while.
    check_settings(cfg.model, max_new_tokens, temperature, top_k, top_p, args.stop)
    check_fits(len(ids), max_new_tokens, window)
    if max_new_tokens < cfg.sample.max_new_tokens and args.max_new_tokens is None and not args.quiet:
        print(f"note: {max_new_tokens} new tokens fill the model's {window}-token window", file=sys.stderr)
    params, _, _ = load(f"{directory}/{step}", mesh=sharding.make_mesh(MeshConfig()))
    if not args.quiet:
        print(f"sampling {directory}/{step}", file=sys.stderr)
    settings = dict(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop=args.stop
    )
    if args.stream:
        for i in range(args.num_samples):
            if i:
                print(SEPARATOR)
            print(prompt, end="", flush=True)
            for deltas in stream(params, cfg.model, tokenizer, [ids], seed=args.seed + i, **settings):
                print(deltas[0].text, end="", flush=True)
            print()
    else:
        with tqdm(
            total=max_new_tokens, desc="generating", unit="step", leave=False, disable=args.quiet, file=sys.stderr
        ) as bar:
            progress = None if args.quiet else lambda done: bar.update(done - bar.n)
            prompts = [ids] * args.num_samples
            samples = generate(params, cfg.model, tokenizer, prompts, seed=args.seed, progress=progress, **settings)
        for i, s in enumerate(samples):
            if i:
                print(SEPARATOR)
            print(prompt + s.text)
    return 0
