"""Registers and spills of the decode kernels, compiled for an H100/H200 (sm_90) on a machine
with no GPU: Triton lowers each kernel to PTX and the ptxas in its wheel to a cubin, whose
resource usage cuobjdump reads. A kernel at 255 registers with a stack is spilling, and fewer
programs fit a SM as registers (or shared memory) grow; neither needs device time to see.

    python scripts/kernel_resources.py               # Qwen3-30B-A3B's batch-1 decode kernels
    python scripts/kernel_resources.py --ptx /tmp/p  # also each variant's PTX, to read loops
    python scripts/kernel_resources.py --order       # also each one's global loads and stores
                                                     # in SASS order around its wait

``--order`` shows what a latency-bound kernel's time after its wait is made of: every run of
loads (``LDG``) that follows a store (``STG``) or a reduction (``SHFL``) is another round trip
to L2 (a load is not moved above a store that might alias it), e.g. ``WAIT LDGx6 SHFLx12
STGx4 LDGx2 ...``.

Arguments are typed as a launch would type them (Triton's own specialisation: 16-byte aligned
pointers, integers divisible by 16 marked so). Uses Triton internals (``ASTSource``,
``native_specialize_impl``) that Triton 3.6 and 3.9 share.

Read it with the GPU host's Triton (3.6): this machine's 3.9 compiles some of these kernels
differently (the MoE up kernel's K loop not unrolled, the down kernel spilling with 2-byte
loads; docs/BENCHMARKS.md, session 31). The compiler runs without a GPU:

    bash scripts/kernel_resources_host.sh --order   # installs it once into .triton-host/
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile


class Ptr:
    """A pointer argument to elements of ``dtype`` (Triton's name: bf16, fp32, i32)."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


def source(fn, args: dict, consts: dict):
    """The kernel ``fn`` with non-constexpr ``args`` (Ptr or a sample value) and ``consts``
    (parameters left out take their defaults)."""
    from triton.backends.compiler import BaseBackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import native_specialize_impl

    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = consts.get(p.name, p.default)
            continue
        value = args.get(p.name, p.default)
        if isinstance(value, Ptr):
            kind, attr = "*" + value.dtype, "D"
        else:
            kind, attr = native_specialize_impl(BaseBackend, value, False,
                                                not p.do_not_specialize,
                                                not p.do_not_specialize_on_alignment)
        signature[p.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = attr
        elif isinstance(attr, str) and attr:
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def cuobjdump(cubin: bytes, *flags: str) -> str:
    """What the cuobjdump in Triton's wheel prints for ``cubin`` with ``flags``."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True,
                              check=True).stdout


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) a thread of the cubin's kernel uses."""
    out = cuobjdump(cubin, "--dump-resource-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {out[:200]}")
    return int(found.group(1)), int(found.group(2))


def sass_order(cubin: bytes) -> str:
    """The kernel's global loads (LDG; CPASYNC into shared memory), stores (STG), atomics
    (ATOMG, RED), shuffles (SHFL), barriers (BAR) and programmatic-launch wait (WAIT) in SASS
    order, runs counted: ``LDGx7 WAIT LDGx6 ...``."""
    runs: list[list] = []
    for line in cuobjdump(cubin, "-sass").splitlines():
        found = re.search(r"\b(ACQBULK|LDGSTS|LDG|STG|ATOMG|RED|SHFL|BAR)\b", line)
        if found is None:
            continue
        op = {"ACQBULK": "WAIT", "LDGSTS": "CPASYNC"}.get(found.group(1), found.group(1))
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return " ".join(op if n == 1 else f"{op}x{n}" for op, n in runs)


def variants() -> list[tuple[str, object, dict, dict, dict]]:
    """(name, kernel, args, constexprs, options) at Qwen3-30B-A3B's batch-1 decode shapes."""
    from bastion.ops.triton.fused_add_rms_norm import _fused_add_rms_norm_kernel
    from bastion.ops.triton.fused_moe_gemv import _moe_gemv_down_kernel, _moe_gemv_up_kernel
    from bastion.ops.triton.gemv import _gemv_kernel
    from bastion.ops.triton.moe_routing import _moe_routing_kernel
    from bastion.ops.triton.rotary import _rotary_kernel
    from bastion.ops.triton.unified_attention import _unified_attention_kernel

    pdl = {"launch_pdl": True}
    up_args = {"x_ptr": Ptr("bf16"), "w13_ptr": Ptr("bf16"), "act_ptr": Ptr("bf16"),
               "ids_ptr": Ptr("i32"), "expert_offset": 0, "num_local": 128, "N": 768,
               "K": 2048, "stride_x": 2048, "stride_we": 1536 * 2048, "stride_wn": 2048,
               "stride_act": 768}
    down_args = {"act_ptr": Ptr("bf16"), "w2_ptr": Ptr("bf16"), "out_ptr": Ptr("bf16"),
                 "ids_ptr": Ptr("i32"), "weights_ptr": Ptr("fp32"), "expert_offset": 0,
                 "num_local": 128, "N": 2048, "K": 768, "stride_act": 768,
                 "stride_we": 2048 * 768, "stride_wn": 768, "stride_out": 2048}
    gemv_args = {"x_ptr": Ptr("bf16"), "w_ptr": Ptr("bf16"), "b_ptr": Ptr("bf16"),
                 "y_ptr": Ptr("bf16"), "M": 1, "N": 2048, "K": 4096, "stride_xm": 4096,
                 "stride_wn": 4096, "stride_ym": 2048}
    attn_args = {"out_ptr": Ptr("bf16"), "part_out_ptr": Ptr("fp32"), "part_ml_ptr": Ptr("fp32"),
                 "done_ptr": Ptr("i32"), "q_ptr": Ptr("bf16"), "k_cache_ptr": Ptr("bf16"),
                 "v_cache_ptr": Ptr("bf16"), "block_tables_ptr": Ptr("i32"),
                 "seq_lens_ptr": Ptr("i32"), "query_start_loc_ptr": Ptr("i32"),
                 "scale_log2": 0.1275, "num_seqs": 1, "stride_q_t": 4096, "stride_q_h": 128,
                 "stride_o_t": 4096, "stride_o_h": 128, "stride_k_blk": 8192,
                 "stride_k_off": 512, "stride_k_h": 128, "stride_v_blk": 8192,
                 "stride_v_off": 512, "stride_v_h": 128, "stride_bt": 2048}
    attn = {"NUM_Q_PER_KV": 8, "BLOCK_Q": 1, "BLOCK_M": 16, "HEAD_DIM": 128, "HEAD_PAD": 128,
            "TILE": 32, "KV_BLOCK_SIZE": 16, "IEEE_DOT": False, "DECODE": True,
            "SKIP_DECODE_ROWS": False, "USE_PDL": 2, "NUM_SPLITS": 16, "FUSED_MERGE": True}
    attn["BLOCK_Q"] = attn["BLOCK_M"] // attn["NUM_Q_PER_KV"]  # as the launcher's _block_q
    out = [("moe up 8x128 (the tuned batch-1 tile: 8 warps, 2 stages)", _moe_gemv_up_kernel,
            up_args, {"TOP_K": 8, "BLOCK_N": 8, "BLOCK_K": 128, "USE_PDL": 2,
                      "EVICT": "evict_first"},
            {"num_warps": 8, "num_stages": 2, **pdl}),
           ("moe down 8x256 (4 warps, 2 stages)", _moe_gemv_down_kernel, down_args,
            {"TOP_K": 8, "BLOCK_TOPK": 8, "BLOCK_N": 8, "BLOCK_K": 256, "USE_PDL": 2,
             "PREFETCH": True, "W_BYTES": 2, "LINES": 128, "EVICT": "evict_first"},
            {"num_warps": 4, "num_stages": 2, **pdl})]
    gemv = {"HAS_BIAS": False, "EVEN_K": True, "BLOCK_M": 1, "USE_PDL": 2, "PREFETCH": False,
            "W_BYTES": 2, "LINES": 128, "ONE_ROW": True, "EVICT": "evict_first"}
    qkv_args = {**gemv_args, "N": 5120, "K": 2048, "stride_xm": 2048, "stride_wn": 2048,
                "stride_ym": 5120}
    for name, fn_args, block_n, block_k in (("o-proj", gemv_args, 4, 4096),
                                            ("qkv", qkv_args, 8, 2048)):
        out.append((f"gemv {name} whole K, {block_n} x {block_k}", _gemv_kernel, fn_args,
                    {**gemv, "BLOCK_N": block_n, "BLOCK_K": block_k},
                    {"num_warps": 4, **pdl}))
    out.append(("attention decode, 16 splits of 32-key tiles", _unified_attention_kernel,
                attn_args, attn, {"num_warps": 4, "num_stages": 2, **pdl}))
    norm_args = {"out_ptr": Ptr("bf16"), "new_res_ptr": Ptr("bf16"), "x_ptr": Ptr("bf16"),
                 "res_ptr": Ptr("bf16"), "weight_ptr": Ptr("bf16"), "stride_x": 2048,
                 "stride_res": 2048, "eps": 1e-6}
    out.append(("residual add + RMSNorm", _fused_add_rms_norm_kernel, norm_args,
                {"HIDDEN": 2048, "BLOCK": 2048, "USE_PDL": 2}, {"num_warps": 8, **pdl}))
    routing_args = {"logits_ptr": Ptr("fp32"), "weights_ptr": Ptr("fp32"), "ids_ptr": Ptr("i32"),
                    "num_real_ptr": Ptr("i32"), "num_tokens": 1, "stride_logits": 128}
    out.append(("routing (softmax, top-8 of 128)", _moe_routing_kernel, routing_args,
                {"NUM_EXPERTS": 128, "BLOCK_E": 128, "TOP_K": 8, "BLOCK_K": 8,
                 "RENORMALIZE": True, "HAS_NUM_REAL": True, "BLOCK_T": 1, "USE_PDL": 2},
                {"num_warps": 1, **pdl}))
    rotary_args = {"q_out_ptr": Ptr("bf16"), "k_out_ptr": Ptr("bf16"), "q_ptr": Ptr("bf16"),
                   "k_ptr": Ptr("bf16"), "v_ptr": Ptr("bf16"), "positions_ptr": Ptr("i64"),
                   "cos_sin_ptr": Ptr("fp32"), "q_w_ptr": Ptr("bf16"), "k_w_ptr": Ptr("bf16"),
                   "k_cache_ptr": Ptr("bf16"), "v_cache_ptr": Ptr("bf16"),
                   "slot_mapping_ptr": Ptr("i64"), "eps": 1e-6, "stride_q": 5120,
                   "stride_k": 5120, "stride_v": 5120, "stride_cs": 128, "stride_c_blk": 8192,
                   "stride_c_off": 512, "stride_c_h": 128}
    out.append(("rotary with q/k norms and the K/V store", _rotary_kernel, rotary_args,
                {"NUM_Q_HEADS": 32, "NUM_K_HEADS": 4, "HEAD_DIM": 128, "ROT_DIM": 128,
                 "Q_HEADS_PAD": 32, "K_HEADS_PAD": 4, "HALF_PAD": 64, "PASS_PAD": 0,
                 "PASS_ARANGE": 1, "DIM_PAD": 128, "IS_NEOX": True, "NORM": True,
                 "STORE": True, "BLOCK_SIZE": 16, "USE_PDL": 2}, {"num_warps": 4, **pdl}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ptx", help="a folder for each variant's PTX")
    p.add_argument("--order", action="store_true",
                   help="each variant's global loads and stores in SASS order")
    args = p.parse_args(argv)
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    print(f"triton {triton.__version__}, sm_90; registers / stack bytes a thread")
    failed = 0
    for name, fn, fn_args, consts, options in variants():
        try:
            kernel = triton.compile(source(fn, fn_args, consts), target=target, options=options)
        except Exception as exc:  # noqa: BLE001 - report every variant
            failed += 1
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            continue
        regs, stack = resources(kernel.asm["cubin"])
        ptx = kernel.asm["ptx"]
        wide = len(re.findall(r"ld\.global[.\w:]*\.v4\.b32", ptx))
        narrow = len(re.findall(r"ld\.global[.\w:]*\.b16", ptx))
        threads = 32 * options["num_warps"]
        shared = kernel.metadata.shared
        # An H100/H200 SM: 64k registers, 64 warps, 228 KB of shared memory (1 KB a program
        # reserved by the driver).
        per_sm = min(65536 // (regs * threads), 64 // options["num_warps"],
                     228 * 1024 // (shared + 1024))
        print(f"{name}: {regs} registers, {stack} B stack{' (spills)' if stack else ''}, "
              f"{shared // 1024} KB shared; {per_sm} programs a SM by registers, warps and "
              f"shared memory; loads in the PTX: {wide} of 16 bytes, {narrow} of 2")
        if args.order:
            print(f"    {sass_order(kernel.asm['cubin'])}")
        if args.ptx:
            os.makedirs(args.ptx, exist_ok=True)
            with open(os.path.join(args.ptx, re.sub(r"\W+", "_", name) + ".ptx"), "w") as f:
                f.write(ptx)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
