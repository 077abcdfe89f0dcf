"""The request fields that constrain the output to a grammar, into one
``StructuredOutputsParams``: OpenAI's ``response_format`` (``json_object``, ``json_schema``),
vLLM's ``structured_outputs`` (``json`` / ``regex`` / ``choice`` / ``grammar`` /
``json_object``) and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. At most one constraint per request; a spec that cannot compile is a 400
naming the problem, before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any

from bastion.api.errors import bad_request
from bastion.core.structured_output.spec import GrammarSpecError, check_spec
from bastion.ipc.messages import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Backends a client may name: bastion has one, so these change nothing.
_BACKENDS = (None, "auto", "xgrammar")


def parse_structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's output constraint, checked; None when it has none."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        found.append(("response_format", response_format))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _vllm_spec(body["structured_outputs"])))
    for field, kind in _GUIDED.items():
        if body.get(field) is not None:
            found.append((field, _one(kind, body[field], field)))
    if body.get("guided_decoding_backend") not in _BACKENDS:
        raise bad_request(f"guided_decoding_backend must be one of auto, xgrammar; got "
                          f"{body['guided_decoding_backend']!r}", "guided_decoding_backend")
    if body.get("guided_whitespace_pattern") is not None:
        raise bad_request("guided_whitespace_pattern is not supported by this server",
                          "guided_whitespace_pattern")
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"set at most one output constraint; this request sets "
                          f"{', '.join(field for field, _ in found)}", found[1][0])
    field, spec = found[0]
    try:
        check_spec(spec)
    except GrammarSpecError as exc:
        raise bad_request(f"{field}: {exc}", field, "invalid_grammar") from None
    return spec


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise bad_request('response_format.json_schema must be an object with a "name" and '
                              'a "schema"', "response_format")
        if schema.get("strict") not in (None, True, False):
            raise bad_request("response_format.json_schema.strict must be true or false",
                              "response_format")
        if "schema" not in schema:
            raise bad_request("response_format.json_schema.schema is required",
                              "response_format")
        return StructuredOutputsParams(json=_schema_text(schema["schema"], "response_format"))
    if kind == "structural_tag":
        raise bad_request("response_format of type structural_tag is not supported by this "
                          "server", "response_format")
    raise bad_request(f"response_format.type must be text, json_object or json_schema; got "
                      f"{kind!r}", "response_format")


def _vllm_spec(value: Any) -> StructuredOutputsParams:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request(f"{field} must be an object with one of {', '.join(_KINDS)}", field)
    if value.get("backend") not in _BACKENDS:
        raise bad_request(f"{field}.backend must be one of auto, xgrammar; got "
                          f"{value['backend']!r}", field)
    unknown = sorted(k for k, v in value.items()
                     if k not in (*_KINDS, "backend") and v not in (None, False))
    if unknown:
        raise bad_request(f"{field}.{unknown[0]} is not supported by this server; it accepts "
                          f"{', '.join(_KINDS)}", field)
    kinds = [k for k in _KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise bad_request(f"{field} must set exactly one of {', '.join(_KINDS)}; got "
                          f"{', '.join(kinds) or 'none'}", field)
    if kinds[0] == "json_object":
        if value["json_object"] is not True:
            raise bad_request(f"{field}.json_object must be true or false", field)
        return StructuredOutputsParams(json_object=True)
    return _one(kinds[0], value[kinds[0]], field)


def _one(kind: str, value: Any, field: str) -> StructuredOutputsParams:
    if kind == "json":
        return StructuredOutputsParams(json=_schema_text(value, field))
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise bad_request(f"{field}: choice must be a non-empty list of non-empty strings",
                              field)
        return StructuredOutputsParams(choice=value)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{field}: {kind} must be a non-empty string", field)
    return StructuredOutputsParams(**{kind: value})


def _schema_text(schema: Any, field: str) -> str:
    """A JSON schema as text: an object as sent, or a string holding one."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{field}: the JSON schema is not valid JSON: {exc}", field,
                              "invalid_grammar") from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{field}: a JSON schema must be an object", field)
    return json.dumps(schema)
