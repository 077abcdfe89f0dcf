"""Which request fields of ``/v1/completions`` and ``/v1/chat/completions`` are refused.

A field that would change the output and is not implemented gets a 400 naming it when the
request sets it to anything but its neutral values; silently ignoring it would return
something the client did not ask for. Fields that change nothing bastion returns (OpenAI's
bookkeeping: ``user``, ``metadata``, ``store``, ...) are accepted and ignored, as vLLM does.
Every other field the routes read is implemented (``tests/test_request_fields.py`` enumerates
OpenAI's and vLLM's request fields against these tables).
"""

from __future__ import annotations

import json
from typing import Any

from bastion.api.errors import bad_request

# name -> the values that mean "not used" (None: the field left out or null). Every name is a
# field of the route's request type (api/schemas.py), so the decoder keeps it for this check.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    # vLLM's extensions
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "priority": (None, 0),
    "request_id": (None,),
    # xgrammar's default whitespace only (api/structured_outputs.py takes the other fields)
    "guided_whitespace_pattern": (None,),
}

_UNSUPPORTED_COMPLETIONS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "prompt_embeds": (None,),
}

_UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    # OpenAI's
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "moderation": (None,),
    # vLLM's chat extensions (``echo`` on completions is implemented)
    "echo": (None, False),
    "continue_final_message": (None, False),
    "documents": (None,),
    "chat_template": (None,),
    "mm_processor_kwargs": (None,),
    # OpenAI's legacy function calling (tools replace it) and reasoning controls bastion's
    # parsers do not read
    "functions": (None, []),
    "function_call": (None, "none"),
    "reasoning_effort": (None,),
    "include_reasoning": (None, True),
}

# Accepted and ignored: none of them changes what bastion returns.
NO_EFFECT = ("user", "metadata", "store", "service_tier", "safety_identifier",
             "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
             # bastion has one grammar backend: "auto" and "xgrammar" name it (other names 400)
             "guided_decoding_backend")


def check_unsupported(body: dict, chat: bool) -> None:
    """400 naming the first field of ``body`` set to a value bastion does not implement."""
    for table in (_UNSUPPORTED, _UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETIONS):
        for name, neutral in table.items():
            if name in body and not _is_neutral(body[name], neutral):
                raise bad_request(f"{name} is not supported by this server (set it to "
                                  f"{_spell(neutral)} or leave it out)", name)


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    for n in neutral:
        # NOTE: booleans by identity: Python's True == 1 would let best_of: true through.
        if isinstance(n, bool) or isinstance(value, bool):
            if value is n:
                return True
        elif value == n:
            return True
    return False


def _spell(neutral: tuple[Any, ...]) -> str:
    return " or ".join(json.dumps(n) for n in neutral)


def unsupported_fields(chat: bool) -> set[str]:
    """Every field ``check_unsupported`` refuses on that route (for the tests)."""
    return set(_UNSUPPORTED) | set(_UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETIONS)
