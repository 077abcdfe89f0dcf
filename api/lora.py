"""LoRA adapters over HTTP (vLLM's routes): ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (admin key), the adapters as ``model`` names, and the
``--lora-modules`` loaded at start-up.

The registry of names lives here, in the API process; each engine checks an adapter when it is
loaded and its workers read it with the first request that names it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os

from aiohttp import web

from bastion.api.config import CLIENT_KEY, MODEL_NAMES_KEY
from bastion.api.errors import ApiError, bad_request
from bastion.api.protocol import read_body, read_request
from bastion.api.schemas import LoadLoRAAdapter, UnloadLoRAAdapter
from bastion.ipc.messages import LoRARequest

LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class LoRARegistry:
    """Adapters by served name; ids are never reused, so a reloaded adapter gets fresh
    prefix-cache hashes and device slots."""

    def __init__(self, is_enabled: bool) -> None:
        self.is_enabled = is_enabled
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self.lock = asyncio.Lock()  # one load or unload at a time

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def new_request(self, name: str, path: str) -> LoRARequest:
        return LoRARequest(name, next(self._ids), path)


LORA_KEY = web.AppKey("bastion_loras", LoRARegistry)


def parse_lora_modules(values: tuple[str, ...]) -> list[tuple[str, str]]:
    """``name=path`` or vLLM's JSON ``{"name": ..., "path": ...}`` -> (name, path) pairs."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON: {exc}") from None
            name, path = spec.get("name"), spec.get("path")
        else:
            name, _, path = value.partition("=")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            raise ValueError(
                f'--lora-modules takes name=path or {{"name": ..., "path": ...}}; got {value!r}'
            )
        modules.append((name, path))
    return modules


async def load_adapter(app: web.Application, name: str, path: str) -> LoRARequest:
    """Register ``name`` once every engine has checked the adapter (ApiError otherwise)."""
    registry = app[LORA_KEY]
    if not registry.is_enabled:
        raise ApiError(
            400,
            "LoRA is not enabled on this server; start it with --enable-lora",
            code="lora_not_enabled",
        )
    async with registry.lock:
        if name in registry.adapters or name in app[MODEL_NAMES_KEY]:
            raise ApiError(
                400,
                f"The lora adapter '{name}' has already been loaded (or names the base model)",
                "lora_name",
                "lora_already_loaded",
            )
        if not os.path.isdir(path):
            raise bad_request(f"lora_path {path!r} is not a folder on the server", "lora_path")
        request = registry.new_request(name, path)
        try:
            await app[CLIENT_KEY].call_utility("add_lora", name, request.lora_int_id, path)
        except ValueError as exc:
            raise bad_request(f"Cannot load lora adapter '{name}': {exc}", "lora_path") from None
        registry.adapters[name] = request
    return request


async def load_lora_adapter(request: web.Request) -> web.Response:
    body = read_request(await read_body(request), LoadLoRAAdapter)
    name, path = body["lora_name"], body["lora_path"]
    if not name or not path:
        raise bad_request(
            "Both 'lora_name' and 'lora_path' must be provided.",
            "lora_path" if name else "lora_name",
        )
    await load_adapter(request.app, name, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """New requests may no longer name the adapter; those already accepted finish with it."""
    body = read_request(await read_body(request), UnloadLoRAAdapter)
    name = body["lora_name"]
    if not name:
        raise bad_request("'lora_name' must be provided.", "lora_name")
    registry = request.app[LORA_KEY]
    async with registry.lock:
        adapter = registry.adapters.pop(name, None)
        if adapter is None:
            raise ApiError(
                404, f"The lora adapter '{name}' cannot be found.", "lora_name", "lora_not_found"
            )
        await request.app[CLIENT_KEY].call_utility("remove_lora", adapter.lora_int_id)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_lora_routes(app: web.Application, is_enabled: bool) -> None:
    app[LORA_KEY] = LoRARegistry(is_enabled)
    app.router.add_post(LORA_PATHS[0], load_lora_adapter)
    app.router.add_post(LORA_PATHS[1], unload_lora_adapter)


def model_entries(app: web.Application, created: int, root: str) -> list[dict]:
    """``/v1/models`` entries of the loaded adapters, the base model as their parent."""
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "bastion",
            "root": adapter.lora_path,
            "parent": root,
        }
        for name, adapter in app[LORA_KEY].adapters.items()
    ]
