"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes) against the fake engine client
and the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import pytest
from test_api import MAX_MODEL_LEN, serve  # noqa: F401 (fixture)

from bastion.api.server import ApiConfig

TEXT = "The capital of France is Paris. 🌍"
MESSAGES = [{"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Name a colour."}]


async def test_text_round_trip(serve, tokenizer):  # noqa: F811
    http, engine = await serve()
    body = await (await http.post("/tokenize", json={"model": "smollm2", "prompt": TEXT,
                                                     "return_token_strs": True})).json()
    ids = tokenizer.encode(TEXT)
    assert body == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                    "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    back = await (await http.post("/detokenize", json={"tokens": body["tokens"]})).json()
    assert back == {"prompt": TEXT}
    # The ids a completion of the same prompt sends to the engine.
    assert (await http.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1})
            ).status == 200
    assert engine.requests[0][1] == ids


async def test_chat_messages_give_the_chat_routes_ids(serve, tokenizer):  # noqa: F811
    http, engine = await serve()
    body = await (await http.post("/tokenize", json={"messages": MESSAGES})).json()
    assert body["token_strs"] is None and body["count"] == len(body["tokens"])
    resp = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
    assert resp.status == 200
    assert body["tokens"] == engine.requests[0][1]
    without = await (await http.post("/tokenize", json={
        "messages": MESSAGES, "add_generation_prompt": False})).json()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert without["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert without["tokens"] != body["tokens"]
    detok = await (await http.post("/detokenize", json={"tokens": without["tokens"]})).json()
    assert detok == {"prompt": text}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "messages"),
    ("/tokenize", {"prompt": ["x"]}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [49152]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": [True]}, "tokens[0]"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
async def test_bad_bodies_get_400(serve, path, body, param):  # noqa: F811
    http, _ = await serve()
    resp = await http.post(path, json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert (error["type"], error["param"]) == ("BadRequestError", param)


async def test_unknown_model_and_api_key(serve):  # noqa: F811
    http, _ = await serve(ApiConfig(api_key="k"))
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert (await http.post(path, json=body)).status == 401
        resp = await http.post(path, json={**body, "model": "gpt-4"},
                               headers={"Authorization": "Bearer k"})
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"
        resp = await http.post(path, json=body, headers={"Authorization": "Bearer k"})
        assert resp.status == 200
