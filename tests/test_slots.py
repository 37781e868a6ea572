"""Behaviour of lm.sampling.slots and rules.draw_rows: decoding over a fixed set of slots whose rows start and stop
on their own, each with its own settings, drawing what generate draws for the same prompt, settings and seed.

The model and prompts are tests/test_sampling.py's (tiny, random weights, the byte tokenizer).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling import MAIN, TOK, full_forward, random_params

from lm import model as M
from lm import platform
from lm import sampling as S
from lm.config import SampleConfig
from lm.sampling import rules, slots

N = 12
# (prompt, temperature, top_p, seed): greedy, sampled, sampled with top-p
ROWS = [("ROMEO:", 0.0, 1.0, 0), (list(range(1, 15)), 1.0, 1.0, 5), ("To be", 0.7, 0.9, 9), ("", 1.3, 0.5, 2)]


def ids_of(prompt) -> list[int]:
    return TOK.encode_context(prompt).tolist() if isinstance(prompt, str) else list(prompt)


def alone(prompt, temperature, top_p, seed, top_k: int = 0) -> list[int]:
    settings = SampleConfig(max_new_tokens=N, temperature=temperature, top_p=top_p, top_k=top_k)
    return S.generate(random_params(), MAIN, TOK, [prompt], settings, seed=seed)[0].tokens


def run(rows, schedule: list[int | None], n_slots: int, top_k: int = 0) -> dict[int, list[int]]:
    """Admit rows[r] when the schedule says r (None: one step), each into the lowest free slot; a row leaves its
    slot after N tokens or end-of-text. Returns each row's tokens."""
    sl = slots.Slots(jax.tree.map(jnp.asarray, random_params()), MAIN, rules.Vocab.of(TOK), n_slots, top_k=top_k)
    got, row_in, live = {}, {}, np.zeros(n_slots, bool)

    def take(slot, token):
        got[row_in[slot]].append(token)
        if len(got[row_in[slot]]) == N or token == TOK.eot:
            live[slot] = False

    for r in schedule:
        if r is None:
            tokens = np.asarray(sl.step(live.copy()))
            for slot in np.flatnonzero(live):
                take(slot, int(tokens[slot]))
        else:
            prompt, temperature, top_p, seed = rows[r]
            slot = int(np.flatnonzero(~live)[0])
            row_in[slot], got[r], live[slot] = r, [], True
            take(slot, int(sl.admit(slot, ids_of(prompt), seed, temperature, top_p)))
    return got


def test_draw_rows_draws_what_draw_draws_with_each_rows_rule():
    logits_BV = jax.random.normal(jax.random.key(0), (6, 300)) * 3
    temperature = np.float32([0, 1, 0.7, 1.3, 0.7, 2])
    top_p = np.float32([1, 1, 0.9, 0.5, 1, 0.2])
    seeds, steps = np.uint32([3, 4, 5, 6, 7, 8]), np.int32([0, 1, 5, 2, 9, 4])
    for nucleus, greedy, top_k in ((False, "argmax", 0), (True, "argmax", 0), (True, "first_max", 0), (False, "argmax", 5),
                                   (True, "argmax", 5)):  # fmt: skip
        got = rules.draw_rows(logits_BV, rules.Vocab(257), temperature, top_p, seeds, steps, nucleus, greedy, top_k)
        for r in range(6):
            if top_p[r] < 1 and not nucleus:
                continue  # a row with top-p is only drawn with the filter compiled
            rule = rules.from_settings(float(temperature[r]), top_k, float(top_p[r]), 257, greedy)
            want = rules.draw(rule, logits_BV[r : r + 1], rules.Vocab(257), seeds[r : r + 1], steps[r])
            assert int(got[r]) == int(want[0]), (r, nucleus, greedy, top_k)


def test_rows_admitted_at_any_step_draw_what_generate_draws_alone():
    want = {r: alone(*row) for r, row in enumerate(ROWS)}
    # Row 0 alone for three steps; rows 1 and 2 join; row 3 takes the slot row 0 left (the lowest free).
    schedule = [0, None, None, None, 1, None, 2] + [None] * 8 + [3] + [None] * 2 * N
    assert run(ROWS, schedule, n_slots=4) == want


def test_the_slots_top_k_is_every_sampled_rows_as_generate_draws_with_it():
    """A server's top_k (its model's generation_config.json) filters every sampled row; greedy rows stay greedy."""
    want = {r: alone(*row, top_k=3) for r, row in enumerate(ROWS)}
    assert want != {r: alone(*row) for r, row in enumerate(ROWS)}  # (the filter changes these rows' draws)
    assert run(ROWS, [0, 1, None, 2, 3] + [None] * 2 * N, n_slots=4, top_k=3) == want
    assert run(ROWS[1:2], [0] + [None] * N, n_slots=2, top_k=TOK.n_vocab)[0] == alone(*ROWS[1])  # all: off


