"""Requests a user sends: reproducible from the seed, sized as the distributions say."""

from __future__ import annotations

import random

import pytest

from gpuscope.loadtest.options import Workload, make_prompt, parse_tenants, tenant_class_name, user_seed
from gpuscope.server.model import encode


def _requests(workload: Workload, seed: str, n: int = 20) -> list[dict]:
    rng = random.Random(seed)
    return [workload.request_body(rng) for _ in range(n)]


def test_same_run_seed_and_user_give_the_same_requests_other_users_differ():
    workload = Workload.from_options(None)
    assert _requests(workload, user_seed(1234, 0, 1)) == _requests(workload, user_seed(1234, 0, 1))
    assert _requests(workload, user_seed(1234, 0, 1)) != _requests(workload, user_seed(1234, 0, 2))
    assert _requests(workload, user_seed(1234, 0, 1)) != _requests(workload, user_seed(1234, 1, 1))
    assert _requests(workload, user_seed(1234, 0, 1)) != _requests(workload, user_seed(99, 0, 1))


def test_prompt_length_is_the_drawn_token_count_for_a_byte_tokenizer():
    rng = random.Random(5)
    for n in (1, 2, 7, 64, 255):
        prompt = make_prompt(rng, n)
        assert len(prompt) == n and prompt.isascii()
        assert len(encode(prompt)) == n + 1  # gpuscope serve counts BOS too


def test_options_from_locust_override_defaults():
    class Options:
        prompt_tokens = "fixed:n=10"
        output_tokens = "fixed:n=3"
        seed = 7
        temperature = "0.5"

    body = Workload.from_options(Options()).request_body(random.Random(0))
    assert len(body["prompt"]) == 10 and body["max_tokens"] == 3
    assert body["temperature"] == 0.5 and body["stream"] is True


def test_tenant_specs():
    assert parse_tenants("alpha:3, beta") == {"alpha": 3.0, "beta": 1.0}
    # The server's tenant-name rule: whatever the server serves, the load test can send.
    assert parse_tenants("9x:1,team.a,low-prio_2") == {"9x": 1.0, "team.a": 1.0, "low-prio_2": 1.0}
    assert tenant_class_name("team.a") == "TenantTeamA"
    for bad, needle in [("a b:1", "must be 1-64 of"), ("x" * 65, "must be 1-64 of"), ("a:x", "not a number"),
                        ("a:1,a:2", "unique"), ("", "no tenants")]:
        with pytest.raises(ValueError, match=needle):
            parse_tenants(bad)
