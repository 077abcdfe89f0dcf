bash scripts/gpu_run.sh tests > /dev/null 2>&1; head -2 $OUT/summary.txt
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
for m in configs/qwen3-0.6b configs/llama-3.1-8b; do for e in 0 1 0 1; do echo "$m WHOLE_K=$e"; BASTION_GEMV_WHOLE_K=$e timeout 60 python3 scripts/bench_latency.py --model $m --batch-size 1 --num-iters 10 2>&1 | grep -E "avg|floor|Error" | tail -2; done; done
for t in 1 2 1 2; do echo "FILL_THREADS=$t"; BASTION_GRAMMAR_FILL_THREADS=$t timeout 70 python3 scripts/bench_structured.py --device cuda --model configs/qwen3-0.6b --load-format dummy --dtype bfloat16 --tokenizer .whl/qwen3tok --executor mp --batch-sizes 32 128 --temperature 0.8 2>&1 | grep -E "batch|overhead|^ *[0-9]|json|none|Error" | tail -6; done