def test_a_seeded_row_draws_the_same_whatever_shares_the_batch():
    seeded = ("To be", 1.0, 1.0, 11)
    by_itself = run([seeded], [0] + [None] * N, n_slots=4)[0]
    crowded = run([*ROWS[:3], seeded], [0, 1, None, 3, 2] + [None] * 2 * N, n_slots=4)[3]
    assert crowded == by_itself == alone(*seeded)


def test_steps_compile_once_and_admissions_once_per_bucket():
    compiled = lambda: (slots._admit._cache_size(), slots._step._cache_size())
    before = compiled()
    # Five slots, which no other test uses, so that the first calls compile.
    run([("ab", 0.8, 1.0, 1), ("a longer prompt", 0.0, 1.0, 2), ("cd", 0.5, 1.0, 3)], [0, 1, None, 2, None], 5)
    assert compiled() == (before[0] + 2, before[1] + 1)  # buckets 8 and 16; one step
    run([("ef", 1.0, 0.7, 4), ("gh", 1.0, 0.3, 5)], [0, None, 1, None], 5)
    assert compiled() == (before[0] + 3, before[1] + 2)  # with the top-p filter: one admission, one step
    # A row with logprobs, penalties or a logit bias shares its bucket's admission: it waits for no compile
    sl = slots.Slots(jax.tree.map(jnp.asarray, random_params()), MAIN, rules.Vocab.of(TOK), 5)
    sl.admit(0, ids_of("ij"), 6, 0.8, 1.0, logprobs=True, presence_penalty=0.5, logit_bias={3: 1.0})
    assert sl.logprobs is not None and sl.admit(1, ids_of("kl"), 7, 0.0, 1.0) is not None and sl.logprobs is None
    assert compiled()[0] == before[0] + 3


def test_idle_slots_do_not_move():
    sl = slots.Slots(jax.tree.map(jnp.asarray, random_params()), MAIN, rules.Vocab.of(TOK), 4)
    sl.admit(1, TOK.encode("hello"), 0, 0.0, 1.0)
    for _ in range(4):
        sl.step(np.asarray([False, True, False, False]))
    np.testing.assert_array_equal(sl.state.cache["lengths"], [0, 5 + 4, 0, 0])
    np.testing.assert_array_equal(sl.state.drawn_B, [0, 5, 0, 0])


@pytest.mark.parametrize("rows", [1, 4])
def test_one_slot_or_several(rows):
    """A batch of one slot (the CPU layout for one row differs) decodes as one of several."""
    row = ("ROMEO:", 1.0, 1.0, 3)
    assert run([row], [0] + [None] * N, n_slots=rows)[0] == alone(*row)


def test_logprobs_are_over_the_real_vocabulary_before_the_sampling_settings():
    """A server's logprobs: log_softmax of the model's logits over the tokenizer's ids (the padding of the model's
    vocabulary and a tokenizer's unused ids have none, however large their logits), the top 20 most likely first."""
    logits_BV = jax.random.normal(jax.random.key(1), (3, 300)) * 3
    logits_BV = logits_BV.at[:, 257:].set(1000.0).at[:, 7].set(1000.0)  # padding, and an unused id
    vocab = rules.Vocab(257, unused=(7,))
    token_B = jnp.asarray([0, 5, 256], jnp.int32)
    got = rules.logprobs(logits_BV, vocab, token_B)
    real = np.asarray(logits_BV, np.float64)[:, :257]
    real[:, 7] = -np.inf
    want_BV = real - np.log(np.exp(real).sum(-1, keepdims=True))
    np.testing.assert_allclose(got.chosen_B, want_BV[np.arange(3), token_B], atol=1e-5)
    np.testing.assert_array_equal(got.ids_BK, np.argsort(-want_BV, axis=-1)[:, :20])
    np.testing.assert_allclose(got.top_BK, np.sort(want_BV, axis=-1)[:, ::-1][:, :20], atol=1e-5)


def penalized_by_recomputation(prompt, n: int, frequency: float, presence: float, bias: dict[int, float]):
    """Greedy tokens with OpenAI's penalties and logit bias applied to a full forward pass's logits at each step:
    logits[j] - count[j] * frequency - (count[j] > 0) * presence + bias[j], counting the generated tokens only."""
    tokens, counts = ids_of(prompt), np.zeros(TOK.n_vocab)
    bias_V = np.zeros(TOK.n_vocab)
    bias_V[list(bias)] = list(bias.values())
    for _ in range(n):
        logits_V = np.asarray(full_forward(MAIN)(random_params(), jnp.asarray([tokens]))[0, -1, : TOK.n_vocab])
        token = int(np.argmax(logits_V - counts * frequency - (counts > 0) * presence + bias_V))
        tokens.append(token)
        counts[token] += 1
    return tokens[len(ids_of(prompt)) :]


