"""The per-step fast paths of the host's bookkeeping (issue 32, item 4) answer as the
general paths they skip."""

from __future__ import annotations

import pytest

from slotserve.config import FinishReason
from slotserve.core.kv_manager import KVCacheManager
from slotserve.engine.outputs import ErrorKind, error_kind_of
from slotserve.request import Request, RequestStatus
from slotserve.sampling import SamplingParams

FINISHED = {"stop", "length", "abort", "error", "rejected"}


@pytest.mark.parametrize("status", list(RequestStatus))
def test_finished_and_finish_reason_follow_the_status_value(status: RequestStatus) -> None:
    request = Request("r", [1, 2], SamplingParams())
    request.status = status
    assert status.finished is (status.value in FINISHED)
    assert request.is_finished is status.finished
    assert request.finish_reason == (status.value if status.value in FINISHED else None)


def test_error_kind_of_a_running_completion_is_none() -> None:
    assert error_kind_of(None) is None
    assert error_kind_of(None, ErrorKind.GRAMMAR_FAILURE) is None
    assert error_kind_of(FinishReason.ERROR) is ErrorKind.INTERNAL
    assert error_kind_of("abort") is ErrorKind.ABORTED


@pytest.mark.parametrize("caching", [False, True])
def test_allocate_slots_within_held_blocks_takes_nothing(caching: bool) -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=caching)
    request = Request("r", list(range(5)), SamplingParams())
    assert len(kv.allocate_slots(request, 5, [])) == 2
    free = kv.num_free_blocks
    for total in (6, 7, 8):  # decodes inside the second block: nothing new
        assert kv.allocate_slots(request, total) == []
        assert kv.block_tables["r"] == [0, 1] and kv.num_free_blocks == free
    assert len(kv.allocate_slots(request, 9)) == 1  # past it: one more block
    assert kv.allocate_slots(request, 17) is None  # more than the pool: nothing taken
    assert len(kv.block_tables["r"]) == 3
    kv.check_integrity()
