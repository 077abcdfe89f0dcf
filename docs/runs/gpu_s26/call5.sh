mkdir -p /tmp/site; compgen -G ".whl/*.whl" >/dev/null && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1; mkdir -p /tmp/pkg; ln -sfn $PWD /tmp/pkg/bastion
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
for t in 1 2 1 2; do echo "greedy FILL_THREADS=$t"; BASTION_GRAMMAR_FILL_THREADS=$t timeout 60 python3 scripts/bench_structured.py --device cuda --model configs/qwen3-0.6b --load-format dummy --dtype bfloat16 --tokenizer .whl/qwen3tok --executor mp --batch-sizes 32 128 2>&1 | grep -E "^ *[0-9]+ \||Error" | tail -3; done
timeout 100 python3 scripts/bench_moe.py --model configs/qwen3-30b-a3b --latency --num-iters 10 2>&1 | grep -E "latency batch|experts reached|Error" | tail -4
