#!/usr/bin/env bash
# Runs the tools users point at an OpenAI server -- guidellm, aiperf and lm-eval, installed from
# PyPI as they would install them -- against a pd-cluster launched here, offline, and prints
# each tool's headline figures. Not part of CI (it installs three tools and takes minutes).
# Exits non-zero on a tool error, a failed request, or an engine unhealthy or still holding a
# request or a KV block after the runs (the last line then says `check_clients: FAIL: ...`).
#
#   scripts/check_clients.sh [CONFIG]          (default configs/local.yaml; port 8000)
#
# Needs pd-cluster installed in the current Python (`pip install torch==2.13.0 -e .`).
# Each tool gets its own venv under $CLIENTS_DIR (default .clients/), made once; torch is pinned
# to 2.13.0 where a tool pulls it in: pip's index decides the build (PyPI on Linux: the CUDA
# one, several GB; TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu takes the CPU wheel).
# Results land in $CLIENTS_DIR/results.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CONFIG=${1:-$ROOT/configs/local.yaml}
WORK=${CLIENTS_DIR:-$ROOT/.clients}
PORT=${PORT:-8000}
URL=http://127.0.0.1:$PORT
PY=${PYTHON:-python}
REQUESTS=${REQUESTS:-64}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
mkdir -p "$WORK/results"
RESULTS=$WORK/results

step() { printf '\n== %s\n' "$*"; }

install() {  # install NAME PIP-SPEC...: a venv per tool, made once
  local name=$1; shift
  if [[ -x $WORK/$name/bin/python && -f $WORK/$name/.done ]]; then return; fi
  step "installing $name into $WORK/$name (once)"
  python3 -m venv "$WORK/$name"
  if [[ -n ${TORCH_INDEX_URL:-} && " $* " == *" torch=="* ]]; then
    "$WORK/$name/bin/pip" install -q --disable-pip-version-check torch==2.13.0 \
      --index-url "$TORCH_INDEX_URL"
  fi
  "$WORK/$name/bin/pip" install -q --disable-pip-version-check "$@"
  touch "$WORK/$name/.done"
}

install lm-eval torch==2.13.0 "lm-eval[api]==0.4.13" transformers
install guidellm guidellm==0.8.1
install aiperf aiperf==0.13.0

