set -u
D=$(python3 -c "import torch;print(torch.cuda.get_device_name().replace(' ','_'))")
echo "device $D"
J=ops/moe_configs
[ -f "$J/E=128,N=768,K=2048,device_name=$D,dtype=bfloat16.json" ] || cp "$J/E=128,N=768,K=2048,device_name=NVIDIA_H200,dtype=bfloat16.json" "$J/E=128,N=768,K=2048,device_name=$D,dtype=bfloat16.json"
S=$SECONDS
TESTS_K=carveout timeout -k 5 120 bash scripts/gpu_run.sh tests >/dev/null 2>&1
cp $OUT/summary.txt $OUT/s1_summary.txt; cp /tmp/bastion-gpu-stages/tests.log $OUT/s1_tests.log; rm -f $OUT/gpu_run.log
echo "carveout test $((SECONDS-S))s"
MOE_VARIANTS="base BASTION_MOE_DOWN_SMEM=1+BASTION_SMEM_CARVEOUT=100 BASTION_MOE_DOWN_SMEM=2+BASTION_SMEM_CARVEOUT=100 BASTION_SMEM_CARVEOUT=100" MOE_ARGS="--rounds 2 --num-iters 10 --timeline" timeout -k 5 220 bash scripts/gpu_run.sh moevariants >/dev/null 2>&1
cp $OUT/summary.txt $OUT/s2_summary.txt; cp /tmp/bastion-gpu-stages/moevariants.log $OUT/s2_moevariants.log; rm -f $OUT/gpu_run.log
echo "variants done $((SECONDS-S))s"
if [ "$D" = "NVIDIA_H200" ] && [ $SECONDS -lt 330 ]; then
  MOE_ARGS="--offline --latency --num-iters 10" timeout -k 5 240 bash scripts/gpu_run.sh moe >/dev/null 2>&1
  cp $OUT/summary.txt $OUT/s3_summary.txt; cp /tmp/bastion-gpu-stages/moe.log $OUT/s3_moe.log; rm -f $OUT/gpu_run.log
fi
echo ==== carveout; cat $OUT/s1_summary.txt; grep -E "passed|failed|Error|assert" $OUT/s1_tests.log | tail -8
echo ==== variants; cat $OUT/s2_summary.txt
echo ==== moe; cat $OUT/s3_summary.txt 2>/dev/null
