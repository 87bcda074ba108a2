"""Who may use the server: API keys (each naming a tenant) and the admin key.

`AccessPolicy` holds the keys; `AccessControl` is the ASGI middleware that enforces them:

- /health is always open (load balancers probe it).
- /v1/* (and /tokenize, /detokenize) need `Authorization: Bearer <key>` when API keys are
  set (an admin key also works);
  otherwise 401 with OpenAI's error body. The request's tenant goes into the ASGI scope
  (`tenant_of(request)`; "default" when no key is set), and with keys the priorities its
  key may use (`check_priority`: 0..0 unless the keys file gives the key a range; the admin
  key any).
- Everything else (the live view at / and /dashboard, /debug/*, /metrics, /docs) is an admin
  route: off (404) with `admin_routes=False`; else it needs the admin key when one is set;
  else, when API keys are set, it is off (404: nobody but an admin should see other
  tenants' requests); else it is open. Admin routes also take HTTP Basic auth (any user name,
  the admin key as password) so a browser can open the live view and its event streams.
  A state-changing admin request (not GET / HEAD / OPTIONS, e.g. POST /reset_prefix_cache)
  is refused (403) when a browser may have sent it from another site: it needs a JSON
  content type (which a cross-site page cannot send without a CORS preflight, which this
  server never grants), no content type and no `Sec-Fetch-Site` (curl, scripts), or
  `Sec-Fetch-Site: same-origin` / `none`.

Keys come from `--api-key` (tenant "default"), the keys file and the admin key (a flag or
`--admin-key-file`); `access_policy_from` checks them together (see its docstring).

NOTE: keys are compared with `hmac.compare_digest` against every configured key (no early
exit), so the time taken does not depend on how much of a key a client guessed.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from slotserve.server.protocol import PRIORITY_BOUND, APIError
from slotserve.server.tenants import OVERFLOW_TENANT

DEFAULT_TENANT = "default"
ADMIN_TENANT = "admin"
# Tenant names the server gives itself: a keys file may not name one (their counters and
# fair shares would be shared with the built-in ones).
RESERVED_TENANTS = frozenset({DEFAULT_TENANT, ADMIN_TENANT, OVERFLOW_TENANT})
TENANT_SCOPE_KEY = "slotserve.tenant"
PRIORITY_SCOPE_KEY = "slotserve.priority_range"
# The priorities a key may use unless the keys file says otherwise: only the default one.
DEFAULT_PRIORITY_RANGE = (0, 0)
ANY_PRIORITY = (-PRIORITY_BOUND, PRIORITY_BOUND)
# The keys file's option `priority=LO..HI` (or `priority=N`).
_PRIORITY_OPTION = re.compile(r"priority=(-?\d+)(?:\.\.(-?\d+))?")
# Admin requests that change nothing (the others pass the cross-site check).
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
# Sec-Fetch-Site values of requests a browser sent from the server's own page, or typed in.
SAME_SITE_FETCHES = (b"same-origin", b"none")
OPEN_PATHS = ("/health",)
# Routes outside /v1 (where vLLM has them) that are guarded as /v1 is: API keys, tenants.
API_PATHS = ("/tokenize", "/detokenize")


@dataclass(frozen=True)
class Tenant:
    """A client identity: its name (logs, metrics, fair share), its weight (fair share) and
    the priorities its requests may ask for (inclusive; with API keys only)."""

    name: str = DEFAULT_TENANT
    weight: float = 1.0
    priority_range: tuple[int, int] = DEFAULT_PRIORITY_RANGE


@dataclass(frozen=True)
class AccessPolicy:
    """The configured keys. No API key: /v1 is open (every request is tenant "default")."""

    api_keys: tuple[tuple[str, Tenant], ...] = ()
    admin_key: str | None = None
    admin_routes: bool = True

    def __post_init__(self) -> None:
        for key, _ in self.api_keys:
            _check_key(key, "an API key")
        if self.admin_key is not None:
            _check_key(self.admin_key, "the admin key")
        keys = [key for key, _ in self.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("an API key is given twice")
        if self.admin_key is not None and self.admin_key in keys:
            raise ValueError("an API key equals the admin key: they must differ")

    @property
    def keys_required(self) -> bool:
        """/v1 needs a key."""
        return bool(self.api_keys)

    @property
    def admin_open(self) -> bool:
        """Admin routes answer without a key (no key of any kind is configured)."""
        return self.admin_routes and self.admin_key is None and not self.api_keys

    @property
    def admin_reachable(self) -> bool:
        """Admin routes exist at all (open, or behind the admin key)."""
        return self.admin_routes and (self.admin_key is not None or not self.api_keys)

    def tenant_for(self, key: str | None) -> Tenant | None:
        """The tenant a presented API key belongs to (the admin key: "admin"); None if the
        key is unknown. Constant time in the key's content (see the module NOTE)."""
        found = None
        if key is None:
            return None
        presented = key.encode()
        for known, tenant in self.api_keys:
            if hmac.compare_digest(presented, known.encode()) and found is None:
                found = tenant
        if self.is_admin(key) and found is None:
            found = Tenant(ADMIN_TENANT, priority_range=ANY_PRIORITY)
        return found

    def is_admin(self, key: str | None) -> bool:
        if key is None or self.admin_key is None:
            return False
        return hmac.compare_digest(key.encode(), self.admin_key.encode())

    def describe(self) -> str:
        """One line for the startup log."""
        tenants = sorted({t.name for _, t in self.api_keys})
        v1 = (f"/v1 needs an API key ({len(self.api_keys)} keys, tenants: "
              f"{', '.join(tenants)})" if self.api_keys else "/v1 is open (no --api-key)")
        if not self.admin_routes:
            admin = "admin routes are off (--disable-admin-routes)"
        elif self.admin_key is not None:
            admin = "admin routes (/, /debug, /metrics) need --admin-key"
        elif self.api_keys:
            admin = "admin routes are off (API keys are set but no --admin-key)"
        else:
            admin = "admin routes (/, /debug, /metrics) are open"
        return f"{v1}; {admin}"


