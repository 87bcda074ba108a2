"""Tenants named by OpenAI's `user` field when the server has no API keys (bounded)."""

from __future__ import annotations

import logging

from slotserve.server.protocol import APIError

logger = logging.getLogger("slotserve.server")

OVERFLOW_TENANT = "other"


class UserTenants:
    """Tenants named by OpenAI's `user` field (without API keys), bounded: the first
    `max_tenants` distinct names get their own tenant, later ones share OVERFLOW_TENANT.

    NOTE: used from the event loop only (no lock); the bound protects the scheduler's and
    the metrics' per-tenant state, which is kept for the server's life.
    """

    def __init__(self, max_tenants: int) -> None:
        self.max_tenants = max_tenants
        self.names: set[str] = set()
        self._warned = False

    def tenant(self, key_tenant: str, user: str | None) -> str:
        """The request's tenant: the API key's when keys are set (max_tenants 0), else the
        `user` field's (bounded), else `key_tenant` ("default"). APIError (400, param
        "user") for a name with control characters."""
        if self.max_tenants == 0 or not user:
            return key_tenant
        if not user.isprintable():
            raise APIError("user must be printable text (no control characters)",
                           param="user")
        if user in self.names:
            return user
        if len(self.names) < self.max_tenants:
            self.names.add(user)
            return user
        if not self._warned:
            logger.warning("more than %d distinct `user` values: later ones share tenant %r "
                           "(--max-user-tenants)", self.max_tenants, OVERFLOW_TENANT)
            self._warned = True
        return OVERFLOW_TENANT
