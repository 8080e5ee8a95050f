"""Shared test set-up: single-threaded torch, CPU devices, quiet logs, tiny model factory, HF
greedy oracle.

torch with several intra-op threads on a small, shared CPU is far slower for tiny models than
one thread, so OMP_NUM_THREADS is pinned before torch is first imported (subprocesses inherit it).

Device: on a GPU machine "auto" would pick CUDA (and dtype "auto" bf16): the fp32 exactness
tests would compare bf16 with HF's fp32, and engines in one process would share a GPU. So
"auto" means the CPU in every process of the test run: PD_CLUSTER_DEVICE is set here, before
any engine, worker, engine subprocess or Ray worker starts, and they all inherit it (engines
also hand their resolved device to the processes they start). In a test marked ``cuda`` or
``two_gpu`` it means CUDA (``_device_of_the_test``); such tests name their device all the same
(``device="cuda"``, a GPU config).
"""
from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["PD_CLUSTER_DEVICE"] = "cpu"  # pd_cluster.config.DEVICE_ENV (not imported yet)
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Eager by default (compiling every engine would blow the suite's time budget); the compile
# tests opt in with compile=True, and PD_CLUSTER_COMPILE=1 runs the whole suite compiled.
os.environ.setdefault("PD_CLUSTER_COMPILE", "0")
# Compiled engines compile before serving (every step compiled: what those tests check); the
# background compile's tests (test_background_compile.py) ask for it.
os.environ.setdefault("PD_CLUSTER_COMPILE_MODE", "blocking")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The cluster secret the KV handshakes and proxy sessions prove (connectors/secret.py; a
# launched cluster makes its own): one per test session, inherited by engine subprocesses.
os.environ.setdefault("PD_CLUSTER_SECRET", __import__("secrets").token_hex(32))
# Ray renices every worker by 15 (its worker_niceness): an engine actor then gets ~1/30 of a
# core against any un-niced process on a shared 2-core machine, and a cluster's start-up took
# 357 s instead of ~10 s in CI (ci8, test_offload_cluster; the proxy actor was as slow). The
# test session's Ray workers (its own, the launcher's, the benchmarks') run at its priority.
os.environ.setdefault("RAY_worker_niceness", "0")

import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator, Sequence  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # @triton.jit reads TRITON_INTERPRET when a kernel is defined, triton's own tl.zeros & co.
    # at `import triton`: whichever test module imported triton first fixed it for the session
    # (test_kv_fp8 before test_kernels made test_kernels' interpreted kernels call compiled
    # library functions). Set once here, before any test module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.script_runs import MARK, ScriptRuns, selected_specs  # noqa: E402
from tests.shared_cluster import SharedCluster, last_user_items  # noqa: E402

torch.set_num_threads(1)

logging.getLogger("pd_cluster").setLevel(logging.WARNING)
try:
    import transformers  # noqa: E402

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
except Exception:  # pragma: no cover - transformers is a hard dependency, but keep conftest importable
    pass

# Near-tie tolerance (docs/design.md, "Testing rules"): a greedy divergence from HF is
# accepted only when HF's top-2 logits at that step are this close.
NEAR_TIE = 1e-4


@pytest.fixture(autouse=True)
def _device_of_the_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" is CUDA in a test marked for GPUs, here and in every process it starts."""
    if request.node.get_closest_marker("cuda") or request.node.get_closest_marker("two_gpu"):
        monkeypatch.setenv("PD_CLUSTER_DEVICE", "cuda")


# ---------------------------------------------------------------------------- time bounds

# Calls that start a Ray cluster. Its start-up alone took up to 315 s on a loaded machine, past
# the default bound (pyproject.toml), and an expired bound ends the whole run: such a test (or
# a fixture it uses) must carry an explicit @pytest.mark.timeout.
_CLUSTER_STARTERS = ("launched_cluster(", "ensure_ray(", "Launcher(", "TwoNodes(",
                     "SharedCluster(")


def _source(func: Any) -> str:
    try:
        return inspect.getsource(func)
    except (OSError, TypeError):
        return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = []
    for item in items:
        if item.get_closest_marker("timeout") or not hasattr(item, "function"):
            continue
        info = getattr(item, "_fixtureinfo", None)
        fixtures = [d.func for defs in (info.name2fixturedefs.values() if info else ())
                    for d in defs]
        if any(s in _source(f) for f in [item.function, *fixtures] for s in _CLUSTER_STARTERS):
            unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError(
            "these tests start a Ray cluster but carry no @pytest.mark.timeout (a cluster's "
            "start-up can pass the default bound; see pyproject.toml): " + ", ".join(unmarked))


# ---------------------------------------------------------------------------- shared cluster

_SHARED = pytest.StashKey[SharedCluster]()
_SHARED_LAST = pytest.StashKey["str | None"]()


@pytest.fixture(scope="session")
def serving_cluster(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedCluster]:
    """The serving modules' one cluster (tests/shared_cluster.py), launched by the first
    ``get()``. A user module wraps it in a module fixture that calls ``check_no_leaks()``
    after its tests."""
    shared = request.config.stash[_SHARED] = SharedCluster(tmp_path_factory.mktemp("state"))
    try:
        yield shared
    finally:
        shared.close()  # a run that ended before the last user module


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[_SHARED_LAST] = last_user_items(session.items)  # after -k, -m


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """The shared cluster goes as soon as its last user module is torn down: the rest of the
    suite gets the cores and Ray's CPUs back."""
    try:
        return (yield)
    finally:
        shared = item.config.stash.get(_SHARED, None)
        if shared is not None and item.nodeid == item.config.stash.get(_SHARED_LAST, None):
            shared.close()


# ---------------------------------------------------------------------------- script runs

def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}(key, argv, timeout=400, first=False): a subprocess run of "
                            "a script the test asserts on (tests/script_runs.py)")


