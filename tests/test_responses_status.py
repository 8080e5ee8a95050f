"""/v1/responses: an incomplete response (cut off at max_output_tokens) holds no item marked
completed, in the body and in the streamed events; a finished one holds completed items."""
from __future__ import annotations

import json

import pytest

from pd_cluster.serving.api.openai_format import Result
from pd_cluster.serving.api.responses import parse_responses
from pd_cluster.serving.api.responses_format import ResponsesFormatter


def _formatter() -> ResponsesFormatter:
    req, _chat = parse_responses(json.dumps({"model": "m", "input": "hi"}).encode())
    return ResponsesFormatter(req, None, "resp-1", "m", False)


@pytest.mark.parametrize("finish, status", [("length", "incomplete"), ("stop", "completed")])
def test_item_status_follows_the_response(finish: str, status: str) -> None:
    result = Result(prompt_token_ids=[1, 2])
    result.text, result.token_ids, result.finish_reason = "Once upon", [5, 6], finish
    body = _formatter().full([result])
    assert body["status"] == status
    assert [item["status"] for item in body["output"]] == [status]
    events = _formatter().events("Once upon", finish, [result])
    done = [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]
    assert done == [status] and final["type"] == f"response.{status}"
    assert [item["status"] for item in final["response"]["output"]] == [status]