def _check_key(key: str, what: str) -> None:
    if not key or any(c.isspace() for c in key) or not key.isprintable():
        raise ValueError(f"{what} must be non-empty printable text without spaces")
    if key.startswith("#"):
        raise ValueError(f"{what} must not start with '#' (a keys file reads a line that "
                         "starts with '#' as a comment)")


@dataclass(frozen=True)
class KeyEntry:
    """One API key and where it was given (`where`: "--api-key #2" or "FILE:LINE"), so
    errors can name the place without printing the key."""

    key: str
    tenant: Tenant
    where: str


def load_api_keys_file(path: str | Path) -> list[tuple[str, Tenant]]:
    """Keys from a file: one `KEY TENANT [WEIGHT] [priority=LO..HI]` per line (see
    read_api_keys_file). ValueError naming the file and line for a malformed one."""
    return [(entry.key, entry.tenant) for entry in read_api_keys_file(path)]


def read_api_keys_file(path: str | Path) -> list[KeyEntry]:
    """The keys file's entries: `KEY TENANT [WEIGHT] [priority=LO..HI]` per line.

    WEIGHT: a positive number (the tenant's fair share; default 1). priority=LO..HI (or
    priority=N): the `priority` values the key's requests may ask for (default 0..0). Blank
    lines and comments (lines whose first character other than blanks is '#') are skipped.
    ValueError naming the file and line (never the key) for: a malformed line, a key given
    twice, a reserved tenant name (default, admin, other), and a comment shaped like an
    entry whose key starts with '#' (`#sk-1 alice`: keys may not start with '#'; comment a
    line out with '# ').
    """
    entries: list[KeyEntry] = []
    seen: dict[str, str] = {}
    text = Path(path).read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        where = f"{path}:{number}"
        if not fields:
            continue
        if fields[0].startswith("#"):
            if _looks_like_entry(fields):
                raise ValueError(f"{where}: this line reads as a key starting with '#' (keys "
                                 "may not); to comment the line out, put a space after '#'")
            continue
        entry = _parse_entry(fields, where)
        if entry.key in seen:
            raise ValueError(f"{where}: this key is listed twice (also line "
                             f"{seen[entry.key].rpartition(':')[2]})")
        seen[entry.key] = where
        entries.append(entry)
    return entries


