"""Behaviour of lm.serve: the OpenAI-compatible server, its continuous-batching scheduler and its request checks.

The server runs as `python -m lm.serve` in a subprocess on 127.0.0.1 (a free port), serving the tiny random Qwen3
of tests/fixtures/open_models (its ChatML template, 256-token window) with 4 slots; the tests talk to it with
OpenAI's own Python client, and with raw HTTP for the mistakes and the disconnects. Greedy outputs are compared
with sample.py's. The scheduler's own tests run it in this process over tests/test_sampling.py's tiny model.
"""

from __future__ import annotations

import copy
import dataclasses
import http.client
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, python_path
from test_sampling import MAIN, TOK, full_forward, random_params

from lm import sampling as S
from lm.chat import encode_chat
from lm.config import SampleConfig
from lm.pretrained import config_and_tokenizer
from lm.serve import api
from lm.serve.cli import AGAIN
from lm.serve.scheduler import SHUTTING_DOWN, Choice, Scheduler

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

QWEN = "hf:" + os.path.join(ROOT, "tests", "fixtures", "open_models", "qwen3")
NAME = "tiny-qwen3"
PROMPTS = ["Hello, my name is", "The year 1999 was"]


# --- the request checks ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served() -> api.Served:
    _, tokenizer = config_and_tokenizer(QWEN)
    return api.Served(NAME, tokenizer, 256)


def test_a_completion_request_becomes_rows(served):
    body = {"model": NAME, "prompt": ["a", "bc"], "max_tokens": 5, "n": 2, "seed": 10, "stop": "x", "top_p": 0.5}
    parsed = api.parse_completion(body, served)
    tok = served.tokenizer
    assert [c.prompt for c in parsed.choices] == [tok.encode("a")] * 2 + [tok.encode("bc")] * 2
    assert [c.seed for c in parsed.choices] == [10, 11, 12, 13]  # row r: seed + r, as generate's rows
    assert {(c.max_tokens, c.temperature, c.top_p, c.stops) for c in parsed.choices} == {(5, 1.0, 0.5, ("x",))}
    assert parsed.prompt_tokens == len(tok.encode("a")) + len(tok.encode("bc")) and not parsed.stream
    # Defaults: 16 tokens; no seed draws a random one per request.
    seeds = {api.parse_completion({"prompt": "a"}, served).choices[0].seed for _ in range(4)}
    assert len(seeds) > 1 and api.parse_completion({"prompt": "a"}, served).choices[0].max_tokens == 16
    # Token ids, one list or several.
    assert [c.prompt for c in api.parse_completion({"prompt": [[5, 6], [7]]}, served).choices] == [[5, 6], [7]]


def test_too_many_prompts_are_refused_before_they_are_tokenized(served):
    """A 4 MiB request of a million prompts was tokenized whole (12 s of a core) before its rows were counted."""

    class Counting:
        def __init__(self, tokenizer):
            self.tokenizer, self.encoded = tokenizer, 0

        def __getattr__(self, name):
            return getattr(self.tokenizer, name)

        def encode_context(self, text):
            self.encoded += 1
            return self.tokenizer.encode_context(text)

    counting = dataclasses.replace(served, tokenizer=Counting(served.tokenizer))
    for prompt in (["a"] * 5000, [[5]] * 5000):
        with pytest.raises(api.APIError, match="5000 prompts x n=1 make 5000 rows"):
            api.parse_completion({"prompt": prompt}, counting)
    with pytest.raises(api.APIError, match="33 prompts x n=128 make 4224 rows"):
        api.parse_completion({"prompt": ["a"] * 33, "n": 128}, counting)
    assert counting.tokenizer.encoded == 0
    assert len(api.parse_completion({"prompt": ["a"] * 32, "n": 128}, counting).choices) == 4096


def test_a_chat_too_long_for_the_window_is_refused_before_it_is_encoded(served, monkeypatch):
    """A chat of thousands of messages was encoded whole (quadratic in them: 7 s for 4,000) before its length was
    checked, in the pool of threads every request is parsed in; it is refused from a count that takes one rendering."""
    from lm import chat

    messages = [{"role": ("user", "assistant")[i % 2], "content": "a"} for i in range(301)]
    with monkeypatch.context() as patched:  # (the encoding's longer work: the conversation rendered before each reply)
        patched.setattr(chat, "_reply_start", lambda *a, **k: pytest.fail("encoded a chat that cannot fit"))
        with pytest.raises(api.APIError, match=r"the conversation is [\d,]+ tokens or more, .* of 256 tokens") as e:
            api.parse_chat({"messages": messages}, served)
    assert e.value.code == "context_length_exceeded"
    for n in (1, 2, 5, 40):  # a floor of encode_chat's count: a chat that fits is never refused by it
        ids = chat.encode_chat(served.tokenizer, messages[:n], add_generation_prompt=True)[0]
        with pytest.raises(chat.TooLong) as floor:  # (the count it refuses a window of 1 with)
            chat.encode_chat(served.tokenizer, messages[:n], add_generation_prompt=True, window=1)
        assert n < floor.value.fewest <= len(ids)


def test_a_chat_of_one_long_message_is_refused_before_it_is_encoded(served, monkeypatch):
    """A stretch of text between two special tokens counted as one token however long it was: a chat of one 14 MB
    message was encoded whole (7 million tokens, 9.5 s of the server's CPU) before it was refused."""
    from lm import chat

    messages = [{"role": "user", "content": "hello world " * 20_000}]
    with monkeypatch.context() as patched:
        patched.setattr(chat, "_encode_run", lambda *a, **k: pytest.fail("encoded a chat that cannot fit"))
        with pytest.raises(api.APIError, match=r"the conversation is [\d,]+ tokens or more, .* of 256 tokens") as e:
            api.parse_chat({"messages": messages}, served)
    assert e.value.code == "context_length_exceeded"
    for content in ("hello world " * 50, "\u1100\u1161\u11a8" * 50, "€uro " * 50, " x "):  # (NFC: 3 jamo, 1 token)
        conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
        ids = chat.encode_chat(served.tokenizer, conversation, add_generation_prompt=True)[0]
        with pytest.raises(chat.TooLong) as floor:  # (still a floor of encode_chat's count)
            chat.encode_chat(served.tokenizer, conversation, add_generation_prompt=True, window=1)
        assert floor.value.fewest <= len(ids)


def test_fields_that_mean_off_are_accepted_as_null_too(served):
    """OpenAI documents echo as "boolean or null": null was refused as an unsupported value."""
    for body in ({"prompt": "a", "echo": None}, {"prompt": "a", "echo": False, "logprobs": None, "best_of": None}):
        assert len(api.parse_completion(body, served).choices) == 1
    chat = {"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": False, "tools": None}
    assert len(api.parse_chat(chat, served).choices) == 1
    # OpenAI's documented fields that ask for nothing when off: they were "Unrecognized request argument"
    off = {"store": False, "metadata": {}, "service_tier": "auto"}
    assert len(api.parse_chat({**chat, **off}, served).choices) == 1
    assert len(api.parse_completion({"prompt": "a", "store": None, "service_tier": "default"}, served).choices) == 1
    with pytest.raises(api.APIError, match="store=true is not supported"):
        api.parse_chat({**chat, "store": True}, served)
    # OpenAI's client sends stream_options.include_obfuscation: lm never pads its events, so false is what it does
    for off in (False, None):
        options = {"include_usage": True, "include_obfuscation": off}
        assert api.parse_chat({**chat, "stream": True, "stream_options": options}, served).include_usage
    # A reply echoed back from an OpenAI response carries its empty fields: the same prompt as without them.
    echoed = {"role": "assistant", "content": "a", "refusal": None, "annotations": [], "tool_calls": None}
    turns = [{"role": "user", "content": "q"}, echoed, {"role": "user", "content": "r"}]
    plain = [{"role": m["role"], "content": m["content"]} for m in turns]
    got, want = (api.parse_chat({"messages": m, "seed": 0}, served).choices for m in (turns, plain))
    assert got == want


def test_penalties_and_logit_bias_become_the_rows_settings(served):
    settings = {"n": 2, "frequency_penalty": 0.5, "presence_penalty": -2, "logit_bias": {"7": 100, "3": -1.5}}
    completion = api.parse_completion({"prompt": ["a", "b"], **settings}, served)
    for c in [*completion.choices, *api.parse_chat({"messages": HI, **settings}, served).choices]:
        assert (c.frequency_penalty, c.presence_penalty, c.logit_bias) == (0.5, -2.0, ((7, 100.0), (3, -1.5)))
    assert len(completion.choices) == 4
    # (the off values, as clients send them: what a request without them gets)
    off = {"prompt": "a", "seed": 0, "frequency_penalty": 0, "presence_penalty": None, "logit_bias": {}}
    assert api.parse_completion(off, served).choices == api.parse_completion({"prompt": "a", "seed": 0}, served).choices


