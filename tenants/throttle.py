"""Throttling of credential guessing (OWASP Authentication Cheat Sheet): slow online
guessing down without letting anyone lock a real user out for good.

What counts as a failure: a credential that had to be guessed and was wrong. For a
password sign-in that is every refusal (unknown user, wrong password, deactivated user
or member, disabled tenant: one answer for all, see services.member_sign_in); for an
API key on any surface, an unknown prefix, a wrong secret or a malformed key. Revoked
and expired keys and bad JWTs are not guesses (nobody guesses 256 bits or a signature
online) and are not counted, so a client with a stale credential keeps its precise 401.

Counters: Redis hashes timed by Redis's clock (TIME), so every process agrees; names
carry an HMAC digest under SECRET_KEY, so Redis holds no username or address.

    sluice:auth:fail:{a:<user>}:s:<src>   failures of one source on one username
    sluice:auth:fail:{a:<user>}           distinct sources that failed on the username
    sluice:auth:known:{a:<user>}:s:<src>  the source signed in as the username before
    sluice:auth:fail:{s:<src>}            failures of one source, any username or key

A source is an IPv4 address or an IPv6 /64. Hash fields: `n`, `until` (ms: the end of
the current lock), `told` (the lock whose first refusal was audited). A counter expires
SLUICE_AUTH_FAILURE_WINDOW_S after its last failure; a known mark after
SLUICE_AUTH_KNOWN_SOURCE_S. API keys are counted per source only: a per-prefix lock
would protect no secret and would let anyone who has seen a prefix (listings, the audit
log) cut a production key off.

Backoff: a counter past its threshold (SLUICE_AUTH_ACCOUNT_FAILURES for a source on a
username, SLUICE_AUTH_ACCOUNT_SOURCES distinct sources for a username,
SLUICE_AUTH_SOURCE_FAILURES for a source) locks for SLUICE_AUTH_BACKOFF_S x 2^(n -
threshold), at most SLUICE_AUTH_BACKOFF_MAX_S, at each failure. A password is refused
before it is checked (429 with Retry-After) while its source is locked, or its source is
locked on that username, or the username is locked and the source is not known to it.
A refusal is not a failure: it neither counts nor extends a lock, so every lock ends
within the cap whatever an attacker sends. One source alone can lock only itself: the
real user from another address signs in meanwhile; many sources (a botnet) lock the
username for addresses it has not signed in from, for a bounded window each time, while
its known addresses still pass. A correct password clears the source's failures on the
username and the username's counter (unless a lock runs: a known source signing in
mid-attack must not reopen it); never a source's own counter (an attacker could
interleave sign-ins of their own).

Hot path: an API key is checked first, and only a failure touches Redis (one round
trip); a cached principal costs nothing. A source that failures locked is also held in
process until its lock ends, so its further keys are refused before the database or
Redis (a principal cached for it still passes).

Redis failing: the throttle fails open (logged), so sign-in keeps working through a
Redis outage with the password hasher's cost as the only brake.

Audit (sluice.auditlog; never a password or a key's secret): `auth.failed` for each
counted failure (status 401, or 429 when a lock now binds its source) and
`auth.throttled` for the first attempt refused under each lock; target
`user:<username>` or `apikey:<prefix>` (redacted as every target); detail: the method
and the source as a pseudonym (`source_tag(address)` finds an address's events).

The source is the TCP peer. X-Forwarded-For is read only when the peer is a trusted
proxy (SLUICE_TRUSTED_PROXIES, CIDRs): the right-most address that is not itself one.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from redis.exceptions import RedisError

from sluice.auditlog import admin_action
from sluice.errors import RateLimited
from sluice.redis import ScriptBatch, sync_redis

logger = logging.getLogger("sluice.auth")

PASSWORD = "password"  # noqa: S105 - a method's name
API_KEY = "api_key"
FAIL_PREFIX = "sluice:auth:fail:"
KNOWN_PREFIX = "sluice:auth:known:"
_HELD_MAX = 10_000

# Shared by the scripts: Redis's clock in ms, and a counter's failure with its backoff.
# The exponent is capped so that the float never overflows; the cap on the lock does the
# real limiting. ARGV of every failing script: threshold(s) first, then backoff ms, max
# backoff ms, window ms as its last three.
_LUA_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function bump(key, threshold, base, cap, window)
  local n = redis.call('HINCRBY', key, 'n', 1)
  local lock = 0
  if n >= threshold then
    lock = math.floor(math.min(cap, base * 2 ^ math.min(n - threshold, 40)))
    redis.call('HSET', key, 'until', now + lock)
  end
  redis.call('PEXPIRE', key, math.max(window, lock))
  return n, lock
end
local function left(key)
  local u = tonumber(redis.call('HGET', key, 'until'))
  if u and u > now then return u - now end
  return 0
end
-- {ms left, 1 if this is the first refusal under the key's lock (the one audited)}
local function refusal(key, ms)
  local h = redis.call('HMGET', key, 'until', 'told')
  if h[2] == h[1] then return {ms, 0} end
  redis.call('HSET', key, 'told', h[1])
  return {ms, 1}
end
"""

