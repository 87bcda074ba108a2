"""A request's scheduling fields, in one frozen value that checks itself once.

The server builds it from the request body and the caller's tenant (a 400 naming a bad
field) and calls EngineClient.generate with its `keywords()`; AsyncEngine.generate builds
one from them (or takes one as `scheduling=`), carries it in its AddRequest command to
LLMEngine.add_request, which copies it onto each of the request's completions
(`apply_to`); the queue policies read those Request fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# NOTE: the field checks and their error are config's (check_policy_fields: one definition,
# which the lab's request records use too); the server catches the error from here.
from slotserve.config import SchedulingFieldError, check_policy_fields

if TYPE_CHECKING:
    from slotserve.request import Request

__all__ = ["SchedulingFieldError", "SchedulingFields", "given_or_loose"]


@dataclass(frozen=True)
class SchedulingFields:
    """priority: lower first (`priority`, and `fair`'s order within a tenant); an integer.
    tenant: whose request it is (`fair`'s shares, the per-tenant queue bound and, with
        tenant-scoped prefix caching, whose cache); a non-empty string.
    slo_ttft_ms / slo_tpot_ms: this request's SLOs in milliseconds (None: the scheduler's
        defaults); positive, at most config.MAX_SLO_MS.
    cache_salt: requests with different salts never share prefix-cache blocks; None or a
        non-empty string.

    NOTE: validated in __post_init__, once, where it is built (dataclasses.replace builds
    a new one and checks it again): holders never check it. SchedulingFieldError (a
    ValueError) names the first bad field.
    """

    priority: int = 0
    tenant: str = "default"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        check_policy_fields(self.priority, self.tenant, self.slo_ttft_ms, self.slo_tpot_ms)
        _check_cache_salt(self.cache_salt)

    @classmethod
    def of(cls, request: Request) -> SchedulingFields:
        """A request's fields as set on it (ValueError naming a bad one)."""
        return cls(request.priority, request.tenant, request.slo_ttft_ms,
                   request.slo_tpot_ms, request.cache_salt)

    def keywords(self) -> dict[str, Any]:
        """The fields as EngineClient.generate's keywords. NOTE: that boundary stays
        keywords (ReplicaFront forwards them to a replica's engine as they are); the
        AsyncEngine builds one SchedulingFields of them again."""
        return dataclasses.asdict(self)

    def apply_to(self, request: Request) -> None:
        """Set the fields on a request (one completion)."""
        request.priority, request.tenant = self.priority, self.tenant
        request.slo_ttft_ms, request.slo_tpot_ms = self.slo_ttft_ms, self.slo_tpot_ms
        request.cache_salt = self.cache_salt


def given_or_loose(given: SchedulingFields | None,
                   loose: SchedulingFields) -> SchedulingFields:
    """`given`, else the fields a caller passed one by one (`loose`); ValueError if it
    passed both (LLMEngine.add_request's and AsyncEngine.generate's keywords)."""
    if given is None:
        return loose
    if loose != SchedulingFields():
        raise ValueError("pass the scheduling fields in `scheduling` or one by one, not both")
    return given


def _check_cache_salt(cache_salt: Any) -> None:
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise SchedulingFieldError("cache_salt", "cache_salt must be a non-empty string if given")
