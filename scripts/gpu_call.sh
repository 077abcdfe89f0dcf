# Sourced by a device call's script (docs/runs/gpu_sNN/*.sh) that runs several gpu_run.sh stages,
# each with its own environment, and keeps each stage's summary and log in $OUT:
#
#   . scripts/gpu_call.sh
#   T=560 call_stage b 260 moe MOE_ARGS="--offline --latency"   # as files b_summary.txt, b_moe.log
#   call_show b
#
# On a device without a tuned MoE table for Qwen3-30B-A3B the H200's is copied under its name
# first ($MOE_TABLE). A stage starts only if its limit ends within $T seconds (default: no
# bound) of this file being sourced; one that cannot says so and returns 1.
set -u
MOE_DEVICE=$(python3 -c "import torch;print(torch.cuda.get_device_name().replace(' ','_'))")
echo "device $MOE_DEVICE"
MOE_TABLE="ops/moe_configs/E=128,N=768,K=2048,device_name=$MOE_DEVICE,dtype=bfloat16.json"
[ -f "$MOE_TABLE" ] \
  || cp "ops/moe_configs/E=128,N=768,K=2048,device_name=NVIDIA_H200,dtype=bfloat16.json" "$MOE_TABLE"
CALL_START=$SECONDS

call_stage() { # name, limit s, gpu_run.sh stage, environment assignments...
  local n=$1 l=$2 st=$3; shift 3
  if [ -n "${T:-}" ] && [ $((SECONDS - CALL_START + l)) -gt "$T" ]; then
    echo "$n $st skipped at $((SECONDS - CALL_START))s"; return 1
  fi
  env "$@" timeout -k 5 "$l" bash scripts/gpu_run.sh "$st" >/dev/null 2>&1
  cp "$OUT/summary.txt" "$OUT/${n}_summary.txt"
  cp "/tmp/bastion-gpu-stages/$st.log" "$OUT/${n}_$st.log"
  rm -f "$OUT/gpu_run.log"
  echo "$n $st done at $((SECONDS - CALL_START))s"
}

call_show() { # names: each stage's summary, last
  local n
  for n in "$@"; do echo "==== $n"; cat "$OUT/${n}_summary.txt" 2>/dev/null; done
}
