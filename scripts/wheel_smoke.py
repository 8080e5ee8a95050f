"""Smoke test of an installed pd-cluster wheel, as a user has it (.ci/run runs it).

Run it with the Python of a venv where the wheel (not the checkout) is installed, from a
folder outside the checkout; it needs nothing but the wheel and its dependencies:

    /tmp/venv/bin/python scripts/wheel_smoke.py

1. The package imported is the installed one (under this venv), the kernels' sources with it.
2. ``LLM(attention_backend="cpu")`` builds the C++ kernels by name in a fresh cache
   (``PD_CLUSTER_CACHE``: a new temp folder unless set) and generates, through the compiled
   step (the CPU default); the kernels loaded (no fallback) and every step ran compiled.
3. ``pd-cluster serve tiny-llama`` (Ray, a prefill and a decode engine, the proxy) answers one
   completion over HTTP, then stops on SIGINT. No engine logged a kernel fallback.

Every wait is bounded. It ends with ``wheel_smoke: N passed, M failed`` (its checks) and exit
status 0 when all passed, else 1 with the failed check printed above that line.
"""
from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from pathlib import Path

SERVE_START_S = 420.0  # Ray, two engines (each compiles or loads the model) and the proxy
REQUEST_S = 120.0
STOP_S = 90.0
PROMPT = "Once upon a time"
FALLBACK = "CPU attention kernel unavailable"  # kernels/cpu_build.py's warning


class Failed(Exception):
    """A check failed: the message says which."""


class Checks:
    """Each check printed as it passes; the first that fails raises Failed."""

    def __init__(self) -> None:
        self.passed = 0

    def __call__(self, ok: object, what: str) -> None:
        if not ok:
            raise Failed(what)
        self.passed += 1
        print(f"wheel smoke: ok: {what}", flush=True)


def installed_package(check: Checks) -> None:
    import kernels
    import pd_cluster
    from kernels import cpu_build
    prefix = Path(sys.prefix).resolve()
    for module in (pd_cluster, kernels):
        path = Path(module.__file__).resolve()
        check(prefix in path.parents, f"{module.__name__} imported from this venv ({path})")
    # The headers they include are proved by the build below (tests/test_packaging.py
    # checks the wheel against the checkout's list).
    check(all(p.is_file() for p in cpu_build._SOURCES), "kernel sources installed")


def offline_generation(check: Checks, cache: Path) -> None:
    from kernels.cpu_build import load_cpu_kernels, load_error
    from pd_cluster import LLM, SamplingParams
    from pd_cluster.engine.compiled_model import CompiledModel
    t0 = time.monotonic()
    # compile_mode blocking: every step compiled, so the check below proves the compiled
    # path of the installed wheel (served eagerly meanwhile is the default, tested in tests/).
    llm = LLM(None, attention_backend="cpu", compile_mode="blocking")  # raises if no kernels
    check(load_cpu_kernels() and not load_error(), "C++ kernels built and loaded")
    check(list((cache / "kernels").glob("*/*.so")), f"kernels built in the fresh cache {cache}")
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    tokens = out[0].outputs[0].token_ids
    check(len(tokens) == 8, f"generated {out[0].outputs[0].text!r}")
    model = llm.engine.runner.forward_model
    check(isinstance(model, CompiledModel) and model.compiled_steps and not model.eager_steps,
          "every step ran through the compiled graph")
    print(f"wheel smoke: offline part took {time.monotonic() - t0:.0f} s", flush=True)


class Serve:
    """``pd-cluster serve tiny-llama`` in the background, its output read on a thread."""

    def __init__(self, env: dict[str, str], cwd: Path, check: Checks) -> None:
        self.check = check
        exe = Path(sys.executable).with_name("pd-cluster")  # the wheel's console script
        self.proc = subprocess.Popen(
            [str(exe), "serve", "tiny-llama", "--port", "0", "--no-progress",
             "--namespace", f"wheel-smoke-{os.getpid()}"],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)  # our SIGINT reaches the launcher alone, by its pid
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for_url(self) -> str:
        deadline = time.monotonic() + SERVE_START_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                m = re.search(r"serving on (http://\S+)", self.lines.get(timeout=1.0))
            except queue.Empty:
                continue
            if m:
                return m.group(1)
        raise Failed("`pd-cluster serve` printed no URL within "
                     f"{SERVE_START_S:.0f} s:\n" + "".join(self.output[-60:]))

    def stop(self) -> None:
        """SIGINT (Ctrl-C) to the launcher by its pid, and a bounded wait for it to clean up;
        past the bound, its whole session is killed and the smoke fails."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                rc = self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                raise Failed(f"serve still running {STOP_S:.0f} s after SIGINT (killed)"
                             ) from None
            self.check(rc == 0, f"serve stopped on SIGINT (exit {rc})")


def complete(url: str) -> dict:
    body = json.dumps({"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_S) as resp:
        return json.loads(resp.read())


def served_completion(check: Checks, cache: Path, cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    env.update(PD_CLUSTER_CACHE=str(cache), PD_CLUSTER_STATE_DIR=str(cwd / "state"))
    t0 = time.monotonic()
    serve = Serve(env, cwd, check)
    try:
        url = serve.wait_for_url()
        print(f"wheel smoke: serving on {url} after {time.monotonic() - t0:.0f} s", flush=True)
        answer = complete(url)
        text = answer["choices"][0]["text"]
        check(answer["usage"]["completion_tokens"] == 4 and text,
              f"served completion {text!r}")
    finally:
        serve.stop()
    log = "".join(serve.output)
    check(FALLBACK not in log, "no engine fell back from the C++ kernels")
    print(f"wheel smoke: serve part took {time.monotonic() - t0:.0f} s", flush=True)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="pd-wheel-smoke-"))
    cache = Path(os.environ.get("PD_CLUSTER_CACHE") or work / "cache")
    os.environ["PD_CLUSTER_CACHE"] = str(cache)  # before pd_cluster reads it
    os.environ.pop("PD_CLUSTER_KERNEL_CACHE", None)
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the compiled code in that cache too
    os.chdir(work)  # nothing importable from the current folder
    check = Checks()
    try:
        check(not (cache / "kernels").exists(), f"the kernel cache {cache} starts empty")
        installed_package(check)
        offline_generation(check, cache)
        served_completion(check, cache, work)
    except Exception as e:  # a failed check, or an error on the way (its traceback)
        if not isinstance(e, Failed):
            traceback.print_exc()
        print(f"wheel smoke: FAILED: {e}", flush=True)
        print(f"wheel_smoke: {check.passed} passed, 1 failed", flush=True)
        return 1
    shutil.rmtree(work, ignore_errors=True)  # kept above, where it may explain a failure
    # The plain closing line CI reads (this runs after the test suite in .ci/run).
    print(f"wheel_smoke: {check.passed} passed, 0 failed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