# KEYS: account, pair (this source on this account), known. ARGV: the pair's threshold,
# the account's (in distinct sources), backoff ms, max ms, window ms. The account counts
# a source once, at its first failure: one source alone never locks the account.
# Returns {the pair's lock ms, the account's lock ms where it binds this source}.
ACCOUNT_FAIL_LUA = _LUA_PRELUDE + """
local base, cap, window = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local n, lock = bump(KEYS[2], tonumber(ARGV[1]), base, cap, window)
local account = left(KEYS[1])
if n == 1 then
  local _, started = bump(KEYS[1], tonumber(ARGV[2]), base, cap, window)
  account = math.max(account, started)
end
if redis.call('EXISTS', KEYS[3]) == 1 then account = 0 end
return {lock, account}
"""

# KEYS: account, pair, known. The lock that binds this source: its own on the account,
# or the account's unless this source signed in to it before. Returns refusal(...).
ACCOUNT_CHECK_LUA = _LUA_PRELUDE + """
local pair, account = left(KEYS[2]), 0
if redis.call('EXISTS', KEYS[3]) == 0 then account = left(KEYS[1]) end
if pair <= 0 and account <= 0 then return {0, 0} end
if pair >= account then return refusal(KEYS[2], pair) end
return refusal(KEYS[1], account)
"""

# KEYS: account, pair, known. ARGV: how long a source stays known, ms. A lock running on
# the account is left alone: a known source signing in mid-attack must not reopen it.
SUCCESS_LUA = _LUA_PRELUDE + """
redis.call('DEL', KEYS[2])
redis.call('SET', KEYS[3], '1', 'PX', ARGV[1])
if left(KEYS[1]) <= 0 then redis.call('DEL', KEYS[1]) end
return 1
"""

# KEYS: a source. ARGV: threshold, backoff ms, max ms, window ms. Returns {n, lock ms}.
SOURCE_FAIL_LUA = _LUA_PRELUDE + """
local n, lock = bump(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
                     tonumber(ARGV[4]))
return {n, lock}
"""

# KEYS: a source. Returns refusal(...) while it is locked, else {0, 0}.
SOURCE_CHECK_LUA = _LUA_PRELUDE + """
local ms = left(KEYS[1])
if ms <= 0 then return {0, 0} end
return refusal(KEYS[1], ms)
"""


@dataclass(frozen=True, slots=True)
class Attempt:
    """One presented credential: what is counted and audited (never its secret)."""

    method: str  # PASSWORD | API_KEY
    account: str  # the username; a key's public prefix ("" when it has none)
    source: str | None  # client_source(...); None: not counted per source
    tenant_id: int | None = None  # the tenant a key's prefix named (its audit chain)
    tenant_slug: str | None = None


@dataclass(frozen=True, slots=True)
class _Anonymous:
    """The audit actor of an attempt that proved no identity."""

    tenant_id: int | None
    tenant_slug: str | None
    key_prefix: str
    subject: str = "anonymous"
    role: str = ""


