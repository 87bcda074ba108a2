"""Workloads with shared prefixes (shared system prompt, multi-turn, n=4) and the prefix-cache
benchmark's pieces, on a tiny random-weight model (token-id prompts, no tokenizer)."""

from __future__ import annotations

import json

import pytest

from benchmarks.prefix_cache import (
    build_workloads,
    check_targets,
    compare,
    format_text,
    interleaved,
)
from slotserve.cli import main
from slotserve.config import ModelConfig
from slotserve.lab.bench import EngineTarget, run_bench
from slotserve.lab.workload import (
    FOLLOW_UPS,
    SYSTEM_PROMPT,
    BenchRequest,
    Workload,
    load_workload,
    multi_turn_workload,
    parallel_sampling_workload,
    save_workload,
    shared_prefix_workload,
)

VOCAB = 512


# ---------------------------------------------------------------------- generators
def test_shared_prefix_chat_requests_share_the_system_prompt():
    w = shared_prefix_workload(64, output_len=16)
    assert len(w) == 64 and all(r.max_tokens == 16 and r.arrival == 0 for r in w.requests)
    assert all(r.messages[0] == {"role": "system", "content": SYSTEM_PROMPT} for r in w.requests)
    questions = {r.messages[1]["content"] for r in w.requests}
    assert len(questions) > 10  # the short questions differ


def test_shared_prefix_token_ids_really_share_the_prefix():
    w = shared_prefix_workload(8, prefix_len=40, suffix_len_min=3, suffix_len_max=6,
                               vocab_size=VOCAB, seed=3)
    prefix = w.requests[0].prompt[:40]
    assert all(r.prompt[:40] == prefix for r in w.requests)
    assert all(3 <= len(r.prompt) - 40 <= 6 for r in w.requests)
    assert len({tuple(r.prompt[40:]) for r in w.requests}) == 8


def test_multi_turn_shapes_and_chat_chaining():
    w = multi_turn_workload(8, turns_min=4, turns_max=8, output_len=24, seed=1)
    assert len(w) == 8 and all(4 <= r.num_turns <= 8 for r in w.requests)
    assert w.num_sends == sum(r.num_turns for r in w.requests) == w.params["num_requests"]
    first = w.requests[0]
    assert first.id == "c0.t0" and all(t in FOLLOW_UPS for t in first.turns)
    second = first.next_turn("answer one", [11, 12])
    assert second.id == "c0.t1" and second.turns == first.turns[1:]
    assert second.messages == [*first.messages, {"role": "assistant", "content": "answer one"},
                               {"role": "user", "content": first.turns[0]}]
    third = second.next_turn("answer two", [13])
    assert third.id == "c0.t2" and third.messages[:3] == second.messages
    request, sent = first, 1
    while (request := request.next_turn("a", [5])) is not None:
        sent += 1
    assert sent == first.num_turns


def test_multi_turn_token_ids_chain_prompt_answer_turn():
    w = multi_turn_workload(2, turns_min=3, turns_max=3, vocab_size=VOCAB, turn_len_min=4,
                            turn_len_max=4)
    first = w.requests[0]
    second = first.next_turn("", [7, 8, 9])
    assert second.prompt == [*first.prompt, 7, 8, 9, *first.turns[0]]


def test_parallel_sampling_and_jsonl_round_trip(tmp_path):
    w = parallel_sampling_workload(4, n=4, output_len=8, vocab_size=VOCAB, prompt_len=32)
    assert all(r.n == 4 and len(r.prompt) == 32 for r in w.requests)
    assert w.num_completions == 16 and w.total_max_tokens == 128
    conv = multi_turn_workload(2, vocab_size=VOCAB)
    path = tmp_path / "w.jsonl"
    save_workload(Workload(w.requests + conv.requests), path)
    back = load_workload(path)
    assert sorted(r.n for r in back.requests) == [1, 1, 4, 4, 4, 4]
    assert sum(r.num_turns for r in back.requests) == conv.num_sends + 4


def test_bad_turns_and_n_are_rejected():
    with pytest.raises(ValueError, match="'n'"):
        BenchRequest("x", 4, prompt=[3, 4], n=0)
    with pytest.raises(ValueError, match="n=1"):
        BenchRequest("x", 4, prompt=[3, 4], n=2, turns=([5],))
    with pytest.raises(ValueError, match="text prompt"):
        BenchRequest("x", 4, prompt="hi", turns=("more",))
    with pytest.raises(ValueError, match="token-id lists"):
        BenchRequest("x", 4, prompt=[3, 4], turns=("more",))
    with pytest.raises(ValueError, match="user messages"):
        BenchRequest("x", 4, messages=[{"role": "user", "content": "a"}], turns=([3],))