@pytest.fixture(scope="session")
def script_runs(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptRuns]:
    """Every selected test's ``script_run``, started two at a time when the first such test
    starts (tests/script_runs.py); ``script_runs.result(request.node)`` waits for one."""
    runs = ScriptRuns(tmp_path_factory.mktemp("scripts"), selected_specs(request.session.items))
    try:
        yield runs
    finally:
        runs.close()


# ---------------------------------------------------------------------------- compiled code

@pytest.fixture(scope="module")
def fresh_inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A fresh compiled-code cache (inductor's and our artifacts beside it) for one module's
    engines and the processes they start: its compiles run cold, and no other module's
    artifacts are loaded. Modules opt in: ``pytestmark = pytest.mark.usefixtures(...)``."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    yield
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


# ---------------------------------------------------------------------------- tiny models

_MODEL_DEFAULTS: dict[str, Any] = dict(
    arch="llama", seed=0, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=None, intermediate_size=128, tie_word_embeddings=False,
    max_position_embeddings=2048)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Factory: ``tiny_model(arch="qwen2", num_kv_heads=1, ...) -> checkpoint dir``.

    Each distinct spec is generated once per session (make_model is deterministic)."""
    root = tmp_path_factory.mktemp("models")
    cache: dict[tuple, str] = {}
    lock = threading.Lock()

    def make(**overrides: Any) -> str:
        unknown = set(overrides) - set(_MODEL_DEFAULTS)
        if unknown:
            raise TypeError(f"tiny_model: unknown spec keys {sorted(unknown)}")
        spec = {**_MODEL_DEFAULTS, **overrides}
        key = tuple(sorted(spec.items()))
        with lock:
            if key not in cache:
                from pd_cluster.checkpoints.maker import make_model

                name = "-".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "default"
                out = root / name.replace("/", "_")
                cache[key] = str(make_model(out, **spec))
            return cache[key]

    return make


def edit_config(src_dir: str, dst_dir: Path, **changes: Any) -> str:
    """Copy a checkpoint dir (symlinking the big files) with config.json keys changed;
    a value of None deletes the key."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(src_dir).iterdir():
        if f.name != "config.json":
            (dst_dir / f.name).symlink_to(f)
    cfg = json.loads((Path(src_dir) / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(dst_dir)


def random_prompt(length: int, seed: int, low: int = 4, high: int = 300) -> list[int]:
    """Deterministic random token ids (avoiding the special ids 0..3)."""
    rng = random.Random(seed * 100003 + length)
    return [rng.randrange(low, high) for _ in range(length)]


# ---------------------------------------------------------------------------- HF oracle

_HF_MODELS: dict[str, Any] = {}
_HF_GREEDY: dict[tuple, list[int]] = {}


def hf_model(model_dir: str) -> Any:
    """The checkpoint loaded in HF transformers, fp32, eval, with EOS disabled (cached per dir)."""
    model = _HF_MODELS.get(model_dir)
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
        _HF_MODELS[model_dir] = model
    return model


def hf_greedy(model_dir: str, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """HF ``generate`` greedy continuation of one prompt run alone (no padding), EOS ignored."""
    key = (model_dir, tuple(prompt_ids), max_new_tokens)
    if key not in _HF_GREEDY:
        model = hf_model(model_dir)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=[],
                                 pad_token_id=3)
        new = out[0, ids.shape[1]:].tolist()
        assert len(new) == max_new_tokens, f"HF stopped early: {len(new)} < {max_new_tokens}"
        _HF_GREEDY[key] = new
    return list(_HF_GREEDY[key])


def hf_next_logits(model_dir: str, token_ids: Sequence[int]) -> torch.Tensor:
    """HF fp32 logits for the token after ``token_ids`` (one full forward, no cache)."""
    model = hf_model(model_dir)
    with torch.inference_mode():
        return model(torch.tensor([list(token_ids)])).logits[0, -1].float()


def assert_greedy_matches(model_dir: str, prompt_ids: Sequence[int], ours: Sequence[int],
                          hf: Sequence[int]) -> None:
    """Token-exact, except that a divergence at a near-tie of HF's top-2 logits is accepted
    (everything after a legitimate divergence is a different, equally valid continuation)."""
    ours, hf = list(ours), list(hf)
    assert len(ours) == len(hf), (f"length differs: ours {len(ours)} vs HF {len(hf)} "
                                  f"(prompt len {len(prompt_ids)})")
    for t, (a, b) in enumerate(zip(ours, hf)):
        if a == b:
            continue
        logits = hf_next_logits(model_dir, list(prompt_ids) + hf[:t])
        top2 = torch.topk(logits, 2)
        gap = float(top2.values[0] - top2.values[1])
        ours_gap = float(top2.values[0] - logits[a])
        if gap <= NEAR_TIE and ours_gap <= NEAR_TIE:
            warnings.warn(f"accepted a greedy divergence from HF at a near-tie (step {t}, "
                          f"top-2 gap {gap:.3g})")
            return  # near-tie: both continuations are legitimate greedy outputs
        raise AssertionError(
            f"greedy output diverges from HF at step {t} (prompt len {len(prompt_ids)}): "
            f"ours {a} vs HF {b}; HF top-2 {top2.indices.tolist()} logits "
            f"{[round(v, 6) for v in top2.values.tolist()]} (gap {gap:.3g}), our token is "
            f"{ours_gap:.3g} below the top (near-tie tolerance {NEAR_TIE})\n"
            f"ours: {ours}\nHF:   {hf}")
