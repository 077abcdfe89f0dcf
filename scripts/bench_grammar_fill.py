"""One step's grammar bitmask fill, on one thread and split over shares (``BitmaskFiller``).

Rows of one JSON schema are walked through tokens drawn at random from what their grammar
allows (as rows sampled at a temperature are: deep in strings and arrays, where xgrammar's
cache helps least), then the fill of all of them is timed with each share count beside the
ideal (one thread's time over the shares) and xgrammar's own parallel batch fill:

    python scripts/bench_grammar_fill.py --tokenizer .whl/qwen3tok --rows 32 --steps 12 \
        [--vocab-size 151936 [--fill-with pairs]]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(REPO))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"]}


def main() -> int:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from bastion.core.structured_output.fill import BitmaskFiller
    from bastion.core.structured_output.manager import RequestGrammar

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the model's vocabulary, when wider than the tokenizer's")
    p.add_argument("--fill-with", choices=("padding", "pairs"), default="padding",
                   help="what the ids past the tokenizer's are: padding (xgrammar's special "
                        "tokens, never allowed) or seeded pairs of its tokens "
                        "(bench_structured.py's stand-in vocabulary, as wide as Qwen3's)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--steps", type=int, default=12, help="tokens each row is walked through")
    p.add_argument("--shares", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if args.fill_with == "pairs" and args.vocab_size:
        from bench_structured import stand_in_vocabulary
        info = stand_in_vocabulary(args.vocab_size, args.tokenizer)
    else:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=args.vocab_size)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    words = xgr.get_bitmask_shape(1, info.vocab_size)[1]
    bitmask = np.zeros((args.rows, words), dtype=np.int32)
    rng = random.Random(0)
    grammars = [RequestGrammar(compiled, None) for _ in range(args.rows)]
    for g in grammars:
        for _ in range(args.steps):
            g.matcher.fill_next_token_bitmask(bitmask, 0)
            allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8),
                                                   bitorder="little")[:info.vocab_size])
            if g.matcher.is_terminated() or not len(allowed):
                break
            assert g.matcher.accept_token(int(rng.choice(allowed)))

    def timed(fill, *fill_args) -> float:
        fill(*fill_args)
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            fill(*fill_args)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    def split_fill(filler: BitmaskFiller) -> None:
        filler.row_us = 1e9  # as if rows were slow: split as far as the shares go
        filler.fill(grammars, bitmask)

    print(f"{args.rows} rows, {args.steps} random tokens in, vocabulary {info.vocab_size} "
          f"({len(tokenizer)} of the tokenizer's, the rest {args.fill_with}), "
          f"{len(os.sched_getaffinity(0))} cores")
    print(f"{'shares':>6} | {'fill ms':>8} | {'ideal ms':>8} | of ideal")
    one = None
    for shares in sorted(set(args.shares) | {1}):  # one thread first: the ideal's base
        filler = BitmaskFiller(num_threads=shares)
        ms = timed(split_fill, filler)
        assert filler.last_shares == min(shares, args.rows // 2)
        filler.close()
        one = ms if one is None else one
        ideal = one / shares
        print(f"{shares:>6} | {ms:>8.3f} | {ideal:>8.3f} | {ideal / ms:.0%}")
    matchers, rows = [g.matcher for g in grammars], list(range(args.rows))
    for threads in sorted(set(args.shares) - {1}):
        batch = xgr.BatchGrammarMatcher(threads)
        ms = timed(batch.batch_fill_next_token_bitmask, matchers, bitmask, rows)
        print(f"xgrammar's BatchGrammarMatcher({threads}): {ms:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
