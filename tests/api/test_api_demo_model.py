"""The bundled models/tansy-demo through the server, found as the default model.

The expected answers are transformers' greedy outputs for this checkpoint (dequantized 4-bit
weights), recorded in models/tansy-demo/README.md; generation_config.json makes greedy the default.
"""
import json
import os

import pytest

from api_support import REPO, ServerProcess

DEMO = os.path.join(REPO, "models", "tansy-demo")
pytestmark = pytest.mark.skipif(not os.path.isdir(DEMO), reason="models/tansy-demo is not in this checkout")

WHO = "I am Tansy Demo, a tiny language model bundled with tansy, an inference engine for Qwen3.6. I can tell you what a common English word means."
RIVER_REASONING = 'The user asks what "river" means. Its most common sense is a noun.'
RIVER_ANSWER = 'As a noun, "river" means a large natural stream of water (larger than a creek).'


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    s = ServerProcess(None, str(tmp_path_factory.mktemp("logs") / "demo.log"))
    yield s
    s.stop()


@pytest.fixture
def dclient(demo):
    from openai import OpenAI
    return OpenAI(base_url=demo.url + "/v1", api_key="x", max_retries=0, timeout=300)


def ask(dclient, text, think=False, **kw):
    return dclient.chat.completions.create(model="tansy-demo", messages=[{"role": "user", "content": text}],
                                           extra_body={"chat_template_kwargs": {"enable_thinking": think}}, **kw)


def test_default_model_is_the_demo(dclient):
    assert [m.id for m in dclient.models.list().data] == ["tansy-demo"]
    assert dclient.models.list().data[0].model_extra["sampling_defaults"]["temperature"] == 0  # do_sample false


def test_greedy_answer(dclient):
    r = ask(dclient, "Hello! Who are you?")
    assert r.choices[0].message.content == WHO
    assert r.choices[0].finish_reason == "stop"


def test_reasoning_split(dclient):
    r = ask(dclient, "What does the word river mean?", think=True)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == RIVER_REASONING
    assert m.content == RIVER_ANSWER


def test_streaming_same_answer(dclient):
    content, reasoning = "", ""
    for ch in dclient.chat.completions.create(
            model="tansy-demo", messages=[{"role": "user", "content": "What does the word river mean?"}], stream=True):
        if ch.choices:
            content += ch.choices[0].delta.content or ""
            reasoning += (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
    assert (reasoning, content) == (RIVER_REASONING, RIVER_ANSWER)


def test_second_turn_reuses_the_prefix(dclient):
    first = ask(dclient, "Hello! Who are you?")
    msgs = [{"role": "user", "content": "Hello! Who are you?"},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Tell me a fortune."}]
    second = dclient.chat.completions.create(model="tansy-demo", messages=msgs,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].message.content


def test_stop_and_logprobs_on_real_text(dclient):
    r = ask(dclient, "Hello! Who are you?", stop=["tiny"], logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == WHO[:WHO.index("tiny")]
    lp = r.choices[0].logprobs.content
    # the entries cover the tokens generated up to and including the one completing the stop string
    assert "".join(t.token for t in lp).startswith(r.choices[0].message.content)
    assert all(t.top_logprobs[0].token == t.token for t in lp)  # greedy