def test_an_assistants_reasoning_content_reaches_the_template(served):
    """(The server kept role and content alone: a reasoning_content that chat data learns was dropped from a
    prompt without a word.) A template that writes it prompts with it; one that does not refuses it, a 400."""
    user = {"role": "user", "content": "q"}
    reply = {"role": "assistant", "content": "a", "reasoning_content": "why"}
    tok = copy.copy(served.tokenizer)
    tok.hf = {**tok.hf, "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
              "{% if m.reasoning_content is string %}<think>{{ m.reasoning_content }}</think>{% endif %}"
              "{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}
    chat = {"messages": [user, reply, user]}
    ids = api.parse_chat(chat, dataclasses.replace(served, tokenizer=tok)).choices[0].prompt
    assert "<think>why</think>a" in tok.decode(ids)
    assert ids == encode_chat(tok, chat["messages"], add_generation_prompt=True)[0]
    with pytest.raises(api.APIError, match="does not write an assistant message's reasoning_content") as caught:
        api.parse_chat(chat, served)
    assert caught.value.status == 400


def test_prompt_text_never_becomes_special_tokens(served):
    tok = served.tokenizer
    text = "<|im_start|>user<|im_end|>"
    assert api.parse_completion({"prompt": text}, served).choices[0].prompt == tok.encode(text)
    assert tok.special_tokens["<|im_end|>"] not in tok.encode(text)
    chat = api.parse_chat({"messages": [{"role": "user", "content": text}]}, served)
    ids = chat.choices[0].prompt
    assert ids == encode_chat(tok, [{"role": "user", "content": text}], add_generation_prompt=True)[0]
    # The template's own: <|im_start|> twice (the user turn, the reply) and <|im_end|> once.
    assert ids.count(tok.special_tokens["<|im_start|>"]) == 2 and ids.count(tok.special_tokens["<|im_end|>"]) == 1
    # It ends at the end-of-turn token, not at its text (which a reply may spell in ordinary tokens)
    assert chat.choices[0].stops == () and chat.choices[0].stop_tokens == (tok.special_tokens["<|im_end|>"],)
    # A chat's default max_tokens is the room the window leaves.
    assert chat.choices[0].max_tokens == 256 - len(ids)


TOO_LONG = "word " * 300
HI = [{"role": "user", "content": "hi"}]
BAD = [
    # (body, status, param, fragment of the message)
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be >= 1, got 0"),
    ({"prompt": "a", "max_tokens": -5}, 400, "max_tokens", ">= 1"),
    # (a value of hundreds of digits: the line held them all)
    ({"prompt": "a", "max_tokens": -(10**400)}, 400, "max_tokens", "got -100000000000000000000000000000000000..."),
    ({"prompt": "a", "temperature": 10**400}, 400, "temperature", "got 1000000000000000000000000000000000000..."),
    ({"prompt": "a", "max_tokens": "5"}, 400, "max_tokens", "must be an integer, got a string"),
    ({"prompt": "a", "max_tokens": 2.5}, 400, "max_tokens", "must be an integer"),
    ({"prompt": "a", "max_tokens": True}, 400, "max_tokens", "must be an integer, got a boolean"),
    ({"prompt": "a", "max_tokens": False}, 400, "max_tokens", "must be an integer, got a boolean"),  # (== 0)
    ({"prompt": "a", "max_tokens": 0.0}, 400, "max_tokens", "must be an integer, got float 0.0"),
    ({"prompt": "a", "temperature": "hot"}, 400, "temperature", "must be a number"),
    ({"prompt": "a", "temperature": 2.5}, 400, "temperature", "must be in [0, 2]"),
    ({"prompt": "a", "top_p": 1.5}, 400, "top_p", "must be in [0, 1]"),
    ({"prompt": "a", "n": 0}, 400, "n", "in [1, 128]"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream", "true or false"),
    ({"prompt": "a", "stop": 5}, 400, "stop", "a string or a list of strings"),
    ({"prompt": "a", "stop": [""]}, 400, "stop", "must not be empty; give the text to stop at"),
    ({"prompt": "a", "seed": 1.5}, 400, "seed", "must be an integer"),
    ({"prompt": "a", "seed": -5}, 400, "seed", "seed must be >= 0, got -5"),  # (as sample.py --seed; drew as 2**32-5)
    ({"prompt": "a", "user": 5}, 400, "user", "user must be a string"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed with stream"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_obfuscation": True}}, 400, "stream_options",
     "include_obfuscation: lm does not pad stream events; set it false or leave it out"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": True, "x": 1}}, 400, "stream_options",
     'must be {"include_usage": true or false, "include_obfuscation": false}'),
    ({"prompt": None}, 400, "prompt", "prompt must be a string"),
    ({"prompt": []}, 400, "prompt", "prompt must be a string"),
    ({"prompt": [1, "a"]}, 400, "prompt", "prompt must be a string"),
    ({"prompt": [5, 100000]}, 400, "prompt", "token id 100000 is not in the tokenizer's range [0, 400)"),
    ({"max_tokens": 3}, 400, "prompt", "prompt is required"),
    ({"prompt": TOO_LONG}, 400, "prompt", "leaves no room for a token it generates within the model's context window of 256"),
    ({"prompt": "a", "max_tokens": 300}, 400, "prompt", "with max_tokens=300"),
    ({"prompt": [5], "max_tokens": 300}, 400, "prompt", "the prompt is 1 token; with max_tokens=300"),
    # (one of a list of prompts was "the prompt", whichever of hundreds it was)
    ({"prompt": ["a", "bc", TOO_LONG]}, 400, "prompt", "prompt 3 of 3 is "),
    ({"prompt": [[5], [5, 6]], "max_tokens": 255}, 400, "prompt", "prompt 2 of 2 is 2 tokens; with max_tokens=255"),
    ({"prompt": [[5] * 1200]}, 400, "prompt", "the prompt is 1,200 tokens, which leaves no room"),  # (1200 tokens)
    # (max_tokens left out, its default 16: told to "lower max_tokens", and to "shorten the prompt", by a token
    # refused again; the lengths that fit are named)
    ({"prompt": [5] * 250}, 400, "prompt", "the prompt is 250 tokens; with max_tokens=16 (its default) that makes "
                                           "266, more than the model's context window of 256 tokens; shorten the "
                                           "prompt or lower max_tokens to at most 6"),
    ({"prompt": [5] * 256}, 400, "prompt", "leaves no room for a token it generates within the model's context "
                                           "window of 256 tokens; shorten the prompt to at most 240 tokens (with "
                                           "max_tokens=16)"),
    ({"prompt": [5] * 256, "max_tokens": 256}, 400, "prompt", "shorten the prompt and lower max_tokens, to 256 "
                                                              "tokens together"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model", "the model `gpt-4` does not exist"),
    ({"prompt": "a", "model": 3}, 400, "model", "model must be a string"),
    ({"prompt": "a", "temprature": 0}, 400, "temprature", "Unrecognized request argument supplied: temprature"),
    ({"prompt": "a", "logprobs": 21}, 400, "logprobs", "logprobs must be in [0, 20], got 21"),
    ({"prompt": "a", "logprobs": -1}, 400, "logprobs", "logprobs must be in [0, 20], got -1"),
    ({"prompt": "a", "logprobs": True}, 400, "logprobs", "logprobs must be an integer, got a boolean"),
    ({"prompt": "a", "top_logprobs": 2}, 400, "top_logprobs", "top_logprobs=2 is not supported"),  # (chat's field)
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, 400, "echo",
     "echo=true is not supported by this server; drop it"),  # (OpenAI's chat has no echo)
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "(0 generates nothing: only with echo=true, to score the "
                                                          "prompt)"),
    ({"prompt": "a", "max_tokens": -1, "echo": True}, 400, "max_tokens", "max_tokens must be >= 0, got -1"),
    ({"prompt": [5] * 257, "max_tokens": 0, "echo": True}, 400, "prompt", "the prompt is 257 tokens, more than the "
     "model's context window of 256 tokens; shorten the prompt to at most 256 tokens"),
    ({"prompt": "a", "best_of": True}, 400, "best_of", "best_of=true is not supported"),
    ({"prompt": "a", "echo": 0}, 400, "echo", "echo must be true or false, got int 0"),
    ({"prompt": "a", "stop": "\ud800"}, 400, None, "holds \\ud800 alone, half of a UTF-16 surrogate pair"),
    ({"prompt": "a\udfff"}, 400, None, "holds \\udfff alone"),
    ({"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5"),
    ({"prompt": "a", "frequency_penalty": -3}, 400, "frequency_penalty", "must be in [-2, 2], got -3"),
    ({"prompt": "a", "frequency_penalty": "1"}, 400, "frequency_penalty", "frequency_penalty must be a number"),
    ({"prompt": "a", "logit_bias": [1, 2]}, 400, "logit_bias", "logit_bias must be an object of token ids to biases"),
    ({"prompt": "a", "logit_bias": {"hello": 5}}, 400, "logit_bias",
     'logit_bias keys must be token ids (non-negative integers), got "hello"'),
    ({"prompt": "a", "logit_bias": {"-1": 5}}, 400, "logit_bias", "non-negative integers"),
    ({"prompt": "a", "logit_bias": {"1.5": 5}}, 400, "logit_bias", "non-negative integers"),
    ({"prompt": "a", "logit_bias": {"999999": 5}}, 400, "logit_bias", "logit_bias: token id 999999 is not in the "
                                                                    "tokenizer's range"),
    ({"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias", "logit_bias[5] must be a number in [-100, 100], "
                                                                  "got 101"),
    # (an id of over 4,300 digits was int()'s ValueError, a 500 and a traceback; one of 4,000 filled the line)
    ({"prompt": "a", "logit_bias": {"9" * 5000: 5}}, 400, "logit_bias", "logit_bias: token id 999999999999999999999... "
                                                                      "is not in the tokenizer's range [0, "),
    ({"prompt": "a", "logit_bias": {"0" * 5000 + "5": 101}}, 400, "logit_bias", "logit_bias[5] must be a number"),
    ({"prompt": "a", "logit_bias": {"5": "x"}}, 400, "logit_bias", 'logit_bias[5] must be a number in [-100, 100], '
                                                                  'got "x"'),
    ({"prompt": "a", "logit_bias": {"5": True}}, 400, "logit_bias", "got true"),
    # (two strings of one id: the bias applied was whichever came last)
    ({"prompt": "a", "logit_bias": {"1": 5, "01": -5}}, 400, "logit_bias", 'logit_bias names token 1 twice ("1" and '
                                                                          '"01"); give each token id once'),
    # (a 5 kB request of 1,000 prompts and n=128 held the server, streams and /health too, for seconds)
    ({"prompt": ["a"] * 33, "n": 128}, 400, "prompt", "33 prompts x n=128 make 4224 rows, more than the 4096 this "
                                                      "server takes in one request; send the prompts in several"),
]
BAD_CHAT = [
    ({"messages": HI, "top_logprobs": 2}, 400, "top_logprobs", "top_logprobs=2 needs logprobs=true; set logprobs"),
    ({"messages": HI, "logprobs": False, "top_logprobs": 1}, 400, "top_logprobs", "needs logprobs=true"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "must be in [0, 20], got 21"),
    ({"messages": HI, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", "must be in [0, 20], got -1"),
    ({"messages": HI, "logprobs": 1}, 400, "logprobs", "logprobs must be true or false, got int 1"),
    ({"messages": HI, "presence_penalty": -2.01}, 400, "presence_penalty", "must be in [-2, 2], got -2.01"),
    ({"messages": HI, "logit_bias": {"5": -100.5}}, 400, "logit_bias", "must be a number in [-100, 100], got -100.5"),
    ({"messages": "hi"}, 400, "messages", "non-empty list"),
    ({"messages": []}, 400, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "messages[0].role must be"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages", "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages", "content parts"),
    ({"messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages", "context window"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400, "max_completion_tokens",
     ">= 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools",
     "not supported"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", 'tools=[{"type": "function", "function": {"n... is not supported by this server'),  # cut short
    ({"messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages", "leaves no room"),  # (max_tokens unset)
    # (a chat that fit no max_completion_tokens was told to shorten "the prompt", which a chat request has none of)
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 300}, 400, "messages",
     "the conversation is 16 tokens; with max_completion_tokens=300 that makes 316, more than the model's context "
     "window of 256 tokens; shorten the conversation or lower max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}, 400, "prompt", "Unrecognized"),
    ({"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "yes"}, 400, "parallel_tool_calls",
     "parallel_tool_calls must be true or false, got a string"),
    # max_tokens is checked though max_completion_tokens overrides it; a message's fields as a request's are
    # (both were ignored silently)
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "max_tokens": "abc"}, 400,
     "max_tokens", "max_tokens must be an integer, got a string"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "max_tokens": -5}, 400,
     "max_tokens", "max_tokens must be >= 1, got -5"),
    ({"messages": [{"role": "user", "content": "hi", "foo": 1}]}, 400, "messages",
     "messages[0].foo is not a message field this server knows; drop it"),
    ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, 400, "messages",
     "messages[0].name is not supported by this server; drop it"),
    # a tool message is refused for its role, not told to drop its tool_call_id (then refused for its role)
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]},
     400, "messages", 'messages[1].role must be system, developer, user or assistant, got "tool"'),
    ({"messages": [{"content": "hi"}]}, 400, "messages", "messages[0].role must be system, developer, user or "
     "assistant, got no role"),
]  # fmt: skip