def admit_and_step(sl, slot: int, prompt, steps: int, live=None, **settings) -> list[int]:
    live = np.eye(sl.rows, dtype=bool)[slot] if live is None else live
    got = [int(sl.admit(slot, ids_of(prompt), 0, 0.0, 1.0, **settings))]
    return got + [int(np.asarray(sl.step(live))[slot]) for _ in range(steps - 1)]


def test_penalties_and_logit_bias_change_the_draws_as_openai_defines_them():
    sl = slots.Slots(jax.tree.map(jnp.asarray, random_params()), MAIN, rules.Vocab.of(TOK), 2)
    plain = admit_and_step(sl, 0, "ROMEO:", N)
    assert len(set(plain)) < N  # the model repeats itself
    assert plain == penalized_by_recomputation("ROMEO:", N, 0.0, 0.0, {})
    spread = admit_and_step(sl, 0, "ROMEO:", N, presence_penalty=2.0)
    assert spread == penalized_by_recomputation("ROMEO:", N, 0.0, 2.0, {}) and len(set(spread)) == N
    for frequency, presence, bias in ((0.7, 0.0, {}), (-0.4, 0.3, {}), (1.0, -1.5, {plain[1]: 3.5, 40: -2.0})):
        settings = dict(frequency_penalty=frequency, presence_penalty=presence, logit_bias=bias)
        got = admit_and_step(sl, 1, "ROMEO:", N, **settings)
        assert got == penalized_by_recomputation("ROMEO:", N, frequency, presence, bias), settings
    # -100 bans the greedy token, +100 forces a token
    assert plain[0] not in admit_and_step(sl, 0, "ROMEO:", N, logit_bias={plain[0]: -100})
    assert admit_and_step(sl, 0, "ROMEO:", N, logit_bias={65: 100}) == [65] * N


def test_rows_without_penalties_draw_what_they_drew_beside_rows_with_them():
    """The penalties are compiled into the steps while a row has them; the other rows draw as before, also in a
    slot whose earlier row had a bias, and their sampled draws too."""
    want = {r: alone(*row) for r, row in enumerate(ROWS)}
    sl = slots.Slots(jax.tree.map(jnp.asarray, random_params()), MAIN, rules.Vocab.of(TOK), 5)
    admit_and_step(sl, 0, "To be", 3, logit_bias={65: 100, 66: 50}, frequency_penalty=2.0)  # leaves its bias
    got = {slot: [int(sl.admit(slot, ids_of(row[0]), row[3], row[1], row[2]))] for slot, row in enumerate(ROWS)}
    forced = [int(sl.admit(4, ids_of("JULIET:"), 0, 0.0, 1.0, logit_bias={66: 100}))]
    for i in range(N - 1):  # (the bias's row leaves after its second token)
        tokens = np.asarray(sl.step(np.asarray([True] * 4 + [i == 0])))
        forced += [int(tokens[4])] * (i == 0)
        for slot in range(4):
            got[slot].append(int(tokens[slot]))
    assert got == want and forced == [66, 66]


def test_steps_compile_the_penalties_in_only_while_a_live_row_has_them():
    """The counts and bias are made with the slots (a server's memory is taken at its start); a step compiles them
    in while a live row has them, and steps without such a row run the program they ran before."""
    sl = slots.Slots(jax.tree.map(jnp.asarray, random_params()), MAIN, rules.Vocab.of(TOK), 6)  # (no other test's 6)
    assert sl.penalties.counts_BV.shape == (6, MAIN.vocab_size)
    assert slots.penalties_bytes(MAIN, 6) == sum(x.nbytes for x in jax.tree.leaves(sl.penalties))
    admit_and_step(sl, 0, "ab", 3)
    before = slots._step._cache_size()
    admit_and_step(sl, 1, "cd", 3, live=np.asarray([1, 1, 0, 0, 0, 0], bool), presence_penalty=0.5)
    assert slots._step._cache_size() == before + 1 and sl.penalties.counts_BV.shape == (6, MAIN.vocab_size)
    admit_and_step(sl, 0, "ab", 3)
    assert slots._step._cache_size() == before + 1


