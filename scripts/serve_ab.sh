#!/usr/bin/env bash
# Serving latency of one checkout, for A/B runs of two checkouts on one GPU machine:
#
#   bash scripts/serve_ab.sh ROOT LABEL
#
# starts `bastion serve` from ROOT (this repository or a `git worktree` of another commit) with
# $SERVE_MODEL_ARGS (default: a SmolLM2 config with dummy weights in .whl/smol), warms it up
# with 200 requests at rate 50, then runs scripts/bench_serve.py (this checkout's) with 1000
# prompts of 1024 in / 128 out at rate 50 and 100 and prints the key lines. The server's log
# goes to $OUT/server_LABEL.log. Wheels in .whl/ are installed first, as in gpu_run.sh.
set -u
ROOT=$1; LABEL=$2; PY=${PYTHON:-python3}; port=8020; OUT=${OUT:-/tmp}
[ -d /tmp/site/zmq ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site .whl/*.whl 2>&1 | tail -2
rm -f /tmp/pkg/bastion; mkdir -p /tmp/pkg; ln -s "$ROOT" /tmp/pkg/bastion
export PYTHONPATH=/tmp/site:/tmp/pkg:$ROOT PYTHONUNBUFFERED=1
$PY -m bastion.procs.cli serve ${SERVE_MODEL_ARGS:-.whl/smol --load-format dummy} --port $port \
  --max-model-len 2048 --max-num-batched-tokens 16384 >"$OUT/server_$LABEL.log" 2>&1 &
pid=$!
for i in $(seq 240); do
  $PY -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health')" \
    2>/dev/null && break
  sleep 1
done
echo "== $LABEL healthy after $i s"
$PY scripts/bench_serve.py --base-url http://127.0.0.1:$port --num-prompts 200 \
  --random-input-len 1024 --random-output-len 128 --request-rate 50 >/dev/null 2>&1
for rate in 50 100; do
  $PY scripts/bench_serve.py --base-url http://127.0.0.1:$port --num-prompts 1000 \
    --random-input-len 1024 --random-output-len 128 --request-rate $rate 2>&1 \
    | grep -E "Request rate|Output token throughput|Mean TTFT|Median TPOT|Median ITL|P99 ITL|Failed"
done
kill -TERM $pid; timeout 20 tail --pid=$pid -f /dev/null; kill -9 $pid 2>/dev/null