def test_empty_message_fields_are_off(served):
    """The README: a message's name, tool_calls, ... are "off when null or empty"; an empty name was refused."""
    plain = [{"role": "user", "content": "hi"}]
    empty = [{"role": "user", "content": "hi", "name": "", "tool_call_id": "", "refusal": ""}]
    got, want = (api.parse_chat({"messages": m, "seed": 0}, served).choices for m in (empty, plain))
    assert got == want


@pytest.mark.parametrize("body, status, param, fragment", BAD + BAD_CHAT)
def test_bad_requests_are_openai_errors(served, body, status, param, fragment):
    parse = api.parse_chat if "messages" in body or "max_completion_tokens" in body else api.parse_completion
    with pytest.raises(api.APIError) as caught:
        parse(api.parse_json(json.dumps(body).encode()), served)  # as the server reads it, from the JSON it is sent
    e = caught.value
    assert (e.status, e.param) == (status, param) and fragment in e.message, e.message
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


# --- the scheduler ---------------------------------------------------------------------------------------------


class Collect:
    """A sink that keeps a request's events (in the order they came) and says when every choice has stopped."""

    def __init__(self, choices: int = 1):
        self.events, self.errors, self.done = [], [], threading.Event()
        self.texts, self.finish = [""] * choices, [None] * choices

    def __call__(self, events, error):
        if error:
            self.errors.append(error)
            self.done.set()
        for e in events:
            self.events.append(e)
            self.texts[e.choice] += e.text
            self.finish[e.choice] = e.finish
        if all(self.finish):
            self.done.set()

    def wait(self):
        assert self.done.wait(120), "the request did not finish"
        return self


@pytest.fixture(scope="module")
def scheduler():
    s = Scheduler(jax.tree.map(jnp.asarray, random_params()), MAIN, TOK, max_batch=2)
    yield s
    s.close()


def generated(prompt: str, n: int, temperature: float, seed: int = 0) -> S.Sample:
    settings = SampleConfig(max_new_tokens=n, temperature=temperature)
    return S.generate(random_params(), MAIN, TOK, [prompt], settings, seed=seed)[0]


def test_more_requests_than_slots_each_get_what_generate_gives(scheduler):
    asks = [("ROMEO:", 0.0, 7), ("To be", 1.0, 3), ("JULIET:", 0.8, 4), ("", 1.0, 5), ("x", 0.0, 0)]
    sinks = []
    for prompt, temperature, seed in asks:
        sinks.append(Collect())
        scheduler.submit([Choice(TOK.encode(prompt) or [TOK.eot], 12, temperature, 1.0, seed)], sinks[-1])
        assert scheduler.load()["busy"] <= 2
    for (prompt, temperature, seed), sink in zip(asks, sinks):
        want = generated(prompt, 12, temperature=temperature, seed=seed)
        assert sink.wait().texts == [want.text] and sink.events[-1].tokens == len(want.tokens)
        assert sink.finish == [want.finish]
    assert scheduler.load()["busy"] == 0 and scheduler.load()["waiting"] == 0


def test_a_long_request_does_not_hold_back_the_others(scheduler):
    assert generated("ROMEO:", 50, temperature=1.0, seed=1).finish == "length"
    long = Collect()
    seen_by_shorts = []  # how many tokens the long row had when each short request ended

    class Short(Collect):
        def __call__(self, events, error):
            super().__call__(events, error)
            if self.done.is_set():
                seen_by_shorts.append(len(long.events))

    shorts = [Short() for _ in range(3)]
    with scheduler._cond:  # all four wait together when the loop next looks
        scheduler.submit([Choice(TOK.encode("ROMEO:"), 50, 1.0, 1.0, 1)], long)
        for i, sink in enumerate(shorts):  # two slots: they take turns in the one the long request leaves
            scheduler.submit([Choice(TOK.encode("To be"), 3, 1.0, 1.0, i)], sink)
    for sink in shorts:
        sink.wait()
    assert len(long.wait().events) == 50 and max(seen_by_shorts) < 20, seen_by_shorts


def test_stop_strings_and_max_tokens_end_a_row(scheduler):
    want = generated("To be", 12, temperature=1.0, seed=2)
    stop = want.text[5:7]
    sink = Collect()
    scheduler.submit([Choice(TOK.encode("To be"), 12, 1.0, 1.0, 2, stops=(stop,))], sink)
    assert sink.wait().texts == [want.text[: want.text.index(stop)]] and sink.finish == ["stop"]


