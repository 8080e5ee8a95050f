"""The proxy's reader of one engine's token stream: a socket read on the event loop, every
complete frame applied as it is read (engine/frame_socket.py: length, CRC-32, payload).

A reader callback on the socket's descriptor, not an asyncio Protocol: a Protocol gets one
read per turn of the loop, at most what the kernel buffered (~200 KB on a unix socket), so a
proxy that fell behind ran every client stream after each such read. The callback reads
again while the engine has written meanwhile (its output thread refills the socket while the
first read is parsed), up to ``_DRAIN_BYTES`` a turn: everything applied before the streams
run, so a proxy that fell behind sends each client one coalesced chunk and catches up.
"""
from __future__ import annotations

import asyncio
import functools
import socket
from typing import Callable

import msgspec

from pd_cluster.serving.engine.frame_socket import FrameParser, MalformedFrame
from pd_cluster.serving.engine.session_sockets import NONCE_BYTES, parse_endpoint

_READ = 256 << 10  # bytes per recv
_DRAIN_BYTES = 4 << 20  # read per turn of the loop at most: then the clients' streams run


class FrameReader:
    """``on_frame(payload)`` for each frame; ``on_malformed(error)`` once when the stream
    cannot be cut into frames or a payload not decoded (raised by ``on_frame``); ``on_lost()``
    once when the engine's end closed. Either ends the reading."""

    def __init__(self, sock: socket.socket, on_frame: Callable[[memoryview], None],
                 on_malformed: Callable[[Exception], None], on_lost: Callable[[], None]):
        self._sock, self._on_frame = sock, on_frame
        self._on_malformed, self._on_lost = on_malformed, on_lost
        self._parser = FrameParser()
        # One receive buffer, reused: recv(n) would allocate n bytes per read (~13 us at
        # 256 KiB, on every token); the parser copies out only a partial frame's tail.
        self._buf = bytearray(_READ)
        self._view = memoryview(self._buf)
        self._loop = asyncio.get_running_loop()
        self.lost = False
        self._loop.add_reader(sock.fileno(), self._read)

    @classmethod
    async def connect(cls, endpoint: str, on_frame: Callable[[memoryview], None],
                      on_malformed: Callable[[Exception], None],
                      on_lost: Callable[[], None],
                      prove: Callable[[bytes], bytes] | None = None) -> FrameReader:
        """Connect to ``unix://<path>`` or ``tcp://<host>:<port>`` (the caller bounds it);
        ``prove(nonce)``: the answer to the engine's challenge (session_sockets.py), before
        any frame comes."""
        kind, addr = parse_endpoint(endpoint)
        if kind == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET,
                                 socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, addr)
            if prove is not None:
                nonce = b""
                while len(nonce) < NONCE_BYTES:
                    got = await loop.sock_recv(sock, NONCE_BYTES - len(nonce))
                    if not got:
                        raise ConnectionError(f"{endpoint} closed before its challenge")
                    nonce += got
                await loop.sock_sendall(sock, prove(nonce))
            return cls(sock, on_frame, on_malformed, on_lost)
        except BaseException:
            sock.close()
            raise

    def _read(self) -> None:
        total = 0
        try:
            while total < _DRAIN_BYTES and not self.lost:
                n = self._sock.recv_into(self._buf)
                if not n:
                    self._end(self._on_lost)
                    return
                self._parser.feed(self._view[:n], self._on_frame)
                total += n
        except (BlockingIOError, InterruptedError):
            return  # drained: the descriptor signals again when the engine writes
        except (MalformedFrame, msgspec.DecodeError, msgspec.ValidationError) as e:
            self._end(functools.partial(self._on_malformed, e))
        except OSError:  # reset: the engine's end is gone
            self._end(self._on_lost)
        # (more left after _DRAIN_BYTES: the descriptor is level-triggered, read next turn)

    def _end(self, tell: Callable[[], None]) -> None:
        if not self.lost:
            self.close()
            tell()

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
        self.lost = True
