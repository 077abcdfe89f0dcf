#!/usr/bin/env bash
# Everything bastion measures on one GPU, in one call, each stage under its own time limit so a
# failing stage cannot eat the call:
#
#   bash scripts/gpu_run.sh                 # all stages
#   bash scripts/gpu_run.sh tests offline   # only these, in this order
#
# Stages: kernels (Triton kernels vs torch references, timed), attnsweep (decode attention's
# launch shapes at workload-like batches), decsweep (decode attention's launch shapes, with
# each variant's registers and spills), readbw (read bandwidth, and paged K/V reads beside
# attention), prefillsweep (prefill attention's launch shapes on workload-like 16k-token
# chunks), gemmhost (the host time of an eager F.linear by shape, cuBLAS against cuBLASLt, and
# of a Triton launch), tests (GPU parity under CUDA graphs; $TESTS_K a pytest -k expression,
# e.g. "moe or overlap"), offline (nano-vllm workload,
# Qwen3-0.6B architecture, dummy weights, prefill chunks of $MAX_BATCHED tokens, default
# 16384; offsync: the same without async scheduling; offtemp: the same sampling at temperature
# 0.6, as nano-vllm's own script does; offenv: the same once per environment assignment in
# $OFFLINE_ENVS, e.g. BASTION_DECODE_ATTENTION_CONFIG=64,4,2, several variables in one run
# joined by '+'; offprof: the same under cProfile; gpuprof: the torch profiler at the steps in
# $PROF_POINTS, with the device's idle gaps between kernels; prefillprof: the first 12 steps
# under cProfile, then under the torch profiler with a Chrome trace in $OUT), floor (that
# workload's bandwidth floor, measured in the same run, and the most DP=2 can gain by it), dp
# (two GPUs, one process each, every second prompt; dpwhole: each the whole workload), hf (a
# slice of the workload through bastion and transformers' continuous batching, with the
# ratio), latency (Llama-3.1-8B architecture, batch 8, 32 in / 128 out; denselat: Qwen3-0.6B
# and Llama-3.1-8B at batch 1, once per environment assignment in $DENSE_ENVS), moetune (the fused MoE
# kernels' launch configs for Qwen3-30B-A3B, JSON to $OUT; $MOE_TUNE_ARGS e.g. "--tokens 1 2
# --update --install"), moe (Qwen3-30B-A3B architecture: offline throughput and batch-1/8
# latency beside their floors; $MOE_ARGS e.g. --latency, $MOE_PROFILE batch sizes to
# profile; moeenv: batch-1 latency once per environment assignment in $MOE_ENVS, as offenv;
# moevariants: the same in one process, the decode graphs captured again per variant in
# $MOE_VARIANTS, in rounds, e.g. MOE_ARGS="--rounds 3 --num-iters 10 --timeline"; moelayout:
# the batch-1 expert kernels alone over the weights as stored and tiled, beside a stream;
# moealign: the MoE align kernel alone with either atomic, beside the whole layer and its floor),
# gemvtune (the decode-rows matmul: cuBLAS against ops/triton/gemv.py's tiles for
# the benchmarked models' linear shapes, beside the floor), specbench (a speculative verify
# step with k = 2, 4 against a decode step, Llama-3.1-8B architecture, batch 1/8/32),
# speccheck (ngram and draft-model greedy tokens identical to plain decoding under the decode
# and verify CUDA graphs, Qwen3-0.6B architecture, float32), lora (the LoRA kernels' tests
# compiled, then scripts/bench_lora.py: Llama-3.1-8B architecture, 4 mixed rank-16 adapters
# against the base model, batch-8 latency with one, and per-kernel decode time), loralat (that
# latency alone, with the shrink on its side stream and without), structured
# (bench_structured.py: step time with every request under one JSON schema against none, batch
# 1/32/128, Qwen3-0.6B architecture, dummy weights; $STRUCT_ARGS e.g. "--executor mp"),
# grammarfill (one step's bitmask fill of 32 rows on one thread, split over 2/4/8 shares and
# on xgrammar's own 2/4/8 threads; the stand-in tokenizer's vocabulary, then structured's
# stand-in as wide as Qwen3's), serve
# (bench_serve.py at rate inf and two finite rates, 1000 prompts of 1024 in / 128 out, against
# the embedded model).
#
# Run from the repository root. Wheels for packages the machine lacks (msgspec, pyzmq, gguf,
# setproctitle) are installed from .whl/ when present; the repository root is made importable
# as the package `bastion`. Logs go to $OUT/gpu_run.log (or /tmp), a short table comes last.
# A device call that runs several stages, each with its own environment, sources
# scripts/gpu_call.sh (each stage's summary and log kept in $OUT, a time bound per call).
set -u
OUT=${OUT:-/tmp/bastion-gpu-run}
mkdir -p "$OUT"
LOG="$OUT/gpu_run.log"
SUMMARY="$OUT/summary.txt"
# Per-stage logs stay off $OUT: only a few files come back from the device.
STAGE_LOGS=/tmp/bastion-gpu-stages
mkdir -p "$STAGE_LOGS"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
PY=${PYTHON:-python3}
ROOT=$PWD

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -3
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
mkdir -p /tmp/pkg
ln -sfn "$ROOT" /tmp/pkg/bastion  # a warm machine may hold a link to an older copy
export PYTHONPATH=/tmp/pkg:$ROOT:${PYTHONPATH:-}