def test_a_cancelled_request_frees_its_slot(scheduler):
    sink = Collect()
    request = scheduler.submit([Choice(TOK.encode("ROMEO:"), 50, 1.0, 1.0, 0)], sink)
    while not sink.events:
        time.sleep(0.001)
    request.cancel()
    deadline = time.time() + 30
    while scheduler.load()["busy"] and time.time() < deadline:
        time.sleep(0.01)
    assert scheduler.load()["busy"] == 0 and not sink.done.is_set()
    seen = len(sink.events)
    time.sleep(0.1)
    assert len(sink.events) == seen  # nothing more arrives


def test_a_failed_step_fails_its_requests_and_the_scheduler_goes_on(scheduler, monkeypatch):
    real = scheduler.slots.step
    calls = []

    def failing(live_B):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of device memory")
        return real(live_B)

    monkeypatch.setattr(scheduler.slots, "step", failing)
    sink = Collect()
    scheduler.submit([Choice(TOK.encode("ROMEO:"), 12, 0.0, 1.0, 0)], sink)
    assert sink.wait().errors == ["generation failed: RuntimeError: out of device memory"]
    after = Collect()
    scheduler.submit([Choice(TOK.encode("ROMEO:"), 12, 0.0, 1.0, 0)], after)
    assert after.wait().texts == [generated("ROMEO:", 12, temperature=0.0).text] and not after.errors


def test_rows_that_would_overrun_the_cache_are_refused(scheduler):
    with pytest.raises(ValueError, match="a row of 6 \\+ 60 tokens in a 64-token window"):
        scheduler.submit([Choice(TOK.encode("ROMEO:"), 60)], Collect())


def test_a_sink_that_fails_cancels_only_its_request(scheduler):
    def broken(events, error):
        raise RuntimeError("Event loop is closed")

    request = scheduler.submit([Choice(TOK.encode("ROMEO:"), 40, 1.0, 1.0, 0)], broken)
    other = Collect()
    scheduler.submit([Choice(TOK.encode("To be"), 12, 0.0, 1.0, 0)], other)
    assert other.wait().texts == [generated("To be", 12, temperature=0.0).text] and not other.errors
    assert request.cancelled and scheduler.load()["busy"] == 0


def test_logprobs_are_the_models_log_softmax_at_each_position(scheduler):
    """The cached decode's logprobs (the prefill's for the first token, the steps' after) are a full forward pass's
    over prompt + generated tokens, of the model's distribution (not the temperature's nor top_p's), the top ones
    most likely first, as many as asked; a row beside it asking none gets none, and the draws do not change."""
    prompt = TOK.encode("ROMEO:")
    for temperature, top_p, k, seed in ((0.0, 1.0, 5, 0), (1.3, 0.8, 20, 3), (0.7, 1.0, 0, 4)):
        sink, plain = Collect(), Collect()
        with scheduler._cond:  # (in one batch)
            scheduler.submit([Choice(prompt, 12, temperature, top_p, seed, logprobs=k)], sink)
            scheduler.submit([Choice(prompt, 12, temperature, top_p, seed)], plain)
        events = sink.wait().events
        ids = [e.logprob.token for e in events]
        assert all(e.logprob is None for e in plain.wait().events) and plain.texts == sink.texts
        settings = SampleConfig(max_new_tokens=12, temperature=temperature, top_p=top_p)
        assert ids == S.generate(random_params(), MAIN, TOK, ["ROMEO:"], settings, seed=seed)[0].tokens
        logits_TV = np.asarray(full_forward(MAIN)(random_params(), jnp.asarray([prompt + ids]))[0], np.float64)
        logits_TV[:, TOK.n_vocab :] = -np.inf  # (the padding of the model's vocabulary is no token)
        want_TV = (logits_TV - np.log(np.exp(logits_TV).sum(-1, keepdims=True)))[len(prompt) - 1 : -1]
        for e, want_V in zip(events, want_TV):
            np.testing.assert_allclose(e.logprob.logprob, want_V[e.logprob.token], atol=2e-5)
            top_ids, top = [i for i, _ in e.logprob.top], [p for _, p in e.logprob.top]
            assert top_ids == np.argsort(-want_V)[:k].tolist() and top == sorted(top, reverse=True)
            np.testing.assert_allclose(top, want_V[top_ids], atol=2e-5)
            if temperature == 0 and k:  # greedy draws the most likely token
                assert top_ids[0] == e.logprob.token


def test_an_echo_scores_its_prompt_as_a_full_forward_pass(scheduler, monkeypatch):
    """An echo with logprobs gets its prompt's tokens' on its first event: each under log_softmax of a full forward
    pass's logits at the position before it, the top ones most likely first; with max_tokens=0 it draws nothing,
    ends with "length" and takes no slot; its generated tokens are what the row draws without echo. One that
    generates is scored by the prefill that admits it: its prompt runs through the model once, not twice."""
    scores = []
    monkeypatch.setattr(scheduler.slots, "score", lambda ids, score=scheduler.slots.score: scores.append(ids) or
                        score(ids))  # fmt: skip
    prompt = TOK.encode("ROMEO: what light")
    logits_TV = np.asarray(full_forward(MAIN)(random_params(), jnp.asarray([prompt]))[0], np.float64)
    logits_TV[:, TOK.n_vocab :] = -np.inf
    want_TV = (logits_TV - np.log(np.exp(logits_TV).sum(-1, keepdims=True)))[:-1]
    for max_tokens in (0, 5):
        echo, plain = Collect(), Collect()
        scores.clear()
        with scheduler._cond:
            scheduler.submit([Choice(prompt, max_tokens, 0.0, 1.0, 0, logprobs=3, echo=True)], echo)
            scheduler.submit([Choice(prompt, max(max_tokens, 1), 0.0, 1.0, 0, logprobs=3)], plain)
        events = echo.wait().events
        scored = events[0].prompt
        assert [lp.token for lp in scored] == prompt[1:] and all(e.prompt is None for e in events[1:])
        for lp, want_V in zip(scored, want_TV):
            np.testing.assert_allclose(lp.logprob, want_V[lp.token], atol=2e-5)
            assert [i for i, _ in lp.top] == np.argsort(-want_V)[:3].tolist()
            np.testing.assert_allclose([p for _, p in lp.top], want_V[[i for i, _ in lp.top]], atol=2e-5)
        assert scores == ([] if max_tokens else [prompt])
        if max_tokens:  # (the same logprobs, to rounding: an echo draws from its prefill's logits at every position)
            assert echo.texts == plain.wait().texts and len(events) == len(plain.events)
            for got, want in zip(events, plain.events):
                assert got.logprob.token == want.logprob.token and [i for i, _ in got.logprob.top] == [
                    i for i, _ in want.logprob.top]  # fmt: skip
                np.testing.assert_allclose([got.logprob.logprob, *(p for _, p in got.logprob.top)],
                                           [want.logprob.logprob, *(p for _, p in want.logprob.top)], atol=1e-5)
        else:
            assert [(e.text, e.tokens, e.finish) for e in events] == [("", 0, "length")]
    with pytest.raises(ValueError, match="a row of 6 \\+ 0 tokens"):  # (without echo, a row draws a token)
        scheduler.submit([Choice(TOK.encode("ROMEO:"), 0)], Collect())
    assert scheduler.load()["busy"] == 0


def test_penalties_and_logit_bias_reach_their_rows_alone(scheduler):
    """A row's penalties and bias change its draws as OpenAI defines them; the row beside it draws as without."""
    from test_slots import penalized_by_recomputation

    prompt = TOK.encode("ROMEO:")
    settings = dict(frequency_penalty=0.5, presence_penalty=1.0, logit_bias=((65, 3.0), (109, -100.0)))
    sink, plain = Collect(), Collect()
    with scheduler._cond:  # (in one batch)
        scheduler.submit([Choice(prompt, 12, 0.0, 1.0, 0, logprobs=0, **settings)], sink)
        scheduler.submit([Choice(prompt, 12, 0.0, 1.0, 0)], plain)
    ids = [e.logprob.token for e in sink.wait().events]
    assert ids == penalized_by_recomputation("ROMEO:", 12, 0.5, 1.0, {65: 3.0, 109: -100.0}) and 109 not in ids
    assert plain.wait().texts == [generated("ROMEO:", 12, temperature=0.0).text] != sink.texts


# --- the server ------------------------------------------------------------------------------------------------


def start(model: str, *args: str, cwd: str = ROOT, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """`python -m lm.serve model --port 0 args...` started; (the process, its port) once it serves. On this
    process's backend (inherited), as the sample.py and generate calls its replies are compared with run."""
    env = {**os.environ, "PYTHONPATH": python_path(), **(env or {})}
    command = [sys.executable, "-m", "lm.serve", model, "--port", "0", *args]
    server = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([server.stdout], [], [], 240)
    line = server.stdout.readline() if ready else ""
    if not line.startswith("serving "):
        server.kill()
        pytest.fail(f"the server did not start: {line!r} {server.stderr.read()[-3000:]}")
    server.ready_line = line  # (its "serving ... at ... (N slots of W tokens)")
    return server, int(line.split()[3].rsplit(":", 1)[1])


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=60)


