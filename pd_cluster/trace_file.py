"""One JSON-lines trace file per process, in a folder named by an environment variable: the
shared writer of the start-up trace (start_trace.py) and the TTFT trace (ttft_trace.py)."""
from __future__ import annotations

import json
import os
from typing import Any


class TraceFile:
    """Appends records to ``<$env>/<pid>.jsonl``; off (the variable unset) a write costs one
    attribute test. Imports nothing heavy: it can come first in any process."""

    def __init__(self, env: str) -> None:
        self.folder = os.environ.get(env) or None
        self._file: Any = None

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def write(self, record: dict[str, Any]) -> None:
        if self.folder is None:
            return
        if self._file is None:
            os.makedirs(self.folder, exist_ok=True)
            # line-buffered: a process killed at shutdown still leaves its lines
            self._file = open(  # noqa: SIM115 - held for the process's life
                os.path.join(self.folder, f"{os.getpid()}.jsonl"), "a",
                buffering=1)
        self._file.write(json.dumps(record) + "\n")
