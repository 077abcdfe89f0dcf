"""Speculative decoding on the CPU: tokens/s with and without drafting, same outputs.

The workload asks the embedded SmolLM2-135M-Instruct to rewrite or continue passages it was
given (the case prompt lookup is made for: the output repeats spans of the prompt), greedy, so
the speculative outputs must be token-identical to plain decoding; the script checks that.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_spec.py --batch-sizes 1 8
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_spec.py --no-async-scheduling
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_spec.py --method draft_model \
        --draft-model tiny-random --num-speculative-tokens 3

Both engines run with the same ``--[no-]async-scheduling`` (on by default, as the engine's
default): with it on, the speculating engine's worker drafts into slots scheduled ahead.

``--method draft_model --draft-model embedded`` drafts with the embedded model itself (every
greedy draft accepted: the cost of a draft model's steps at the best acceptance); ``tiny-random``
builds a random 2-layer Llama with the embedded model's vocabulary in a temporary folder (its
drafts are junk: the cost of drafting when nothing is accepted); anything else is a path.

All eight prompts run at each batch size, ``batch_size`` at a time. Each configuration runs
once to warm up and then ``--repeats`` times; the best run counts (other processes share a
small CPU). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from bastion.core.scheduler import _SpecStats
from bastion.ipc.messages import SamplingParams
from bastion.procs.llm import LLM

PASSAGES = [
    ("The river rose slowly through the night, and by morning the lower streets of the town were "
     "under water. Shopkeepers carried their goods upstairs while the council opened the school "
     "as a shelter for families who had to leave their homes."),
    ("To install the package, first create a virtual environment, then activate it and run the "
     "installer. If the installer reports a missing compiler, install the build tools for your "
     "system and run the installer again."),
    ("Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in "
     "the chloroplasts of plant cells, where chlorophyll absorbs mostly red and blue light and "
     "reflects green, which is why leaves look green."),
    ("def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < "
     "len(b):\n        if a[i] <= b[j]:\n            result.append(a[i])\n            i += 1\n"
     "        else:\n            result.append(b[j])\n            j += 1\n    return result\n"),
]
TASKS = [
    "Rewrite the following passage exactly, word for word.\n\n{p}\n\nRewritten passage:\n",
    "Here is a passage:\n\n{p}\n\nRepeat it, then continue it with one more sentence.\n\n",
]


def prompts() -> list[str]:
    return [t.format(p=p) for t in TASKS for p in PASSAGES]


def run(llm: LLM, batch_size: int, max_tokens: int, ignore_eos: bool = False,
        num_prompts: int = 8) -> tuple[float, list[list[int]]]:
    """The first ``num_prompts`` prompts, ``batch_size`` at a time (one ``generate`` call per
    group)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    all_prompts, token_ids = prompts()[:num_prompts], []
    start = time.perf_counter()
    for i in range(0, len(all_prompts), batch_size):
        outputs = llm.generate(all_prompts[i:i + batch_size], params)
        token_ids += [o.outputs[0].token_ids for o in outputs]
    return time.perf_counter() - start, token_ids


def count_spec_stats() -> dict[str, int]:
    """Totals of drafts, draft tokens and accepted tokens from now on, kept up to date by
    wrapping the scheduler's per-step observer (its own reports reset every step)."""
    totals = {"drafts": 0, "accepted": 0, "draft_tokens": 0}
    observe = _SpecStats.observe

    def counting(self, num_draft_tokens: int, num_accepted: int) -> None:
        totals["drafts"] += 1
        totals["draft_tokens"] += num_draft_tokens
        totals["accepted"] += num_accepted
        observe(self, num_draft_tokens, num_accepted)

    _SpecStats.observe = counting
    return totals


def draft_model_path(name: str) -> str:
    """``embedded``, ``tiny-random`` or a path (see the module docstring)."""
    if name == "embedded":
        from bastion.core.loader.embedded import embedded_gguf_path

        return embedded_gguf_path()
    if name != "tiny-random":
        return name
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tempfile.mkdtemp(prefix="bench-spec-draft-")
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, initializer_range=0.1,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="always generate --max-tokens (default: a rewrite ends at EOS)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=8,
                        help="the first N of the 8 prompts (1: the word-for-word rewrite only)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=True, help="async scheduling for both engines (default: on)")
    parser.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    parser.add_argument("--draft-model", default="embedded",
                        help="with --method draft_model: embedded, tiny-random or a path")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = parser.parse_args()
    if args.method == "ngram":
        spec_config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                       "prompt_lookup_min": args.prompt_lookup_min,
                       "prompt_lookup_max": args.prompt_lookup_max}
    else:
        spec_config = {"method": "draft_model", "model": draft_model_path(args.draft_model),
                       "num_speculative_tokens": args.num_speculative_tokens}
    plain = LLM(dtype="float32", max_model_len=1024, async_scheduling=args.async_scheduling)
    spec = LLM(dtype="float32", max_model_len=1024, speculative_config=spec_config,
               async_scheduling=args.async_scheduling)
    assert spec.engine.async_scheduling == args.async_scheduling
    # Totals over the timed runs (the engine's own reports reset every step).
    totals = count_spec_stats()
    rows = []
    for batch_size in args.batch_sizes:
        best = {}
        outs = {}
        for name, llm in (("plain", plain), ("spec", spec)):
            run(llm, 8, 8)  # warm-up
            times = []
            for _ in range(args.repeats):
                totals.update(drafts=0, accepted=0, draft_tokens=0)
                elapsed, outs[name] = run(llm, batch_size, args.max_tokens, args.ignore_eos,
                                          args.num_prompts)
                times.append(elapsed)
            best[name] = min(times)
        num_tokens = sum(len(t) for t in outs["plain"])
        rows.append({
            "batch": batch_size, "output_tokens": num_tokens,
            "plain_tok_s": num_tokens / best["plain"], "spec_tok_s": num_tokens / best["spec"],
            "speedup": best["plain"] / best["spec"],
            "mean_acceptance_length": 1 + totals["accepted"] / max(totals["drafts"], 1),
            "draft_acceptance_rate": totals["accepted"] / max(totals["draft_tokens"], 1),
            "identical": outs["plain"] == outs["spec"],
            "async_scheduling": args.async_scheduling, "method": args.method,
        })
    print(f"{args.method}, k={args.num_speculative_tokens}, async scheduling "
          f"{'on' if args.async_scheduling else 'off'}")
    print(f"{'batch':>5} {'tokens':>7} {'plain tok/s':>12} {'spec tok/s':>12} {'speedup':>8} "
          f"{'mean accept len':>16} {'draft accept':>13} {'identical':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['output_tokens']:>7} {r['plain_tok_s']:>12.1f} "
              f"{r['spec_tok_s']:>12.1f} {r['speedup']:>7.2f}x "
              f"{r['mean_acceptance_length']:>16.2f} {100 * r['draft_acceptance_rate']:>12.1f}% "
              f"{r['identical']!s:>10}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