# ---------------------------------------------------------------------- on the engine
@pytest.fixture(scope="module")
def target(tiny_llama):
    cfg = ModelConfig.from_hf_dict(tiny_llama.config.to_dict())
    weights = {k: v.detach().clone() for k, v in tiny_llama.state_dict().items()}
    return EngineTarget(cfg, weights, None, dict(max_model_len=256, block_size=8,
                                                 num_blocks=256, max_num_seqs=8))


def test_engine_runs_each_turn_after_the_previous_answer(target):
    w = multi_turn_workload(3, turns_min=2, turns_max=4, output_len=5, vocab_size=VOCAB,
                            turn_len_min=4, turn_len_max=9, seed=2)
    result = run_bench(w, target)
    assert result.completed == w.num_sends and result.failed == 0
    assert result.total_output_tokens == 5 * w.num_sends
    # Each turn's prompt = the previous prompt + its 5-token answer + the next turn's ids.
    expected = sum(len(r.prompt) * r.num_turns
                   + sum((k + 1) * (5 + len(t)) for k, t in enumerate(reversed(r.turns)))
                   for r in w.requests)
    assert result.total_input_tokens == expected
    cache = result.prefix_cache
    assert cache["prompt_tokens"] == expected and cache["hits"] > 0
    assert cache["prefill_tokens_computed"] == expected - cache["hits"]


def test_shared_prefix_is_computed_once_with_caching_and_every_time_without(target):
    w = shared_prefix_workload(6, output_len=3, prefix_len=40, vocab_size=VOCAB)
    on = run_bench(w, target.configured(enable_prefix_caching=True))
    off = run_bench(w, target.configured(enable_prefix_caching=False))
    assert on.prefix_cache["prompt_tokens"] == off.prefix_cache["prompt_tokens"]
    assert off.prefix_cache["hits"] == 0 and off.prefix_cache["queries"] == 0
    # 40 shared tokens = 5 full blocks of 8: at least the 5 later requests find them.
    assert on.prefix_cache["hits"] >= 5 * 40
    assert on.config["enable_prefix_caching"] and not off.config["enable_prefix_caching"]


def test_n4_counts_every_completion(target):
    w = parallel_sampling_workload(3, n=4, output_len=4, vocab_size=VOCAB, prompt_len=24)
    result = run_bench(w, target)
    assert result.completed == 12 and result.total_output_tokens == 48
    assert result.prefix_cache["prompt_tokens"] == 3 * 4 * 24
    assert result.prefix_cache["hits"] > 0  # the 3 later completions share the 16 full-block ids


# ---------------------------------------------------------------------- the benchmark
def test_interleaving_puts_drift_on_both_sides():
    assert interleaved(1) == [False, True]
    assert interleaved(2) == [False, True, True, False]


def test_benchmark_pieces_on_the_tiny_model(target):
    workloads = build_workloads(target, scale=0.25)
    assert set(workloads) == {"shared-system-prompt", "multi-turn", "n=4", "W", "W-random"}
    assert workloads["n=4"].requests[0].n == 4 and workloads["multi-turn"].num_sends > 2
    small = shared_prefix_workload(4, output_len=2, prefix_len=32, vocab_size=VOCAB)
    row = compare(target, small, 1, "shared-system-prompt")
    assert row["off"]["prefill_tokens_computed"] == row["off"]["prompt_tokens"]
    assert row["on"]["prefill_tokens_computed"] < row["off"]["prefill_tokens_computed"]
    assert row["ratios"]["prefill_computed_x"] > 1 and row["on"]["hit_rate"] > 0
    targets = check_targets({"shared-system-prompt": row})
    assert [t["metric"] for t in targets] == ["ttft_p50_x", "prefill_computed_x"]
    text = format_text({"shared-system-prompt": row}, targets)
    assert "| shared-system-prompt | on |" in text and "prefill_computed_x" in text


@pytest.mark.parametrize("scenario, sends", [("shared-system-prompt", 3), ("n4", 12)])
def test_cli_scenarios_write_their_workload(tiny_llama, tmp_path, scenario, sends):
    model = tmp_path / "tiny"
    tiny_llama.save_pretrained(model)
    path, out = tmp_path / "w.jsonl", tmp_path / "out.json"
    code = main(["bench", "--model", str(model), "--scenario", scenario, "--num-requests", "3",
                 "--output-len", "2", "--block-size", "8", "--num-blocks", "512",
                 "--max-model-len", "512", "--no-progress", "--save-workload", str(path),
                 "--out", str(out)])
    assert code == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["completed"] == sends and row["failed"] == 0
    assert row["prefix_cache"]["hits"] > 0 and row["config"]["enable_prefix_caching"]
    assert load_workload(path).num_completions == sends
