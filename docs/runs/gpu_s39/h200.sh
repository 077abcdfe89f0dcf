# H200 (needs_h200), for a session with little device time left: call3.sh's stages reordered by
# what they answer, each started only if it can end within $T seconds of the call's start:
# l batch-1/8 latency alone, when $T is too short for b; b both targets + the offline phase
# table; a the 16,384-token prefill retune (timed against the committed entry); c the GPU suite;
# d the dense Qwen3-0.6B offline check.
set -u
T=${T:-560}
D=$(python3 -c "import torch;print(torch.cuda.get_device_name().replace(' ','_'))")
echo "device $D"
J=ops/moe_configs; F="$J/E=128,N=768,K=2048,device_name=$D,dtype=bfloat16.json"
[ -f "$F" ] || cp "$J/E=128,N=768,K=2048,device_name=NVIDIA_H200,dtype=bfloat16.json" "$F"
S=$SECONDS
run() { # name, limit, stage, env...
  local n=$1 l=$2 st=$3; shift 3
  [ $((SECONDS - S + l)) -le $T ] || { echo "$n $st skipped at $((SECONDS-S))s"; return 1; }
  env "$@" timeout -k 5 $l bash scripts/gpu_run.sh $st >/dev/null 2>&1
  cp $OUT/summary.txt $OUT/${n}_summary.txt; cp /tmp/bastion-gpu-stages/$st.log $OUT/${n}_$st.log; rm -f $OUT/gpu_run.log
  echo "$n $st done at $((SECONDS-S))s"
}
[ $T -lt 260 ] && run l 170 moe MOE_ARGS="--latency --num-iters 10"
run b 260 moe MOE_ARGS="--offline --latency --num-iters 10"
run a 100 moetune MOE_TUNE_ARGS="--tokens 16384 --block-ms 128 --iters 5 --update --install" && cp "$F" $OUT/tuned.json
run c 150 tests
run d 70 offline
for n in l b a c d; do echo "==== $n"; cat $OUT/${n}_summary.txt 2>/dev/null; done
