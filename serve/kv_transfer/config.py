"""EngineArgs.kv_transfer_config (vLLM's --kv-transfer-config JSON) and the kv_role each `--role` means.

`jaxinfra serve --role prefill` is kv_role "kv_producer" and `--role decode` "kv_consumer", both
over the shared-memory connector; the connector serves either direction per request (by its
kv_transfer_params), so the role names the engine's job for metrics and logs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from serve.kv_transfer.base import KVConnectorBase

CONNECTORS = ("SharedMemoryConnector",)
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str = "SharedMemoryConnector"
    kv_role: str = "kv_both"
    offer_timeout_s: float = 30.0
    """Seconds a prefill engine keeps offered blocks that no decode engine pulls."""

    @classmethod
    def from_dict(cls, config: Any) -> KVTransferConfig:
        """From the JSON; a bad one is a ValueError naming its field."""
        field = "kv_transfer_config"
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(config, dict) or set(config) - names:
            raise ValueError(f"{field} takes only {', '.join(sorted(names))}, got {config!r}")
        out = cls(**config)
        if out.kv_connector not in CONNECTORS:
            raise ValueError(f"{field}.kv_connector must be one of {', '.join(CONNECTORS)}, got {out.kv_connector!r}")
        if out.kv_role not in KV_ROLES.values():
            raise ValueError(f"{field}.kv_role must be one of {', '.join(KV_ROLES.values())}, got {out.kv_role!r}")
        timeout = out.offer_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"{field}.offer_timeout_s must be a number > 0, got {timeout!r}")
        return out

    def connector(self, block_size: int) -> KVConnectorBase:
        """The connector this config names."""
        from serve.kv_transfer.shm_connector import SharedMemoryConnector

        return SharedMemoryConnector(block_size, self.offer_timeout_s, self.kv_role)
