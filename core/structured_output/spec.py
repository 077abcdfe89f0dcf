"""What a ``StructuredOutputsParams`` asks for, as one grammar key, and its check without a
tokenizer (the API process rejects a spec that cannot compile before it queues the request).

xgrammar is imported on first use: it pulls torch in, which a process that never sees a
grammar need not pay for.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from bastion.ipc.messages import StructuredOutputsParams

# xgrammar's C++ errors start with a time stamp and a source location ("[13:25:58]
# /project/cpp/regex_converter.cc:94: "); a client needs only the message after them.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarKey(NamedTuple):
    """One compiled grammar's identity: requests with equal keys share it (the cache key)."""

    kind: str  # json | json_object | regex | grammar (a choice becomes a grammar)
    text: str


class GrammarSpecError(ValueError):
    """A spec that cannot compile; the message names the kind and xgrammar's reason."""


def grammar_key(spec: StructuredOutputsParams) -> GrammarKey:
    if spec.json is not None:
        return GrammarKey("json", spec.json)
    if spec.regex is not None:
        return GrammarKey("regex", spec.regex)
    if spec.choice is not None:
        return GrammarKey("grammar", choice_grammar(spec.choice))
    if spec.grammar is not None:
        return GrammarKey("grammar", spec.grammar)
    return GrammarKey("json_object", "")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (each a literal string)."""
    # NOTE: JSON string escapes are the EBNF literal escapes xgrammar reads (\" \\ \n \uXXXX).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_spec(spec: StructuredOutputsParams) -> None:
    """Raise ``GrammarSpecError`` when the spec cannot become a grammar (a bad JSON schema,
    regex or EBNF, an empty choice). Needs no tokenizer: xgrammar parses the spec into a
    grammar, which is the step that fails on bad input; compiling against the vocabulary
    cannot fail after it."""
    key = grammar_key(spec)
    if spec.choice is not None and (not spec.choice or not all(spec.choice)):
        raise GrammarSpecError("choice must be a non-empty list of non-empty strings")
    try:
        build_grammar(key)
    except GrammarSpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and others
        raise GrammarSpecError(f"the {_kind_name(key.kind)} cannot be compiled: "
                               f"{clean_error(exc)}") from None


def build_grammar(key: GrammarKey):  # -> xgrammar.Grammar
    import xgrammar as xgr

    if key.kind == "json":
        try:
            json.loads(key.text)
        except ValueError as exc:
            raise GrammarSpecError(f"the JSON schema is not valid JSON: {exc}") from None
        return xgr.Grammar.from_json_schema(key.text, **JSON_SCHEMA_OPTIONS)
    if key.kind == "regex":
        return xgr.Grammar.from_regex(key.text)
    if key.kind == "grammar":
        return xgr.Grammar.from_ebnf(key.text)
    return xgr.Grammar.builtin_json_grammar()


# NOTE: compact separators (", " and ": ") instead of any whitespace: under a grammar that
# allows unbounded whitespace a small model can emit newlines until max_tokens (vLLM's
# ``disable-any-whitespace`` exists for that). Strict mode: no properties beyond the schema's.
JSON_SCHEMA_OPTIONS = {"any_whitespace": False, "strict_mode": True}


def clean_error(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _CPP_PREFIX.sub("", lines[0]) if lines else type(exc).__name__


def _kind_name(kind: str) -> str:
    return {"json": "JSON schema", "regex": "regex", "grammar": "grammar",
            "json_object": "JSON grammar"}[kind]
