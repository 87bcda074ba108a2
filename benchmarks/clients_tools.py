"""benchmarks.clients' clients, each its command line and the parser of its own export
(aiperf, guidellm, `slotserve bench`), the workload they all send, and the embedded model's
tokenizer as the Hugging Face directory they need (see benchmarks/clients.py's docstring for
the definitions of each figure)."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

TOOLS = ("slotserve bench", "aiperf", "guidellm")
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "gap_p50_ms", "output_tok_s")


@dataclass(frozen=True)
class Workload:
    """What every client sends (see the module docstring)."""

    requests: int = 24
    input_tokens: int = 128
    output_tokens: int = 64
    slots: int = 8
    seed: int = 0


@dataclass
class ClientResult:
    """One client's run, from its own export (milliseconds; output tokens per second)."""

    tool: str
    ok: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None  # each request's mean gap after its first token (aiperf's ITL)
    gap_p50_ms: float | None  # every gap between two tokens (None: the tool keeps no gaps)
    output_tok_s: float | None
    command: list[str]
    ttft_mean_ms: float | None = None  # the means, to set beside the server's own
    itl_mean_ms: float | None = None
    wall_s: float = 0.0
    server: dict | None = None  # what the server counted during the run (/metrics deltas)
    error_messages: list[str] | None = None


# -- the tokenizer -------------------------------------------------------------------------------


