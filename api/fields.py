"""Which request fields of ``/v1/completions`` and ``/v1/chat/completions`` are refused.

A field that would change the output and is not implemented gets a 400 naming it when the
request sets it to anything but its neutral values; silently ignoring it would return
something the client did not ask for. Fields that change nothing bastion returns (OpenAI's
bookkeeping: ``user``, ``metadata``, ``store``, ...) are accepted and ignored, as vLLM does.
Every other field the routes read is implemented (``tests/test_api.py`` enumerates OpenAI's
and vLLM's request fields against these tables).
"""

from __future__ import annotations

import json
from typing import Any

from bastion.api.errors import bad_request

# name -> the values that mean "not used" (None: the field left out or null).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "suffix": (None, ""),
    "best_of": (None, 1),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "moderation": (None,),
    # vLLM's extensions
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "spaces_between_special_tokens": (None, True),
    "prompt_embeds": (None,),
    "logits_processors": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "priority": (None, 0),
    "request_id": (None,),
    "mm_processor_kwargs": (None,),
    # ------------------------------------------------------------------------------------
    # Issue #21 (structured outputs, tool calling, reasoning) implements these on its own
    # branches; until it merges they are refused here. Its merge removes this group.
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "chat_template_kwargs": (None, {}),
    "reasoning_effort": (None,),
    "include_reasoning": (None, True),
    # ------------------------------------------------------------------------------------
}

# Chat only: vLLM's chat extensions (``echo`` on completions is implemented).
_UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "continue_final_message": (None, False),
    "documents": (None,),
    "chat_template": (None,),
}

# Accepted and ignored: none of them changes what bastion returns.
NO_EFFECT = ("user", "metadata", "store", "service_tier", "safety_identifier",
             "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options")


def check_unsupported(body: dict, chat: bool) -> None:
    """400 naming the first field of ``body`` set to a value bastion does not implement."""
    tables = (_UNSUPPORTED, _UNSUPPORTED_CHAT) if chat else (_UNSUPPORTED,)
    for table in tables:
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
    return set(_UNSUPPORTED) | (set(_UNSUPPORTED_CHAT) if chat else set())
