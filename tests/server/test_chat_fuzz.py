"""Property: whatever a client sends to /v1/chat/completions (or stop strings to either API), the answer
is a 2xx or a 4xx JSON error, never a 5xx."""

from __future__ import annotations

import json

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.test_fuzz import check_answer, json_values

roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", ""]) | json_values
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | json_values},
                                       optional={"text": st.text(max_size=40) | json_values}), max_size=3)
contents = st.text(max_size=80) | parts | json_values
messages = st.lists(st.fixed_dictionaries({}, optional={"role": roles, "content": contents}),
                    max_size=4) | json_values
stops = st.none() | st.text(max_size=6) | st.lists(st.text(max_size=6), max_size=20) | json_values
field_values = {
    "messages": messages,
    "max_tokens": st.integers(-5, 80) | json_values,
    "max_completion_tokens": st.integers(-5, 80) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values})
    | json_values,
    "stop": stops,
    "model": st.sampled_from(["gpuscope-tiny"]) | st.text(max_size=10) | json_values,
    "logprobs": st.booleans() | json_values,
    "add_special_tokens": st.booleans() | json_values,
}
bodies = st.fixed_dictionaries({}, optional=field_values).map(lambda d: json.dumps(d).encode())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=bodies)
def test_any_chat_request_gets_2xx_or_4xx_json(server, body):
    check_answer(requests.post(server.url + "/v1/chat/completions", data=body,
                        headers={"Content-Type": "application/json"}, timeout=30))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(stop=stops, stream=st.booleans())
def test_any_stop_on_completions_gets_2xx_or_4xx_json(server, stop, stream):
    body = {"prompt": "stop strings", "max_tokens": 12, "temperature": 0, "stream": stream, "stop": stop}
    # json.dumps, not requests' json=: a non-finite float is sent as Infinity/NaN, which the server
    # must refuse with a 400 rather than the client refusing to send it.
    check_answer(requests.post(server.url + "/v1/completions", data=json.dumps(body),
                               headers={"Content-Type": "application/json"}, timeout=30))
