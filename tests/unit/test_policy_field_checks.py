"""A request's scheduling fields are checked by one definition (config.check_policy_fields):
SchedulingFields (the engine's and the server's), the replay's and the workload's request
records all refuse the same values with the same error naming the same field."""

from __future__ import annotations

import pytest

from slotserve.config import SchedulingFieldError, check_policy_fields
from slotserve.core.scheduling_fields import SchedulingFieldError as ServersError
from slotserve.core.scheduling_fields import SchedulingFields
from slotserve.lab.replay import ReplayRequest
from slotserve.lab.workload.requests import BenchRequest

GOOD = {"priority": 0, "tenant": "t", "slo_ttft_ms": None, "slo_tpot_ms": None}
BAD = [("priority", 1.5), ("priority", True), ("tenant", ""), ("tenant", 7),
       ("slo_ttft_ms", 0), ("slo_ttft_ms", 3_600_001), ("slo_tpot_ms", float("nan")),
       ("slo_tpot_ms", "5")]


@pytest.mark.parametrize("field, value", BAD)
def test_every_holder_refuses_a_bad_field_with_one_message(field, value):
    fields = {**GOOD, field: value}
    with pytest.raises(SchedulingFieldError) as direct:
        check_policy_fields(**fields)
    assert direct.value.field == field and str(direct.value).startswith(field)
    with pytest.raises(ServersError) as built:
        SchedulingFields(**fields)
    assert (built.value.field, str(built.value)) == (field, str(direct.value))
    with pytest.raises(ValueError) as replayed:
        ReplayRequest("r", 4, 2, **fields)
    assert str(replayed.value) == f"{direct.value} (request 'r')"
    with pytest.raises(ValueError) as workload:
        BenchRequest("w", 4, prompt="hi", **fields)
    assert str(workload.value) == f"request 'w': {direct.value}"


def test_good_fields_pass_everywhere():
    check_policy_fields(-3, "a", 3_600_000, 0.5)  # one hour exactly is allowed
    assert SchedulingFields(-3, "a", 3_600_000, 0.5).tenant == "a"
    assert ReplayRequest("r", 4, 2, tenant="a", priority=-3, slo_ttft_ms=3_600_000).priority == -3
