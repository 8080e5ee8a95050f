"""vLLM's --generation-config: the sampling keys of a generation_config.json are the defaults
of requests that leave them unset (a request's own value wins; max_new_tokens is also the cap
of every HTTP request's max_tokens, vLLM's server-wide limit), over HTTP (the proxy's app with
a fake engine, through the openai SDK) and offline (``LLM``); ``vllm`` ignores the file; a
folder is read instead of the model's; bad values are errors naming the key."""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pd_cluster.generation_defaults import load_generation_defaults
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.cluster.model_source import check_model
from tests.token_path_fakes import FakeEngineActor

FILE = {"temperature": 0.5, "top_p": 0.8, "top_k": 7, "repetition_penalty": 1.2,
        "max_new_tokens": 5, "do_sample": True, "eos_token_id": 2}
SAMPLING = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens")


def _model(root: Path, gen: dict[str, Any] | None) -> str:
    """The built-in model's checkpoint with ``gen`` as its generation_config.json."""
    out = root / "model"
    shutil.copytree(check_model("tiny-llama"), out)
    base = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**base, **(gen or {})}))
    return str(out)


def _folder(root: Path, gen: dict[str, Any]) -> str:
    out = root / "gen"
    out.mkdir()
    (out / "generation_config.json").write_text(json.dumps(gen))
    return str(out)


# ---- the defaults themselves ------------------------------------------------------------
def test_sources_and_the_override(tmp_path: Path) -> None:
    model = _model(tmp_path, {**FILE, "min_p": 0.1})
    auto = load_generation_defaults(model)
    assert auto.values == {"temperature": 0.5, "top_p": 0.8, "top_k": 7,
                           "repetition_penalty": 1.2, "max_tokens": 5}
    assert auto.ignored == {"min_p": "this server's sampler has no min_p"}
    assert "temperature=0.5" in auto.summary() and "min_p not applied" in auto.summary()
    assert load_generation_defaults(model, "vllm").values == {}
    assert load_generation_defaults(model, "vllm").summary() is None
    only = load_generation_defaults(model, "vllm", {"temperature": 0.25})
    assert only.values == {"temperature": 0.25} and only.source == "override_generation_config"
    merged = load_generation_defaults(model, "auto", {"temperature": 0.25, "top_k": 0})
    assert merged.values["temperature"] == 0.25 and merged.values["top_p"] == 0.8
    folder = load_generation_defaults(model, _folder(tmp_path, {"top_p": 0.3, "top_k": None}))
    assert folder.values == {"top_p": 0.3}  # null is unset, as in vLLM
    plain = load_generation_defaults(check_model("tiny-llama"))  # the built-in: no sampling keys
    assert plain.values == {} and plain.summary() is None


@pytest.mark.parametrize("gen_config, override, file, message", [
    ("/no/such/folder", None, {}, "generation_config: '/no/such/folder' is not a folder"),
    ("auto", {"temprature": 1.0}, {}, "unknown key 'temprature' (one of temperature, top_p, "
                                      "top_k, repetition_penalty, max_new_tokens; did you "
                                      "mean temperature?)"),
    ("auto", {"max_tokens": 4}, {}, "max_tokens is max_new_tokens"),
    ("auto", {"min_p": 0.1}, {}, "override_generation_config: min_p: this server's sampler"),
    ("auto", {"top_p": 1.5}, {}, "override_generation_config: top_p: must be in (0, 1]"),
    ("auto", None, {"temperature": -1}, "generation_config.json (MODEL): temperature: must "
                                        "be >= 0, got -1 (generation_config vllm ignores"),
    ("auto", None, {"max_new_tokens": 0}, "max_new_tokens: must be >= 1"),
    ("auto", None, {"top_k": 2.5}, "top_k: must be -1 (disabled), 0 (disabled) or >= 1"),
])
def test_bad_values_name_the_key(tmp_path: Path, gen_config: str, override: Any,
                                 file: dict[str, Any], message: str) -> None:
    model = _model(tmp_path, file)
    with pytest.raises(ValueError) as e:
        load_generation_defaults(model, gen_config, override)
    assert message.replace("MODEL", model) in str(e.value)
    assert load_generation_defaults(model, "vllm").values == {}  # vllm never reads the file


def test_a_folder_without_the_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no generation_config.json"):
        load_generation_defaults(_model(tmp_path, {}), str(tmp_path))


def test_serve_flags_and_the_check_before_ray_starts(tmp_path: Path) -> None:
    from pd_cluster.cli import build_parser
    from pd_cluster.serving.cluster.cli_cluster import preflight
    from pd_cluster.serving.cluster.serve_cli import serve_config
    model = _model(tmp_path, FILE)

    def config(*flags: str) -> Any:
        return serve_config(build_parser().parse_args(["serve", model, "--port", "0", *flags]))
    cfg = config("--generation-config", "vllm", "--override-generation-config",
                 '{"temperature": 0.5}')
    assert cfg.engine["generation_config"] == "vllm"
    assert cfg.engine["override_generation_config"] == {"temperature": 0.5}
    assert preflight(cfg, None) is None
    assert "is not a folder" in preflight(config("--generation-config", "/no/such"), None)
    with pytest.raises(ValueError) as e:  # the config's own check, before anything starts
        config("--override-generation-config", '{"top_p": 2}')
    assert str(e.value) == "engine.override_generation_config.top_p: must be in (0, 1], got 2"
    with pytest.raises(ValueError, match="engine.override_generation_config: unknown key"):
        config("--override-generation-config", '{"temp": 0.5}')