MODEL_DIR=$("$PY" -c "from pd_cluster.serving.cluster.cluster_config import load_config
from pd_cluster.serving.cluster.model_source import resolve_model
print(resolve_model(load_config('$CONFIG').model))")
MODEL=$("$PY" -c "from pd_cluster.serving.cluster.cluster_config import load_config
print(load_config('$CONFIG').model_name)")

step "launching $CONFIG on port $PORT (model $MODEL, tokenizer $MODEL_DIR)"
STATE=$(mktemp -d)
PD_CLUSTER_STATE_DIR=$STATE "$PY" -m pd_cluster.cli launch --config "$CONFIG" --port "$PORT" \
  --no-progress > "$RESULTS/cluster.log" 2>&1 &
LAUNCHER=$!
stop_cluster() {
  if kill -0 "$LAUNCHER" 2>/dev/null; then
    kill -INT "$LAUNCHER"  # the launcher's Ctrl-C: engines and the Ray instance it started go
    for _ in $(seq 60); do kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 1; done
    kill -0 "$LAUNCHER" 2>/dev/null && kill -KILL "$LAUNCHER"
  fi
  rm -rf "$STATE"
}
trap stop_cluster EXIT
for i in $(seq 180); do
  curl -sf "$URL/health" > /dev/null && break
  kill -0 "$LAUNCHER" 2>/dev/null || { tail -20 "$RESULTS/cluster.log"; exit 1; }
  [[ $i == 180 ]] && { echo "cluster not healthy after 180 s"; tail -20 "$RESULTS/cluster.log"; exit 1; }
  sleep 1
done
echo "healthy: $(curl -s "$URL/health")"

step "guidellm: $REQUESTS streaming completions, 8 concurrent, 64 prompt / 32 output tokens"
(cd "$RESULTS" && "$WORK/guidellm/bin/guidellm" run \
  --backend "kind=openai_http,target=$URL,model=$MODEL" \
  --profile kind=concurrent,streams=8 \
  --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 \
  --tokenizer "kind=huggingface_auto,model=$MODEL_DIR" \
  --constraint "kind=max_requests,count=$REQUESTS" \
  --output kind=json,path=guidellm.json --disable-console-interactive > guidellm.log 2>&1) \
  || { tail -30 "$RESULTS/guidellm.log"; exit 1; }
"$WORK/guidellm/bin/python" - "$RESULTS/guidellm.json" <<'EOF'
import json, sys
b = json.load(open(sys.argv[1]))["benchmarks"][0]
s, m = b["scheduler_state"], b["metrics"]
ok = lambda k: m[k]["successful"]
print(f"guidellm: {s['successful_requests']} ok, {s['errored_requests']} errors, "
      f"{s['cancelled_requests']} cancelled; TTFT p50 {ok('time_to_first_token_ms')['median']:.1f} ms, "
      f"ITL p50 {ok('inter_token_latency_ms')['median']:.1f} ms, "
      f"output {ok('output_tokens_per_second')['mean']:.0f} tok/s")
sys.exit(1 if s["errored_requests"] or s["successful_requests"] == 0 else 0)
EOF

step "aiperf: $REQUESTS streaming chat completions, 8 concurrent, 64 prompt / 32 output tokens"
# aiperf 0.13 in HF offline mode looks a local tokenizer directory up as a Hub repo id and
# fails; the tokenizer is a local directory, so it runs without HF_HUB_OFFLINE (no download).
(cd "$RESULTS" && env -u HF_HUB_OFFLINE "$WORK/aiperf/bin/aiperf" profile \
  --model "$MODEL" --url "$URL" --endpoint-type chat --streaming --tokenizer "$MODEL_DIR" \
  --concurrency 8 --request-count "$REQUESTS" --synthetic-input-tokens-mean 64 \
  --output-tokens-mean 32 --extra-inputs ignore_eos:true --artifact-dir aiperf \
  --ui-type none > aiperf.log 2>&1) || { tail -30 "$RESULTS/aiperf.log"; exit 1; }
"$WORK/aiperf/bin/python" - "$RESULTS/aiperf/profile_export_aiperf.json" "$REQUESTS" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
p50 = lambda k: d[k]["p50"]
n = int(d["request_count"]["avg"])
errors = sum(e.get("count", 0) for e in d.get("error_summary") or [])
print(f"aiperf: {n} requests, {errors} errors; TTFT p50 {p50('time_to_first_token'):.1f} ms, "
      f"time to second token p50 {p50('time_to_second_token'):.1f} ms, "
      f"ITL p50 {p50('inter_token_latency'):.1f} ms, "
      f"output {d['output_token_throughput']['avg']:.0f} tok/s")
sys.exit(1 if errors or n != int(sys.argv[2]) else 0)
EOF

step "lm-eval: animal_facts (70 multiple-choice questions, loglikelihood via echo + logprobs)"
(cd "$ROOT/scripts/lm_eval_tasks" && "$WORK/lm-eval/bin/lm_eval" --model local-completions \
  --model_args "model=$MODEL,base_url=$URL/v1/completions,tokenizer=$MODEL_DIR,tokenizer_backend=huggingface,num_concurrent=4,max_retries=1,tokenized_requests=True" \
  --tasks animal_facts --include_path . --batch_size 8 > "$RESULTS/lm-eval.log" 2>&1) \
  || { tail -30 "$RESULTS/lm-eval.log"; exit 1; }
grep -E "^\|" "$RESULTS/lm-eval.log" \
  || { echo "check_clients: FAIL: lm-eval printed no results"; tail -30 "$RESULTS/lm-eval.log"; exit 1; }

step "after the runs: idle, every engine healthy, no KV block held"
"$PY" - "$URL" <<'EOF'
import json, sys, time, urllib.request
deadline = time.monotonic() + 60  # the last requests' blocks may still be being released
while True:
    body = json.load(urllib.request.urlopen(f"{sys.argv[1]}/cluster/status", timeout=30))
    held = [e["name"] for e in body["engines"] if not e["healthy"] or e["inflight"]
            or e["stats"].get("num_active") or e["stats"].get("kv_blocks_used")]
    if (not held and not body["inflight"]) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
for e in body["engines"]:
    s = e["stats"]
    print(f"{e['name']}: healthy={e['healthy']} requests={s.get('requests_total')} "
          f"running={s.get('num_running')} waiting={s.get('num_waiting')} "
          f"kv_blocks_used={s.get('kv_blocks_used')} kv_fallbacks={s.get('kv_fallbacks')}")
if held or body["inflight"]:
    sys.exit(f"check_clients: FAIL: after 60 s, {body['inflight']} request(s) in flight; "
             f"unhealthy, or holding requests or KV blocks: {held}")
EOF
echo "check_clients: ok: the three tools ran with no error and no failed request; no KV block" \
     "held after them; logs and reports in $RESULTS"
