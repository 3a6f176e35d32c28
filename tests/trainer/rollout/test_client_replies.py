"""The client's reading of vLLM's /inference/v1/generate reply: a reply it cannot trust is a
ServerError (the chunk goes to another server), never a KeyError or a completion with
log-probs that do not line up with its tokens."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gspo_trainer.rollout.client import ServerError, _parse_choices


def reply(n: int = 2, tokens: int = 3, **change: Any) -> dict[str, Any]:
    """A reply as vLLM's route writes it (output_mode "tokens", logprobs 0), choices in
    reverse order (the route numbers them; the client must sort)."""
    choices = [
        {
            "index": k,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [10 * k + t for t in range(tokens)],
            "logprobs": {
                "content": [
                    {"token_id": 10 * k + t, "logprob": -0.25 * (t + 1), "top_logprobs": []}
                    for t in range(tokens)
                ]
            },
        }
        for k in reversed(range(n))
    ]
    body = {
        "request_id": "generate-tokens-1",
        "model": "m",
        "output_mode": "tokens",
        "choices": choices,
    }
    for path, value in change.items():
        *keys, last = path.split("__")
        target: Any = body
        for key in keys:
            target = target[int(key)] if key.isdigit() else target[key]
        target[int(last) if last.isdigit() else last] = value
    return body


def parse(
    body: dict[str, Any], n: int = 2, version: str | None = "3", expected: int | None = 3
) -> list[dict[str, Any]]:
    return _parse_choices(json.dumps(body).encode(), n, version, expected)


def test_a_reply_is_read_in_index_order_with_its_version() -> None:
    out = parse(reply())
    assert [c["token_ids"] for c in out] == [[0, 1, 2], [10, 11, 12]]
    assert [c["logprobs"] for c in out] == [[-0.25, -0.5, -0.75]] * 2
    assert {c["policy_version"] for c in out} == {3}
    assert {c["finish_reason"] for c in out} == {"length"}


@pytest.mark.parametrize(
    ("body", "version", "expected", "message"),
    [
        (reply(), None, 3, "no policy version header"),
        (reply(), "2", 3, "version 2, expected 3"),
        (reply(n=1), "3", 3, "expected 2 choices, got 1"),
        (reply(choices__0__logprobs=None), "3", 3, "not of the generate route's shape"),
        (reply(choices__1__token_ids="abc"), "3", 3, "not of the generate route's shape"),
        ({"error": {"message": "boom"}}, "3", 3, "not of the generate route's shape"),
        (reply(choices__0__finish_reason="abort"), "3", 3, "ended with 'abort'"),
        (reply(choices__0__token_ids=[1, 2]), "3", 3, "3 log-probs for 2 tokens"),
    ],
)
def test_a_reply_it_cannot_trust_is_a_server_error(
    body: dict[str, Any], version: str | None, expected: int, message: str
) -> None:
    with pytest.raises(ServerError, match=message):
        parse(body, version=version, expected=expected)


def test_bytes_that_are_not_json_are_a_server_error() -> None:
    with pytest.raises(ServerError, match="not of the generate route's shape"):
        _parse_choices(b"<html>502 Bad Gateway</html>", 2, "3", 3)
