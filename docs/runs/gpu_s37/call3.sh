# H200 (needs_h200: Qwen3-30B-A3B's 60 GB of weights and the nano-vllm workload's K/V do not fit an H100's 80 GB)
set -u
D=$(python3 -c "import torch;print(torch.cuda.get_device_name().replace(' ','_'))")
echo "device $D"
J=ops/moe_configs; F="$J/E=128,N=768,K=2048,device_name=$D,dtype=bfloat16.json"
[ -f "$F" ] || cp "$J/E=128,N=768,K=2048,device_name=NVIDIA_H200,dtype=bfloat16.json" "$F"
S=$SECONDS
run() { # name, limit, stage, env...
  local n=$1 l=$2 st=$3; shift 3
  env "$@" timeout -k 5 $l bash scripts/gpu_run.sh $st >/dev/null 2>&1
  cp $OUT/summary.txt $OUT/${n}_summary.txt; cp /tmp/bastion-gpu-stages/$st.log $OUT/${n}_$st.log; rm -f $OUT/gpu_run.log
  echo "$n $st done at $((SECONDS-S))s"
}
run b 260 moe MOE_ARGS="--offline --latency --num-iters 10"
run c 150 tests
[ $SECONDS -lt 400 ] && run a 100 moetune MOE_TUNE_ARGS="--tokens 16384 --block-ms 128 --iters 5 --update --install" && cp "$F" $OUT/tuned.json
[ $SECONDS -lt 440 ] && run v 120 moevariants MOE_VARIANTS="base BASTION_MOE_UP_RELEASE_AT_END=1 BASTION_MOE_GEMV_CONFIG=down=4,256,4,2 BASTION_MOE_UP_RELEASE_AT_END=1+BASTION_MOE_GEMV_CONFIG=down=4,256,4,2" MOE_ARGS="--rounds 2 --num-iters 10"
[ $SECONDS -lt 510 ] && run d 70 offline
for n in b c a v d; do echo "==== $n"; cat $OUT/${n}_summary.txt 2>/dev/null; done
