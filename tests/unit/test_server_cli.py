"""`slotserve serve` / `slotserve chat`: flags, the served name, the chat loop (no model)."""

from __future__ import annotations

import io

import pytest

from slotserve.cli import build_parser
from slotserve.server.chat import RemoteChat, api_base, run_chat
from slotserve.server.startup import access_policy, listen_host, served_model_names


def test_serve_flags():
    args = build_parser().parse_args(
        ["serve", "--port", "9000", "--batching", "static", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "256", "--kv-cache-memory", "64M", "--max-waiting", "3",
         "--trace", "t.json"])
    # NOTE: --host has no default now: listen_host picks loopback and logs it (issue 14)
    assert (args.host, args.port, args.batching, args.max_num_seqs) == (None, 9000,
                                                                         "static", 4)
    assert listen_host(args, access_policy(args)) == "127.0.0.1"
    assert args.max_num_batched_tokens == 256 and args.kv_cache_memory == 64 << 20
    assert args.max_waiting == 3 and args.trace == "t.json" and args.model is None


def test_kernel_flags_reach_the_engine_config():
    from slotserve.config import engine_config
    from slotserve.engine_args import engine_kwargs

    args = build_parser().parse_args(["serve", "--quantization", "int8"])
    config = engine_config(None, **engine_kwargs(args))
    assert (config.quantization, config.kernels) == ("int8", "auto")
    args = build_parser().parse_args(["generate", "hi", "--kernels", "reference"])
    assert engine_config(None, **engine_kwargs(args)).kernels == "reference"
    with pytest.raises(SystemExit):  # argparse rejects unknown choices with exit code 2
        build_parser().parse_args(["serve", "--quantization", "int4"])


def test_chat_flags():
    args = build_parser().parse_args(["chat", "--url", "http://h:1"])
    assert args.url == "http://h:1" and args.max_num_seqs == 1
    args = build_parser().parse_args(["chat", "--url", "http://h:1", "--api-key", "sk-1"])
    assert args.api_key == "sk-1"
    assert RemoteChat("http://h:1", "m", api_key="sk-1").client.api_key == "sk-1"


@pytest.mark.parametrize("name,model_arg,override,expected", [
    ("SmolLM2-135M-Instruct.Q4_1", None, None,
     ("SmolLM2-135M-Instruct", ("SmolLM2-135M-Instruct.Q4_1",))),
    ("my-model", "/models/my-model", None, ("my-model", ("/models/my-model",))),
    ("qwen2-0.5b-instruct-q8_0", None, "qwen", ("qwen", ("qwen2-0.5b-instruct",
                                                         "qwen2-0.5b-instruct-q8_0"))),
])
def test_served_model_names(name, model_arg, override, expected):
    assert served_model_names(name, model_arg, override) == expected


def test_api_base():
    assert api_base("http://h:8000") == "http://h:8000/v1"
    assert api_base("http://h:8000/v1/") == "http://h:8000/v1"


class EchoBackend:
    model_name = "echo"

    def __init__(self) -> None:
        self.seen = []

    def stream(self, messages, max_tokens, temperature):
        self.seen.append([dict(m) for m in messages])
        yield from ["you ", "said ", messages[-1]["content"]]


def scripted(*lines):
    queue = list(lines)

    def read(prompt: str) -> str:
        if not queue:
            raise EOFError
        return queue.pop(0)

    return read


def test_chat_keeps_history_and_streams():
    backend, out = EchoBackend(), io.StringIO()
    history = run_chat(backend, system="be nice", read=scripted("hi", "", "again"), out=out)
    assert history == [
        {"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "you said hi"}, {"role": "user", "content": "again"},
        {"role": "assistant", "content": "you said again"}]
    assert len(backend.seen) == 2 and len(backend.seen[1]) == 4
    assert "you said hi\n" in out.getvalue()


def test_chat_reset_and_exit():
    backend = EchoBackend()
    history = run_chat(backend, read=scripted("one", "/reset", "two", "/exit", "never"),
                       out=io.StringIO())
    assert history == [{"role": "user", "content": "two"},
                       {"role": "assistant", "content": "you said two"}]


def test_remote_chat_uses_the_openai_client():
    class Stream(list):
        closed = False

        def close(self):
            self.closed = True

    def chunk(text):
        delta = type("D", (), {"content": text})
        return type("C", (), {"choices": [type("Ch", (), {"delta": delta})]})

    stream = Stream([chunk("a"), chunk(None), chunk("b")])
    calls = []

    class Completions:
        def create(self, **kwargs):
            calls.append(kwargs)
            return stream

    client = type("Client", (), {"chat": type("Chat", (), {"completions": Completions()})})
    chat = RemoteChat("http://h", "m", client=client)
    assert "".join(chat.stream([{"role": "user", "content": "x"}], 5, 0.0)) == "ab"
    assert calls[0]["model"] == "m" and calls[0]["stream"] and stream.closed


@pytest.mark.parametrize("flags,keys,level,words", [
    ([], False, "INFO", "listening on 127.0.0.1 only"),
    (["--host", "::1"], False, "INFO", "listening on ::1 only"),
    (["--host", "0.0.0.0"], False, "WARNING", "anyone who reaches 0.0.0.0:8000"),
    (["--host", "0.0.0.0", "--api-key", "sk-1"], True, None, None),
])
def test_listen_host_says_who_can_reach_the_api(flags, keys, level, words, caplog):
    args = build_parser().parse_args(["serve", *flags])
    policy = access_policy(args)
    assert policy.keys_required == keys
    with caplog.at_level("INFO", "slotserve.server"):
        host = listen_host(args, policy)
    assert host == (args.host or "127.0.0.1")
    if words is None:
        assert not caplog.records
    else:
        assert [(r.levelname, words in r.getMessage()) for r in caplog.records] == [(level, True)]


def test_access_flags():
    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b",
                                      "--admin-key", "adm", "--disable-admin-routes",
                                      "--max-stop-strings", "3", "--max-stop-chars", "9"])
    policy = access_policy(args)
    assert [k for k, _ in policy.api_keys] == ["a", "b"] and policy.admin_key == "adm"
    assert not policy.admin_routes and not policy.admin_reachable
    from slotserve.server.startup import server_limits
    limits = server_limits(args)
    assert (limits.max_stop_strings, limits.max_stop_chars) == (3, 9)
