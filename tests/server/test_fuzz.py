"""Property: whatever a client sends to /v1/completions, the answer is a 2xx or a 4xx JSON error."""

from __future__ import annotations

import json

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
field_values = {
    "prompt": st.text(max_size=300) | json_values,
    "max_tokens": st.integers(-5, 80) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "stream": st.booleans() | json_values,
    "model": st.text(max_size=20) | json_values,
    "n": st.integers(0, 3) | json_values,
}
bodies = (
    st.fixed_dictionaries({}, optional=field_values).map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=300)
)
tenants = st.none() | st.sampled_from(["alpha", "beta", ""]) | st.text(
    st.characters(min_codepoint=33, max_codepoint=126), max_size=20)


def check_answer(r: requests.Response) -> None:
    """A generation route's answer to any body: 2xx or 4xx JSON, never 5xx; a stream ends in [DONE]."""
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["code"] == r.status_code and error["message"]
    elif r.headers["Content-Type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=bodies, tenant=tenants)
def test_any_request_gets_2xx_or_4xx_json(server, body, tenant):
    headers = {"Content-Type": "application/json"}
    if tenant is not None:
        headers["X-Tenant"] = tenant
    r = requests.post(server.url + "/v1/completions", data=body, headers=headers, timeout=30)
    check_answer(r)
