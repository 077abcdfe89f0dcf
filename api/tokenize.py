"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (encoded as ``/v1/completions`` encodes it) or chat
``messages`` (rendered and encoded as ``/v1/chat/completions`` does, so the ids are exactly
those the chat route would send to the engine) and answers ``{"count", "max_model_len",
"tokens", "token_strs"}``; ``/detokenize`` turns ``tokens`` back into ``{"prompt"}``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from bastion.api.chat import parse_chat_template_kwargs, parse_messages, render_prompt
from bastion.api.config import CLIENT_KEY, CONFIG_KEY, MODEL_NAMES_KEY
from bastion.api.errors import bad_request
from bastion.api.fields import check_unsupported
from bastion.api.protocol import check_model, get, read_body, read_request
from bastion.api.schemas import DetokenizeRequest, TokenizeRequest
from bastion.api.serving import off_loop
from bastion.api.tools import parse_tools


def tokenize_body(request: web.Request, raw: bytes) -> dict[str, Any]:
    client = request.app[CLIENT_KEY]
    body = read_request(raw, TokenizeRequest)
    check_model(body, request.app[MODEL_NAMES_KEY])
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad_request("send exactly one of prompt (a string) or messages (a chat)",
                          "messages" if has_messages else "prompt")
    if has_prompt:
        token_ids = client.tokenizer.encode(
            body["prompt"], add_special_tokens=get(body, "add_special_tokens", True))
    else:
        check_unsupported(body, chat=True)
        # The tools only reach the template here: no tool choice to check.
        tools = parse_tools({"tools": body.get("tools"), "tool_choice": "none"},
                            request.app[CONFIG_KEY])
        token_ids = render_prompt(client, parse_messages(body["messages"]),
                                  get(body, "add_generation_prompt", True),
                                  get(body, "add_special_tokens", False), tools,
                                  parse_chat_template_kwargs(body)).token_ids
    token_strs = None
    if get(body, "return_token_strs", False):
        token_strs = client.tokenizer.convert_ids_to_tokens(token_ids)
    return {"count": len(token_ids), "max_model_len": client.max_model_len,
            "tokens": token_ids, "token_strs": token_strs}


def detokenize_body(request: web.Request, raw: bytes) -> dict[str, Any]:
    client = request.app[CLIENT_KEY]
    body = read_request(raw, DetokenizeRequest)
    check_model(body, request.app[MODEL_NAMES_KEY])
    tokens = body["tokens"]
    vocab_size = len(client.tokenizer)
    if not all(t < vocab_size for t in tokens):
        raise bad_request(f"tokens must be a list of token ids in [0, {vocab_size})", "tokens")
    return {"prompt": client.tokenizer.decode(tokens)}


async def tokenize(request: web.Request) -> web.Response:
    return web.json_response(await off_loop(tokenize_body, request, await read_body(request)))


async def detokenize(request: web.Request) -> web.Response:
    return web.json_response(await off_loop(detokenize_body, request,
                                            await read_body(request)))
