"""A Hugging Face repo id on this machine before anything starts: from the local hub cache,
else downloaded (progress bars) where the Hub answers, else one line naming the command that
fetches it. huggingface_hub honours HF_HUB_OFFLINE, HF_HUB_CACHE and HF_HOME."""
from __future__ import annotations

import socket
import threading
from urllib.parse import urlparse

# What an engine reads from a checkpoint; nothing else is fetched from a repo.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
PROBE_TIMEOUT = 2.0  # s: how long "is the Hub reachable" may take (DNS included)


def download_command(repo_id: str) -> str:
    """The installed huggingface_hub's download command: `hf` since 0.34, before it
    `huggingface-cli`."""
    import huggingface_hub
    major, minor = (int(p) for p in huggingface_hub.__version__.split(".")[:2])
    cli = "hf" if (major, minor) >= (0, 34) else "huggingface-cli"
    return f"{cli} download {repo_id}"


def cached_snapshot(repo_id: str) -> str | None:
    """The repo's snapshot directory in the local hub cache (refs/main), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        path = snapshot_download(repo_id, allow_patterns=CHECKPOINT_FILES, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    from pathlib import Path
    return path if (Path(path) / "config.json").is_file() else None


def hub_reachable(timeout: float = PROBE_TIMEOUT) -> bool:
    """A TCP connection to the Hub's endpoint within ``timeout`` (name lookup included: it
    runs on a thread so a stuck resolver cannot hold the caller)."""
    from huggingface_hub import constants
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    ok = [False]

    def probe() -> None:
        try:
            socket.create_connection((url.hostname or "", port), timeout=timeout).close()
            ok[0] = True
        except OSError:
            pass
    t = threading.Thread(target=probe, daemon=True, name="hub-probe")
    t.start()
    t.join(timeout)
    return ok[0]


def offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def fetch_repo(repo_id: str, where: str = "this machine") -> str:
    """The repo's local snapshot directory: cached, or downloaded now with progress bars;
    ValueError (one line, the download command in it) when neither can be."""
    path = cached_snapshot(repo_id)
    if path is not None:
        return path
    from huggingface_hub import constants
    cache = constants.HF_HUB_CACHE
    if offline():
        why = "HF_HUB_OFFLINE is set"
    elif not hub_reachable():
        why = f"the Hub ({constants.ENDPOINT}) is not reachable"
    else:
        return _download(repo_id, where)
    raise ValueError(f"model: {repo_id!r} is not in the Hugging Face cache of {where} "
                     f"({cache}) and {why}; fetch it with `{download_command(repo_id)}` "
                     f"or give a checkpoint directory")


def _download(repo_id: str, where: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
    try:
        return snapshot_download(repo_id, allow_patterns=CHECKPOINT_FILES)
    except RepositoryNotFoundError:
        raise ValueError(f"model: {repo_id!r} is not a repository on the Hub (or it is gated: "
                         f"`hf auth login`)") from None
    except (HfHubHTTPError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"model: cannot fetch {repo_id!r} on {where}: {first}; try "
                         f"`{download_command(repo_id)}`") from None
