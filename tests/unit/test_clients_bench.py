"""benchmarks/clients.py's pieces that need no third-party client: the HF tokenizer directory
(checked against transformers' AutoTokenizer), slotserve bench's workload, and the readers of
aiperf's and guidellm's exports (on excerpts of real exports)."""

from __future__ import annotations

import json

import pytest

from benchmarks.clients import (
    ClientResult,
    Workload,
    bench_workload,
    median_over_rounds,
    parse_aiperf,
    parse_guidellm,
    ratios,
    write_hf_tokenizer,
)
from slotserve.lab.workload import load_workload
from slotserve.loader import Tokenizer, default_model_path

TEXTS = ["Hello world, this is a test.", "  leading spaces and 12345 digits\n\nnewlines",
         "<|im_start|>user\nspecial tokens in text<|im_end|>", "ünïcödé – “quotes” 😀"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    try:
        default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    return write_hf_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_hf_tokenizer_directory_encodes_and_templates_like_slotserve(hf_dir):
    from transformers import AutoTokenizer

    ours = Tokenizer.load(str(hf_dir))
    theirs = AutoTokenizer.from_pretrained(str(hf_dir))
    for text in TEXTS:
        assert theirs.encode(text, add_special_tokens=True) == ours.encode(text), text
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) \
        == ours.apply_chat_template(messages)
    assert theirs.eos_token_id == ours.eos_token_ids[0]


def test_bench_workload_prompts_have_the_asked_length_and_differ(hf_dir, tmp_path):
    workload = Workload(requests=6, input_tokens=40, output_tokens=7)
    path = bench_workload(tmp_path / "w.jsonl", hf_dir, workload)
    requests = load_workload(path).requests
    tokenizer = Tokenizer.load(str(hf_dir))
    contents = [r.messages[0]["content"] for r in requests]
    assert len(requests) == 6 and len(set(contents)) == 6
    assert all(r.max_tokens == 7 and r.arrival == 0 for r in requests)
    assert [len(tokenizer.encode(c, add_special_tokens=False)) for c in contents] == [40] * 6


def _stat(p50: float, p99: float) -> dict:
    return {"unit": "ms", "avg": p50 + 1, "p50": p50, "p99": p99}


def test_parse_aiperf_reads_its_summary_export(tmp_path):
    export = {"completed_request_count": {"unit": "requests", "avg": 24.0},
              "error_summary": [{"error_details": {"code": 500}, "count": 2}],
              "time_to_first_token": _stat(100.0, 300.0),
              "inter_token_latency": _stat(20.0, 40.0),
              "inter_chunk_latency": _stat(18.0, 90.0),
              "output_token_throughput": {"unit": "tokens/sec", "avg": 55.5}}
    (tmp_path / "profile_export_aiperf.json").write_text(json.dumps(export))
    r = parse_aiperf(tmp_path, ["aiperf"])
    assert (r.ok, r.errors, r.ttft_p50_ms, r.ttft_p99_ms) == (24, 2, 100.0, 300.0)
    assert (r.itl_p50_ms, r.gap_p50_ms, r.output_tok_s) == (20.0, 18.0, 55.5)
    assert (r.ttft_mean_ms, r.itl_mean_ms) == (101.0, 21.0)


def _dist(p50: float, p99: float) -> dict:
    return {"successful": {"mean": p50 + 2, "percentiles": {"p50": p50, "p99": p99}}}


def test_parse_guidellm_reads_its_json_report(tmp_path):
    metrics = {"request_totals": {"successful": 23, "errored": 1, "incomplete": 0, "total": 24},
               "time_to_first_token_ms": _dist(110.0, 310.0),
               "inter_token_latency_ms": _dist(21.0, 41.0),
               "output_tokens_per_second": _dist(50.0, 90.0)}
    report = {"benchmarks": [{"metrics": metrics, "requests": {
        "errored": [{"info": {"error": "HTTP 503"}}]}}]}
    (tmp_path / "g.json").write_text(json.dumps(report))
    r = parse_guidellm(tmp_path / "g.json", ["guidellm"])
    assert (r.ok, r.errors, r.ttft_p50_ms, r.ttft_p99_ms) == (23, 1, 110.0, 310.0)
    assert (r.itl_p50_ms, r.gap_p50_ms, r.output_tok_s) == (21.0, None, 52.0)
    assert (r.ttft_mean_ms, r.itl_mean_ms) == (112.0, 23.0)
    assert r.error_messages == ["HTTP 503"]


def _result(tool: str, ttft: float, tok_s: float) -> ClientResult:
    return ClientResult(tool, 24, 0, ttft, 2 * ttft, 10.0, None, tok_s, [tool])


def test_ratios_and_medians_over_rounds():
    bench, other = _result("slotserve bench", 100.0, 50.0), _result("aiperf", 110.0, 40.0)
    r = ratios(other, bench)
    assert r["ttft_p50_ms"] == pytest.approx(1.1) and r["output_tok_s"] == pytest.approx(0.8)
    assert r["gap_p50_ms"] is None  # neither kept single gaps
    rounds = [[bench, other], [_result("aiperf", 130.0, 44.0), _result("slotserve bench", 90.0,
                                                                          60.0)],
              [_result("slotserve bench", 300.0, 10.0), _result("aiperf", 120.0, 42.0)]]
    medians = {m.tool: m for m in median_over_rounds(rounds)}
    assert medians["slotserve bench"].ttft_p50_ms == 100.0
    assert medians["aiperf"].output_tok_s == 42.0 and medians["aiperf"].ok == 72
