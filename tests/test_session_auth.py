"""A proxy session proves the cluster secret (session_sockets.py): a client that connects to a
session's token stream without the answer to its nonce (or with another secret's) gets
nothing and is closed, counted, while the real proxy then connects and reads every frame; a
tcp request socket takes only CURVE clients holding the secret's keys. Refused connections
are counted each and logged rate-limited."""
from __future__ import annotations

import asyncio
import secrets
import socket

import pytest
import zmq

from pd_cluster.driver.messages import EngineDelta
from pd_cluster.serving.engine.request_reader import RequestReader, request_message
from pd_cluster.serving.engine.session_sockets import NONCE_BYTES, parse_endpoint
from pd_cluster.serving.cluster.testing import wait_until
from tests.test_token_path_sender import _Proxy, prove
from pd_cluster.driver.messages import EngineRequest
from tests.token_path_fakes import PARAMS


@pytest.mark.parametrize("ipc", [False, True])
def test_a_forged_token_session_client_gets_nothing(ipc: bool, caplog) -> None:
    proxy = _Proxy(ipc=ipc, connect=False)
    try:
        proxy.sender.route("r", "s")
        proxy.sender.emit([EngineDelta("r", 0, [1], "early")])  # waits for the real proxy
        kind, addr = parse_endpoint(proxy.endpoint)
        forged = []
        for answer in (None, b"\0" * 32, "other-secret"):
            s = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET)
            s.settimeout(10)
            s.connect(addr)
            if answer == "other-secret":
                prove(s, "s", secrets.token_hex(32).encode())
            elif answer is not None:
                assert len(s.recv(NONCE_BYTES)) == NONCE_BYTES
                s.sendall(answer)
            else:
                s.shutdown(socket.SHUT_WR)  # says nothing
            forged.append(s)
        failures = lambda: proxy.sender.counters["session_auth_failures"]  # noqa: E731
        wait_until(lambda: failures() == 3, 10, "three refused connections")
        # counted each, logged once (then a summary per interval: peers cannot fill logs)
        assert sum("refused a connection" in r.getMessage() for r in caplog.records) == 1
        for s in forged:  # at most the nonce came, then the engine closed it: no frame
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            assert len(data) <= NONCE_BYTES
            s.close()
        proxy.connect()  # the real proxy: the frame that waited, then the next
        proxy.sender.emit([EngineDelta("r", 1, [2], "late")])
        assert [d.text for d in proxy.read(2)] == ["early", "late"]
        assert failures() == 3
    finally:
        proxy.sender.stop()
        if proxy.sock is not None:
            proxy.sock.close()


def test_a_tcp_request_socket_takes_only_curve_clients_of_the_cluster() -> None:
    async def go() -> None:
        got: list = []
        reader = RequestReader("s", False, "127.0.0.1", "/tmp", got.append, lambda ids: None)
        ctx = zmq.Context.instance()
        plain = ctx.socket(zmq.PUSH)
        plain.setsockopt(zmq.LINGER, 0)
        try:
            plain.connect(reader.endpoint)  # no CURVE keys: its handshake never completes
            plain.send(request_message(EngineRequest("forged", [1, 2, 3], PARAMS)), zmq.NOBLOCK)
            from connectors.secret import cluster_secret
            from pd_cluster.serving.engine.session_sockets import curve_request_socket
            real = ctx.socket(zmq.PUSH)
            real.setsockopt(zmq.LINGER, 0)
            curve_request_socket(real, cluster_secret(), server=False)
            real.connect(reader.endpoint)
            real.send(request_message(EngineRequest("genuine", [1, 2, 3], PARAMS)))
            for _ in range(500):  # bounded: the genuine one arrives
                if got:
                    break
                await asyncio.sleep(0.02)
            assert [r.request_id for r in got] == ["genuine"]  # the forged one never will
            real.close(0)
        finally:
            plain.close(0)
            reader.close()
    asyncio.run(go())