def _parse_entry(fields: list[str], where: str) -> KeyEntry:
    _check_field_count(fields, where)
    key, name = fields[0], fields[1]
    try:
        _check_key(key, "the key")
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if name in RESERVED_TENANTS:
        raise ValueError(f"{where}: the tenant name {name!r} is reserved (the server's "
                         f"own: {', '.join(sorted(RESERVED_TENANTS))}); choose another")
    weight, priorities = _options(fields[2:], where)
    return KeyEntry(key, Tenant(name, weight, priorities), where)


def _check_field_count(fields: list[str], where: str) -> None:
    plain = [f for f in fields if not f.startswith("priority=")]
    if not 2 <= len(plain) <= 3 or len(fields) > 4:
        raise ValueError(f"{where}: expected 'KEY TENANT [WEIGHT]', got {len(fields)} fields "
                         "(and optionally priority=LO..HI)")


def _options(fields: list[str], where: str) -> tuple[float, tuple[int, int]]:
    """(weight, priority range) from a line's optional fields, in either order (the field
    count is checked: at most one weight)."""
    weight: float | None = None
    priorities: tuple[int, int] | None = None
    for text in fields:
        if not text.startswith("priority="):
            weight = _weight(text, where)
        elif priorities is None:
            priorities = _priority_range(text, where)
        else:
            raise ValueError(f"{where}: priority= is given twice")
    return (1.0 if weight is None else weight,
            DEFAULT_PRIORITY_RANGE if priorities is None else priorities)


def _looks_like_entry(fields: list[str]) -> bool:
    """A comment line that would be a valid entry if its first word were a key."""
    if fields[0] == "#":
        return False
    try:
        _check_field_count(fields, "")
        _options(fields[2:], "")
    except ValueError:
        return False
    return fields[1] not in RESERVED_TENANTS


def _priority_range(text: str, where: str) -> tuple[int, int]:
    match = _PRIORITY_OPTION.fullmatch(text)
    if match is None:
        raise ValueError(f"{where}: expected priority=LO..HI or priority=N (integers), got "
                         f"{text!r}")
    low = int(match[1])
    high = low if match[2] is None else int(match[2])
    if not -PRIORITY_BOUND <= low <= high <= PRIORITY_BOUND:
        raise ValueError(f"{where}: the priority range needs {-PRIORITY_BOUND} <= LO <= HI <= "
                         f"{PRIORITY_BOUND}, got {text!r}")
    return low, high


def _weight(text: str, where: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise ValueError(f"{where}: the weight must be a number, got {text!r}") from None
    if not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"{where}: the weight must be a positive number, got {text!r}")
    return weight


def read_admin_key_file(path: str | Path) -> str:
    """The admin key from a file (its only word; surrounding blank lines and spaces are
    ignored), so it is not on the command line. ValueError naming the file."""
    words = Path(path).read_text(encoding="utf-8").split()
    if len(words) != 1:
        raise ValueError(f"--admin-key-file {path}: expected the key alone, got "
                         f"{len(words)} words")
    try:
        _check_key(words[0], "the admin key")
    except ValueError as exc:
        raise ValueError(f"--admin-key-file {path}: {exc}") from None
    return words[0]


def access_policy_from(api_keys: Sequence[str] = (), keys_file: str | Path | None = None,
                       admin_key: str | None = None, admin_key_file: str | Path | None = None,
                       admin_routes: bool = True) -> AccessPolicy:
    """The AccessPolicy of the access flags, all of them checked together.

    ValueError, naming where the key was given (never the key), for: a malformed key or
    keys file (read_api_keys_file), a key given twice (among --api-key, or in both
    --api-key and the file), an API key equal to the admin key, and both --admin-key and
    --admin-key-file. --api-key keys are tenant "default" with priorities 0..0.
    """
    entries: list[KeyEntry] = []
    for number, key in enumerate(api_keys, 1):
        where = f"--api-key #{number}"
        try:
            _check_key(key, where)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        entries.append(KeyEntry(key, Tenant(), where))
    if keys_file is not None:
        entries += read_api_keys_file(keys_file)
    if admin_key is not None and admin_key_file is not None:
        raise ValueError("give the admin key once: --admin-key or --admin-key-file")
    if admin_key_file is not None:
        admin_key = read_admin_key_file(admin_key_file)
    elif admin_key is not None:
        _check_key(admin_key, "--admin-key")
    seen: dict[str, str] = {}
    for entry in entries:
        if entry.key in seen:
            raise ValueError(f"{entry.where}: this key is also given as {seen[entry.key]}")
        if admin_key is not None and hmac.compare_digest(entry.key.encode(),
                                                         admin_key.encode()):
            raise ValueError(f"{entry.where}: this API key equals the admin key; they must "
                             "differ")
        seen[entry.key] = entry.where
    return AccessPolicy(api_keys=tuple((e.key, e.tenant) for e in entries),
                        admin_key=admin_key, admin_routes=admin_routes)


