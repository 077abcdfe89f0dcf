# H200 (needs_h200), session 40's plan: gpu_s39/h200.sh's stages with two MoE A/Bs after the
# baseline; each stage starts only if it can end within $T seconds of the call's start:
# b  both targets + the offline phase table (the baseline), and a profile of 16 steps at
#    batch 256 (each kernel's device time);
# g  the MoE align kernel alone with either atomic, beside the layer (bench_moe_align.py);
# r  the offline runs and the profile again with BASTION_MOE_ALIGN_RELAXED=1 (the atomics);
# p  the same with BASTION_MOE_GROUPED_PDL=1 as well (the launches, once the align is short);
# c  the GPU suite (the align tests with either atomic, the grouped path with and without
#    programmatic launch);
# a  the 16,384-token prefill retune (timed against the committed entry);
# d  the dense Qwen3-0.6B offline check.
# A second call runs the stages left: S="a d" (or "c a d"). On an H100 (the nano-vllm shape
# does not fit its K/V): S="g c".
T=${T:-560}
S=${S:-b g r p c a d}
. scripts/gpu_call.sh
for s in $S; do
  case $s in
    b) call_stage b 260 moe MOE_ARGS="--offline --latency --num-iters 10" MOE_PROFILE=256 ;;
    g) call_stage g 90 moealign ;;
    r) call_stage r 150 moe MOE_ARGS="--offline" MOE_PROFILE=256 BASTION_MOE_ALIGN_RELAXED=1 ;;
    p) call_stage p 150 moe MOE_ARGS="--offline" MOE_PROFILE=256 BASTION_MOE_ALIGN_RELAXED=1 \
         BASTION_MOE_GROUPED_PDL=1 ;;
    c) call_stage c 150 tests ;;
    a) call_stage a 100 moetune \
         MOE_TUNE_ARGS="--tokens 16384 --block-ms 128 --iters 5 --update --install" \
         && cp "$MOE_TABLE" "$OUT/tuned.json" ;;
    d) call_stage d 70 offline ;;
  esac
done
call_show $S