# -- where a call comes from ---------------------------------------------------------
def client_source(peer: str | None, forwarded_for: str | None = None) -> str | None:
    """The client's address as this server sees it: the peer, unless the peer is a
    trusted proxy, then the right-most X-Forwarded-For hop that is not one. Cheap when
    no proxy is trusted (the peer as given; it is parsed only if a failure is counted)."""
    if not peer or not forwarded_for or not settings.SLUICE_TRUSTED_PROXIES:
        return peer or None
    address = _address(peer)
    if address is None or not _trusted(address):
        return peer
    for hop in reversed(forwarded_for.split(",")):
        parsed = _address(hop)
        if parsed is None:
            break  # a hop no proxy wrote: the last trusted one is all we know
        address = parsed
        if not _trusted(parsed):
            break
    return str(address)


def http_source(meta: Mapping[str, Any]) -> str | None:
    """client_source of a Django request (`request.META`)."""
    return client_source(meta.get("REMOTE_ADDR"), meta.get("HTTP_X_FORWARDED_FOR"))


def asgi_source(scope: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """client_source of an ASGI connection (`headers` lower-cased, decoded)."""
    client = scope.get("client")
    return client_source(client[0] if client else None, headers.get("x-forwarded-for"))


def grpc_source(peer: str | None, forwarded_for: str | None = None) -> str | None:
    """client_source of a gRPC peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5")."""
    kind, _, rest = (peer or "").partition(":")
    host = rest.rsplit(":", 1)[0].strip("[]") if kind in ("ipv4", "ipv6") else ""
    return client_source(host or None, forwarded_for)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip()
    if text.startswith("["):  # "[v6]:port"
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:  # "v4:port"
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@functools.lru_cache(maxsize=4)
def _networks(cidrs: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network,
                                               ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def _trusted(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return any(address in net for net in _networks(tuple(settings.SLUICE_TRUSTED_PROXIES)))


def _bucket(source: str) -> str:
    """The unit a source is counted by: an IPv4 address, an IPv6 /64 (one subscriber's
    usual allocation: counting single v6 addresses would be no limit at all)."""
    address = _address(source)
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address) if address is not None else source[:100]


def _digest(kind: str, value: str) -> str:
    return hmac.new(settings.SECRET_KEY.encode(), f"{kind}:{value}".encode(),
                    hashlib.sha256).hexdigest()[:32]


def source_tag(source: str) -> str:
    """The pseudonym that audit events give a source address."""
    return _digest("s", _bucket(source))[:16]


def _account_keys(attempt: Attempt) -> list[str]:
    """The account's counter, this source's on it, and its known-source mark: one hash
    tag, so one script updates them together (and one Redis Cluster slot holds them)."""
    # Case-folded: "Alice" and "alice" share one budget of guesses.
    account = _digest("a", attempt.account.strip().casefold())
    source = _digest("s", _bucket(attempt.source)) if attempt.source else "-"
    return [f"{FAIL_PREFIX}{{a:{account}}}", f"{FAIL_PREFIX}{{a:{account}}}:s:{source}",
            f"{KNOWN_PREFIX}{{a:{account}}}:s:{source}"]


def _source_key(source: str) -> str:
    return f"{FAIL_PREFIX}{{s:{_digest('s', _bucket(source))}}}"


def _backoff_args() -> list[int]:
    return [settings.SLUICE_AUTH_BACKOFF_S * 1000, settings.SLUICE_AUTH_BACKOFF_MAX_S * 1000,
            settings.SLUICE_AUTH_FAILURE_WINDOW_S * 1000]


# -- the throttle --------------------------------------------------------------------
# Sources locked by failures, held in process: source -> monotonic end of the lock.
_held: dict[str, float] = {}


def refuse_if_held(source: str | None) -> None:
    """RateLimited if failures locked this source (known in process: no I/O)."""
    if source is None or not _held:
        return
    until = _held.get(source)
    if until is None:
        return
    left = until - time.monotonic()
    if left <= 0:
        _held.pop(source, None)
        return
    raise _too_many(left)


def check(attempt: Attempt) -> None:
    """Before a password is checked: RateLimited while a lock binds this attempt (its
    source's on the account; the account's, unless this source signed in to it before;
    the source's own), audited once per lock. A refusal counts as nothing."""
    try:
        batch = ScriptBatch(sync_redis())
        batch.script(ACCOUNT_CHECK_LUA, _account_keys(attempt), [])
        if attempt.source:
            batch.script(SOURCE_CHECK_LUA, [_source_key(attempt.source)], [])
        replies = batch.run()
    except RedisError:
        logger.exception("auth throttle: Redis unavailable; sign-in not throttled")
        return
    left_ms = max(int(r[0]) for r in replies)
    if left_ms <= 0:
        return
    if any(int(r[1]) for r in replies):
        _audit("auth.throttled", attempt, status=429, retry_after_s=left_ms / 1000)
    raise _too_many(left_ms / 1000)


def failed(attempt: Attempt) -> None:
    """Count a wrong credential and audit it; RateLimited (instead of the caller's own
    refusal) once a lock binds the attempt's source."""
    lock_ms = 0
    try:
        batch = ScriptBatch(sync_redis())
        if attempt.method == PASSWORD:
            batch.script(ACCOUNT_FAIL_LUA, _account_keys(attempt), [
                settings.SLUICE_AUTH_ACCOUNT_FAILURES, settings.SLUICE_AUTH_ACCOUNT_SOURCES,
                *_backoff_args()])
        if attempt.source:
            batch.script(SOURCE_FAIL_LUA, [_source_key(attempt.source)],
                         [settings.SLUICE_AUTH_SOURCE_FAILURES, *_backoff_args()])
        replies = batch.run() if batch.pipe.command_stack else []
    except RedisError:
        logger.exception("auth throttle: Redis unavailable; failure not counted")
        replies = []
    if attempt.method == PASSWORD and replies:
        lock_ms = max(int(replies[0][0]), int(replies[0][1]))
    if attempt.source and replies:
        source_lock_ms = int(replies[-1][1])
        if source_lock_ms > 0:
            _hold(attempt.source, source_lock_ms / 1000)
        lock_ms = max(lock_ms, source_lock_ms)
    _audit("auth.failed", attempt, status=429 if lock_ms else 401,
           retry_after_s=lock_ms / 1000)
    if lock_ms:
        raise _too_many(lock_ms / 1000)


def succeeded(attempt: Attempt) -> None:
    """A correct password: this source's failures on the account are forgotten, the
    source is known to the account (it passes the account's lock from now on), and the
    account's counter starts again unless a lock is running. A source's own counter is
    never cleared (an attacker could interleave sign-ins of their own)."""
    if attempt.method != PASSWORD:
        return
    try:
        batch = ScriptBatch(sync_redis())
        batch.script(SUCCESS_LUA, _account_keys(attempt),
                     [settings.SLUICE_AUTH_KNOWN_SOURCE_S * 1000])
        batch.run()
    except RedisError:
        logger.exception("auth throttle: Redis unavailable; account counter not cleared")


def clear() -> None:
    """Forget the sources held in this process (tests; Redis keeps its counters)."""
    _held.clear()


def _hold(source: str, seconds: float) -> None:
    if len(_held) >= _HELD_MAX:
        now = time.monotonic()
        for stale in [s for s, until in _held.items() if until <= now]:
            _held.pop(stale, None)
        if len(_held) >= _HELD_MAX:
            _held.clear()  # bounded; Redis still has every lock
    _held[source] = time.monotonic() + seconds


def _too_many(retry_after_s: float) -> RateLimited:
    seconds = max(1, math.ceil(retry_after_s))
    return RateLimited(f"Too many failed sign-in attempts. Try again in {seconds} s.",
                       code="too_many_failed_attempts", retry_after_s=seconds)


def _audit(action: str, attempt: Attempt, *, status: int, retry_after_s: float) -> None:
    label = "user" if attempt.method == PASSWORD else "apikey"
    detail: dict[str, Any] = {"method": attempt.method}
    if attempt.source:
        detail["source"] = source_tag(attempt.source)
    if retry_after_s > 0:
        detail["locked_s"] = max(1, math.ceil(retry_after_s))
    actor = _Anonymous(tenant_id=attempt.tenant_id, tenant_slug=attempt.tenant_slug,
                       key_prefix=attempt.account if attempt.method == API_KEY else "")
    admin_action(actor=actor, action=action, target=f"{label}:{attempt.account}"[:200],
                 status=status, detail=detail)
