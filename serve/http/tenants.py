"""Tenants: who a key belongs to, its quotas, priority and prefix-cache group (`--api-keys-file`),
and the per-tenant accounting that turns quotas into 429s with a Retry-After.

The keys file (YAML):

    tenants:
      search: {requests_per_minute: 600, tokens_per_minute: 200000, max_concurrent: 32, priority: 0}
      docs:   {tokens_per_minute: 50000, prefix_cache_group: shared}   # tenants naming one group share
      wiki:   {prefix_cache_group: shared}                             # cached prefixes; others never do
      ops:    {operator: true}                                         # /status shows it every tenant
    keys:
      sk-search-1: search
      sha256:<hex digest of the key>: docs      # a key may be given by its SHA-256 instead

Every limit is optional (absent = unlimited). Concurrency counts sequences (prompts x n, or x beams),
as the engine does. Tokens are prompt + generated tokens: a call reserves its prompt and `max_tokens`
for each sequence when it is admitted (as OpenAI's limits count max_tokens), and what it did not
generate is handed back when it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from serve.core.scheduling_policy import check_weight

WINDOW_S = 60.0
HOLD_S = 1.0  # a refusal that follows another of the same tenant within this long is answered this late
MAX_HELD = 64  # refusals held at once per tenant; past it they are answered at once


@dataclasses.dataclass(frozen=True)
class Tenant:
    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    priority: int = 0  # added to each request's priority (lower runs first) with --scheduling-policy priority
    prefix_cache_group: str | None = None  # default: the tenant's own name ("" = the server's shared cache)
    operator: bool = False  # sees every tenant's rows in /status (the --api-key is one); others see their own
    weight: float = 1.0  # its share of the engine against other tenants with --scheduling-policy fair

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"tenant {self.name!r}: {name} must be a positive int, got {value!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"tenant {self.name!r}: priority must be an int, got {self.priority!r}")
        if not isinstance(self.operator, bool):
            raise ValueError(f"tenant {self.name!r}: operator must be true or false, got {self.operator!r}")
        if self.prefix_cache_group is not None and not isinstance(self.prefix_cache_group, str):
            raise ValueError(f"tenant {self.name!r}: prefix_cache_group must be a string")
        try:
            check_weight(self.weight)
        except ValueError as e:
            raise ValueError(f"tenant {self.name!r}: {e}") from None

    def cache_salt(self, request_salt: str | None) -> str | None:
        """The salt the engine hashes into the request's prefix-cache keys: the tenant's group and the
        request's own salt, encoded as a JSON pair so that no request salt of one group can spell
        another group's (a raw prefix such as "tenant:beta\\0" once joined tenant beta's cache). The
        shared group ("") without a salt of its own uses the server's default cache."""
        group = self.name if self.prefix_cache_group is None else self.prefix_cache_group
        if not group and request_salt is None:
            return None
        return json.dumps([group, request_salt])


def load_keys_file(path: str | Path) -> dict[bytes, Tenant]:
    """Key digests (SHA-256) -> tenants, from the YAML above; a ValueError naming the problem
    (never the key) for anything malformed."""
    where = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--api-keys-file {where}: cannot read it: {e}") from e
    if not isinstance(data, dict) or set(data) != {"tenants", "keys"}:
        raise ValueError(f"--api-keys-file {where}: expected a mapping with exactly 'tenants' and 'keys'")
    tenants_raw, keys_raw = data["tenants"], data["keys"]
    if not isinstance(tenants_raw, dict) or not tenants_raw:
        raise ValueError(f"--api-keys-file {where}: 'tenants' must be a non-empty mapping of name -> limits")
    if not isinstance(keys_raw, dict) or not keys_raw:
        raise ValueError(f"--api-keys-file {where}: 'keys' must be a non-empty mapping of key -> tenant name")
    known = {f.name for f in dataclasses.fields(Tenant)} - {"name"}
    tenants: dict[str, Tenant] = {}
    for name, limits in tenants_raw.items():
        limits = limits or {}
        if not isinstance(limits, dict):
            raise ValueError(f"--api-keys-file {where}: tenant {name!r} must map to a mapping of limits")
        unknown = sorted(set(limits) - known)
        if unknown:
            raise ValueError(f"--api-keys-file {where}: tenant {name!r} has unknown field(s) {unknown}")
        try:
            tenants[str(name)] = Tenant(name=str(name), **limits)
        except ValueError as e:
            raise ValueError(f"--api-keys-file {where}: {e}") from e
    out: dict[bytes, Tenant] = {}
    for n, (key, name) in enumerate(keys_raw.items()):
        if name not in tenants:
            raise ValueError(f"--api-keys-file {where}: key #{n + 1} names unknown tenant {name!r}")
        digest = _digest(str(key), where, n)
        if digest in out:
            raise ValueError(f"--api-keys-file {where}: key #{n + 1} is listed twice")
        out[digest] = tenants[name]
    return out


