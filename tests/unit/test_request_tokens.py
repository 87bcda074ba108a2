"""Request.token_ids_between is all_token_ids' slice, built without all of it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from slotserve.request import Request
from slotserve.sampling import SamplingParams


@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=12),
       output=st.lists(st.integers(0, 99), max_size=12),
       start=st.integers(0, 26), length=st.integers(0, 26))
def test_token_ids_between_is_the_slice_of_all_token_ids(prompt, output, start, length):
    request = Request("r", list(prompt), SamplingParams(), output_token_ids=list(output))
    stop = start + length
    assert request.token_ids_between(start, stop) == request.all_token_ids[start:stop]
