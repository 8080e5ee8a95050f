"""The proxy as a Ray actor, so a detached cluster keeps serving after the launcher exits.

The actor is a plain (threaded) actor whose constructor binds the port and runs uvicorn on
its own thread and event loop; Ray restarting the actor therefore restarts the server too.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any

from pd_cluster import start_trace

logger = logging.getLogger(__name__)

_START_TIMEOUT = 120.0  # s: tokenizer load + first health check of every engine
_STOP_TIMEOUT = 10.0
_ROLE_TIMEOUT = 10.0  # s: an engine's answer to "which role now" when the proxy starts


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP so asyncio sets TCP_NODELAY on accepted connections (it checks proto):
    # without it Nagle + delayed ACKs hold streamed tokens back ~40 ms on keep-alive.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class ProxyActor:
    def __init__(self, config: dict[str, Any], engines: list[dict[str, str]], namespace: str,
                 secrets: dict[str, Any] | None = None, detached: bool = False,
                 deferred: bool = False):
        """``secrets`` (handed through Ray, never the config): ``cluster`` (the cluster
        secret its sessions prove) and ``api_keys`` (resolved in the launching shell).
        ``detached``: engines it adds at run time (scaling.py) outlive their creator too.
        ``deferred``: made by the launcher beside the engines, so that its process and the
        libraries serving needs load while they do (seconds off the first answer); it serves
        when ``start`` is called, once they are ready and linked. An actor Ray restarts
        serves at once: its engines are up."""
        start_trace.mark_process_start("proxy")
        start_trace.mark("proxy", "actor init")
        _log_to_stderr()  # Ray forwards it to the launcher's console
        self._args = (config, engines, namespace, secrets or {}, detached)
        self._url: str | None = None
        self.app: Any = None
        self.server: Any = None
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._tokenizer: Any = None
        _load_serving_libraries()
        start_trace.mark("proxy", "serving libraries imported")
        if deferred and not _restarted():
            self._tokenizer = _preload_tokenizer(config)
            start_trace.mark("proxy", "tokenizer loaded")
            return
        self.start()

    def start(self) -> str:
        """Serve (once; later calls return the URL): the app over the engines, bound and
        answering, or RuntimeError."""
        if self._url is not None:
            return self._url
        start_trace.mark("proxy", "start called")
        import ray
        import uvicorn

        from connectors.secret import install
        from pd_cluster.serving.cluster.cluster_config import ClusterConfig
        from pd_cluster.serving.api.app import create_app

        config, engines, namespace, secrets, detached = self._args
        if secrets.get("cluster"):
            install(secrets["cluster"])
        cfg = ClusterConfig.from_dict(config)
        handles = current_engines(engines, namespace)
        from pd_cluster.serving.cluster.engine_starter import EngineStarter
        from pd_cluster.serving.cluster.engine_starter import engine_env
        starter = EngineStarter(cfg, namespace, secrets.get("cluster"), detached,
                                engine_env(cfg, quiet=True))
        self.app = create_app(cfg, handles, secrets.get("api_keys"), starter, self._tokenizer)
        self._tokenizer = None  # the app's now
        self.sock = bind_socket(cfg.proxy.host, cfg.proxy.port)
        port = self.sock.getsockname()[1]
        host = cfg.proxy.host
        if host in ("0.0.0.0", "::", ""):
            host = ray.util.get_node_ip_address()
        tls = cfg.proxy.ssl_certfile is not None
        url = f"{'https' if tls else 'http'}://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=3,
            timeout_keep_alive=30, ssl_certfile=cfg.proxy.ssl_certfile,
            ssl_keyfile=cfg.proxy.ssl_keyfile))
        self.thread = threading.Thread(target=self._serve, name="proxy-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + _START_TIMEOUT
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"proxy failed to start on {url}: {self._error!r}")
            time.sleep(0.05)
        self._url = url
        start_trace.mark("proxy", "serving")
        logger.info("proxy serving on %s", url)
        return url

    def _serve(self) -> None:
        try:
            self.loop = _new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        except BaseException as e:  # noqa: BLE001 - reported by __init__ / health
            self._error = e
            logger.exception("proxy server stopped")

    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the proxy has not started serving")
        return self._url

    def health(self) -> bool:
        if self.thread is None or not self.thread.is_alive():
            raise RuntimeError(f"proxy server is down: {self._error!r}")
        return True

    def status(self) -> list[dict[str, Any]]:
        state = self.app.state.proxy
        if self.loop is None:
            raise RuntimeError("the proxy server has not started")
        fut = asyncio.run_coroutine_threadsafe(state.pool.check_all(), self.loop)
        fut.result(timeout=state.cfg.proxy.health_check_timeout + 5)
        return [s.to_dict() for s in state.pool.status()]

    def shutdown_timeout(self) -> float:
        if self.app is None:  # never served: nothing in flight
            return 0.0
        return float(self.app.state.proxy.cfg.proxy.shutdown_timeout)

    def drain(self) -> dict[str, Any]:
        """No new requests; wait for the in-flight ones (api/shutdown.py), bounded."""
        if self.loop is None:
            return {"in_flight": 0, "ended": 0, "left": 0, "seconds": 0.0}
        timeout = self.shutdown_timeout()
        fut = asyncio.run_coroutine_threadsafe(self.app.state.proxy.drain.run(timeout),
                                               self.loop)
        return fut.result(timeout=timeout + 2 * _STOP_TIMEOUT)

    def stop(self) -> None:
        """Graceful: stop accepting, finish the lifespan, close the socket (frees the port)."""
        if self.server is None or self.thread is None:  # never served
            return
        self.server.should_exit = True
        self.thread.join(_STOP_TIMEOUT)
        try:
            self.sock.close()
        except OSError:
            pass


def current_engines(launched: list[dict[str, str]], namespace: str
                    ) -> list[tuple[str, str, Any]]:
    """(name, role, handle) of every engine in ``namespace``: the launched ones and any added
    since (`pd-cluster scale`), each with the role it serves now (it may have switched), for a
    proxy that Ray restarted. An engine that does not answer keeps its launch role."""
    import ray

    from pd_cluster.serving.cluster.engine_starter import named_engines
    roles = {e["name"]: e["role"] for e in launched}
    handles = named_engines(namespace)  # a launched engine scaled down since is not among them
    for e in launched:
        if e["name"] not in handles:  # the listing failed: ask for it by name
            try:
                handles[e["name"]] = ray.get_actor(e["name"], namespace=namespace)
            except ValueError:  # removed by a scale-down
                pass
    refs = {name: h.health.remote() for name, h in handles.items()}
    for name, ref in refs.items():
        try:
            roles[name] = ray.get(ref, timeout=_ROLE_TIMEOUT)["role"]
        except Exception:  # noqa: BLE001 - down now: the health checks take it from here
            pass
    return [(name, roles[name], h) for name, h in handles.items() if name in roles]


def _restarted() -> bool:
    """Whether Ray is restarting this actor (its constructor runs again, with its args)."""
    import warnings

    import ray
    with warnings.catch_warnings():  # Ray 2.60 warns inside the property (its actor_id)
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _load_serving_libraries() -> None:
    """Import what serving needs (the web stack, the app): seconds of Python that a deferred
    proxy spends while the engines load, not after. The tokenizer's own imports come with it
    (``_preload_tokenizer``): no torch where the model's files allow (tokenizer_loader.py)."""
    import uvicorn  # noqa: F401

    from pd_cluster.serving.api import app  # noqa: F401


def _preload_tokenizer(config: dict[str, Any]) -> Any:
    """The app's tokenizer, loaded while the engines load (None if it fails: ``start`` loads
    it again and says why)."""
    from pd_cluster.serving.api.proxy_state import load_tokenizer
    from pd_cluster.serving.cluster.cluster_config import ClusterConfig
    try:
        return load_tokenizer(ClusterConfig.from_dict(config))
    except Exception:  # noqa: BLE001 - reported by start(), where the launcher waits
        return None


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's when installed (as uvicorn picks it): a cheaper call_soon and socket write per
    streamed chunk; asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _log_to_stderr() -> None:
    """The access log and stats lines at INFO on this process's stderr (Ray forwards them to
    the launcher's console in the foreground)."""
    import sys
    log = logging.getLogger("pd_cluster")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def proxy_actor_class() -> Any:
    import ray
    return ray.remote(ProxyActor)
