#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one command, for whoever has a GPU machine:
#   1. environment: torch, CUDA, GPUs, Triton, CuPy
#   2. every test marked `cuda` or `two_gpu` (kernels vs torch in bf16, the Triton backend vs HF,
#      pinned-host staging, two engines sizing their caches on one GPU, the one-GPU and
#      two-GPU clusters end to end against a colocated engine)
#   3. scripts/bench_kernels.py (paged decode attention vs the GPU's copy bandwidth)
#   4. configs/one-gpu.yaml launched from the CLI as a user would (P and D share the GPU, KV over
#      ZMQ through pinned host memory): a greedy request, a streamed one, KV counters, a short
#      scripts/bench_serving.py load, a leak check, stop
#   5. with 2+ GPUs and CuPy: configs/two-gpu.yaml the same way (KV over NCCL)
# then a summary table. Logs go to $GPU_CHECK_DIR (default: a new folder under /tmp).
#
#   bash scripts/gpu_check.sh            # PYTHON=/path/to/python to pick an interpreter
# Needs the project installed in that Python: pip install -e ".[test]" (and ".[nccl]" for 2 GPUs).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${GPU_CHECK_DIR:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
declare -a ROWS=()

row() { ROWS+=("$(printf '%-28s %-5s %s' "$1" "$2" "$3")"); echo "== $1: $2 $3"; }

# ---- 1. environment ------------------------------------------------------------------------
if ! "$PY" - >"$DIR/env.log" 2>&1 <<'EOF'
import importlib.util, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available {torch.cuda.is_available()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}")
for mod in ("triton", "cupy"):
    spec = importlib.util.find_spec(mod)
    print(f"{mod}: {__import__(mod).__version__ if spec else 'missing'}")
missing = [m for m in ("pd_cluster", "ray", "fastapi", "uvicorn", "zmq", "msgpack", "openai",
                       "transformers", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    raise SystemExit(f"missing Python packages: {', '.join(missing)} "
                     f"(pip install -e '.[test]' in this interpreter)")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA GPU visible to torch: nothing to check here")
EOF
then
    cat "$DIR/env.log"; echo "gpu_check: $(tail -n 1 "$DIR/env.log")" >&2; exit 2
fi
cat "$DIR/env.log"
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
HAS_CUPY=$("$PY" -c 'import importlib.util as u; print(int(u.find_spec("cupy") is not None))')
row environment ok "$(grep -m1 '^GPU 0' "$DIR/env.log"); $GPUS GPU(s)"

# ---- 2. cuda tests -------------------------------------------------------------------------
timeout 1800 "$PY" -m pytest -q -rs -m "cuda or two_gpu" tests -p no:cacheprovider \
    >"$DIR/cuda_tests.log" 2>&1
rc=$?
summary=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$DIR/cuda_tests.log" | tail -n 1)
row "cuda tests" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "$summary"

# ---- 3. kernel bench -----------------------------------------------------------------------
timeout 900 "$PY" scripts/bench_kernels.py >"$DIR/bench_kernels.log" 2>&1
rc=$?
row "bench_kernels" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "$(tail -n 1 "$DIR/bench_kernels.log")"

# ---- 4./5. launched clusters ---------------------------------------------------------------
# One launched cluster: start detached, one greedy and one streamed request, the KV counters,
# a short serving load, every engine idle with no KV block held, stop.
check_cluster() {
    local config=$1 name=$2 ns="gpu-check-$2-$$" log="$DIR/$2.log" port url ok=ok detail
    port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    url="http://127.0.0.1:$port"
    if ! timeout 600 "$PY" -m pd_cluster.cli launch --config "$config" --port "$port" \
            --namespace "$ns" --detach --no-progress >"$log" 2>&1; then
        row "$name" FAIL "launch failed: $(tail -n 1 "$log")"; return
    fi
    detail=$(timeout 300 "$PY" - "$url" >>"$log" 2>&1 <<'EOF'; echo $?
import sys, time, httpx, openai
url = sys.argv[1]
client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
model = client.models.list().data[0].id
r = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=16,
                              temperature=0)
print("greedy:", repr(r.choices[0].text))
text = "".join(c.choices[0].text for c in client.completions.create(
    model=model, prompt="Once upon a time", max_tokens=32, temperature=0, stream=True))
assert text, "empty stream"
print("streamed:", repr(text))
deadline = time.monotonic() + 60
while True:  # idle: nothing in flight, every KV block free
    st = httpx.get(f"{url}/cluster/status", timeout=30).json()
    busy = st["inflight"] or any(e["inflight"] or e["stats"].get("kv_blocks_used")
                                 for e in st["engines"])
    if not busy or time.monotonic() > deadline:
        break
    time.sleep(0.5)
for e in st["engines"]:
    s = e["stats"]
    print(f"{e['name']}: {s.get('kv_blocks_total')} KV blocks, {s.get('kv_blocks_used')} used, "
          f"KV bytes sent {s.get('kv_bytes_sent', 0)} received {s.get('kv_bytes_received', 0)}, "
          f"fallbacks {s.get('kv_fallbacks', 0)}")
assert not busy, "blocks still held after the requests finished"
d = [e["stats"] for e in st["engines"] if e["role"] == "decode"]
assert all(s.get("kv_bytes_received", 0) > 0 and not s.get("kv_fallbacks") for s in d), \
    "KV did not reach decode (it prefilled by itself)"
EOF
)
    [ "$detail" = 0 ] || ok=FAIL
    # shellcheck disable=SC2086  # word-split on purpose: a list of arguments
    timeout 900 "$PY" scripts/bench_serving.py --url "$url" --modes pd --no-progress \
        ${GPU_CHECK_BENCH_ARGS:---num-requests 200 --request-rate 20} >>"$log" 2>&1 || ok=FAIL
    grep -qE '^=== pd: .* 0 failed' "$log" || ok=FAIL
    timeout 120 "$PY" -m pd_cluster.cli stop --namespace "$ns" >>"$log" 2>&1 || ok=FAIL
    row "$name" "$ok" "$(grep -E '^(greedy|decode-0)' "$log" | tr '\n' ' ' | cut -c1-160)"
    grep -E '^(=== pd|throughput|ms |ttft|tpot|itl|e2e)' "$log" | sed 's/^/    /'
    ROWS+=("$(grep -E '^(ttft|tpot) ' "$log" | sed 's/^/    /')")
}

check_cluster configs/one-gpu.yaml one-gpu-cluster
if [ "$GPUS" -ge 2 ] && [ "$HAS_CUPY" = 1 ]; then
    check_cluster configs/two-gpu.yaml two-gpu-nccl-cluster
else
    row two-gpu-nccl-cluster skip "needs 2 GPUs and cupy (have $GPUS GPU(s), cupy=$HAS_CUPY)"
fi

# ---- summary -------------------------------------------------------------------------------
echo
echo "gpu_check summary (logs in $DIR)"
printf '%s\n' "${ROWS[@]}"
! printf '%s\n' "${ROWS[@]}" | grep -q ' FAIL '
