"""The engine flags shared by ``bastion generate`` and ``bastion serve``, derived from the config
dataclasses (one flag per field, each also in its underscore spelling), and the user error
that both report as one line with exit status 2. Kept apart from ``procs/cli.py`` so that
``procs/serve.py`` needs nothing from the command that dispatches to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
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

_ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig,
                   FaultToleranceConfig, LoRAConfig)
# distributed_executor_backend: the offline LLM's; the CLI takes vLLM's flag with no effect.
_SKIP = {"hf_overrides", "device", "distributed_executor_backend"}
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


def add_common_args(parser: argparse.ArgumentParser) -> None:
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
