"""LoRA adapters served as models, as vLLM serves them: `--lora-modules name=path` at start, and, when the
VLLM_ALLOW_RUNTIME_LORA_UPDATING variable is set, POST /v1/load_lora_adapter and /v1/unload_lora_adapter while
running. A request names an adapter in its `model`; /v1/models lists each with the base model as its parent.

Each adapter is checked against the model when it is added (fovea/models/lora.py), so a bad one is a 400 then,
never a failed request later. An unloaded name loaded again gets a new id: nothing cached for the old one is used, and the engine frees the old
one's weights once the requests that use it are done.
"""

from __future__ import annotations

import itertools
import os

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from fovea.config.flags import LoRAModule
from fovea.core.request import LoRARequest
from fovea.server.errors import APIError

RUNTIME_UPDATES = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class ServedAdapters:
    """The adapters a server answers for, by name."""

    def __init__(self, check, base_names: list[str]):
        self.check, self.base_names = check, base_names  # check: InputProcessor.check_lora
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, module: LoRAModule) -> LoRARequest:
        if module.name in self.by_name or module.name in self.base_names:
            raise APIError(400, f"The lora adapter '{module.name}' has already been loaded.", param="lora_name")
        lora = LoRARequest(module.name, next(self._ids), module.path, module.base_model_name or self.base_names[0])
        lora, _ = self.check(lora)  # a LoRAError (a ValueError, 400) names what is wrong
        self.by_name[module.name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest:
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError", "lora_name")
        return lora


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str | None = None
    lora_path: str | None = None


async def load_lora_adapter(request: Request):
    served = request.app.state.served
    body = await served.read_body(request, LoadLoRAAdapterRequest)
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
    await served.engine.run_in_pool(served.loras.add, LoRAModule(body.lora_name, body.lora_path))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request):
    served = request.app.state.served
    body = await served.read_body(request, LoadLoRAAdapterRequest)
    if not body.lora_name:
        raise APIError(400, "'lora_name' must be provided.", param="lora_name")
    served.engine.remove_lora(served.loras.remove(body.lora_name).lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def routes() -> list:
    """The runtime routes, only where the variable allows them (vLLM's rule: they change what a server serves)."""
    if os.environ.get(RUNTIME_UPDATES, "").lower() not in ("1", "true"):
        return []
    return [
        ("/v1/load_lora_adapter", "POST", load_lora_adapter),
        ("/v1/unload_lora_adapter", "POST", unload_lora_adapter),
    ]
