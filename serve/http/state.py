"""What every endpoint of one server shares: the engine, metrics, the served name and the admission count."""

from __future__ import annotations

import time

from serve.engine.async_engine import AsyncEngine
from serve.http.auth import KeyRing
from serve.http.drain import Drain
from serve.http.lora_modules import LoraRegistry
from serve.http.metrics import ServerMetrics
from serve.http.openai_protocol import OpenAIError
from serve.http.tenants import TenantQuotas
from serve.http.tool_parsers import ToolConfig
from serve.types import LoRARequest


class ServerState:
    """Held as `app.state.server`; `in_flight` counts sequences (prompts x n) admitted and not yet done."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        keys: KeyRing | None,
        max_queue: int,
        request_timeout: float | None,
        metrics: ServerMetrics,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.keys = keys  # accepted API keys and their tenants (None: no key needed)
        self.quotas = TenantQuotas()
        self.drain = Drain()
        self.capacity = engine.args.max_num_seqs + max_queue  # sequences (prompts x n) in flight
        self.request_timeout = request_timeout
        self.in_flight = 0
        self.tools = ToolConfig()  # --tool-call-parser, --enable-auto-tool-choice
        self.created = int(time.time())
        self.loras = LoraRegistry(model_name)  # --lora-modules and /v1/load_lora_adapter's adapters

    def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: absent or the base model); a 404 naming it when no
        model of that name is served."""
        if model is None or model == self.model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise OpenAIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
        return lora

    def token_text(self, token: int) -> str:
        tok = self.engine.tokenizer
        return tok.decode([token], skip_special_tokens=False) if tok else str(token)