def write_hf_tokenizer(folder: Path) -> Path:
    """The embedded model's tokenizer as a Hugging Face directory `AutoTokenizer` loads.

    `Tokenizer.save` writes tokenizer.json (the `tokenizers` backend, which is HF's own
    format) and slotserve's tokenizer_meta.json; HF also wants tokenizer_config.json: the
    class, the special tokens and the chat template.
    """
    from slotserve.loader import load_model

    tokenizer = load_model().tokenizer
    if tokenizer is None:
        raise RuntimeError("the default model has no tokenizer")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder))
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "add_bos_token": tokenizer.add_bos_token,
              "bos_token": _token(tokenizer, tokenizer.bos_token_id),
              "eos_token": _token(tokenizer, (tokenizer.eos_token_ids or (None,))[0]),
              "chat_template": tokenizer.chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def _token(tokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else tokenizer.id_to_token(token_id)


# -- slotserve bench's workload --------------------------------------------------------------


def bench_workload(path: Path, tokenizer_dir: Path, workload: Workload) -> Path:
    """`slotserve bench --workload` JSONL: the requests of `workload`, each one user message
    of `input_tokens` tokens of random vocabulary words (distinct prompts, all at t=0)."""
    from slotserve.loader.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(str(tokenizer_dir))
    words = _vocabulary_words(tokenizer)
    rng = random.Random(workload.seed)
    with path.open("w") as f:
        for _ in range(workload.requests):
            text = _text_of_length(tokenizer, words, rng, workload.input_tokens)
            line = {"messages": [{"role": "user", "content": text}],
                    "max_tokens": workload.output_tokens}
            f.write(json.dumps(line) + "\n")
    return path


def _vocabulary_words(tokenizer) -> list[str]:
    """Whole lowercase words of the vocabulary (" word": one token each)."""
    words = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if text.startswith(" ") and text[1:].isalpha() and text[1:].islower() and len(text) > 3:
            words.append(text)
    return words


def _text_of_length(tokenizer, words: list[str], rng: random.Random, length: int) -> str:
    """Random words cut to `length` tokens (re-encoding the cut text keeps the length: every
    word is one token and a space starts each)."""
    text = "".join(rng.choice(words) for _ in range(length)).strip()
    ids = tokenizer.encode(text, add_special_tokens=False)[:length]
    return tokenizer.decode(ids)


# -- running the clients -----------------------------------------------------------------------


def bench_command(url: str, workload_file: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "slotserve.cli", "bench", "--url", url, "--endpoint", "chat",
            "--workload", str(workload_file), "--out", str(out), "--no-progress"]


def aiperf_command(exe: str, url: str, model: str, tokenizer_dir: Path, workload: Workload,
                   out_dir: Path) -> list[str]:
    extra = {"ignore_eos": True, "min_tokens": workload.output_tokens, "temperature": 0}
    return [exe, "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", str(tokenizer_dir), "--use-server-token-count",
            "--prompt-input-tokens-mean", str(workload.input_tokens),
            "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(workload.output_tokens),
            "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", json.dumps(extra),
            "--concurrency", str(workload.requests), "--request-count", str(workload.requests),
            "--random-seed", str(workload.seed), "--ui-type", "none",
            "--output-artifact-dir", str(out_dir)]


def guidellm_scenario(url: str, model: str, tokenizer_dir: Path, workload: Workload,
                      out: Path) -> dict:
    """guidellm's scenario (the JSON form of its `run` options)."""
    return {
        "backend": {"kind": "openai_http", "target": url, "model": model,
                    "request_format": "/v1/chat/completions",
                    "extras": {"body": {"temperature": 0}}},
        "profile": {"kind": "concurrent", "streams": [workload.requests]},
        "constraints": [{"kind": "max_requests", "count": workload.requests}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
        # NOTE: no *_stdev: guidellm wants them > 0; without them every length is fixed
        "data": [{"kind": "synthetic_text", "prompt_tokens": workload.input_tokens,
                  "output_tokens": workload.output_tokens}],
        "seed": {"kind": "static", "value": workload.seed},
        "outputs": [{"kind": "json", "path": str(out)}],
    }


def guidellm_command(exe: str, scenario_file: Path) -> list[str]:
    return [exe, "run", "--scenario", str(scenario_file), "--disable-console-interactive"]


# -- reading the clients' exports ------------------------------------------------------------


def parse_bench(path: Path, command: list[str]) -> ClientResult:
    """`slotserve bench --out`: TPOT is the per-request mean gap, ITL every gap."""
    run = json.loads(path.read_text())["results"][0]
    return ClientResult("slotserve bench", run["completed"], run["failed"],
                        run["ttft_ms"]["p50"], run["ttft_ms"]["p99"], run["tpot_ms"]["p50"],
                        run["itl_ms"]["p50"], run["output_throughput"], command,
                        run["ttft_ms"]["mean"], run["tpot_ms"]["mean"],
                        error_messages=run["errors"] or None)


def parse_aiperf(folder: Path, command: list[str]) -> ClientResult:
    """aiperf's profile_export_aiperf.json: inter_token_latency is each request's
    (latency - TTFT) / (output tokens - 1), inter_chunk_latency every gap between chunks."""
    run = json.loads((folder / "profile_export_aiperf.json").read_text())
    ok = int(run["completed_request_count"]["avg"])
    errors = sum(int(e.get("count", 1)) for e in run.get("error_summary") or [])
    return ClientResult("aiperf", ok, errors, run["time_to_first_token"]["p50"],
                        run["time_to_first_token"]["p99"], run["inter_token_latency"]["p50"],
                        run["inter_chunk_latency"]["p50"], run["output_token_throughput"]["avg"],
                        command, run["time_to_first_token"]["avg"],
                        run["inter_token_latency"]["avg"],
                        error_messages=[str(e) for e in run.get("error_summary") or []] or None)


def parse_guidellm(path: Path, command: list[str]) -> ClientResult:
    """guidellm's JSON report (its one benchmark): inter_token_latency_ms is each request's
    (latency - TTFT) / (output tokens - 1), one sample per gap; no single gaps are kept."""
    run = json.loads(path.read_text())["benchmarks"][0]
    metrics, totals = run["metrics"], run["metrics"]["request_totals"]

    def p(name: str, q: str) -> float:
        return metrics[name]["successful"]["percentiles"][q]

    def mean(name: str) -> float:
        return metrics[name]["successful"]["mean"]

    errored = [r.get("info", {}).get("error") for r in run["requests"].get("errored") or []]
    return ClientResult("guidellm", totals["successful"],
                        totals["errored"] + totals["incomplete"],
                        p("time_to_first_token_ms", "p50"), p("time_to_first_token_ms", "p99"),
                        p("inter_token_latency_ms", "p50"), None,
                        metrics["output_tokens_per_second"]["successful"]["mean"], command,
                        mean("time_to_first_token_ms"), mean("inter_token_latency_ms"),
                        error_messages=[str(e) for e in errored] or None)