@pytest.fixture(scope="module")
def port():
    server, port = start(QWEN, "--max-batch", "4", "--name", NAME, "--quiet", "--max-request-mb", "0.5")
    yield port
    stop(server)


@pytest.fixture(scope="module")
def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def raw(port: int, method: str, path: str, body: bytes | str | None = None) -> tuple[int, dict]:
    status, text = raw_text(port, method, path, body)
    return status, json.loads(text)


def raw_text(port: int, method: str, path: str, body: bytes | str | None = None) -> tuple[int, str]:
    """(status, body text) of a request, read whole."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request(method, path, body, {"Content-Type": "application/json"} if body is not None else {})
    response = connection.getresponse()
    status, text = response.status, response.read().decode()
    connection.close()
    return status, text


def sample_py(capsys, *args: str) -> str:
    """What sample.py prints (greedy, quiet) for these arguments."""
    assert S.main([QWEN, "--temperature", "0", "--quiet", *args]) == 0
    return capsys.readouterr().out


def test_greedy_completions_equal_sample_py(client, capsys):
    for prompt in PROMPTS:
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
        assert got.object == "text_completion" and got.model == NAME
        assert prompt + got.choices[0].text + "\n" == sample_py(capsys, "--prompt", prompt, "--max-new-tokens", "20")
        n_prompt = len(config_and_tokenizer(QWEN)[1].encode(prompt))
        assert (got.usage.prompt_tokens, got.usage.total_tokens) == (n_prompt, n_prompt + got.usage.completion_tokens)
        if got.choices[0].finish_reason == "length":
            assert got.usage.completion_tokens == 20


def test_greedy_chat_equals_sample_py_chat(client, capsys):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0)
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    printed = sample_py(capsys, "--chat", "What is 2+2?", "--system", "Be brief.", "--max-new-tokens", "30")
    assert got.choices[0].message.content + "\n" == printed
    ids = encode_chat(config_and_tokenizer(QWEN)[1], messages, add_generation_prompt=True)[0]
    assert got.usage.prompt_tokens == len(ids)


def test_streams_come_token_by_token_and_equal_the_whole_response(client):
    settings = dict(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0.9, seed=4, stop=["\n\n"])
    whole = client.completions.create(**settings)
    chunks = list(client.completions.create(**settings, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text and len([t for t in texts if t]) > 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage

    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
    chunks = list(
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason is not None
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_chat_logprobs_through_the_openai_client(client):
    """Each generated token's logprob and its top_logprobs, as OpenAI's client parses them; a stream's chunks carry
    their tokens' and together they are the whole response's; the bytes of the tokens spell the text."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    for temperature in (0.0, 1.0):
        settings = dict(model=NAME, messages=messages, max_tokens=24, temperature=temperature, seed=5)
        whole = client.chat.completions.create(**settings, logprobs=True, top_logprobs=3)
        content = whole.choices[0].logprobs.content
        assert len(content) == whole.usage.completion_tokens
        ended = whole.choices[0].finish_reason == "stop"  # (the end of turn is a token drawn: it has its logprob)
        spelled = b"".join(bytes(e.bytes) for e in content[: len(content) - ended])
        assert spelled.decode("utf-8", "replace") == whole.choices[0].message.content
        for e in content:
            assert bytes(e.bytes).decode("utf-8", "backslashreplace") == e.token and e.logprob <= 0
            top = [t.logprob for t in e.top_logprobs]
            assert len(top) == 3 and top == sorted(top, reverse=True) and e.logprob <= top[0]
            if temperature == 0:  # greedy's token is the most likely
                assert (e.token, e.logprob) == (e.top_logprobs[0].token, e.top_logprobs[0].logprob)
        chunks = list(client.chat.completions.create(**settings, logprobs=True, top_logprobs=3, stream=True))
        assert [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content] == content
        plain = client.chat.completions.create(**settings)
        assert plain.choices[0].logprobs is None
        assert plain.choices[0].message.content == whole.choices[0].message.content
    assert any("\\x" in e.token for e in content)  # (a token that is part of a character: named by its bytes)
    zero = client.chat.completions.create(**{**settings, "max_tokens": 3}, logprobs=True)
    assert [e.top_logprobs for e in zero.choices[0].logprobs.content] == [[]] * 3


def test_completion_logprobs(client):
    """A completion's logprobs: N gives tokens, token_logprobs, top_logprobs (the N most likely, and the drawn
    token) and text_offset (where each token's text begins in the choice's text), streamed the same."""
    settings = dict(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=1.0, seed=5, logprobs=2)
    whole = client.completions.create(**settings)
    lp, text = whole.choices[0].logprobs, whole.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens
    for token, logprob, top, offset in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert top[token] == logprob and 2 <= len(top) <= 3
        if "\\x" not in token and offset < len(text):
            assert text[offset : offset + len(token)] == token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(**settings, stream=True):
        for field, values in streamed.items():
            values += getattr(chunk.choices[0].logprobs, field) if chunk.choices[0].logprobs else []
    assert streamed == lp.model_dump()
    zero = client.completions.create(**{**settings, "logprobs": 0})
    assert [list(t) for t in zero.choices[0].logprobs.top_logprobs] == [[t] for t in zero.choices[0].logprobs.tokens]


def test_echo_gives_the_prompts_text_and_logprobs(client, served):
    """echo=true: the prompt's text before the completion's, its tokens' logprobs before the generated ones' (the
    first's null); max_tokens=0 generates nothing; a stream's first chunk carries the prompt; chat refuses echo."""
    tok = served.tokenizer
    ids = tok.encode(PROMPTS[0])
    settings = dict(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    plain, whole = client.completions.create(**settings), client.completions.create(**settings, echo=True)
    text, lp = whole.choices[0].text, whole.choices[0].logprobs
    assert text == PROMPTS[0] + plain.choices[0].text and whole.usage == plain.usage
    n = len(ids)
    assert lp.tokens == [tok.decode([i]) for i in ids] + plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # (the same, to rounding: an echo's first token is drawn from its prefill's logits at every position)
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert len(lp.top_logprobs) == n + len(plain.choices[0].logprobs.top_logprobs)
    for top, want in zip(lp.top_logprobs[n:], plain.choices[0].logprobs.top_logprobs):
        assert top == pytest.approx(want, abs=1e-5)
    assert all(top[t] == p and len(top) <= 3 for t, p, top in zip(lp.tokens[1:], lp.token_logprobs[1:],
                                                                   lp.top_logprobs[1:]))  # fmt: skip
    assert [text[o : o + len(t)] for t, o in zip(lp.tokens[:n], lp.text_offset)] == lp.tokens[:n]
    assert lp.text_offset[n] == len(PROMPTS[0])
    scored = client.completions.create(**{**settings, "max_tokens": 0}, echo=True)
    assert scored.choices[0].text == PROMPTS[0] and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n], abs=1e-5)
    assert scored.usage.completion_tokens == 0
    chunks = list(client.completions.create(**settings, echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPTS[0] and chunks[0].choices[0].logprobs.tokens == lp.tokens[:n]
    assert "".join(c.choices[0].text for c in chunks) == text
    assert [p for c in chunks if c.choices[0].logprobs for p in c.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="echo=true is not supported"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"echo": True})


def test_lm_evals_local_completions_scores_through_echo(port, served):
    """lm-eval's local-completions model scores a continuation with the request it sends and the parse it reads."""
    completions = pytest.importorskip("lm_eval.models.openai_completions")
    model = completions.LocalCompletionsAPI.__new__(completions.LocalCompletionsAPI)
    model.model = NAME
    context, continuation = served.tokenizer.encode("The year 1999"), served.tokenizer.encode(" was")
    tokens = context + continuation
    payload = model._create_payload([tokens], generate=False, seed=1234)
    status, out = raw(port, "POST", "/v1/completions", json.dumps(payload))
    assert status == 200, out
    [(logprob, greedy)] = completions.LocalCompletionsAPI.parse_logprobs(out, [tokens], [len(context)])
    want = client_free_logprob(port, tokens, len(context))
    assert logprob == pytest.approx(want, abs=1e-5) and isinstance(greedy, bool)


def client_free_logprob(port: int, tokens: list[int], start: int) -> float:
    """The sum of tokens[start:]'s logprobs, each from a request that generates the one next token."""
    total = 0.0
    for i in range(start, len(tokens)):
        body = {"prompt": tokens[:i], "max_tokens": 1, "temperature": 0, "logprobs": 20,
                "logit_bias": {str(tokens[i]): 100}}  # fmt: skip
        status, out = raw(port, "POST", "/v1/completions", json.dumps(body))
        assert status == 200, out
        total += out["choices"][0]["logprobs"]["token_logprobs"][0]
    return total


def test_penalties_and_logit_bias_through_the_openai_client(client, served):
    """OpenAI's client sends logit_bias's ids as it is given them (ints, JSON's string keys); a bias of 100 forces
    its token, -100 bans it; presence_penalty=2 stops greedy repeating its tokens; logprobs stay the model's."""
    settings = dict(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=1)
    tokens = lambda reply: reply.choices[0].logprobs.tokens
    plain = client.completions.create(**settings)
    assert len(set(tokens(plain))) < 16  # (this model repeats itself)
    spread = client.completions.create(**settings, presence_penalty=2.0, frequency_penalty=0.5)
    assert len(set(tokens(spread))) > len(set(tokens(plain)))
    cat = int(served.tokenizer.encode(" cat")[0])
    word = served.tokenizer.decode([cat])
    forced = client.completions.create(**settings, logit_bias={cat: 100})
    assert forced.choices[0].text == word * 16
    assert forced.choices[0].logprobs.token_logprobs[0] < min(plain.choices[0].logprobs.token_logprobs[0], -1)
    first = list(served.tokenizer.encode(tokens(plain)[0]))
    assert len(first) == 1
    banned = client.completions.create(**settings, logit_bias={str(first[0]): -100})
    assert tokens(banned)[0] != tokens(plain)[0]
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logit_bias={cat: 100}
    )
    assert chat.choices[0].message.content == word * 4
    with pytest.raises(openai.BadRequestError, match="presence_penalty must be in"):
        client.completions.create(**settings, presence_penalty=3)


