"""The ``bastion`` command: ``bastion generate "prompt"`` and ``bastion serve``.

Engine flags are derived from the config dataclasses, one flag per field
(``max_model_len`` -> ``--max-model-len``), so the CLI and the configs cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any

from bastion.core.config import (
    CacheConfig,
    FaultToleranceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

_ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig,
                   FaultToleranceConfig)
_SKIP = {"hf_overrides", "device"}


def _flag_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    return {"int": int, "float": float, "str": str, "bool": bool}.get(
        getattr(base, "__name__", str(base)), str)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for cls in _ENGINE_CONFIGS:
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group(cls.__name__)
        for f in dataclasses.fields(cls):
            if f.name in _SKIP:
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = _flag_type(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else None
            if kind is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=default)
            else:
                group.add_argument(flag, dest=f.name, type=kind, default=default)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--speculative-config", dest="speculative_config", default=None,
                        help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_min": 1, '
                             '"prompt_lookup_max": 4}')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for cls in _ENGINE_CONFIGS for f in dataclasses.fields(cls)} - _SKIP
    kwargs = {name: getattr(args, name) for name in names}
    if args.device is not None:
        kwargs["device"] = args.device
    if getattr(args, "speculative_config", None) is not None:
        kwargs["speculative_config"] = args.speculative_config
    return kwargs


def _cmd_generate(args: argparse.Namespace) -> int:
    from bastion.core.llm import LLM
    from bastion.ipc.messages import SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bastion", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate once for a prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="apply the chat template (default) or send the raw prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server (a systemd daemon)")
    serve.add_argument("model_tag", nargs="?", default=None,
                       help="the model, as with --model (vLLM style)")
    from bastion.procs.serve import add_serve_args, cmd_serve

    add_serve_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
