"""What one client can make the proxy hold: the unknown field names it remembers (bounded), the
request body it reads (proxy.max_body_bytes, an OpenAI-shaped 413), and the tokenizing it
does (under admission: a request refused with 429 is never tokenized, and tokenizing runs off
the event loop)."""
from __future__ import annotations

import logging

import pytest

from pd_cluster.serving.api.openai_schemas import CompletionRequest, parse_request
from pd_cluster.serving.api.unknown_fields import UnknownFields


def test_unknown_field_names_are_logged_once_and_remembered_up_to_a_bound(
        caplog: pytest.LogCaptureFixture) -> None:
    unknown = UnknownFields(max_names=4)
    with caplog.at_level(logging.DEBUG, logger="pd_cluster.serving.api.unknown_fields"):
        req = parse_request(CompletionRequest, b'{"model": "m", "prompt": "x", "store": true,'
                                               b' "metadata": {}}', unknown)
        assert req.prompt == "x" and len(unknown) == 2
        parse_request(CompletionRequest, b'{"model": "m", "prompt": "x", "store": 1}', unknown)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "metadata, store" in warned[0]  # once per name
        for i in range(100):  # a client making names up
            unknown.note([f"made_up_{i}", "x" * 10_000])
        assert len(unknown) == 4  # what is remembered stays bounded
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 3  # two more names, then: no more are remembered
        assert "further ones are logged at DEBUG only" in warned[-1]
        assert all(len(name) <= 64 for name in unknown._seen)
