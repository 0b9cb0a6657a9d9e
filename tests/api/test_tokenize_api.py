"""/tokenize and /detokenize (vLLM's shapes) against the real server, checked against the
`tokenizers` library and against what /v1/chat/completions runs."""
import pytest
import requests

from api_support import MAX_SEQ, MODEL_ID


def post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=30)


def test_tokenize_text_matches_hf(server, hf_tokenizer):
    text = "Hello world! Ünïcödé, 123 tokens\n<|im_start|>"
    r = post(server, "/tokenize", {"model": MODEL_ID, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    j = r.json()
    want = hf_tokenizer.encode(text, add_special_tokens=True).ids
    assert j["tokens"] == want and j["count"] == len(want) and j["max_model_len"] == MAX_SEQ
    assert "".join(j["token_strs"]) == text
    assert post(server, "/tokenize", {"prompt": text}).json()["token_strs"] is None  # model is optional


def test_detokenize_round_trip(server, hf_tokenizer):
    text = "Round trip, with émojis 🙂 and\nnewlines"
    ids = hf_tokenizer.encode(text).ids
    r = post(server, "/detokenize", {"model": MODEL_ID, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}


def test_tokenize_messages_is_the_chat_prompt(server, client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    j = post(server, "/tokenize", {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert j["prompt"] == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                          "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    r = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert j["count"] == r.usage.prompt_tokens


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": []}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/tokenize", {"messages": "Hi"}, 400, "messages"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens[0]"),
])
def test_malformed(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert post(server, "/tokenize", {"prompt": "still fine"}).status_code == 200


def test_not_json(server):
    r = requests.post(server.url + "/tokenize", data="{", timeout=30, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
