"""The ``bastion`` command: ``bastion generate "prompt"``, ``bastion serve [MODEL]`` and
``bastion install-units``.

Engine flags are derived from the config dataclasses, one flag per field
(``max_model_len`` -> ``--max-model-len``), so the CLI and the configs cannot drift apart.
Every flag is also accepted in its underscore spelling (``--max_model_len``), as vLLM's are.
A user error (a flag, a config value, a path, a port) is one line on stderr and exit status 2;
``--log-level debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import traceback
import typing
from collections.abc import Sequence
from typing import Any, NoReturn

from bastion.api.config import ApiConfigError
from bastion.core.config import (
    CacheConfig,
    ConfigError,
    FaultToleranceConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

logger = logging.getLogger("bastion.cli")

_ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig,
                   FaultToleranceConfig, LoRAConfig)
_SKIP = {"hf_overrides", "device"}
# vLLM's other spellings of bastion's flags.
_ALIASES = {"policy": ("--scheduling-policy",), "tensor_parallel_size": ("-tp",),
            "data_parallel_size": ("-dp",), "data_parallel_rank": ("-dpr",)}
# vLLM flags that change nothing here: accepted, with one info line saying why.
_NO_EFFECT: dict[str, tuple[dict[str, Any], str]] = {
    "--trust-remote-code": ({"action": "store_true"},
                            "bastion runs no code from model folders, only its own model classes"),
    "--distributed-executor-backend": ({"choices": ["mp"]},
                                       "bastion always runs one worker process per GPU (mp)"),
    "--disable-log-requests": ({"action": "store_true"}, "bastion logs no line per request"),
    "--disable-log-stats": ({"action": "store_true"}, "bastion logs no periodic stats"),
}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class UserError(Exception):
    """Something the user asked for that cannot be done (a taken port, a missing file)."""


# What ``main`` reports as one line with exit status 2: the user can fix these.
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, ApiConfigError, UserError,
                                                 FileNotFoundError)


class FlexibleArgumentParser(argparse.ArgumentParser):
    """argparse with vLLM's conventions: ``--flag_name`` means ``--flag-name``, no prefix
    abbreviations, and errors as one line naming the flag."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(normalize_flags(argv), namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def normalize_flags(argv: list[str]) -> list[str]:
    """``--max_model_len=8`` -> ``--max-model-len=8``; values and anything after ``--`` stay."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def _flag_type(tp: Any) -> tuple[Any, bool]:
    """(the argparse type, whether the flag takes several values) of a field's annotation."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is tuple:
        return _flag_type(args[0])[0], True
    base = args[0] if args else tp
    kind = {"int": int, "float": float, "str": str, "bool": bool}.get(
        getattr(base, "__name__", str(base)), str)
    return kind, False


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for cls in _ENGINE_CONFIGS:
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group(cls.__name__)
        for f in dataclasses.fields(cls):
            if f.name in _SKIP:
                continue
            flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ())]
            kind, is_list = _flag_type(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else None
            if kind is bool:
                group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=default)
            elif is_list:
                group.add_argument(*flags, dest=f.name, type=kind, nargs="+", default=default)
            else:
                group.add_argument(*flags, dest=f.name, type=kind, default=default)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--speculative-config", dest="speculative_config", default=None,
                        help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_min": 1, '
                             '"prompt_lookup_max": 4}')
    group = parser.add_argument_group("accepted for vLLM compatibility, no effect")
    for flag, (kwargs, why) in _NO_EFFECT.items():
        group.add_argument(flag, default=None, help=why, **kwargs)


def _add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as with --model (vLLM style)")
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                        help="debug also prints the traceback of a user error")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for cls in _ENGINE_CONFIGS for f in dataclasses.fields(cls)} - _SKIP
    kwargs = {name: getattr(args, name) for name in names}
    model_tag = getattr(args, "model_tag", None)
    if model_tag is not None:
        if kwargs["model"] is not None and kwargs["model"] != model_tag:
            raise ConfigError(f"two models given: {model_tag!r} and --model {kwargs['model']!r}")
        kwargs["model"] = model_tag
    if args.device is not None:
        kwargs["device"] = args.device
    if getattr(args, "speculative_config", None) is not None:
        kwargs["speculative_config"] = args.speculative_config
    return kwargs


def no_effect_notes(args: argparse.Namespace) -> list[str]:
    """One line per no-effect flag the user gave, to be logged once logging is set up."""
    notes = []
    for flag, (_, why) in _NO_EFFECT.items():
        if getattr(args, flag[2:].replace("-", "_"), None):
            notes.append(f"{flag} has no effect: {why}")
    return notes


def _cmd_generate(args: argparse.Namespace) -> int:
    from bastion.procs.logs import setup_logging

    setup_logging(args.log_level)
    for note in no_effect_notes(args):
        logger.info(note)
    from bastion.core.llm import LLM
    from bastion.ipc.messages import SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


def _cmd_install_units(args: argparse.Namespace) -> int:
    from bastion.procs.units import install_units

    install_units(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = FlexibleArgumentParser(prog="bastion", description=__doc__.splitlines()[0])
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
    gen.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server (a systemd daemon)")
    _add_common_args(serve)
    from bastion.procs.serve import add_serve_args, cmd_serve

    add_serve_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    from bastion.procs.units import add_install_units_args

    units = sub.add_parser("install-units",
                           help="write systemd units that run this environment's bastion")
    add_install_units_args(units)
    units.set_defaults(func=_cmd_install_units)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; an unknown flag is a one-line error naming it (exit status 2)."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        flags = [e for e in extras if e.startswith("-")] or extras
        where = f"bastion {args.command}"
        plural = "s" if len(flags) > 1 else ""
        parser.exit(2, f"{where}: error: unknown flag{plural} {' '.join(flags)} "
                       f"(`{where} --help` lists the flags)\n")
    return args


def report_user_error(exc: BaseException, log_level: str) -> int:
    """One line on stderr (and the traceback at debug level); returns the exit status, 2."""
    if log_level == "debug":
        traceback.print_exception(exc)
    print(f"bastion: error: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        return report_user_error(exc, getattr(args, "log_level", "info"))


if __name__ == "__main__":
    # NOTE: through the package, not this __main__ copy: the error classes other modules raise
    # must be the ones main catches.
    from bastion.procs.cli import main as package_main

    sys.exit(package_main())
