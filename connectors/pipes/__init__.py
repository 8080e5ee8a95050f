"""Pipes carry (header, tensor) messages between prefill (producer) and decode (consumer).

Transports live in `<name>_pipe.py` modules and are created by name: create_pipe("zmq", cfg).
"""
from connectors.pipes.base import (HandshakeError, KVPipe, PipeClosed, PipeConfig, PipeError,
                                   PipeTimeout, available_pipes, create_pipe, register_pipe)

__all__ = ["HandshakeError", "KVPipe", "PipeClosed", "PipeConfig", "PipeError", "PipeTimeout",
           "available_pipes", "create_pipe", "register_pipe"]
