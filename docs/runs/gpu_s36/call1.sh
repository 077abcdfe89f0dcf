set -u
D=$(python3 -c "import torch;print(torch.cuda.get_device_name().replace(' ','_'))")
echo "device $D"
J=ops/moe_configs
[ -f "$J/E=128,N=768,K=2048,device_name=$D,dtype=bfloat16.json" ] || cp "$J/E=128,N=768,K=2048,device_name=NVIDIA_H200,dtype=bfloat16.json" "$J/E=128,N=768,K=2048,device_name=$D,dtype=bfloat16.json"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
mkdir -p /tmp/pkg; ln -sfn "$PWD" /tmp/pkg/bastion
S=$SECONDS
PYTHONPATH=/tmp/site:/tmp/pkg:$PWD timeout -k 5 100 python3 -m pytest -q -x -s -p no:cacheprovider tests/test_triton_kernels.py -m gpu -k "staged_in_shared" > $OUT/s0_smem.log 2>&1; echo "smem smoke rc=$? $((SECONDS-S))s" | tee $OUT/s0_rc.txt
tail -25 $OUT/s0_smem.log
if grep -q "4 passed" $OUT/s0_smem.log; then SM=1; else SM=0; fi
if [ $SM = 1 ]; then MOE_VARIANTS="base BASTION_MOE_DOWN_SMEM=1 BASTION_MOE_DOWN_SMEM=2" MOE_ARGS="--rounds 2 --num-iters 10 --timeline" timeout -k 5 330 bash scripts/gpu_run.sh moevariants >/dev/null 2>&1
cp $OUT/summary.txt $OUT/s2_summary.txt; cp /tmp/bastion-gpu-stages/moevariants.log $OUT/s2_moevariants.log; mv $OUT/gpu_run.log $OUT/s2_gpu_run.log; fi
if [ $SM = 0 ]; then K1="qwen3_30b_shape and not shared"; elif [ $SECONDS -gt 330 ]; then K1="qwen3_30b_shape"; else K1="same_bits or qwen3_30b_shape"; fi
TESTS_K="$K1" bash scripts/gpu_run.sh tests >/dev/null 2>&1
cp $OUT/summary.txt $OUT/s1_summary.txt; cp /tmp/bastion-gpu-stages/tests.log $OUT/s1_tests.log; mv $OUT/gpu_run.log $OUT/s1_gpu_run.log
if [ $SECONDS -lt 380 ]; then TESTS_K="not same_bits and not staged_in_shared and not qwen3_30b_shape" bash scripts/gpu_run.sh tests >/dev/null 2>&1; cp $OUT/summary.txt $OUT/s3_summary.txt; cp /tmp/bastion-gpu-stages/tests.log $OUT/s3_tests.log; fi
echo ==== smem; cat $OUT/s0_rc.txt
echo ==== same_bits; cat $OUT/s1_summary.txt; grep -E "first differs|bits of off|FAIL|Error" $OUT/s1_tests.log | head -20
echo ==== variants; cat $OUT/s2_summary.txt 2>/dev/null
echo ==== rest; cat $OUT/s3_summary.txt
