# H100 (no needs_h200): the stages that fit 80 GB and do not judge the targets:
# the whole GPU suite on the pruned code, then the batch-1 release-at-end / 4x256 down-tile A/B.
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
run c 200 tests
[ $SECONDS -lt ${VT:-330} ] && run v 150 moevariants MOE_VARIANTS="base BASTION_MOE_UP_RELEASE_AT_END=1 BASTION_MOE_GEMV_CONFIG=down=4,256,4,2 BASTION_MOE_UP_RELEASE_AT_END=1+BASTION_MOE_GEMV_CONFIG=down=4,256,4,2" MOE_ARGS="--rounds 2 --num-iters 10"
for n in c v; do echo "==== $n"; cat $OUT/${n}_summary.txt 2>/dev/null; done
