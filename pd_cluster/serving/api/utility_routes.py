"""The endpoints around generation that vLLM's server has and clients use: /tokenize,
/detokenize, /version, and OpenAI-shaped bodies for unknown paths (404) and methods (405)."""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from pd_cluster.serving.api.errors import APIError, invalid_request, model_not_found
from pd_cluster.serving.api.openai_schemas import ChatMessage
from pd_cluster.serving.api.request_body import read_body


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def add_utility_routes(app: FastAPI, state: Any) -> None:
    from pd_cluster import __version__

    def check_model(model: str | None) -> None:
        if model is not None and model not in state.cfg.served_names:
            raise model_not_found(model, state.cfg.served_names)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = _parse(TokenizeRequest, await read_body(request, state.cfg.proxy.max_body_bytes))
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise invalid_request("give exactly one of prompt, messages", "prompt")

        def work() -> list[int]:  # on the proxy's tokenizing thread, off the event loop
            if req.prompt is not None:
                return state.tokenizer.encode(req.prompt,
                                              add_special_tokens=req.add_special_tokens)
            return state.chat_prompt(req)
        ids = await asyncio.wrap_future(state.tokenizing.submit(work))
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": list(ids)}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = _parse(DetokenizeRequest, await read_body(request, state.cfg.proxy.max_body_bytes))
        check_model(req.model)
        if any(not 0 <= t < state.vocab_size for t in req.tokens):
            raise invalid_request(f"tokens: ids must be in [0, {state.vocab_size})", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"Invalid URL ({request.method} {request.url.path})",
                   405: f"Method {request.method} not allowed for {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        err = APIError(exc.status_code, message, "invalid_request_error")
        return JSONResponse(err.body(), status_code=exc.status_code)


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    from pydantic import ValidationError
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        raise invalid_request(f"{'.'.join(loc) or 'body'}: {err['msg']}",
                              loc[0] if loc else None) from None
