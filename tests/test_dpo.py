"""Preference fine-tuning (DPO): the loss and its gradient against numpy, the pair data (text and chat, masks,
truncation, refusals), a tiny model that learns a synthetic preference, exact resume, LoRA on an imported Llama
and its export."""

import dataclasses
import json
import os
import random
import re
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_params, losses, params

from lm import config as config_lib
from lm import platform, pretrained
from lm.chat import encode_chat
from lm.data import prepare_for_training
from lm.data.examples import load_examples
from lm.errors import ConfigError, UserError
from lm.loss import chunked_token_losses, dpo_loss
from lm.model import init_params
from lm.steps import dpo_sums, make_eval_step
from lm.model import Transformer
from lm.train import train

LLAMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "open_models", "llama")


# --- the loss -------------------------------------------------------------------------------------------------


def numpy_dpo(x, w, targets, mask, reference, beta, smoothing):
    """The mean DPO loss over pairs of rows (2p chosen, 2p+1 rejected) whose logits are x . w, and its gradient
    with respect to x and w, written out by hand."""
    x, w, reference = (np.asarray(a, np.float64) for a in (x, w, reference))
    logits = x @ w
    logits = logits - logits.max(-1, keepdims=True)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    token_logp = np.log(np.take_along_axis(probs, targets[..., None], -1)[..., 0])
    policy = (token_logp * mask).sum(-1).reshape(-1, 2)
    delta = (policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1])
    sigmoid = lambda z: 1 / (1 + np.exp(-z))
    loss = (-(1 - smoothing) * np.log(sigmoid(beta * delta)) - smoothing * np.log(sigmoid(-beta * delta))).mean()
    d_delta = (-(1 - smoothing) * beta * sigmoid(-beta * delta) + smoothing * beta * sigmoid(beta * delta)) / len(delta)
    d_row = np.stack([d_delta, -d_delta], 1).reshape(-1)  # d loss / d log pi(row)
    onehot = np.eye(w.shape[1])[targets]
    d_logits = d_row[:, None, None] * mask[..., None] * (onehot - probs)
    return loss, np.einsum("rtv,dv->rtd", d_logits, w), np.einsum("rtd,rtv->dv", x, d_logits)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_dpo_loss_and_its_gradient_equal_numpy(smoothing):
    rng = np.random.default_rng(0)
    pairs, t, d, v, beta = 3, 7, 5, 11, 0.5  # chunks of 3: two and a remainder of 1
    x = rng.normal(size=(2 * pairs, t, d)).astype(np.float32)
    w = rng.normal(size=(d, v)).astype(np.float32)
    targets = rng.integers(0, v, size=(2 * pairs, t))
    mask = (rng.uniform(size=(2 * pairs, t)) < 0.6).astype(np.float32)
    reference = rng.normal(-12, 2, size=(pairs, 2)).astype(np.float32)

    def mean_loss(x, w):
        ce = chunked_token_losses(x, w, jnp.asarray(targets), chunk=3, dtype="float32")
        policy = -(ce * mask).sum(-1).reshape(-1, 2)
        return dpo_loss(policy, reference, beta, smoothing)[0].mean()

    loss, (dx, dw) = jax.jit(jax.value_and_grad(mean_loss, argnums=(0, 1)))(x, w)
    want_loss, want_dx, want_dw = numpy_dpo(x, w, targets, mask, reference, beta, smoothing)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("way", [{}, {"loss_grad": "written", "log_z": "online"}], ids=["cpu", "gpu_loss"])
def test_dpo_sums_chunked_equal_unchunked_and_start_at_log_2(way):
    """Also with a GPU's loss choices (lm.platform): the reference's log-probabilities (no gradient) are computed
    with the policy's log Z, so policy = reference gives rewards of exactly 0 (they differed by rounding)."""
    rng = np.random.default_rng(1)
    batch = {
        "inputs": jnp.asarray(rng.integers(0, 60, (4, 2, 12)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, 60, (4, 2, 12)), jnp.int32),
        "loss_mask": jnp.asarray(rng.uniform(size=(4, 2, 12)) < 0.5, jnp.float32).at[:, :, -1].set(1.0),
    }
    batch["loss_mask"] = batch["loss_mask"].at[3].set(0.0)  # an empty pair, as filling up a validation batch
    results = []
    for chunk in (0, 5):
        model = dict(n_layer=1, n_head=2, n_embd=16, vocab_size=64, max_seq_len=12)
        cfg = config_lib.replace(config_lib.Config(), model=model, train={"loss_chunk": chunk, "dpo_beta": 0.3})
        p = nn.unbox(init_params(cfg.model, jax.random.key(0)))
        m = Transformer(cfg.model, deterministic=True, platform=dataclasses.replace(platform.current(), **way))
        reference = jax.tree.map(lambda a: a * 0.9, p)
        fn = lambda p: dpo_sums(cfg, m, m, p, reference, batch)["loss"]
        at_start = jax.jit(lambda p: dpo_sums(cfg, m, m, p, p, batch))
        # The reference's last bits apart, as another program may compute them on a GPU: still ties. Not so a real
        # difference of the same order as rounding's bound (the 1e-5 of the log-probabilities' size once allowed
        # counted margins of 7e-4 as ties, on replies of 400 tokens).
        apart = jax.jit(lambda p, eps: dpo_sums(cfg, m, m, p, jax.tree.map(lambda a: a * (1 + eps), p), batch))
        near = apart(p, 1e-5)
        assert float(near["reward_accuracy"]) == 1.5 and float(near["reward_margin"]) != 0.0
        assert float(apart(p, 1e-3)["reward_accuracy"]) != 1.5
        results.append((jax.jit(jax.value_and_grad(fn))(p), at_start(p)))
    (full, _), (chunked, at_start) = results  # at the start: chunked, where the reference has its own function
    # Summed in another order: float32 rounding of the order of 1e-7 on gradients up to ~0.3 (1.3e-7 on one
    # CPU, beyond the 1e-7 first allowed); a chunking fault moves them by orders of magnitude more.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), full, chunked)
    # Policy = reference: every reward is 0, each of the 3 pairs with tokens costs log 2 and counts half as right.
    assert float(at_start["loss"]) == pytest.approx(3 * np.log(2), rel=1e-6)
    assert float(at_start["reward_accuracy"]) == 1.5 and float(at_start["reward_margin"]) == 0.0