def tenant_of(request) -> str:
    """The tenant name AccessControl stored for this request ("default" without one)."""
    return request.scope.get(TENANT_SCOPE_KEY, DEFAULT_TENANT)


def check_priority(request, priority: int) -> None:
    """APIError (400, param "priority") when the request's key may not use `priority`
    (its range from the keys file; 0..0 by default). Without API keys any priority goes."""
    allowed = request.scope.get(PRIORITY_SCOPE_KEY)
    if allowed is None:
        return
    low, high = allowed
    if not low <= priority <= high:
        span = f"{low}" if low == high else f"{low}..{high}"
        raise APIError(f"priority: this API key may ask for priority {span} only (the keys "
                       f"file's priority=LO..HI), got {priority}", param="priority",
                       code="priority_not_allowed")


def _credentials(scope) -> tuple[str | None, str | None]:
    """(the Bearer token, the Basic auth password) of the request; None where absent."""
    for name, value in scope.get("headers", ()):
        if name != b"authorization":
            continue
        text = value.decode("latin-1").strip()
        scheme, _, rest = text.partition(" ")
        if scheme.lower() == "bearer":
            return rest.strip() or None, None
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(rest.strip(), validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                return None, None
            return None, decoded.partition(":")[2] or None
    return None, None


class AccessControl:
    """ASGI middleware enforcing an AccessPolicy (see the module docstring)."""

    def __init__(self, app, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":  # NOTE: no route uses one; refuse rather than skip
            return await send({"type": "websocket.close", "code": 1008})
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        bearer, password = _credentials(scope)
        if path == "/v1" or path.startswith("/v1/") or path in API_PATHS:
            error = self._check_api(scope, bearer)
        else:
            error = self._check_admin(bearer or password) or _check_cross_site(scope)
        if error is not None:
            return await send_error(send, error)
        await self.app(scope, receive, send)

    def _check_api(self, scope, key: str | None) -> APIError | None:
        if not self.policy.keys_required:
            scope[TENANT_SCOPE_KEY] = DEFAULT_TENANT
            return None
        tenant = self.policy.tenant_for(key)
        if tenant is None:
            message = ("missing API key: send 'Authorization: Bearer <key>'" if key is None
                       else "invalid API key")
            return APIError(message, 401, "authentication_error", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        scope[TENANT_SCOPE_KEY] = tenant.name
        scope[PRIORITY_SCOPE_KEY] = tenant.priority_range
        return None

    def _check_admin(self, key: str | None) -> APIError | None:
        if not self.policy.admin_reachable:
            return APIError("Not Found", 404, "invalid_request_error")
        if self.policy.admin_open or self.policy.is_admin(key):
            return None
        return APIError("this route needs the admin key (--admin-key)", 401,
                        "authentication_error", code="invalid_api_key",
                        headers={"WWW-Authenticate": 'Basic realm="slotserve admin"'})


def _check_cross_site(scope) -> APIError | None:
    """403 for a state-changing admin request that a browser may have sent from another
    site (see the module docstring): what a cross-site form or a no-cors fetch can send."""
    if scope["method"] in SAFE_METHODS:
        return None
    content_type = fetch_site = None
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            content_type = value.split(b";")[0].strip().lower()
        elif name == b"sec-fetch-site":
            fetch_site = value.strip().lower()
    if content_type == b"application/json" or fetch_site in SAME_SITE_FETCHES:
        return None
    if content_type is None and fetch_site is None:  # not a browser (curl, a script)
        return None
    return APIError("this admin request may come from another site's page: send it with "
                    "Content-Type: application/json (or from this server's own page)", 403,
                    "permission_error", code="cross_site_request")


async def send_error(send, error: APIError) -> None:
    """Answer with OpenAI's error body from an ASGI middleware (outside FastAPI's handlers)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