# ---- over HTTP ----------------------------------------------------------------------------
class _Recording(FakeEngineActor):
    """The fake engine, keeping the SamplingParams of each request it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.params: list[SamplingParams] = []

    def accept(self, req: Any) -> None:
        self.params.append(req.params)
        super().accept(req)


def _served(model: str, engine_keys: dict[str, Any], requests: Any) -> list[SamplingParams]:
    """The SamplingParams the engine got for each of ``requests(sdk)``'s requests."""
    from pd_cluster.serving.api.app import create_app
    from pd_cluster.serving.cluster.cluster_config import parse_config
    cfg = parse_config({"model": model, "mode": "colocated", "colocated": {"replicas": 1},
                        "engine": engine_keys, "proxy": {"port": 0}})
    engine = _Recording()
    app = create_app(cfg, [(engine.name, engine.role, engine.handle)])
    state = app.state.proxy

    async def go() -> None:
        await state.pool.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://proxy", timeout=30) as http:
                sdk = openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="x",
                                         http_client=http, max_retries=0)
                await requests(sdk, cfg.model_name)
        finally:
            await state.pool.close()
            state.close()
            engine.stop()
        assert state.inflight == 0 and not engine.sender._routes  # nothing left running
    asyncio.run(go())
    return engine.params


def _fields(p: SamplingParams) -> tuple[Any, ...]:
    return tuple(getattr(p, k) for k in SAMPLING)


def test_http_requests_get_the_files_defaults_and_their_own_values_win(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = _model(tmp_path, FILE)
    chat = [{"role": "user", "content": "hi"}]

    async def requests(sdk: openai.AsyncOpenAI, name: str) -> None:
        await sdk.chat.completions.create(model=name, messages=chat)  # nothing set
        await sdk.chat.completions.create(  # everything set
            model=name, messages=chat, temperature=0.0, top_p=1.0, max_tokens=3,
            extra_body={"top_k": -1, "repetition_penalty": 1.0})
        await sdk.chat.completions.create(model=name, messages=chat, max_tokens=9)  # capped
        await sdk.completions.create(model=name, prompt=[5, 6, 7])  # completions' default 16
        await sdk.completions.create(model=name, prompt=[5, 6, 7], temperature=0.9)

    with caplog.at_level(logging.INFO, logger="pd_cluster.serving.api.proxy_state"):
        got = [_fields(p) for p in _served(model, {}, requests)]
    assert got == [(0.5, 0.8, 7, 1.2, 5), (0.0, 1.0, -1, 1.0, 3), (0.5, 0.8, 7, 1.2, 5),
                   (0.5, 0.8, 7, 1.2, 5), (0.9, 0.8, 7, 1.2, 5)]
    said = [r.getMessage() for r in caplog.records if "default sampling params" in
            r.getMessage()]
    assert len(said) == 1 and "temperature=0.5, top_p=0.8, top_k=7" in said[0]  # once, at start


def test_http_vllm_mode_ignores_the_file_and_a_folder_or_override_replaces_it(
        tmp_path: Path) -> None:
    model = _model(tmp_path, FILE)
    folder = _folder(tmp_path, {"temperature": 0.3, "max_new_tokens": 4})

    async def requests(sdk: openai.AsyncOpenAI, name: str) -> None:
        await sdk.chat.completions.create(model=name, messages=[{"role": "user",
                                                                  "content": "hi"}])
    plain = _served(model, {"generation_config": "vllm"}, requests)[0]
    assert _fields(plain)[:4] == (1.0, 1.0, -1, 1.0)  # SamplingParams' own defaults
    assert plain.max_tokens > 5  # the room the prompt leaves, no cap
    assert _fields(_served(model, {"generation_config": folder}, requests)[0]) == (
        0.3, 1.0, -1, 1.0, 4)
    over = {"override_generation_config": {"temperature": 0.25, "max_new_tokens": 2}}
    assert _fields(_served(model, over, requests)[0]) == (0.25, 0.8, 7, 1.2, 2)


# ---- offline ------------------------------------------------------------------------------
def test_offline_llm_uses_the_defaults_when_given_no_params(tmp_path: Path) -> None:
    from pd_cluster import LLM
    model = _model(tmp_path, {"temperature": 0.0, "max_new_tokens": 3, "top_k": 5})
    prompt = [5, 6, 7, 8]
    with LLM(model) as llm:
        assert _fields(llm.get_default_sampling_params()) == (0.0, 1.0, 5, 1.0, 3)
        default = llm.generate([prompt])[0].outputs[0]
        assert len(default.token_ids) == 3 and default.finish_reason == "length"
        greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))
        own = greedy[0].outputs[0].token_ids
        assert len(own) == 6 and own[:3] == default.token_ids  # explicit params win offline
        llm.engine.check_no_leaks()
    with pytest.raises(ValueError, match="is not a folder"):  # before the engine loads
        LLM(model, generation_config=str(tmp_path / "missing"))