def test_an_admission_that_scores_its_prompt_scores_it_as_score_does_and_draws_the_same_rows():
    """admit(score=True) scores the prompt with the prefill that admits it (an echo's one pass): its scores are
    score()'s, and the row draws what it draws unscored, sampled or greedy."""
    params = jax.tree.map(jnp.asarray, random_params())
    scored, plain = (slots.Slots(params, MAIN, rules.Vocab.of(TOK), 2) for _ in range(2))
    for prompt, temperature, top_p, seed in (ROWS[0], ROWS[2]):  # (greedy, sampled with top-p: one bucket)
        ids = ids_of(prompt)
        first = scored.admit(1, ids, seed, temperature, top_p, logprobs=True, score=True)
        want = scored.score(ids)
        n = len(ids) - 1
        np.testing.assert_array_equal(np.asarray(scored.scored.ids_BK)[:n], np.asarray(want.ids_BK)[:n])
        np.testing.assert_allclose(np.asarray(scored.scored.chosen_B)[:n], np.asarray(want.chosen_B)[:n], atol=1e-6)
        np.testing.assert_allclose(np.asarray(scored.scored.top_BK)[:n], np.asarray(want.top_BK)[:n], atol=1e-6)
        drawn = np.asarray(scored.logprobs.chosen_B)
        assert int(first) == int(plain.admit(1, ids, seed, temperature, top_p, logprobs=True))
        assert plain.scored is None
        np.testing.assert_allclose(drawn, np.asarray(plain.logprobs.chosen_B), atol=1e-6)
        live = np.asarray([False, True])
        for _ in range(3):
            assert int(scored.step(live)[1]) == int(plain.step(live)[1])


@pytest.mark.parametrize("tied", [True, False])
def test_scoring_a_long_prompt_never_holds_the_logits_of_all_its_positions(tied):
    """An echo's scores come from the prefill's hidden states, the head's logits a chunk of positions at a time
    (the platform's loss_chunk): the float32 logits of a long prompt's every position (gigabytes for thousands of
    positions of a large vocabulary) never exist at once. Measured as the compiled scoring's memory beyond that of
    the prefill an unscored admission runs; shapes only, nothing is allocated."""
    plat = platform.current()
    width = 8 * plat.loss_chunk
    cfg = dataclasses.replace(MAIN, vocab_size=65536, max_seq_len=width, tie_embeddings=tied)
    params = jax.eval_shape(lambda: nn.unbox(M.init_params(cfg, jax.random.key(0))))
    prompt_1T = jax.ShapeDtypeStruct((1, width), jnp.int32)
    vocab = rules.Vocab(cfg.vocab_size)
    score = slots._score.lower(params, prompt_1T, model=cfg, platform=plat, vocab=vocab).compile()
    last = jnp.asarray([width - 1])
    prefill = jax.jit(lambda p, x: slots._prefill(p, x, cfg, plat, last)).lower(params, prompt_1T).compile()
    beyond = score.memory_analysis().temp_size_in_bytes - prefill.memory_analysis().temp_size_in_bytes
    whole = width * cfg.vocab_size * 4  # (all the logits at once, in float32: scored at once, it took 1.6x that)
    assert beyond < whole / 2


def test_compile_all_leaves_no_request_a_compile():
    """A server's first request with top-p, logprobs, penalties, an echo or a longer prompt compiled its program while
    every live row waited; after compile_all, requests of every kind and prompt length trace nothing. (rows=3 and a
    24-token window: slot states no other test gives the admission and step, so they are traced here first.)"""
    traced = []

    def listen(event, duration, **info):
        if event == "/jax/core/compile/jaxpr_trace_duration" and info.get("fun_name") in ("_admit", "_step", "_score"):
            traced.append(info["fun_name"])

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        sl = slots.Slots(jax.tree.map(jnp.asarray, random_params()), MAIN, rules.Vocab.of(TOK), 3, window=24)
        assert sl.compile_all() == 3 * 4 + 3 + 8  # buckets 8, 16 and 24: 4 admissions and a score each; 8 steps
        # (score() takes no slot state: another test may have traced it for these weights)
        assert (traced.count("_admit"), traced.count("_step")) == (12, 8)
        traced.clear()
        live = np.zeros(3, bool)
        for length, temperature, top_p, logprobs, penalty, score in [
            (1, 0.0, 1.0, False, 0.0, False), (9, 0.8, 0.9, True, 0.0, True), (23, 1.0, 1.0, False, 1.5, False),
            (16, 0.0, 0.5, True, 0.0, True), (5, 1.2, 0.3, False, 0.0, False),
        ]:  # fmt: skip
            slot = int(np.flatnonzero(~live)[0]) if not live.all() else 0
            sl.admit(slot, [7] * length, 1, temperature, top_p, logprobs, presence_penalty=penalty, score=score)
            live[slot] = length < 20  # (a row of 23 tokens has one to draw: it leaves)
            for _ in range(2):
                sl.step(live.copy())
        for length in (2, 13, 24):
            sl.score([7] * length)
        jax.block_until_ready(sl.state)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert traced == []