QWEN=configs/qwen3-0.6b
LLAMA=configs/llama-3.1-8b
NANO="--num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024"

# stage NAME LIMIT_S GREP_PATTERN -- command...: run, log, and keep the lines worth a summary.
stage() {
  local name=$1 limit=$2 pattern=$3
  shift 4
  echo "===== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$STAGE_LOGS/$name.log" >>"$LOG"
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start))
  tail -n 25 "$STAGE_LOGS/$name.log"
  {
    printf '%-9s rc=%-4s %4ss\n' "$name" "$rc" "$took"
    grep -E "$pattern" "$STAGE_LOGS/$name.log" | tail -n 14 | sed 's/^/    /'
  } >>"$SUMMARY"
}

# wait_healthy PORT PID TRIES: poll /health every 0.5 s; fail (with the log) if it never answers.
wait_healthy() {
  for _ in $(seq "$3"); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || break
    sleep 0.5
  done
  return 1
}

run_serve() {
  local port=8011 slog=$STAGE_LOGS/server.log
  # SERVE_MODEL_ARGS: e.g. "path/to/folder --load-format dummy" (a config.json and tokenizer
  # files, random weights) where the embedded model's package is not installed.
  $PY -m bastion.procs.cli serve ${SERVE_MODEL_ARGS:-} --port $port --max-model-len 2048 \
    --max-num-batched-tokens 16384 >"$slog" 2>&1 &
  local pid=$!
  wait_healthy $port $pid 240 || { tail -n 60 "$slog"; return 1; }
  local rc=0
  for rate in inf 50 100; do
    $PY scripts/bench_serve.py --base-url "http://127.0.0.1:$port" --num-prompts 1000 \
      --random-input-len 1024 --random-output-len 128 --request-rate $rate || rc=$?
  done
  kill -TERM $pid 2>/dev/null
  wait $pid
  tail -n 5 "$slog"
  return $rc
}
# A DP=2 expert-parallel server on two GPUs (NCCL), then the fault drill against rank 1.
# FT_DP_ARGS / FT_ENGINE change the shape: FT_DP_ARGS=" " FT_ENGINE=0 is DP=1 on one GPU.
run_ftdrill() {
  local port=8012 slog=$STAGE_LOGS/ft_server.log
  $PY -m bastion.procs.cli serve ${FT_MODEL_ARGS:-} --port $port \
    ${FT_DP_ARGS:---data-parallel-size 2 --enable-expert-parallel} --enable-fault-injection \
    --ft-hang-timeout-s 10 --max-model-len 1024 --data-parallel-rpc-port 29700 >"$slog" 2>&1 &
  local pid=$!
  # Expanded now: the trap runs after this function's locals are gone.
  trap "cp '$slog' '$OUT/ft_server.log'" EXIT
  wait_healthy $port $pid 360 || { tail -n 60 "$slog"; return 1; }
  echo "server healthy after $SECONDS s"
  # Each fault waits for the warm spare (the drill's "spare s"); "none" is the numerics' own
  # baseline of identical streams (dummy weights in bf16 flip near-ties between batchings).
  $PY scripts/ft_drill.py --base-url "http://127.0.0.1:$port" --engine ${FT_ENGINE:-1} \
    --num-requests 16 --max-tokens 128 ${FT_DRILL_ARGS:-} \
    --kinds none raise worker_exit hang kill_worker kill_engine
  local rc=$?
  kill -TERM $pid 2>/dev/null
  wait $pid
  grep -E "coordinator: (epoch|group|engine)|fault detected|warm spare|promoted spare" "$slog" \
    | tail -n 80
  return $rc
}
export -f wait_healthy run_serve run_ftdrill
export PY OUT STAGE_LOGS SERVE_MODEL_ARGS FT_MODEL_ARGS FT_DP_ARGS FT_ENGINE FT_DRILL_ARGS

