"""OpenAI's Responses API (/v1/responses, stateless) driven by the official openai client against
the real server on the tiny scripted model (see make_tiny_model.py): with thinking on it reasons
and calls get_weather(city="Paris"); with thinking off it answers the scripted sentence.
"""
import json

import openai
import pytest
import requests

from api_support import MODEL_ID

REASONING = "The user asked about the weather, so I will call get_weather."
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
NO_THINK = {"effort": "none"}


def test_plain_text(client, scripts):
    r = client.responses.create(model=MODEL_ID, input="Hi", reasoning=NO_THINK, temperature=0)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.output_text == scripts["answer"]["text"]
    assert r.usage.output_tokens == len(scripts["answer"]["tokens"]) + 1
    assert r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_instructions_and_message_items(client, scripts):
    r = client.responses.create(model=MODEL_ID, instructions="Be brief.", reasoning=NO_THINK, temperature=0,
                                input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    assert r.output_text == scripts["answer"]["text"]
    plain = client.responses.create(model=MODEL_ID, input="Hi", reasoning=NO_THINK, temperature=0, max_output_tokens=1)
    assert r.usage.input_tokens > plain.usage.input_tokens
    assert r.instructions == "Be brief."


def test_max_output_tokens_incomplete(client):
    r = client.responses.create(model=MODEL_ID, input="Hi", reasoning=NO_THINK, temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_reasoning_and_function_call(client):
    r = client.responses.create(model=MODEL_ID, input="Weather in Paris?", tools=[WEATHER], temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == REASONING
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert call.status == "completed"


def test_function_call_round_trip(client):
    first = client.responses.create(model=MODEL_ID, input="Weather in Paris?", tools=[WEATHER], temperature=0)
    items = [{"role": "user", "content": "Weather in Paris?"}]
    items += [o.model_dump(exclude_none=True) for o in first.output]  # reasoning and function_call passed back
    call = first.output[-1]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"c": 21})})
    second = client.responses.create(model=MODEL_ID, input=items, tools=[WEATHER], temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.output[-1].type == "function_call"


def stream_events(client, **kw):
    return list(client.responses.create(stream=True, **kw))


def test_stream_event_sequence(client):
    kw = dict(model=MODEL_ID, input="Weather in Paris?", tools=[WEATHER], temperature=0)
    full = client.responses.create(**kw)
    events = stream_events(client, **kw)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # Item by item: added, its parts and deltas, done.
    expected_head = ["response.output_item.added", "response.content_part.added"]
    i = types.index("response.output_item.added")
    assert types[i:i + 2] == expected_head
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 5 and "".join(d.delta for d in deltas) == REASONING
    done = types.index("response.reasoning_text.done")
    assert types[done:done + 3] == ["response.reasoning_text.done", "response.content_part.done",
                                    "response.output_item.done"]
    assert types[done + 3] == "response.output_item.added" and events[done + 3].item.type == "function_call"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    fdone = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert fdone.arguments == args and fdone.name == "get_weather"
    final = events[-1].response
    strip = lambda out: [{k: v for k, v in o.model_dump().items() if k not in ("id", "call_id")} for o in out]  # noqa
    assert strip(final.output) == strip(full.output)
    assert final.usage.output_tokens == full.usage.output_tokens
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {o.id for o in final.output}


def test_stream_text_and_helper(client, scripts):
    events = stream_events(client, model=MODEL_ID, input="Hi", reasoning=NO_THINK, temperature=0)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == scripts["answer"]["text"]
    assert [e.type for e in events if e.type.startswith("response.output_text")][-1] == "response.output_text.done"
    # The client's stream helper accumulates the events into a Response of its own.
    with client.responses.stream(model=MODEL_ID, input="Hi", reasoning=NO_THINK, temperature=0) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert final.output_text == scripts["answer"]["text"]
    # ... and a reasoning + function_call stream.
    with client.responses.stream(model=MODEL_ID, input="Weather in Paris?", tools=[WEATHER], temperature=0) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert final.output[0].content[0].text == REASONING
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}


def test_stream_incomplete(client):
    events = stream_events(client, model=MODEL_ID, input="Hi", reasoning=NO_THINK, temperature=0, max_output_tokens=2)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def post(server, body):
    return requests.post(server.url + "/v1/responses", json=body, timeout=60)


BASE = {"model": MODEL_ID, "input": "Hi", "max_output_tokens": 2}


@pytest.mark.parametrize("change,field", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": "json"}}, "text.format"),
    ({"input": None}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"instructions": 3}, "instructions"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "5"}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": "x"}, "top_p"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": "high"}, "reasoning"),
    ({"stream": 1}, "stream"),
    ({"metadata": []}, "metadata"),
    ({"model": None}, "model"),
    ({"model": 1}, "model"),
])
def test_malformed_400(server, change, field):
    body = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field, err
    assert f"'{field}'" in err["message"] and "\n" not in err["message"]


def test_errors_through_the_client(client, server):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="Hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_ID, input="Hi", previous_response_id="resp_x")
    assert "stores no responses" in e.value.message
    assert post(server, BASE).status_code == 200  # unaffected