def test_n_choices_and_seeds(client, capsys):
    settings = dict(model=NAME, prompt=PROMPTS[1], max_tokens=10, temperature=1.0)
    many = client.completions.create(**settings, n=3, seed=20)
    assert [c.index for c in many.choices] == [0, 1, 2] and len({c.text for c in many.choices}) > 1
    ones = [client.completions.create(**settings, seed=20 + i) for i in range(3)]  # choice i draws with seed + i
    assert [c.text for c in many.choices] == [one.choices[0].text for one in ones]
    assert many.usage.completion_tokens == sum(one.usage.completion_tokens for one in ones)
    assert many.usage.prompt_tokens == ones[0].usage.prompt_tokens  # the prompt counts once
    streamed = ["", "", ""]
    for chunk in client.completions.create(**settings, n=3, seed=20, stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == [c.text for c in many.choices]
    # Several prompts: choice p * n + i draws with seed + p * n + i, as sample.py numbers its rows (sample.py gave
    # each prompt's sample i seed + i, so its texts for the second prompt differed from the server's).
    batch = client.completions.create(**{**settings, "prompt": PROMPTS}, n=2, seed=7)
    printed = sample_py(capsys, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--num-samples", "2", "--seed", "7",
                        "--temperature", "1", "--max-new-tokens", "10")  # fmt: skip
    prompts = [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    from lm.sampling.cli import SEPARATOR

    assert printed == f"\n{SEPARATOR}\n".join(p + c.text for p, c in zip(prompts, batch.choices)) + "\n"


def test_a_seeded_request_gives_the_same_text_whatever_else_is_in_the_batch(client):
    seeded = dict(model=NAME, prompt=PROMPTS[0], max_tokens=30, temperature=1.0, top_p=1.0, seed=123)
    alone = client.completions.create(**seeded).choices[0].text
    results = {}

    def ask(key, **settings):
        results[key] = client.completions.create(**settings).choices[0].text

    crowd = [("abc", 40, 0.0, 1.0, 0), ("xyz", 25, 1.2, 0.5, 1), ("The", 35, 0.7, 0.9, 2)]  # greedy, top-p, ...
    others = [dict(prompt=p, max_tokens=m, temperature=t, top_p=tp, seed=s) for p, m, t, tp, s in crowd]
    threads = [threading.Thread(target=ask, args=(i,), kwargs={"model": NAME, **o}) for i, o in enumerate(others)]
    threads.append(threading.Thread(target=ask, args=("seeded",), kwargs=seeded))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["seeded"] == alone


def test_models_and_health(client, port):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    assert raw(port, "GET", "/v1/models/") == raw(port, "GET", "/v1/models")  # (a trailing slash named no model)
    assert raw(port, "GET", f"/v1/models/{NAME}/") == raw(port, "GET", f"/v1/models/{NAME}")  # (the card)
    assert raw(port, "GET", "/health/")[0] == 200  # (not a 307 redirect without a body)
    for path in ("/v1/completions/", "/v1/chat/completions/"):  # (a 307 redirect without a body, not followed)
        asked = {"messages": [{"role": "user", "content": "a"}]} if "chat" in path else {"prompt": "a"}
        body = {"max_tokens": 2, **asked}
        status, reply = raw(port, "POST", path, json.dumps(body))
        # (2 tokens, or fewer where the unseeded draw ended the text)
        drawn, finish = reply["usage"]["completion_tokens"], reply["choices"][0]["finish_reason"]
        assert status == 200 and (drawn, finish) in ((2, "length"), (1, "stop"), (2, "stop")), reply
    status, health = raw(port, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["slots"] == 4 and health["model"] == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


@pytest.mark.parametrize(
    "method, path, body, status, fragment",
    [
        ("POST", "/v1/completions", b'{"prompt": "a",', 400, "not valid JSON"),
        ("POST", "/v1/completions", b"\xff\xfe", 400, "not valid JSON"),
        ("POST", "/v1/completions", b'["a"]', 400, "must be a JSON object, got a list"),
        ("POST", "/v1/completions", b"null", 400, "must be a JSON object, got null"),
        pytest.param("POST", "/v1/completions", b"[" * 10_000 + b"]" * 10_000, 400, "nests too deeply", id="nested"),
        ("POST", "/v1/completions", '{"prompt": "a", "max_tokens": "ten"}', 400, "max_tokens must be an integer"),
        ("POST", "/v1/completions", '{"prompt": "a", "max_tokens": 0}', 400, "max_tokens must be >= 1"),
        ("POST", "/v1/completions", json.dumps({"prompt": TOO_LONG}), 400, "context window of 256"),
        ("POST", "/v1/completions", '{"prompt": "a", "model": "gpt-4"}', 404, "`gpt-4` does not exist"),
        ("POST", "/v1/chat/completions", '{"messages": [{"role": "user"}]}', 400, "content must be a string"),
        ("POST", "/v1/chat/completions", '{"messages": [], "stream": true}', 400, "non-empty list"),
        ("GET", "/v1/completions", None, 405, "GET is not allowed"),
        ("POST", "/v1/embeddings", "{}", 404, "no route /v1/embeddings"),
        # (a client's base_url without /v1, as OpenAI's own ends: "no route /completions", and no word of /v1)
        ("POST", "/completions", '{"prompt": "a"}', 404, "no route /completions; the API is under /v1 (POST "
         "/v1/completions): end the client's base_url in /v1"),
        ("GET", "/models", None, 404, "the API is under /v1 (GET /v1/models)"),
    ],
)
def test_mistakes_get_openai_errors_and_the_server_goes_on(client, port, method, path, body, status, fragment):
    got, data = raw(port, method, path, body)
    assert got == status and fragment in data["error"]["message"], data
    assert data["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model=NAME, prompt="a", max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_request_body_over_the_limit_is_refused_before_it_is_parsed(client, port, chunked):
    """(A 100 MB prompt held every other request for 20 s while it was parsed and tokenized, then got a 400.)"""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    if chunked:  # 600 KiB as it arrives, against --max-request-mb 0.5
        pieces = [b'{"prompt": "', *[b"word " * 12_800] * 10, b'"}']
        connection.request("POST", "/v1/completions", iter(pieces), {"Content-Type": "application/json"})
    else:  # a gigabyte declared, none sent: refused without waiting for it
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(2**30))
        connection.endheaders()
    response = connection.getresponse()
    error = json.loads(response.read())["error"]
    connection.close()
    assert response.status == 413 and error["code"] == "request_too_large", error
    assert "limit of 0.5 MiB" in error["message"] and "--max-request-mb" in error["message"]
    under = json.dumps({"prompt": "word " * 90_000})  # 450 KB: read, parsed and refused for its length
    assert raw(port, "POST", "/v1/completions", under)[0] == 400
    assert client.completions.create(model=NAME, prompt="a", max_tokens=2).choices[0].text is not None


def test_the_limit_a_request_is_refused_over_is_the_one_given():
    """--max-request-mb 0.001 (1,048 bytes) said "limit of 0.000999451 MiB", the bytes it came to."""
    import asyncio

    from starlette.requests import Request

    from lm.serve.app import _body

    async def receive():
        return {"type": "http.request", "body": b"x" * 2048, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"2048")]}
    with pytest.raises(api.APIError, match=r"over this server's limit of 0\.001 MiB; send a shorter request"):
        asyncio.run(_body(Request(scope, receive), 0.001))
    assert asyncio.run(_body(Request(scope, receive), 0.002)) == b"x" * 2048  # (2,097 bytes)


def test_the_openai_client_raises_on_a_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        client.completions.create(model=NAME, prompt="a", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


def wait_idle(port: int) -> dict:
    deadline = time.time() + 60
    while (health := raw(port, "GET", "/health")[1])["busy"] and time.time() < deadline:
        time.sleep(0.02)
    return health


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_disconnects_frees_its_slot(client, port, stream):
    long = dict(model=NAME, prompt=PROMPTS[0], max_tokens=240, temperature=0)
    assert client.completions.create(**long).choices[0].finish_reason == "length"  # 240 steps if not cut short
    before = wait_idle(port)["steps"]
    body = json.dumps({**long, "stream": stream})
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        if stream:
            received = b""
            while b"data: " not in received:  # the headers, then the first chunk
                received += s.recv(4096)
        else:
            while raw(port, "GET", "/health")[1]["busy"] == 0:
                time.sleep(0.005)
    after = wait_idle(port)
    assert after["busy"] == 0 and after["steps"] - before < 120, (before, after)


def test_a_stopped_server_answers_every_request_and_exits_cleanly():
    """Ctrl-C on a busy server: it stops taking connections, the requests in progress get --grace seconds
    to finish, and then those left end in a 503 (a stream with that error event, then [DONE]); the process exits
    with 130 and the log holds no traceback. Before, uvicorn cancelled them: a plain-text 500, streams cut off,
    a traceback for each. A client that goes away with half its body sent is no traceback either."""
    server, port = start(QWEN, "--max-batch", "2", "--grace", "1")  # a second is far from enough here
    with socket.create_connection(("127.0.0.1", port)) as s:  # a body cut short
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    answers = []

    def ask(i):
        body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "n": 4, "stream": i % 2 == 1}
        try:
            answers.append((i % 2 == 1, *raw_text(port, "POST", "/v1/completions", json.dumps(body))))
        except Exception as e:  # noqa: BLE001 (asserted below)
            answers.append((None, type(e).__name__, str(e)))

    clients = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for c in clients:
        c.start()
    while raw(port, "GET", "/health")[1]["busy"] < 2:  # work in progress, more waiting
        time.sleep(0.01)
    started = time.time()
    server.send_signal(signal.SIGINT)
    assert server.wait(timeout=60) == 130
    assert time.time() - started < 30  # uvicorn's own cancelling, 1 + GRACE_S in, would fail the checks below
    for c in clients:
        c.join()
    shutting = {"error": {"message": SHUTTING_DOWN, "type": "server_error", "param": None, "code": None}}
    for stream, status, text in answers:
        assert status in (200, 503), (stream, status, text)
        if stream:
            events = [json.loads(e) for e in text.split("data: ")[1:-1]]
            assert status == 200 and text.endswith("data: [DONE]\n\n"), text[-200:]
            assert events[-1] == shutting or events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
        elif status == 503:
            assert json.loads(text) == shutting
        else:
            assert [c["finish_reason"] for c in json.loads(text)["choices"]] == ["length"] * 4
    assert any(SHUTTING_DOWN in text for *_, text in answers)  # the grace did not let every request finish
    err = server.stderr.read()
    assert "Traceback" not in err and err.endswith("interrupted\n"), err[-3000:]
    # uvicorn's own hint said a second Ctrl-C quits at once; here it drains first (a third quits).
    assert "force quit" not in err and f"Waiting for connections to close. {AGAIN}" in err, err[-3000:]


# slow: about 15 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_body_still_arriving_when_the_grace_ends_gets_the_503():
    """A client still sending its body (a slow upload) when a SIGTERM's grace ended was left to uvicorn, which cut
    it off grace + 5 s later with a plain-text 500 and logged a traceback; it now gets the drain's 503 at once."""
    server, port = start(QWEN, "--max-batch", "1", "--grace", "0.5")
    body = json.dumps({"prompt": "a", "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:5]))  # fmt: skip
        time.sleep(0.3)  # (the request has started: its body is being read)
        started = time.time()
        server.send_signal(signal.SIGTERM)
        s.settimeout(30)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"] == SHUTTING_DOWN
    assert server.wait(timeout=60) == -signal.SIGTERM and time.time() - started < 4  # not grace + 5 s
    err = server.stderr.read()
    assert "Traceback" not in err and "timeout graceful shutdown" not in err, err[-3000:]


# 2.0 and 3.0: about 6 s each, in the slow tier (the default suite's 15 minutes); .ci/run runs them after it
@pytest.mark.parametrize(
    "when", [1.0, pytest.param(2.0, marks=pytest.mark.slow), pytest.param(3.0, marks=pytest.mark.slow), "serving"]
)  # loading to serving: about 4 s on 2 CPU cores
def test_ctrl_c_while_the_server_starts_exits_with_130(when):
    """A Ctrl-C that lands while XLA compiles (here the server's warm-up) left the compilation running in a thread
    of its own as the interpreter exited: the process died of SIGABRT (SIGSEGV in sample.py) after 'interrupted'.
    One the moment `serving` was printed could land before uvicorn's signal handlers (a 'never awaited'
    RuntimeWarning before 'interrupted'); the line now comes from the app's start-up, once they are in place."""
    # (cpu: the moments `when` are a CPU's loading and compiling times)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": python_path()}
    command = [sys.executable, "-m", "lm.serve", QWEN, "--port", "0", "--quiet"]  # quiet: no uvicorn log if it serves
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr.readline().startswith("loading ")
        if when == "serving":
            assert server.stdout.readline().startswith("serving ")
        else:
            time.sleep(when)
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 130 and server.stderr.read() == "interrupted\n"
    finally:  # (one that did not stop was left serving after the test had failed)
        server.kill()
        server.wait()


SWALLOWING_WARM_UP = """
import os, signal, sys, time
import lm.serve.cli as C

warm_up = C._warm_up

def swallowing(*args):  # the Ctrl-C lands where a library swallows its KeyboardInterrupt (as JAX's callbacks do)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    except KeyboardInterrupt:
        pass
    return warm_up(*args)

C._warm_up = swallowing
sys.argv = ["lm.serve", *sys.argv[1:]]
sys.exit(C.main())
"""


def test_a_ctrl_c_swallowed_while_the_server_starts_still_stops_it():
    """A Ctrl-C whose KeyboardInterrupt code swallowed as the server loaded or compiled (it happened under load:
    servers left serving an hour later) stops it once its start-up is done, before it serves: 130, 'interrupted'."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": python_path()}
    command = [sys.executable, "-c", SWALLOWING_WARM_UP, QWEN, "--port", "0", "--quiet"]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == ""  # (it said "serving ..." and served on)
        assert server.wait(timeout=60) == 130 and server.stderr.read().endswith("\ninterrupted\n")
    finally:
        server.kill()
        server.wait()


def test_sigterm_stops_the_server_by_that_signal(tiny_run):
    """SIGTERM (a service manager's stop) ends the server, after the answer it gave, by that signal itself (uvicorn
    re-raises it once it has stopped: a shell reports 143), without a traceback (README, "Stopping")."""
    server, port = start(tiny_run, "--quiet", "--max-batch", "1")
    assert server.ready_line.rstrip().endswith("(1 slot of 32 tokens)"), server.ready_line  # (it said "1 slots")
    body = {"model": tiny_run, "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}
    assert raw_text(port, "POST", "/v1/completions", json.dumps(body))[0] == 200
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == -signal.SIGTERM
    assert "Traceback" not in server.stderr.read()


# nohup: about 9 s, in the slow tier (the default suite's 15 minutes); .ci/run runs it after the default suite
@pytest.mark.parametrize("nohup", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["terminal", "nohup"])
def test_a_closed_terminal_stops_the_server_as_sigterm_does(nohup):
    """A server whose terminal closed (an ssh session that dropped: its log's writes fail, SIGHUP comes) answers
    the request in progress, then ends by that SIGHUP; it died at once, cutting the request off (uvicorn handles
    SIGINT and SIGTERM only). Under `nohup` (SIGHUP ignored when it started) it serves on."""
    terminal, tty = os.openpty()
    env = {**os.environ, "PYTHONPATH": python_path()}
    command = [*(["nohup"] if nohup else []), sys.executable, "-m", "lm.serve", QWEN, "--port", "0", "--grace", "60"]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=tty, text=True,
                              start_new_session=True)  # fmt: skip
    os.close(tty)
    try:
        lines = queue.Queue()  # (read whole by a thread: select on the pipe misses lines read ahead into its buffer)
        threading.Thread(target=lambda: [*map(lines.put, server.stdout), lines.put("")], daemon=True).start()
        line = "loading"  # (nohup sends a terminal's stderr to stdout: the log's lines come first there)
        while line and not line.startswith("serving "):
            line = lines.get(timeout=240)
        assert line, "the server did not start"
        port = int(line.split()[3].rsplit(":", 1)[1])
        answers = []
        body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0})
        asking = threading.Thread(target=lambda: answers.append(raw(port, "POST", "/v1/completions", body)))
        asking.start()
        while raw(port, "GET", "/health")[1]["busy"] == 0:
            time.sleep(0.01)
        os.close(terminal)  # (the terminal is gone: writes to it fail from here on)
        server.send_signal(signal.SIGHUP)
        asking.join()
        assert answers[0][0] == 200 and answers[0][1]["choices"][0]["finish_reason"] == "length", answers
        if nohup:
            assert raw(port, "GET", "/health")[0] == 200 and server.poll() is None
        else:
            assert server.wait(timeout=60) == -signal.SIGHUP
    finally:
        server.kill()
        server.wait()


def test_serving_a_run_directory_with_a_shorter_window(tiny_run, capsys, tmp_path):
    """--compile-all compiles what requests in a 24-token window can need: buckets 8, 16 and 24 (tests/test_slots.py
    checks that requests then compile nothing), and --compile-cache keeps them for the next start."""
    every = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # (however quick)
    server, port = start(tiny_run, "--quiet", "--max-batch", "2", "--max-len", "24", "--compile-all",
                         "--compile-cache", str(tmp_path / "cache"), env=every)  # (the model's window: 32)  # fmt: skip
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert raw(port, "GET", f"/v1/models/{tiny_run}")[1]["max_model_len"] == 24
        got = c.completions.create(model=tiny_run, prompt="ROMEO:", max_tokens=12, temperature=0).choices[0].text
        with pytest.raises(openai.BadRequestError, match="with max_tokens=20 that makes 26, more than the server's "
                           "--max-len of 24 tokens"):  # fmt: skip
            c.completions.create(model=tiny_run, prompt="ROMEO:", max_tokens=20)
    finally:
        stop(server)
    assert "compiled 23 programs in " in server.stderr.read()
    assert sum(name.startswith("jit__step") for name in os.listdir(tmp_path / "cache")) == 8
    kept = jax.config.jax_compilation_cache_dir
    mine = ["--compile-cache", str(tmp_path / "mine")]
    assert S.main([tiny_run, "--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "12", "-q", *mine]) == 0
    assert capsys.readouterr().out == "ROMEO:" + got + "\n"
    assert jax.config.jax_compilation_cache_dir == kept  # (a main called from Python leaves the process's cache)


@pytest.mark.slow  # a training run into a local S3 server first
def test_serving_a_run_in_a_bucket(tmp_path, s3_server):
    env = dict(s3_server)  # (train.py, the server and sample.py on this process's backend, as the others)
    url = "s3://runs/served"
    train = [sys.executable, os.path.join(ROOT, "train.py"), "tiny", f"run.dir={url}",
             f"run.local_dir={tmp_path / 'work'}", f"data.cache_dir={tmp_path / 'cache'}", "logging.progress=false",
             "train.steps=2", "train.eval_every=0"]  # fmt: skip
    done = subprocess.run(train, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    server, port = start(url, "--quiet", cwd=str(tmp_path), env=env)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == [url]
        got = c.completions.create(model=url, prompt="ROMEO:", max_tokens=12, temperature=0).choices[0].text
    finally:
        stop(server)
    sample = [sys.executable, os.path.join(ROOT, "sample.py"), url, "--prompt", "ROMEO:", "--max-new-tokens", "12",
              "--temperature", "0", "-q"]  # fmt: skip
    done = subprocess.run(sample, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "ROMEO:" + got + "\n", done.stderr[-3000:]


def test_an_hf_models_generation_config_gives_the_requests_defaults(tmp_path, capsys, served):
    """As vLLM serves it: generation_config.json's temperature and top_p are a request's when it gives none, and
    its top_k filters every sampled row (the OpenAI API has none); top_k 1 is greedy at any temperature. The
    server sampled at temperature 1 over every token."""
    directory = tmp_path / "qwen3"
    shutil.copytree(QWEN.removeprefix("hf:"), directory)
    generation = json.loads((directory / "generation_config.json").read_text())
    generation.update(do_sample=True, temperature=1.5, top_p=0.95, top_k=1, repetition_penalty=1.1)
    (directory / "generation_config.json").write_text(json.dumps(generation))
    server, port = start(f"hf:{directory}", "--quiet", "--max-batch", "1")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        got = [c.completions.create(model=f"hf:{directory}", prompt=PROMPTS[0], max_tokens=20, **settings)
               for settings in ({}, {"temperature": 2.0, "seed": 3})]  # fmt: skip
    finally:
        stop(server)
    note = "note: generation_config.json's repetition_penalty=1.1 is not applied: lm samples with temperature, top_k"
    assert note in server.stderr.read()
    greedy = sample_py(capsys, "--prompt", PROMPTS[0], "--max-new-tokens", "20")
    assert [PROMPTS[0] + g.choices[0].text + "\n" for g in got] == [greedy, greedy]
    parsed = api.parse_completion({"prompt": "a"}, dataclasses.replace(served, temperature=0.0, top_p=0.5))
    assert (parsed.choices[0].temperature, parsed.choices[0].top_p) == (0.0, 0.5)
    # What a file leaves out, or one without sampling settings (the fixture's names token ids), is OpenAI's default:
    # it was lm's sample.py default, temperature 0.8
    from lm.serve.cli import request_defaults

    assert request_defaults(QWEN) == ({"temperature": 1.0, "top_p": 1.0}, 0, [])
    generation.update(do_sample=True, temperature=0.6, top_p=1.0, repetition_penalty=1.0)
    del generation["top_k"]
    (directory / "generation_config.json").write_text(json.dumps(generation))
    assert request_defaults(f"hf:{directory}") == ({"temperature": 0.6, "top_p": 1.0}, 50, [])  # (transformers' top_k)
    (directory / "generation_config.json").unlink()
    assert request_defaults(f"hf:{directory}") == ({"temperature": 1.0, "top_p": 1.0}, 0, [])


def test_a_run_is_served_with_its_own_sampling_settings(tiny_run, tmp_path):
    """A run's `sample` settings, which sample.py samples it with and its export's generation_config.json holds (a
    fine-tune of an hf:DIR takes that model's): it was served at OpenAI's 1 and 1, and its export at its own."""
    from lm import config as C
    from lm.export import main as export_main
    from lm.serve.cli import request_defaults

    sample = C.load(os.path.join(tiny_run, "config.yaml")).sample
    want = ({"temperature": sample.temperature, "top_p": sample.top_p}, sample.top_k, [])
    assert request_defaults(f"{tiny_run}/checkpoints/10") == want and want[0]["temperature"] == 0.8
    assert export_main([tiny_run, str(tmp_path / "out")]) == 0
    assert request_defaults(f"hf:{tmp_path / 'out'}") == want


def test_without_the_serve_extra_the_command_says_what_to_install(monkeypatch, capsys):
    from lm.serve import cli

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if it were not installed
    assert cli.main([QWEN]) == 2
    assert capsys.readouterr().err == "error: serving needs uvicorn: pip install 'lm[serve]'\n"


def test_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = subprocess.run(  # (cpu: the port is refused whatever the device)
            [sys.executable, "-m", "lm.serve", QWEN, "--port", str(taken.getsockname()[1])],
            cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": python_path()}, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("error: cannot listen on 127.0.0.1:"), done.stderr
    assert "choose another --port" in done.stderr and done.stderr.count("\n") == 1


def test_a_grace_longer_than_a_timer_can_wait_is_one_line(capsys):
    """--grace inf (or 1e10) passed the check, then a first Ctrl-C printed "Thread-2 failed: OverflowError" and
    never drained: threading.Timer waits at most threading.TIMEOUT_MAX seconds."""
    from lm.serve import cli

    for grace in ("inf", "1e10"):
        assert cli.main([QWEN, "--grace", grace, "--max-len", "1"]) == 2  # (--max-len 1: refused next, were it not)
        err = capsys.readouterr().err
        assert err.startswith("error: --grace must be a number of seconds in [0, ") and err.count("\n") == 1, err


def test_an_empty_host_is_one_line(capsys):
    """--host "" (an unset $HOST) listened on every interface, a server open to the network, without a word."""
    from lm.serve import cli

    assert cli.main([QWEN, "--host", "", "--max-len", "1"]) == 2  # (--max-len 1: refused next, were it not)
    err = capsys.readouterr().err
    assert err.startswith("error: --host must not be empty") and err.count("\n") == 1, err


def test_standard_output_carries_the_ready_line_alone(tiny_run):
    """uvicorn's access log went to stdout: a script that read the ready line from a pipe and nothing after it hung
    the server once 64 KiB of log lines had filled the pipe (1,120 requests: SIGTERM could not stop it then)."""
    server, port = start(tiny_run, "--max-batch", "1")  # (not --quiet: the access log on)
    try:
        assert raw(port, "GET", "/health")[0] == 200
    finally:
        stop(server)
    assert server.stdout.read() == ""
    assert '"GET /health HTTP/1.1" 200' in server.stderr.read()


# slow: about 8 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_the_ready_line_names_an_ipv6_host_as_a_url():
    """--host ::1 printed "serving ... at http://::1:PORT", which no client or browser takes as a URL."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    import urllib.request

    server, port = start(QWEN, "--host", "::1", "--quiet", "--max-batch", "1")
    try:
        url = server.ready_line.split()[3]
        assert url == f"http://[::1]:{port}", server.ready_line
        with urllib.request.urlopen(url + "/health", timeout=60) as response:
            assert json.load(response)["status"] == "ok"
    finally:
        stop(server)