@pytest.mark.parametrize("way", [{}, {"loss_grad": "written", "log_z": "online"}], ids=["cpu", "gpu_loss"])
def test_dpo_log_probabilities_leave_a_padded_vocabulary_out_of_the_softmax(way):
    """A reply's log-probability is the model's over the tokenizer's ids, as it samples and as its export scores
    them: the rows of a padded vocabulary (never targets) took probability from both replies, and DPO pushed mass
    into them to lower the rejected one's (a bytes model's padding grew from 16% to 19% in 40 steps)."""
    rng = np.random.default_rng(2)
    n_vocab = 50  # rows 50..63 are padding
    batch = {
        "inputs": jnp.asarray(rng.integers(0, n_vocab, (3, 2, 12)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, n_vocab, (3, 2, 12)), jnp.int32),
        "loss_mask": jnp.asarray(rng.uniform(size=(3, 2, 12)) < 0.5, jnp.float32).at[:, :, -1].set(1.0),
    }
    model = dict(n_layer=1, n_head=2, n_embd=16, vocab_size=64, max_seq_len=12)
    beta = 0.3
    for chunk in (0, 5):
        cfg = config_lib.replace(
            config_lib.Config(), model=model, data={"format": "preference"}, init_from="x",
            train={"loss_chunk": chunk, "dpo_beta": beta, "objective": "dpo"},
        )
        p = nn.unbox(init_params(cfg.model, jax.random.key(0)))
        p = jax.tree.map(lambda a: a * 5, p)  # padding rows with a real share of the probability
        reference = jax.tree.map(lambda a: a * 0.9, p)
        m = Transformer(cfg.model, deterministic=True, platform=dataclasses.replace(platform.current(), **way))

        def logp(params):  # numpy, over the first n_vocab rows only
            logits = np.asarray(m.apply(params, batch["inputs"].reshape(-1, 12)), np.float64)[..., :n_vocab]
            logits = logits - logits.max(-1, keepdims=True)
            logits = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            token = np.take_along_axis(logits, np.asarray(batch["targets"]).reshape(-1, 12)[..., None], -1)[..., 0]
            return (token * np.asarray(batch["loss_mask"]).reshape(-1, 12)).sum(-1).reshape(-1, 2)

        rewards = beta * (logp(p) - logp(reference))
        margin = rewards[:, 0] - rewards[:, 1]
        want = np.log1p(np.exp(-margin)).sum()
        got = jax.jit(lambda p: dpo_sums(cfg, m, m, p, reference, batch, n_vocab=n_vocab))(p)
        np.testing.assert_allclose(float(got["loss"]), want, rtol=1e-5)
        np.testing.assert_allclose(float(got["reward_chosen"]), rewards[:, 0].sum(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(float(got["reward_rejected"]), rewards[:, 1].sum(), rtol=1e-4, atol=1e-5)
        # the training run's evaluation (and its train step: the same dpo_sums) is told the tokenizer's ids
        sums, _ = jax.jit(make_eval_step(cfg, n_vocab))(p, batch, reference)
        np.testing.assert_allclose(float(sums["loss"]), want, rtol=1e-5)


# --- the data -------------------------------------------------------------------------------------------------


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def prepared(tmp_path, path, tok=None, *more):
    cfg = config_lib.load(
        None, [f"data.path={path}", "data.format=preference", "train.objective=dpo", "init_from=x",
               f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.25", *more],
    )  # fmt: skip
    data = prepare_for_training(cfg.data, 0, tok, progress=False)
    source = data.sources[0]
    return data, source, cfg


def sequences(source, split):
    tokens, mask, offsets = load_examples(source.directory, split, source.meta)
    return [(tokens[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]


def test_text_pairs_hold_the_prompt_once_and_train_only_on_responses(tmp_path):
    records = [{"prompt": f"Q{i}: ", "chosen": "yes", "rejected": "no!"} for i in range(8)]
    data, source, cfg = prepared(tmp_path, write_jsonl(tmp_path / "p.jsonl", records))
    tok = data.tokenizer
    assert source.meta["kind"] == "preference" and source.meta["splits"]["val"]["pairs"] == 2
    seqs = sequences(source, "train")
    assert len(seqs) == 12  # 6 train pairs: chosen, rejected, chosen, ...
    for (chosen, c_mask), (rejected, r_mask) in zip(seqs[::2], seqs[1::2]):
        prompt = len(chosen) - 4
        assert chosen[:prompt] == rejected[:prompt] and chosen[prompt:] == tok.encode("yes") + [tok.eot]
        assert rejected[prompt:] == tok.encode("no!") + [tok.eot]
        assert c_mask == [0] * prompt + [1] * 4 and r_mask == c_mask
    batch = next(data.train_iterator(cfg.data, 0, np.arange(4)))
    assert batch["inputs"].shape == (4, 2, cfg.data.block_size)
    chosen, _ = seqs[0]
    assert batch["loss_mask"][:, 0].sum() == 4 * 4  # every pair has its 4 response targets, on each side
    stream = data.train_iterator(dataclasses.replace(cfg.data, batch_size=3), 0, np.arange(3))
    epoch = [bytes(row[row > 0].astype(np.uint8)) for _ in range(2) for row in next(stream)["inputs"][:, 0]]
    want = [bytes(ids[:-1]) for ids, _ in seqs[::2]]
    assert sorted(epoch) == sorted(want) and epoch != want  # each pair once an epoch, shuffled
    assert data.steps_for_epochs(dataclasses.replace(cfg.data, epochs=5, batch_size=4), 0) == 8  # 30 pairs, 4 a step
    val = data.val_batches(cfg.data, 5, np.arange(4))["data"]
    assert len(val) == 1 and val[0]["loss_mask"][2:].sum() == 0  # 2 pairs, and 2 empty ones filling the batch


def test_invalid_utf8_in_pairs_is_a_warning_naming_the_file(tmp_path, capsys):
    """The warning named no file (and said "1 invalid UTF-8 sequences"), where prepare's names the first."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"".join(b'{"prompt": "Q%d ", "chosen": "yes", "rejected": "no"}\n' % i for i in range(7))
                     + b'{"prompt": "\xff", "chosen": "\xe6\x97\xa5", "rejected": "no"}\n')  # fmt: skip
    prepared(tmp_path, str(path))
    want = (f"warning: replaced 1 invalid UTF-8 sequence or unpaired \\ud800-\\udfff escape with U+FFFD in 1 file, "
            f"first in {path}\n")
    assert want in capsys.readouterr().err


def test_an_empty_prompt_conditions_the_replies_on_end_of_text(tmp_path):
    """With no prompt and a tokenizer without BOS, a reply's first token had nothing before it and was never scored:
    pairs told apart by their first tokens ("A" against "B") trained on end-of-text alone. They now follow an
    end-of-text, as lm.eval's empty contexts do, and every reply token is a target."""
    records = [{"prompt": "", "chosen": "A", "rejected": "B"} for _ in range(6)]
    _, source, _ = prepared(tmp_path, write_jsonl(tmp_path / "p.jsonl", records))
    eot = source.meta["n_vocab"] - 1
    for ids, mask in sequences(source, "train")[:2]:
        assert ids[0] == eot and len(ids) == 3 and mask == [0, 1, 1]  # [EOT, reply, EOT]: both reply tokens learned
    assert sequences(source, "train")[0][0][1] != sequences(source, "train")[1][0][1]


def test_pairs_go_on_from_an_origin_at_another_batch_size(tmp_path):
    """A resume at another data.batch_size goes on from the first pair not trained on: each epoch has every pair
    once, and data.epochs' steps are counted on from there."""
    from lm.data.loaders import Origin
    from lm.data.preference import pair_iterator, pair_steps

    records = [{"prompt": f"Q{i}: ", "chosen": "yes", "rejected": "no!"} for i in range(16)]
    _, source, cfg = prepared(tmp_path, write_jsonl(tmp_path / "p.jsonl", records))
    n = source.meta["splits"]["train"]["pairs"]
    make = lambda batch, origin: pair_iterator(source.directory, source.meta, cfg.data.block_size, batch, 0,
                                               origin=origin)  # fmt: skip
    fours = make(4, Origin())
    first = [next(fours) for _ in range(2)]
    threes, origin = make(3, Origin(2, 8)), Origin(2, 8)
    threes.set_state({**threes.get_state(), "next_index": 2})
    steps = pair_steps(source.meta, 3, 2, origin)
    assert steps == 2 + -(-(2 * n - 8) // 3) and pair_steps(source.meta, 4, 2) == -(-2 * n // 4)
    rest = [next(threes) for _ in range(steps - 2)]
    prompts = [bytes(row[row > 0].astype(np.uint8))[:4] for b in [*first, *rest] for row in b["inputs"][:, 0]]
    prompts = [p for p in prompts if p][: 2 * n]  # (the last batch's empty pairs left out)
    assert sorted(prompts[:n]) == sorted(prompts[n:]) and len(set(prompts[:n])) == n  # each pair once an epoch


def test_data_epochs_trains_each_pair_that_many_times_its_last_batch_filled_with_empty_pairs(tmp_path):
    """data.epochs=1 over 12 pairs, 5 a step: 3 steps, whose last batch held 3 pairs of a second epoch (trained twice,
    `epoch` 1.25 and "epoch 2 begins" logged); it now holds the epoch's last 2 pairs and 3 empty ones, as task
    data's last batch is filled with empty rows."""
    records = [{"prompt": f"Q{i:02d}: ", "chosen": "yes", "rejected": "no!"} for i in range(16)]
    data, source, cfg = prepared(tmp_path, write_jsonl(tmp_path / "p.jsonl", records))
    n = source.meta["splits"]["train"]["pairs"]
    for epochs in (1, 2):
        d = dataclasses.replace(cfg.data, epochs=epochs, batch_size=5)
        steps = data.steps_for_epochs(d, 0)
        assert steps == -(-n * epochs // 5)
        stream = data.train_iterator(d, 0, np.arange(5))
        rows = [row for _ in range(steps) for row in next(stream)["inputs"][:, 0]]
        prompts = [bytes(row[row > 0].astype(np.uint8)) for row in rows]
        taken = [p for p in prompts if p]
        assert len(taken) == n * epochs and all(taken.count(p) == epochs for p in taken)
        progress = data.progress(d, 0)
        assert progress(steps)["epoch"] == epochs and progress.new_epochs(steps - 1) == []
        assert progress.new_epochs(steps) == []  # (no epoch epochs + 1 begins)


def test_long_pairs_are_cut_from_the_prompts_start_or_refused(tmp_path, capsys):
    records = [{"prompt": "p" * 40 + "END", "chosen": "abc", "rejected": "de"}] * 4
    path = write_jsonl(tmp_path / "long.jsonl", records)
    data, source, _ = prepared(tmp_path, path, None, "data.block_size=16")
    warning = "warning: 4 preference pairs are longer than data.block_size+1 = 17 tokens"
    assert warning in capsys.readouterr().err
    prepared(tmp_path, path, None, "data.block_size=16")  # prepared already: said again, on every run
    assert warning in capsys.readouterr().err
    (chosen, c_mask), (rejected, r_mask) = sequences(source, "train")[:2]
    assert len(chosen) == 17 and bytes(chosen[-7:-1]) == b"ENDabc" and sum(c_mask) == 4  # the prompt's start went
    assert len(rejected) == 16 and bytes(rejected[:-3]) == bytes(chosen[:-4]) and sum(r_mask) == 3  # the same cut
    with pytest.raises(UserError, match=r"long.jsonl:1: the pair is 47 tokens, longer than data.block_size\+1 = 17"):
        prepared(tmp_path, path, None, "data.block_size=16", "data.pair_overflow=refuse")
    too_long = write_jsonl(tmp_path / "reply.jsonl", [{"prompt": "q", "chosen": "c" * 30, "rejected": "r"}])
    with pytest.raises(UserError, match=r"reply.jsonl:1: a response of 31 tokens needs 32 with the prompt token"):
        prepared(tmp_path, too_long, None, "data.block_size=16")
    # (A reply of exactly data.block_size+1 tokens was "a response alone takes 17 of data.block_size+1 = 17 tokens",
    # which reads as if it fit.)
    edge = write_jsonl(tmp_path / "edge.jsonl", [{"prompt": "q", "chosen": "c" * 16, "rejected": "r"}])
    fits_not = r"edge.jsonl:1: a response of 17 tokens needs 18 with the prompt token before it, more than "
    fits_not += r"data.block_size\+1 = 17"
    with pytest.raises(UserError, match=fits_not):
        prepared(tmp_path, edge, None, "data.block_size=16")


def test_a_chat_pair_whose_learned_tokens_fit_is_not_cut_for_the_templates_closing_newline(tmp_path, capsys):
    """(The template's newline after <|endoftext|>, neither a target nor the input of one, counted in a pair's
    length: a pair whose learned tokens fit data.block_size + 1 exactly was refused under pair_overflow=refuse ("the
    pair is 25 tokens"), and a reply that fit with one prompt token was refused as "a response alone takes 24 of
    data.block_size+1 = 24 tokens".)"""

    def chat(reply):
        return {"messages": [{"role": "user", "content": "q"}], "chosen": {"role": "assistant", "content": reply},
                "rejected": {"role": "assistant", "content": reply[::-1] + "?"}}  # fmt: skip

    fits = write_jsonl(tmp_path / "fits.jsonl", [chat("yes")] * 4)  # "User: q\nAssistant: " + 4 + EOT = 24, then "\n"
    _, source, _ = prepared(tmp_path, fits, None, "data.block_size=23", "data.pair_overflow=refuse")
    assert "warning" not in capsys.readouterr().err
    (chosen, c_mask), (rejected, r_mask) = sequences(source, "train")[:2]
    assert bytes(chosen[:19]) == b"User: q\nAssistant: " and len(chosen) == 23 and len(rejected) == 24  # whole
    assert sum(c_mask) == 4 and sum(r_mask) == 5 and r_mask[-1] == 1  # ending at the end-of-text token, learned
    long_reply = write_jsonl(tmp_path / "reply.jsonl", [chat("y" * 21)] * 4)  # 1 prompt token + 23 fit in 24
    _, source, _ = prepared(tmp_path, long_reply, None, "data.block_size=23")
    assert "4 preference pairs are longer than data.block_size+1 = 24 tokens" in capsys.readouterr().err
    (chosen, c_mask), (rejected, r_mask) = sequences(source, "train")[:2]
    assert len(rejected) == 24 and bytes(rejected[:2]) == b" y" and sum(r_mask) == 23


def test_pairs_whose_responses_are_the_same_are_counted_or_refused(tmp_path, capsys):
    """(Accepted without a word: a pair's loss is log 2 whatever the model, and a file of them trained nothing at
    grad_norm 0.)"""
    same = {"prompt": "a", "chosen": "b", "rejected": "b"}
    path = write_jsonl(tmp_path / "same.jsonl", [same] * 8)
    with pytest.raises(UserError, match="every training pair of .*same.jsonl has the same chosen and rejected"):
        prepared(tmp_path, path)
    good = {"prompt": "a", "chosen": "b", "rejected": "c"}
    path = write_jsonl(tmp_path / "some.jsonl", [same, good, good, good] * 4)
    _, source, _ = prepared(tmp_path, path)
    n = sum(a == b for (a, _), (b, _) in zip(sequences(source, "train")[::2], sequences(source, "train")[1::2]))
    warning = (f"warning: {n} training preference pairs have the same chosen and rejected response (the first in the "
               f"files: {path}:1); DPO learns")  # (the line to find them by: it gave a count alone)
    assert n > 0 and warning in capsys.readouterr().err
    prepared(tmp_path, path)  # prepared already: said again, on every run
    assert warning in capsys.readouterr().err


@pytest.mark.parametrize(
    "record, says",
    [
        ({"prompt": "a", "chosen": "b"}, r"missing 'rejected'; .* \(chat\)$"),  # (no prompt field hint: no fix)
        ({"prompt": "a", "chosen": 3, "rejected": "c"}, r"not a string: 'chosen'; .* \(chat\)$"),
        ({"chosen": "b", "rejected": "c"}, "no 'prompt', and 'chosen' and 'rejected' do not begin alike .*; give "
         "the prompt as 'prompt' .*, or name its field with data.prompt_field$"),
        ({"chosen": " b", "rejected": " c"}, "no 'prompt', and 'chosen' and 'rejected' do not begin alike"),  # (" ")
        ({"chosen": "b"}, r"missing 'prompt'; .*; name another prompt field with data.prompt_field$"),
        (["a", "b", "c"], re.escape('["a", "b", "c"] is not a JSON object; write one preference record a line')),
        ({"messages": [{"role": "user", "content": "a"}], "chosen": {"role": "assistant", "content": "b"}},
         "missing 'rejected'"),
        ({"messages": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"},
         "not an assistant message: 'chosen'"),
    ],
)  # fmt: skip
def test_a_record_missing_a_field_names_its_file_and_line(tmp_path, record, says):
    good = {"prompt": "a", "chosen": "b", "rejected": "c"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, record])
    with pytest.raises(UserError, match=f"bad.jsonl:3: {says}"):
        prepared(tmp_path, path)


def test_trls_standard_implicit_prompt_pairs_are_the_explicit_pairs_trl_splits_them_into(tmp_path):
    """(Refused as "missing 'prompt'": Anthropic's HH-RLHF form, {'chosen': str, 'rejected': str}.) The prompt is
    what both begin with, less the space before the replies' first word (a BPE joins it to that word, " h" here),
    as TRL's extract_prompt splits it; a split inside a word is tokenized on each side as the explicit record is."""
    _, tok = pretrained.config_and_tokenizer(f"hf:{LLAMA}")
    turn = "\n\nHuman: pick {}\n\nAssistant:"
    implicit, explicit = [], []  # (explicit: what trl.data_utils.extract_prompt returns for each implicit record)
    for i in range(4):
        implicit += [{"chosen": turn.format(i) + " hello", "rejected": turn.format(i) + " go away"},
                     {"chosen": turn.format(i) + " blue sky", "rejected": turn.format(i) + " blunt"}]
        explicit += [{"prompt": turn.format(i), "chosen": " hello", "rejected": " go away"},
                     {"prompt": turn.format(i) + " blu", "chosen": "e sky", "rejected": "nt"}]  # fmt: skip
    got = []
    for name, records in (("implicit", implicit), ("explicit", explicit)):
        _, source, _ = prepared(tmp_path, write_jsonl(tmp_path / f"{name}.jsonl", records), tok)
        got.append([sequences(source, split) for split in ("train", "val")])
    assert got[0] == got[1]
    prompt = len(tok.encode_context(turn.format(0)))  # (a blue pair's is longer: " blu" too)
    hello = [(ids, mask) for split in got[0] for ids, mask in split if len(ids) - sum(mask) == prompt]
    assert len(hello) == 8
    for (ids, mask), reply in zip(hello, [" hello", " go away"] * 4):
        assert [t for t, m in zip(ids, mask) if m] == tok.encode(reply) + [tok.eot]


def test_implicit_prompt_pairs_with_the_same_replies_or_one_the_beginning_of_the_other(tmp_path, capsys):
    """Identical replies are a pair whose responses are the same, counted in the warning as an explicit one is;
    where one reply is the whole beginning of the other, the shorter one is its end-of-text alone."""
    records = [{"chosen": "Q: yes", "rejected": "Q: yes, sir"}] * 6 + [{"chosen": "Q: no", "rejected": "Q: no"}] * 2
    from lm.data.preference import prepare_preference
    from lm.tokenizer import get_tokenizer

    val = write_jsonl(tmp_path / "val.jsonl", [{"prompt": "Q:", "chosen": " a", "rejected": " b"}])
    out, tok = str(tmp_path / "out"), get_tokenizer("bytes")
    meta = prepare_preference(write_jsonl(tmp_path / "p.jsonl", records), tok, out, 32, val_path=val, progress=False)
    seqs, eot = sequences(types.SimpleNamespace(directory=out, meta=meta), "train"), tok.eot
    assert seqs[0] == (list(b"Q: yes") + [eot], [0] * 6 + [1])
    assert seqs[1] == (list(b"Q: yes, sir") + [eot], [0] * 6 + [1] * 6)
    assert seqs[-1] == seqs[-2] == (list(b"Q: no") + [eot], [0] * 5 + [1])
    assert "warning: 2 training preference pairs have the same chosen and rejected response" in capsys.readouterr().err


def test_a_file_mixing_text_and_chat_pairs_is_refused_naming_the_first_pair_of_the_other_kind(tmp_path):
    """(Accepted: the text pairs trained the model to reply without its chat template, and the run's closing line
    said --chat or not by the first pair alone.) Across data.path and data.val_path too."""
    text = {"prompt": "a", "chosen": "b", "rejected": "c"}
    chat = {"messages": [{"role": "user", "content": "a"}], "chosen": {"role": "assistant", "content": "b"},
            "rejected": {"role": "assistant", "content": "c"}}  # fmt: skip
    path = write_jsonl(tmp_path / "mixed.jsonl", [chat, chat, text, chat])
    with pytest.raises(UserError, match=r"mixed.jsonl:3: a text pair after chat pairs \(.*mixed.jsonl:1 is one\); "
                       "give pairs of one kind"):  # fmt: skip
        prepared(tmp_path, path)
    texts, chats = write_jsonl(tmp_path / "texts.jsonl", [text] * 4), write_jsonl(tmp_path / "chats.jsonl", [chat] * 2)
    from lm.data.preference import prepare_preference
    from lm.tokenizer import get_tokenizer

    with pytest.raises(UserError, match=r"chats.jsonl:1: a chat pair after text pairs"):
        prepare_preference(texts, get_tokenizer("bytes"), str(tmp_path / "out"), 32, val_path=chats, progress=False)


def test_chat_pairs_render_as_chat_fine_tuning_does_with_loss_on_the_last_reply_only(tmp_path):
    _, tok = pretrained.config_and_tokenizer(f"hf:{LLAMA}")
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello <|im_end|> there"},  # text, never the special token
        {"role": "user", "content": "Pick one"},
    ]
    chosen, rejected = {"role": "assistant", "content": "blue"}, {"role": "assistant", "content": "red, no"}
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": history, "chosen": chosen, "rejected": rejected}] * 4)
    _, source, _ = prepared(tmp_path, path, tok)
    (c_ids, c_mask), (r_ids, r_mask) = sequences(source, "train")[:2]
    for ids, mask, reply in ((c_ids, c_mask, chosen), (r_ids, r_mask, rejected)):
        want_ids, want_mask = encode_chat(tok, [*history, reply])
        assert ids == want_ids  # as data.format=chat tokenizes the conversation
        last = [i for i, m in enumerate(want_mask) if m][-len(tok.encode(reply["content"])) - 1 :]
        assert [i for i, m in enumerate(mask) if m] == last  # the reply and its end of turn, not the earlier one
        assert ids[last[-1]] == tok.special_tokens["<|im_end|>"]


def trl_forms(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """lm's chat pairs in TRL's conversational forms: explicit prompt, and implicit (whole conversations)."""
    explicit = [{"prompt": r["messages"], "chosen": [r["chosen"]], "rejected": [r["rejected"]]} for r in records]
    implicit = [{"chosen": [*r["messages"], r["chosen"]], "rejected": [*r["messages"], r["rejected"]]} for r in records]
    return explicit, implicit


def test_trls_conversational_pairs_are_chat_pairs_with_the_same_tokens_and_masks(tmp_path):
    """(TRL's explicit-prompt form was refused as "not a string: 'prompt'", its implicit form as "missing
    'prompt'".) The history's earlier reply stays out of the mask in each form."""
    from lm.data.preference import holds_chats

    _, tok = pretrained.config_and_tokenizer(f"hf:{LLAMA}")
    records = [{"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello"},
                             {"role": "user", "content": "Pick one"}],
                "chosen": {"role": "assistant", "content": f"blue {i}"},
                "rejected": {"role": "assistant", "content": f"red, no {i}"}} for i in range(8)]  # fmt: skip
    explicit, implicit = trl_forms(records)
    got = []
    for name, form in (("lm", records), ("explicit", explicit), ("implicit", implicit)):
        path = write_jsonl(tmp_path / f"{name}.jsonl", form)
        assert holds_chats(path)  # (the run's --chat hint and export's stop at the template's end of reply)
        _, source, _ = prepared(tmp_path, path, tok)
        got.append([sequences(source, split) for split in ("train", "val")])
        assert source.meta["splits"]["train"]["pairs"] == 6
    assert got[0] == got[1] == got[2]
    (ids, mask), _ = got[0][0][:2]
    assert sum(mask) == len(tok.encode("blue 0")) + 1 and ids[[i for i, m in enumerate(mask) if m][-1]] == (
        tok.special_tokens["<|im_end|>"])  # fmt: skip
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    assert not holds_chats(text)


user, reply = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}


@pytest.mark.parametrize(
    "record, says",
    [
        ({"prompt": [user], "chosen": [reply, user], "rejected": [reply]}, "'chosen' holds 2 messages after its"),
        ({"prompt": [user], "chosen": [reply], "rejected": [user]}, r"'rejected' ends in \{\"role\": \"user\""),
        ({"prompt": [user], "chosen": [reply], "rejected": []}, "not a list of messages: 'rejected'"),
        ({"prompt": [user], "chosen": "a", "rejected": [reply]}, "not a list of messages: 'chosen'"),
        ({"prompt": "q", "chosen": [reply], "rejected": [reply]}, "'prompt' is not a list of messages beside"),
        ({"chosen": [user, reply], "rejected": [user, {**reply, "content": "b"}, user, reply]},
         "'rejected' holds 3 messages after the messages it begins with as 'chosen' does"),
        ({"chosen": [user, reply], "rejected": [{**user, "content": "r"}, reply]}, "'chosen' holds 2 messages after"),
        ({"chosen": [user, user], "rejected": [user, reply]}, "'chosen' ends in .*, not an assistant message"),
        ({"chosen": [user, {"role": "assistant", "content": 3}], "rejected": [user, reply]}, "'chosen' ends in"),
    ],
)  # fmt: skip
def test_a_trl_pair_that_is_not_one_reply_against_one_is_one_line(tmp_path, record, says):
    good = {"prompt": [user], "chosen": [reply], "rejected": [{**reply, "content": "b"}]}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, record])
    with pytest.raises(UserError, match=f"bad.jsonl:3: {says}.*: a conversational preference record is "
                       r"\{'prompt': \[messages\], ") as refused:  # fmt: skip
        prepared(tmp_path, path)
    assert "\n" not in str(refused.value)


def test_a_refused_first_prepare_leaves_no_cache_directory_behind(tmp_path):
    """(data/pairs-preference-XXXXXXXX/ stayed holding only .prepare.lock and .read.lock, for good: the corrected
    file prepares into another directory.) Task and chat data alike; a directory that was there stays."""
    from lm.data.examples import prepare_examples
    from lm.data.preference import prepare_preference
    from lm.tokenizer import get_tokenizer

    bad = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a"}])
    with pytest.raises(UserError, match="pairs.jsonl:2: missing 'chosen'"):
        prepared(tmp_path, bad)
    assert os.listdir(tmp_path / "cache") == []
    tok, out = get_tokenizer("bytes"), tmp_path / "out"
    for chat, record in ((False, {"prompt": 3}), (True, {"messages": 3})):
        path = write_jsonl(tmp_path / "examples.jsonl", [record])
        with pytest.raises(UserError):
            prepare_examples(path, tok, str(out), chat=chat, progress=False)
        assert not out.exists()
    out.mkdir()  # (one the user made: lm leaves it)
    with pytest.raises(UserError):
        prepare_preference(bad, tok, str(out), 32, progress=False)
    assert out.is_dir()
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 4)
    _, source, _ = prepared(tmp_path, good)  # (and a prepare that works keeps its directory)
    assert os.path.isfile(os.path.join(source.directory, "meta.json"))


# --- training -------------------------------------------------------------------------------------------------


def synthetic_pairs(path, n=400, seed=0):
    """Prefer replies that end with "!" over those that end with "?": random letters otherwise."""
    rng = random.Random(seed)
    word = lambda k: "".join(rng.choice("abcdefghij") for _ in range(k))
    return write_jsonl(
        path, [{"prompt": word(6) + ": ", "chosen": word(5) + "!", "rejected": word(5) + "?"} for _ in range(n)]
    )


def dpo_args(tmp_path, data_cache, base, pairs, *more):
    return [
        f"run.dir={tmp_path / 'dpo'}", f"data.cache_dir={data_cache}", "logging.progress=false", f"init_from={base}",
        f"data.path={pairs}", "data.format=preference", "train.objective=dpo", "data.block_size=32",
        "data.batch_size=8", "train.steps=12", "train.log_every=1", "train.eval_every=6", "train.eval_batches=5",
        "train.ckpt_every=6", "train.steps_per_call=1", "optim.lr=3e-3", "optim.warmup_steps=2", *more,
    ]  # fmt: skip


def evals(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "val_loss" in r]


def test_dpo_learns_a_synthetic_preference_and_resumes_exactly(tmp_path, data_cache, tiny_run, capsys):
    pairs = synthetic_pairs(tmp_path / "pairs.jsonl")
    args = dpo_args(tmp_path, data_cache, tiny_run, pairs)
    whole = train(config_lib.load(None, [*args, f"run.dir={tmp_path / 'whole'}"]))
    out = capsys.readouterr().out
    n_train = int(re.search(r"^data: (\d+) train and \d+ val preference pairs \(", out, re.M).group(1))
    # the step's log line shows the rewards, as the evaluation's does (it showed reward_accuracy alone)
    rewards = r"reward_accuracy [\d.]+ margin -?[\d.]+ \(chosen -?[\d.]+, rejected -?[\d.]+\)"
    assert re.search(rf"^step 12: loss [\d.]+ .* {rewards}", out, re.M)
    held_out = evals(whole)
    assert [r["step"] for r in held_out] == [0, 6, 12]
    assert held_out[0]["val_reward_accuracy"] == 0.5 and held_out[0]["val_loss"] == pytest.approx(np.log(2))
    assert held_out[-1]["val_reward_accuracy"] >= 0.9 and held_out[-1]["val_loss"] < held_out[0]["val_loss"]
    assert held_out[-1]["val_reward_chosen"] > 0 > held_out[-1]["val_reward_rejected"]
    with open(os.path.join(whole, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f if '"reward_margin"' in line]
    assert len(logged) == 12 and {"reward_accuracy", "reward_chosen", "reward_rejected"} <= logged[0].keys()
    # epochs of the pairs, 8 a step (a DPO run logged none)
    assert [r["epoch"] for r in logged] == pytest.approx([8 * (i + 1) / n_train for i in range(12)])
    # Killed after its checkpoint at step 6, the run resumes with the same reference model and batches.
    cut = config_lib.load(None, [*args, f"run.dir={tmp_path / 'cut'}"])
    train(cut, stop_after=6)
    resumed = train(cut)
    assert losses(resumed) == losses(whole)
    assert_same_params(params(resumed, 12), params(whole, 12))


def test_a_block_longer_than_the_starting_models_context_is_refused_before_the_pairs_are_prepared(
    tmp_path, data_cache, tiny_run
):
    """(data.block_size=128 from a run of block 32: the pairs were tokenized, with warnings about the pairs longer
    than 129 tokens, into a cache of that block size, minutes on a large file, before the one line refused it.)"""
    pairs = synthetic_pairs(tmp_path / "pairs.jsonl", n=20)
    cache = tmp_path / "cache"
    args = dpo_args(tmp_path, data_cache, tiny_run, pairs, "data.block_size=128", f"data.cache_dir={cache}")
    says = r"^data.block_size=128 is longer than init_from's context, model.max_seq_len=32"
    with pytest.raises(UserError, match=says):
        train(config_lib.load(None, args))
    assert not cache.exists() or not os.listdir(cache)


def chat_pairs(n: int) -> list[dict]:
    """n chat preference pairs: a user's Qi, the reply "Ai!" chosen over "Ai?" (i mod 5)."""
    return [
        {"messages": [{"role": "user", "content": f"Q{i}"}], "chosen": {"role": "assistant", "content": f"A{i % 5}!"},
         "rejected": {"role": "assistant", "content": f"A{i % 5}?"}}
        for i in range(n)
    ]  # fmt: skip


def test_dpo_on_trls_implicit_prompt_pairs_trains_and_ends_with_a_command_that_chats(tmp_path, data_cache, capsys):
    pairs = write_jsonl(tmp_path / "trl.jsonl", trl_forms(chat_pairs(8))[1])
    args = dpo_args(tmp_path, data_cache, f"hf:{LLAMA}", pairs, "lora.rank=4", "train.steps=1", "train.eval_every=0",
                    "data.batch_size=2")  # fmt: skip
    run_dir = train(config_lib.load(None, args))
    out = capsys.readouterr().out
    assert re.search(r"^step 1: loss [\d.]+ ", out, re.M) and f"python sample.py {run_dir} --chat Hello\n" in out


def test_dpo_on_chat_pairs_ends_with_a_command_that_chats(tmp_path, data_cache, capsys):
    """A model aligned on chat pairs is a chat model: the run's closing line says to sample it with --chat, as the
    README's walk-through does (it said `sample.py RUN` alone, which prompts the chat model with raw text)."""
    from lm.data.preference import holds_chats

    records = chat_pairs(8)
    chats = write_jsonl(tmp_path / "chat_pairs.jsonl", records)
    texts = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    assert holds_chats(chats) and not holds_chats(texts) and not holds_chats(str(tmp_path / "gone.jsonl"))
    args = dpo_args(tmp_path, data_cache, f"hf:{LLAMA}", chats, "lora.rank=4", "train.steps=1", "train.eval_every=0",
                    "data.batch_size=2")  # fmt: skip
    run_dir = train(config_lib.load(None, args))
    assert f"sample with: python sample.py {run_dir} --chat Hello\n" in capsys.readouterr().out


@pytest.mark.slow
def test_dpo_with_lora_on_an_imported_llama_exports(tmp_path, data_cache):
    records = chat_pairs(40)
    path = write_jsonl(tmp_path / "chat_pairs.jsonl", records)
    args = dpo_args(
        tmp_path, data_cache, f"hf:{LLAMA}", path, "lora.rank=4", "train.steps=6", "train.eval_every=6",
        "train.eval_batches=1", "data.batch_size=4", "optim.lr=1e-2",
    )  # fmt: skip
    run_dir = train(config_lib.load(None, args))
    history = evals(run_dir)
    assert history[0]["val_reward_accuracy"] == 0.5 and history[-1]["val_loss"] < history[0]["val_loss"]
    from lm import hf
    from lm.export import main as export_main

    trained, cfg, _ = pretrained.load(run_dir)  # the base with the adapters merged
    base, _, _ = pretrained.load(f"hf:{LLAMA}")
    assert export_main([run_dir, str(tmp_path / "aligned")]) == 0
    again, again_cfg, _ = hf.load(str(tmp_path / "aligned"))
    ids = jnp.asarray([[0, 5, 9, 17, 33]])
    out = Transformer(again_cfg).apply(again, ids)
    np.testing.assert_allclose(out, Transformer(cfg).apply(trained, ids), atol=1e-5)
    assert not np.allclose(out, Transformer(cfg).apply(base, ids), atol=1e-5)  # the export holds what DPO changed


@pytest.mark.parametrize("fmt", ["preference", "examples"])
def test_compressed_pair_and_task_files_read_as_their_suffix_says(tmp_path, fmt):
    """Preference pairs and task examples in .jsonl.gz / .jsonl.zst are read decompressed, as text inputs are: the
    same sequences as the plain file (they were "not a JSON line"); a compressed file without its suffix is one
    line saying so (it was the same "not a JSON line")."""
    import gzip

    import zstandard

    if fmt == "preference":
        records = [{"prompt": f"Q{i}: ", "chosen": "yes", "rejected": "no!"} for i in range(8)]
    else:
        records = [{"prompt": f"Q{i}: ", "completion": "yes"} for i in range(8)]
    plain = write_jsonl(tmp_path / "p.jsonl", records)
    with open(plain, "rb") as f:
        raw = f.read()
    (tmp_path / "p.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "p.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "gz.jsonl").write_bytes(gzip.compress(raw))
    args = () if fmt == "preference" else ("data.format=examples", "train.objective=cross_entropy")
    want = {split: sequences(prepared(tmp_path, plain, None, *args)[1], split) for split in ("train", "val")}
    for name in ("p.jsonl.gz", "p.jsonl.zst"):
        source = prepared(tmp_path, str(tmp_path / name), None, *args)[1]
        assert {split: sequences(source, split) for split in ("train", "val")} == want, name
    with pytest.raises(UserError, match=r"gz\.jsonl is gzip-compressed, not text; name it with its suffix"):
        prepared(tmp_path, str(tmp_path / "gz.jsonl"), None, *args)


def test_a_run_from_fresh_weights_resumed_as_dpo_says_it_has_no_starting_weights(tmp_path, data_cache, tiny_run):
    """(A pretraining run's name given to a DPO run: 'this run was started from init_from=, which its DPO reference
    read again on resume; resume with that init_from', an empty init_from that DPO refuses.)"""
    import shutil

    pretrained_run = tmp_path / "pretrained"
    shutil.copytree(tiny_run, pretrained_run, ignore=shutil.ignore_patterns("pinned"))
    pairs = synthetic_pairs(tmp_path / "pairs.jsonl", n=20)
    args = dpo_args(tmp_path, data_cache, tiny_run, pairs, f"run.dir={pretrained_run}", "train.steps=20")
    with pytest.raises(UserError, match=r"^this run was started from freshly initialised weights, without init_from: "
                       r"it has no starting weights to read again as a DPO reference model; start a new run"):  # fmt: skip
        train(config_lib.load(None, args))
    assert sorted(os.listdir(pretrained_run / "checkpoints")) == sorted(os.listdir(os.path.join(tiny_run, "checkpoints")))


def test_a_resume_from_another_reference_is_refused_before_its_pairs_are_prepared(tmp_path, data_cache, tiny_run):
    """(The refusal came once the pairs were tokenized, with the other model's tokenizer: minutes of a large file.)"""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_run, other, ignore=shutil.ignore_patterns("pinned"))
    pairs = synthetic_pairs(tmp_path / "pairs.jsonl", n=40)
    args = dpo_args(tmp_path, data_cache, tiny_run, pairs, "train.steps=2", "train.ckpt_every=2", "train.eval_every=0")
    train(config_lib.load(None, args))
    fresh = tmp_path / "fresh_cache"
    with pytest.raises(UserError, match=r"^this run was started from init_from=.*/checkpoints/10, which its DPO "
                       r"reference read again on resume; resume with that init_from"):  # fmt: skip
        train(config_lib.load(None, [*args, f"init_from={other}", "train.steps=4", f"data.cache_dir={fresh}"]))
    assert not fresh.exists()  # no pairs prepared


def test_dpo_epochs_that_give_more_steps_than_the_step_counter_holds_are_one_line(tmp_path, data_cache, tiny_run):
    """(data.epochs=10**9 over 400 pairs: train.steps=5e10 was trained on unchecked, and the config.yaml it wrote was
    then refused by the printed resume command: 'train.steps must be in [1, 2**31)'.)"""
    pairs = synthetic_pairs(tmp_path / "pairs.jsonl")
    args = dpo_args(tmp_path, data_cache, tiny_run, pairs, "data.epochs=1000000000")
    with pytest.raises(ConfigError, match=r"^data\.epochs=1000000000 gives train\.steps=\d+, past the step "
                       r"counter's 2\*\*31"):  # fmt: skip
        train(config_lib.load(None, args))
    assert not (tmp_path / "dpo").exists()
