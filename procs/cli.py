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
import logging
import sys
import traceback

from bastion.procs.args import (
    LOG_LEVELS,
    USER_ERRORS,
    FlexibleArgumentParser,
    UserError,
    add_common_args,
    add_engine_args,
    engine_kwargs,
    no_effect_notes,
    normalize_flags,
)

__all__ = ["UserError", "build_parser", "engine_kwargs", "main", "no_effect_notes",
           "normalize_flags", "parse_args"]

logger = logging.getLogger("bastion.cli")


def _cmd_generate(args: argparse.Namespace) -> int:
    from bastion.procs.logs import setup_logging

    setup_logging(args.log_level)
    for note in no_effect_notes(args):
        logger.info(note)
    from bastion.ipc.messages import SamplingParams
    from bastion.procs.llm import LLM

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
    add_common_args(serve)
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


def run() -> None:
    """The ``bastion`` command: ``main``, then the process ends at once (``exit_now``)."""
    from bastion.procs.lifecycle import exit_now

    exit_now(main())


if __name__ == "__main__":
    # NOTE: through the package, not this __main__ copy: the error classes other modules raise
    # must be the ones main catches.
    from bastion.procs.cli import run

    run()
