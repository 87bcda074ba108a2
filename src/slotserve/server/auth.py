"""Who may use the server: API keys (each naming a tenant) and the admin key.

`AccessPolicy` holds the keys; `AccessControl` is the ASGI middleware that enforces them:

- /health is always open (load balancers probe it).
- /v1/* (and /tokenize, /detokenize) need `Authorization: Bearer <key>` when API keys are
  set (an admin key also works);
  otherwise 401 with OpenAI's error body. The request's tenant goes into the ASGI scope
  (`tenant_of(request)`; "default" when no key is set).
- Everything else (the live view at / and /dashboard, /debug/*, /metrics, /docs) is an admin
  route: off (404) with `admin_routes=False`; else it needs the admin key when one is set;
  else, when API keys are set, it is off (404: nobody but an admin should see other
  tenants' requests); else it is open. Admin routes also take HTTP Basic auth (any user name,
  the admin key as password) so a browser can open the live view and its event streams.

NOTE: keys are compared with `hmac.compare_digest` against every configured key (no early
exit), so the time taken does not depend on how much of a key a client guessed.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import math
from dataclasses import dataclass
from pathlib import Path

from slotserve.server.protocol import APIError

DEFAULT_TENANT = "default"
ADMIN_TENANT = "admin"
TENANT_SCOPE_KEY = "slotserve.tenant"
OPEN_PATHS = ("/health",)
# Routes outside /v1 (where vLLM has them) that are guarded as /v1 is: API keys, tenants.
API_PATHS = ("/tokenize", "/detokenize")


@dataclass(frozen=True)
class Tenant:
    """A client identity: its name (for logs and, later, fair share) and its weight."""

    name: str = DEFAULT_TENANT
    weight: float = 1.0


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
            found = Tenant(ADMIN_TENANT)
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


def load_api_keys_file(path: str | Path) -> list[tuple[str, Tenant]]:
    """Keys from a file: one `KEY TENANT [WEIGHT]` per line (blank lines and lines starting
    with # are skipped). ValueError naming the file and line for a malformed one."""
    keys: list[tuple[str, Tenant]] = []
    seen: set[str] = set()
    text = Path(path).read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"{path}:{number}"
        if len(fields) not in (2, 3):
            raise ValueError(f"{where}: expected 'KEY TENANT [WEIGHT]', got {len(fields)} "
                             "fields")
        key, name = fields[0], fields[1]
        weight = _weight(fields[2], where) if len(fields) == 3 else 1.0
        if key in seen:
            raise ValueError(f"{where}: this key is listed twice")
        try:
            _check_key(key, "the key")
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        seen.add(key)
        keys.append((key, Tenant(name, weight)))
    return keys


def _weight(text: str, where: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise ValueError(f"{where}: the weight must be a number, got {text!r}") from None
    if not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"{where}: the weight must be a positive number, got {text!r}")
    return weight


def tenant_of(request) -> str:
    """The tenant name AccessControl stored for this request ("default" without one)."""
    return request.scope.get(TENANT_SCOPE_KEY, DEFAULT_TENANT)


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
            error = self._check_admin(bearer or password)
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
        return None

    def _check_admin(self, key: str | None) -> APIError | None:
        if not self.policy.admin_reachable:
            return APIError("Not Found", 404, "invalid_request_error")
        if self.policy.admin_open or self.policy.is_admin(key):
            return None
        return APIError("this route needs the admin key (--admin-key)", 401,
                        "authentication_error", code="invalid_api_key",
                        headers={"WWW-Authenticate": 'Basic realm="slotserve admin"'})


async def send_error(send, error: APIError) -> None:
    """Answer with OpenAI's error body from an ASGI middleware (outside FastAPI's handlers)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
