"""Speculative decoding's verification runs on the C++ decode stack (issue 35): an
iteration of decodes, some with draft tokens, is one decode group of a row per token, so the
stack (not the Python layers) computes it, with output token-identical to speculation off."""

from __future__ import annotations

import numpy as np

from slotserve.attention.metadata import build_metadata
from slotserve.config import SlotKind
from slotserve.core.outputs import ScheduledSeq
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_hf_model
from tests.unit.test_spec_engine import GREEDY, NGRAM, repetitive_prompts, run, text_engine


def drafted(request_id: str, start_pos: int, table: list[int], drafts: int) -> ScheduledSeq:
    tokens = list(range(5, 6 + drafts))  # the last sampled token, then the drafts
    return ScheduledSeq(request_id, tokens, start_pos, table, True, SamplingParams(), 1,
                        SlotKind.DECODE, spec_token_ids=tokens[1:])


def test_drafted_decodes_are_rows_of_one_group():
    seqs = [drafted("a", 6, [3, 1, 4], 2), drafted("b", 3, [0], 0), drafted("c", 4, [2, 5], 3)]
    meta = build_metadata(seqs, block_size=4, device="cpu", group_decodes=False)
    assert meta.decode_only
    group = meta.decode_groups[0]
    positions = [6, 7, 8, 3, 4, 5, 6, 7]  # a: 6..8; b: 3; c: 4..7
    assert group.context_lens.tolist() == [p + 1 for p in positions]
    assert group.rows.tolist() == list(range(8))
    tables = group.block_tables.numpy()
    assert tables[:3].tolist() == [[3, 1, 4]] * 3 and tables[3].tolist() == [0, 0, 0]
    expected_slots = [np.array(t)[p // 4] * 4 + p % 4
                      for t, p in zip([[3, 1, 4]] * 3 + [[0]] + [[2, 5]] * 4, positions)]
    assert meta.slot_mapping.tolist() == expected_slots


def test_grouped_path_keeps_drafted_decodes_as_chunks():
    seqs = [drafted("a", 6, [3, 1, 4], 2), drafted("b", 3, [0], 0)]
    meta = build_metadata(seqs, block_size=4, device="cpu", group_decodes=True)
    assert not meta.decode_only and [p.num_queries for p in meta.prefills] == [3]


def test_speculative_iterations_run_on_the_stack_and_match_plain_decoding():
    hf_model = tiny_hf_model("llama")
    prompts = repetitive_prompts(4)
    engine = text_engine(hf_model, speculative_config=NGRAM)
    stack = engine.runner.model.decode_stack
    assert stack is not None
    rows_per_call = []

    class CountingStack:
        def forward(self, input_ids, *args):
            rows_per_call.append(len(input_ids))
            return stack.forward(input_ids, *args)

    engine.runner.model.decode_stack = CountingStack()
    result = run(engine, prompts, GREEDY)
    reference = run(text_engine(hf_model), prompts, GREEDY)
    assert {k: v[0] for k, v in result.items()} == {k: v[0] for k, v in reference.items()}
    # iterations with more rows than running sequences verified drafts on the stack
    assert sum(1 for rows in rows_per_call if rows > len(prompts)) >= 5, rows_per_call