STAGES=${*:-tests offline floor latency kernels hf serve}
nvidia-smi -L 2>&1 | tee -a "$LOG"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$LOG"
for s in $STAGES; do
  case $s in
    kernels) stage kernels 60 'FAIL|ERR|copy|GB/s|attention' -- \
      $PY scripts/gpu_kernel_check.py --quick --iters 30 ;;
    attnsweep) stage attnsweep 240 'copy|step|^ *[0-9]' -- \
      $PY scripts/gpu_kernel_check.py --attention-sweep --iters 30 ;;
    decsweep) stage decsweep 300 'copy|step|^ *[0-9]' -- \
      $PY scripts/gpu_kernel_check.py --decode-sweep --iters 30 ;;
    readbw) stage readbw 150 'copy|stream|step|^ *[0-9]' -- \
      $PY scripts/gpu_kernel_check.py --read-bandwidth --iters 30 ;;
    gemmhost) stage gemmhost 120 'blas|triton' -- \
      $PY scripts/gpu_kernel_check.py --gemm-host --iters 30 ;;
    prefillsweep) stage prefillsweep 200 'copy|chunk|whole|halves' -- \
      $PY scripts/gpu_kernel_check.py --prefill-sweep --iters 20 ;;
    tests) stage tests 300 'passed|failed|error|bf16:' -- \
      $PY -m pytest -q -x -s -p no:cacheprovider tests/gpu tests/test_triton_kernels.py -m gpu \
      ${TESTS_K:+-k "$TESTS_K"} ;;
    offline) stage offline 150 'workload|bastion|phase|steps 1-|batch >=|Error|error' -- \
      $PY scripts/bench_offline.py --model $QWEN --load-format dummy --dtype bfloat16 $NANO \
      --temperature 0 --max-num-batched-tokens ${MAX_BATCHED:-16384} --skip-hf ;;
    offenv) stage offenv 400 'environment|workload|bastion LLM|Error|error' -- bash -c \
      "for e in ${OFFLINE_ENVS:-BASTION_DECODE_ATTENTION_CONFIG=64,4,2 BASTION_DECODE_ATTENTION_CONFIG=64,4,3}; do \
      echo \"environment \$e\"; env \${e//+/ } $PY scripts/bench_offline.py --model $QWEN \
      --load-format dummy --dtype bfloat16 $NANO --temperature 0 --max-num-batched-tokens 16384 \
      --skip-hf; done" ;;
    offtemp) stage offtemp 150 'workload|bastion|Error|error' -- \
      $PY scripts/bench_offline.py --model $QWEN --load-format dummy --dtype bfloat16 $NANO \
      --temperature 0.6 --max-num-batched-tokens 16384 --skip-hf ;;
    offsync) stage offsync 150 'workload|bastion|Error|error' -- \
      $PY scripts/bench_offline.py --model $QWEN --load-format dummy --dtype bfloat16 $NANO \
      --temperature 0 --max-num-batched-tokens 16384 --skip-hf --no-async-scheduling ;;
    offprof) stage offprof 150 'workload|bastion|cprofile|tottime|model_runner|scheduler|engine_core|llm.py|Error' -- \
      $PY scripts/bench_offline.py --model $QWEN --load-format dummy --dtype bfloat16 $NANO \
      --temperature 0 --max-num-batched-tokens 16384 --skip-hf --cprofile ;;
    gpuprof) stage gpuprof 150 'torch profile|device gaps|gap before|^_[a-z_]+ |cuBLAS|Memcpy|host wait|other:|bastion|Error' -- bash -c \
      "for w in ${PROF_POINTS:-60:5 400:5 800:5}; do $PY scripts/bench_offline.py --model $QWEN --load-format dummy \
      --dtype bfloat16 $NANO --temperature 0 --max-num-batched-tokens 16384 --skip-hf \
      --torch-profile \$w; done" ;;
    prefillprof) stage prefillprof 200 'cprofile|tottime|cumtime|model_runner|scheduler|engine_core|unified|rotary|linear|torch profile|first steps|bastion LLM|Error' -- bash -c \
      "$PY scripts/bench_offline.py --model $QWEN --load-format dummy --dtype bfloat16 $NANO \
      --temperature 0 --max-num-batched-tokens 16384 --skip-hf --cprofile-steps 12; \
      $PY scripts/bench_offline.py --model $QWEN --load-format dummy --dtype bfloat16 $NANO \
      --temperature 0 --max-num-batched-tokens 16384 --skip-hf --torch-profile 1:12 \
      --profile-trace $OUT/prefill_trace.json && gzip -f $OUT/prefill_trace.json" ;;
    moetune) stage moetune 420 'copy|tokens|^ *[0-9]|wrote|Error' -- \
      $PY scripts/tune_moe.py --model configs/qwen3-30b-a3b --out "$OUT" ${MOE_TUNE_ARGS:-} ;;
    gemvtune) stage gemvtune 300 'copy|shape|^ +[0-9a-z.]+ [a-z_]+ +[0-9]|Error' -- \
      $PY scripts/tune_gemv.py ;;
    moe) stage moe 400 'offline|latency|experts reached|profile|^  +[0-9]|Error|error' -- \
      $PY scripts/bench_moe.py --model configs/qwen3-30b-a3b --profile ${MOE_PROFILE:-} \
      ${MOE_ARGS:-} ;;
    moelayout) stage moelayout 300 'copy|kernel|[|]|Error|error' -- \
      $PY scripts/bench_moe_layout.py ;;
    moealign) stage moealign 120 'copy|tokens|^ *[0-9]|Error|error' -- \
      $PY scripts/bench_moe_align.py ;;
    moevariants) stage moevariants 560 'variant|batch 1|[|]|Error|error' -- \
      $PY scripts/bench_moe.py --model configs/qwen3-30b-a3b --variants ${MOE_VARIANTS:-base} \
      ${MOE_ARGS:-} ;;
    moeenv) stage moeenv 560 'environment|latency batch|Error|error' -- bash -c \
      "for e in ${MOE_ENVS:-BASTION_PDL=1}; do echo \"environment \$e\"; env \${e//+/ } $PY \
      scripts/bench_moe.py --model configs/qwen3-30b-a3b --latency --batch-sizes 1 \
      --census-batch 8 ${MOE_ARGS:-}; done" ;;
    grammarfill) stage grammarfill 120 'rows|shares|^ +[0-9]+ \||xgrammar|Error' -- bash -c \
      "for v in '' '--vocab-size 151936 --fill-with pairs'; do $PY scripts/bench_grammar_fill.py \
      --tokenizer .whl/qwen3tok \$v --shares 1 2 4 8 --iters 200; done" ;;
    floor) stage floor 40 'floor|Error' -- \
      $PY scripts/bench_latency.py --model $QWEN --offline-floor ;;
    hf) stage hf 120 'workload|bastion|HF|ratio|Error' -- \
      $PY scripts/bench_offline.py --model $QWEN --load-format dummy --dtype bfloat16 \
      --num-seqs 8 --min-input 100 --max-input 1024 --min-output 100 --max-output 512 \
      --temperature 0 --max-num-batched-tokens 16384 --hf-continuous-batching ;;
    latency) stage latency 150 'latency|avg|floor|Error' -- \
      $PY scripts/bench_latency.py --model $LLAMA ;;
    denselat) stage denselat 400 'environment|model|avg|floor|Error|error' -- bash -c \
      "for m in $QWEN $LLAMA; do for e in ${DENSE_ENVS:-BASTION_PDL=1}; do \
      echo \"environment \$e model \$m\"; env \${e//+/ } $PY scripts/bench_latency.py \
      --model \$m --batch-size 1 --num-iters 10; done; done" ;;
    dp) stage dp 150 'workload|bastion|Error|error' -- \
      $PY scripts/bench_offline.py --model $QWEN --load-format dummy --dtype bfloat16 $NANO \
      --temperature 0 --max-num-batched-tokens 16384 --skip-hf --data-parallel-size 2 ;;
    dpwhole) stage dpwhole 200 'workload|bastion|Error|error' -- \
      $PY scripts/bench_offline.py --model $QWEN --load-format dummy --dtype bfloat16 $NANO \
      --temperature 0 --max-num-batched-tokens 16384 --skip-hf --data-parallel-size 2 \
      --dp-whole-workload ;;
    tp) stage tp 150 'latency|avg|floor|Error' -- \
      $PY scripts/bench_latency.py --model $LLAMA --tensor-parallel-size 2 ;;
    tpeager) stage tpeager 150 'latency|avg|floor|Error' -- \
      $PY scripts/bench_latency.py --model $LLAMA --tensor-parallel-size 2 --enforce-eager ;;
    ftdrill) stage ftdrill 300 'fault|none|raise|exit|hang|kill|Error' -- bash -c run_ftdrill ;;
    specbench) stage specbench 300 'batch|copy|^ *[0-9]|Error|error' -- \
      $PY scripts/bench_spec_gpu.py --model $LLAMA ;;
    speccheck) stage speccheck 240 'batch|free blocks|Error|error' -- \
      $PY scripts/gpu_spec_check.py ;;
    lora) stage lora 420 'passed|failed|tok/s|ms|x base|Error|error' -- bash -c \
      "$PY -m pytest -q -x -p no:cacheprovider tests/test_lora_kernels.py && \
       $PY scripts/bench_lora.py --device cuda --profile && $PY scripts/bench_lora_kernels.py" ;;
    # .whl/qwen3tok (carried, ignored by git): a tokenizer folder for the stand-in vocabulary;
    # made from the converted embedded model: copy tokenizer.json, tokenizer_config.json and
    # chat_template.jinja from ~/.cache/bastion/gguf/SmolLM2-*/, and configs/qwen3-0.6b's
    # config.json with vocab_size 49152, bos 1, eos 2 (the ftdrill stage serves it as a model).
    loralat) stage loralat 300 'SIDE_STREAM|latency|Error|error' -- bash -c \
      "for v in 1 0; do echo \"BASTION_LORA_SIDE_STREAM=\$v\"; BASTION_LORA_SIDE_STREAM=\$v \
      $PY scripts/bench_lora.py --device cuda --latency-only; done" ;;
    structured) stage structured 300 'batch|overhead|^ *[0-9]|json|none|Error|error' -- \
      $PY scripts/bench_structured.py --device cuda --model $QWEN --load-format dummy \
      --dtype bfloat16 --tokenizer ${STRUCT_TOKENIZER:-.whl/qwen3tok} ${STRUCT_ARGS:-} ;;
    serve) stage serve 110 'rate|throughput|TTFT|TPOT|tok/s|Error|failed' -- bash -c run_serve ;;
    *) echo "unknown stage $s" ;;
  esac
done
echo "===== summary" | tee -a "$LOG"
cat "$SUMMARY" | tee -a "$LOG"