def _digest(key: str, where: str, n: int) -> bytes:
    if key.startswith("sha256:"):
        try:
            digest = bytes.fromhex(key.removeprefix("sha256:"))
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"--api-keys-file {where}: key #{n + 1} is not a valid sha256:<64 hex digits>")
        return digest
    if len(key) < 8:
        raise ValueError(f"--api-keys-file {where}: key #{n + 1} is shorter than 8 characters")
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclasses.dataclass
class _Usage:
    requests: deque[float] = dataclasses.field(default_factory=deque)  # admission times
    tokens: deque[list[float]] = dataclasses.field(default_factory=deque)  # [admission time, tokens]
    token_sum: int = 0
    in_flight: int = 0  # sequences
    admitted: int = 0
    refused: int = 0
    refused_at: tuple[float, float] = (-math.inf, -math.inf)  # the last two refusals' times
    held: int = 0  # refusals being held (hold_refusal)

    def expire(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= int(self.tokens.popleft()[1])


@dataclasses.dataclass
class Admission:
    """One admitted call: its sequences in flight, and its entry in the token window (the prompt and
    the reserved completions until it ends, then what it used)."""

    sequences: int
    prompt_tokens: int
    entry: list[float]


class NeverFits(ValueError):
    """A call that no wait lets through its tenant's limits; `param` names the request field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class QuotaExceeded(Exception):
    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


class TenantQuotas:
    """Sliding one-minute windows of requests and tokens and the sequences in flight, per tenant."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.clock = clock
        self.sleep = sleep
        self.usage: dict[str, _Usage] = {}

    def admit(self, tenant: Tenant, prompt_tokens: int, sequences: int = 1, max_new_tokens: int = 0) -> Admission:
        """Count a call of `sequences` sequences in, reserving its prompt tokens and `max_new_tokens`
        for each sequence; QuotaExceeded with the seconds after which the same call would fit, or
        NeverFits for a call that never can."""
        need = prompt_tokens + sequences * max_new_tokens
        if tenant.max_concurrent is not None and sequences > tenant.max_concurrent:
            raise NeverFits(
                f"this request needs {sequences} sequences; tenant {tenant.name!r} may run {tenant.max_concurrent} "
                "at once, so it can never run",
                "n",
            )
        tpm = tenant.tokens_per_minute
        if tpm is not None and need > tpm:
            raise NeverFits(
                f"this request reserves {need} tokens ({prompt_tokens} in its prompts, max_tokens {max_new_tokens} "
                f"for each of {sequences} sequences); tenant {tenant.name!r} has {tpm} a minute: lower max_tokens",
                "max_tokens",
            )
        now = self.clock()
        u = self.usage.setdefault(tenant.name, _Usage())
        u.expire(now)
        self._check(tenant, u, now, sequences, need)
        u.requests.append(now)
        u.in_flight += sequences
        u.admitted += 1
        entry = [now, need]
        u.tokens.append(entry)
        u.token_sum += need
        return Admission(sequences, prompt_tokens, entry)

    def refusal(self, tenant: Tenant) -> QuotaExceeded | None:
        """Why no call of this tenant fits now (any call needs a request, a sequence and a token), counted
        as a refusal; None if one may. The server asks before reading a body, so a flood of refused calls
        costs it little."""
        now = self.clock()
        u = self.usage.setdefault(tenant.name, _Usage())
        u.expire(now)
        try:
            self._check(tenant, u, now, 1, 1)
        except QuotaExceeded as e:
            return e
        return None

    async def hold_refusal(self, tenant: Tenant) -> None:
        """Before a refusal is answered: a tenant refused again within HOLD_S waits HOLD_S for it (up to
        MAX_HELD at once), as nginx's limit_req delays excess requests. A client flooding from a few
        connections is slowed to a few calls a second, and its refusals stop taking the event loop and
        the CPU that other tenants' streams need; a first refusal is answered at once."""
        u = self.usage[tenant.name]
        previous, last = u.refused_at
        if last - previous >= HOLD_S or u.held >= MAX_HELD:
            return
        u.held += 1
        try:
            await self.sleep(HOLD_S)
        finally:
            u.held -= 1

    def _check(self, tenant: Tenant, u: _Usage, now: float, sequences: int, need: int) -> None:
        """QuotaExceeded (counted) if a call of `sequences` sequences reserving `need` tokens does not fit now."""
        try:
            if tenant.max_concurrent is not None and u.in_flight + sequences > tenant.max_concurrent:
                raise QuotaExceeded(
                    f"tenant {tenant.name!r} has {u.in_flight} sequences in flight and this request needs "
                    f"{sequences} more (its limit is {tenant.max_concurrent})",
                    1,
                )
            rpm = tenant.requests_per_minute
            if rpm is not None and len(u.requests) >= rpm:
                raise QuotaExceeded(
                    f"tenant {tenant.name!r} is over its {rpm} requests per minute", u.requests[0] + WINDOW_S - now
                )
            tpm = tenant.tokens_per_minute
            if tpm is not None and u.token_sum + need > tpm:
                raise QuotaExceeded(
                    f"tenant {tenant.name!r} is over its {tpm} tokens per minute (this request reserves {need})",
                    self._tokens_free_at(u, tpm - need) - now,
                )
        except QuotaExceeded:
            u.refused += 1
            u.refused_at = (u.refused_at[1], now)
            raise

    def _tokens_free_at(self, u: _Usage, allowed: int) -> float:
        """When the window's tokens drop to `allowed` (a minute from now if they never will)."""
        total = u.token_sum
        for t, n in u.tokens:
            total -= int(n)
            if total <= allowed:
                return t + WINDOW_S
        return self.clock() + WINDOW_S

    def release(self, tenant: Tenant, admission: Admission, generated_tokens: int) -> None:
        """A call ended (finished, failed or abandoned): its sequences leave the in-flight count and its
        reservation, if still in the window, becomes what it used."""
        u = self.usage[tenant.name]
        u.in_flight -= admission.sequences
        entry = admission.entry
        if entry[0] > self.clock() - WINDOW_S:
            used = admission.prompt_tokens + generated_tokens
            u.token_sum += used - int(entry[1])
            entry[1] = used

    def snapshot(self, tenants: Iterable[Tenant] = ()) -> dict[str, dict[str, Any]]:
        """Per-tenant numbers for /status (every tenant in `tenants`, and any that sent requests):
        in flight, requests and tokens in the last minute, totals, and the tenant's limits."""
        now = self.clock()
        limits = {
            t.name: {k: v for k, v in dataclasses.asdict(t).items() if k not in ("name", "operator") and v is not None}
            for t in tenants
        }
        out = {}
        for name in sorted({*self.usage, *limits}):
            u = self.usage.get(name, _Usage())
            u.expire(now)
            out[name] = {
                "in_flight": u.in_flight,  # sequences
                "requests_last_minute": len(u.requests),
                "tokens_last_minute": u.token_sum,
                "admitted": u.admitted,
                "refused": u.refused,
                "limits": limits.get(name, {}),
            }
        return out
