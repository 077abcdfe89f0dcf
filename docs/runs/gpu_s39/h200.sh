# H200 (needs_h200), for a session with little device time left: call3.sh's stages reordered by
# what they answer, each started only if it can end within $T seconds of the call's start:
# l batch-1/8 latency alone, when $T is too short for b; b both targets + the offline phase
# table; a the 16,384-token prefill retune (timed against the committed entry); c the GPU suite;
# d the dense Qwen3-0.6B offline check.
T=${T:-560}
. scripts/gpu_call.sh
[ "$T" -lt 260 ] && call_stage l 170 moe MOE_ARGS="--latency --num-iters 10"
call_stage b 260 moe MOE_ARGS="--offline --latency --num-iters 10"
call_stage a 100 moetune MOE_TUNE_ARGS="--tokens 16384 --block-ms 128 --iters 5 --update --install" \
  && cp "$MOE_TABLE" "$OUT/tuned.json"
call_stage c 150 tests
call_stage d 70 offline
call_show l b a c d
