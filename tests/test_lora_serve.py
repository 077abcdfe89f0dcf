"""LoRA through ``bastion serve`` (one server for the module): adapters named as ``model`` give
transformers + PEFT's greedy tokens on the embedded SmolLM2; ``--lora-modules`` at start-up;
load -> use -> unload -> load again through the admin routes, errors in OpenAI's shape."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
from serve_fixture import SMALL_SERVER_ARGS, ServerProcess

from tests.lora_fixtures import ALL_MODULES, add_random_adapter, greedy

ADMIN_KEY = "lora-admin-key"
PROMPT = [1, 504, 3458, 282, 4649, 314]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[ServerProcess, dict]:
    """Two random adapters for the embedded model's Hugging Face form (the folder its GGUF
    converts to), a server with one of them in ``--lora-modules``, and PEFT's greedy tokens for
    each adapter and the base model (computed while the server starts)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from bastion.core.loader.embedded import embedded_gguf_path
    from bastion.core.loader.gguf_loader import ensure_converted

    folder = ensure_converted(embedded_gguf_path())
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    root = str(tmp_path_factory.mktemp("lora-serve"))
    peft, static = add_random_adapter(hf, "static", root, 16, 32, ALL_MODULES, seed=3)
    peft, dynamic = add_random_adapter(
        peft, "dyn", root, 8, 16, ["q_proj", "v_proj"], seed=4, std=0.1
    )
    args = (
        *SMALL_SERVER_ARGS,
        "--admin-key",
        ADMIN_KEY,
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--lora-modules",
        json.dumps({"name": "static", "path": static}),
    )
    srv = ServerProcess(args, workdir=str(tmp_path_factory.mktemp("lora-server")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a busy 2-core host: each forward ~4x slower
    try:
        expected = {}
        for name in ("static", "dyn"):
            peft.set_adapter(name)
            expected[name] = greedy(peft, PROMPT, MAX_TOKENS)
        with peft.disable_adapter():
            expected["base"] = greedy(peft, PROMPT, MAX_TOKENS)
        assert len({tuple(t) for t in expected.values()}) == 3
        tokenizer = AutoTokenizer.from_pretrained(folder)
        srv.wait_healthy(timeout_s=180)
    except BaseException:
        srv.kill_tree()
        raise
    finally:
        torch.set_num_threads(threads)
    yield (
        srv,
        {
            "paths": {"static": static, "dyn": dynamic},
            "text": {k: tokenizer.decode(v) for k, v in expected.items()},
        },
    )
    srv.kill_tree()


@pytest.fixture
def server(setup) -> ServerProcess:
    return setup[0]


@pytest.fixture
def adapters(setup) -> dict:
    return setup[1]


def post(server: ServerProcess, path: str, body: dict, key: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(server.base_url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def complete(server: ServerProcess, model: str) -> tuple[int, dict]:
    status, body = post(
        server,
        "/v1/completions",
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    return status, json.loads(body)


def error_of(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_models_list_the_adapters_with_the_base_as_parent(server, adapters) -> None:
    status, body = server.get("/v1/models")
    assert status == 200
    models = {m["id"]: m for m in json.loads(body)["data"]}
    assert models["static"]["parent"] == "SmolLM2-135M-Instruct"
    assert models["static"]["root"] == adapters["paths"]["static"]
    assert "parent" not in models["SmolLM2-135M-Instruct"]
    _, metrics = server.get("/metrics")
    assert ('bastion:lora_requests_info{max_lora="2",running_lora_adapters="",'
            'waiting_lora_adapters=""}') in metrics.decode()


def test_adapter_as_model_matches_peft(server, adapters) -> None:
    status, body = complete(server, "static")
    assert status == 200, body
    assert body["model"] == "static"
    assert body["choices"][0]["text"] == adapters["text"]["static"]
    status, body = complete(server, "SmolLM2-135M-Instruct")
    assert body["choices"][0]["text"] == adapters["text"]["base"]


def test_load_use_unload_load_again(server, adapters) -> None:
    path = adapters["paths"]["dyn"]
    load = {"lora_name": "dyn", "lora_path": path}
    status, body = post(server, "/v1/load_lora_adapter", load)  # no admin key
    assert status == 401 and error_of(body)["code"] == "invalid_api_key"

    status, body = post(server, "/v1/load_lora_adapter", load, ADMIN_KEY)
    assert (status, body) == (200, b"Success: LoRA adapter 'dyn' added successfully.")
    status, out = complete(server, "dyn")
    assert status == 200 and out["choices"][0]["text"] == adapters["text"]["dyn"]

    status, body = post(server, "/v1/load_lora_adapter", load, ADMIN_KEY)
    assert status == 400 and error_of(body)["code"] == "lora_already_loaded"

    status, body = post(server, "/v1/unload_lora_adapter", {"lora_name": "dyn"}, ADMIN_KEY)
    assert (status, body) == (200, b"Success: LoRA adapter 'dyn' removed successfully.")
    status, out = complete(server, "dyn")
    assert status == 404 and out["error"]["code"] == "model_not_found"
    status, body = post(server, "/v1/unload_lora_adapter", {"lora_name": "dyn"}, ADMIN_KEY)
    assert status == 404 and error_of(body)["code"] == "lora_not_found"

    status, body = post(server, "/v1/load_lora_adapter", load, ADMIN_KEY)
    assert status == 200
    status, out = complete(server, "dyn")
    assert out["choices"][0]["text"] == adapters["text"]["dyn"]
    status, out = complete(server, "static")  # the other adapter is untouched
    assert out["choices"][0]["text"] == adapters["text"]["static"]


def test_bad_loads_are_400s_naming_the_problem(server, adapters, tmp_path) -> None:
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "x"}, ADMIN_KEY)
    assert status == 400
    assert error_of(body) == {
        # The typed body (api/schemas.py LoadLoRAAdapter) names the missing field.
        "message": "Invalid request body: Object missing required field `lora_path`",
        "type": "BadRequestError",
        "param": "lora_path",
        "code": None,
    }
    status, body = post(
        server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}, ADMIN_KEY
    )
    assert status == 400
    error = error_of(body)
    assert error["param"] == "lora_path"
    assert error["message"] == (
        f"Cannot load lora adapter 'x': no LoRA adapter at {tmp_path}: "
        "adapter_config.json is missing"
    )
    status, body = post(
        server,
        "/v1/load_lora_adapter",
        {"lora_name": "SmolLM2-135M-Instruct", "lora_path": adapters["paths"]["dyn"]},
        ADMIN_KEY,
    )
    assert status == 400 and error_of(body)["code"] == "lora_already_loaded"
