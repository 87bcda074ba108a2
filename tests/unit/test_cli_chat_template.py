"""`slotserve chat` and `slotserve generate` take --chat-template (a file or the template
itself, as `slotserve serve --chat-template`) and --chat-template-kwargs (a JSON object,
checked as a request's chat_template_kwargs); the prompt the engine gets is the template's.

NOTE: smollm2_vocab_model is tests/unit/conftest.py's (SmolLM2's tokenizer, a tiny model):
the commands get an engine over it in place of the one their flags would load.
"""

from __future__ import annotations

import io

import pytest

import slotserve
from slotserve.cli import build_parser, main
from slotserve.config import engine_config
from slotserve.engine.llm import LLM
from slotserve.engine.llm_engine import LLMEngine
from slotserve.server.chat import LocalChat, RemoteChat

# Told apart from SmolLM2's own template (<|im_start|>...) in the prompt's tokens.
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
            "{% if add_generation_prompt %}{% if think %}<think>{% else %}<answer>{% endif %}"
            "{% endif %}")


@pytest.fixture
def engine(smollm2_vocab_model):
    cfg, weights, tokenizer = smollm2_vocab_model
    return LLMEngine(engine_config(quantization="none", max_model_len=256, num_blocks=64,
                                   max_num_seqs=2), cfg, weights, tokenizer)


@pytest.fixture
def prompts_seen(engine, monkeypatch) -> list[list[int]]:
    """The prompt ids the engine is given; `slotserve chat` and `generate` run on it."""
    seen: list[list[int]] = []
    add_request = engine.add_request

    def recording_add_request(request_id, prompt, params, *args, **kwargs):
        seen.append(list(prompt))
        return add_request(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording_add_request)
    monkeypatch.setattr(slotserve, "LLM", lambda model=None, **kwargs: LLM(engine=engine))
    monkeypatch.setattr("slotserve.commands.chat.build_engine", lambda args: engine)
    return seen


def encoded(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_generate_renders_the_given_template_and_its_variables(engine, prompts_seen,
                                                               tmp_path, capsys):
    tokenizer = engine.tokenizer
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert main(["generate", "Hi", "--max-tokens", "2", "--chat-template", str(path)]) == 0
    assert main(["generate", "Hi", "--max-tokens", "2", "--chat-template", TEMPLATE,
                 "--chat-template-kwargs", '{"think": true}']) == 0
    assert prompts_seen == [encoded(tokenizer, "[user:Hi]<answer>"),
                            encoded(tokenizer, "[user:Hi]<think>")]
    # Without the flags: the model's own template, as before.
    assert main(["generate", "Hi", "--max-tokens", "2"]) == 0
    assert prompts_seen[-1] == tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert prompts_seen[-1] != prompts_seen[0]
    capsys.readouterr()


def test_generate_raw_refuses_a_template(prompts_seen, capsys):
    for flags in (["--chat-template", TEMPLATE], ["--chat-template-kwargs", "{}"]):
        assert main(["generate", "Hi", "--raw", *flags]) == 2
        assert "--raw" in capsys.readouterr().err
    assert prompts_seen == []


def test_chat_renders_the_given_template_and_its_variables(engine, prompts_seen,
                                                           monkeypatch, capsys):
    tokenizer = engine.tokenizer
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nMore\n"))
    assert main(["chat", "--max-tokens", "2", "--system", "S", "--chat-template", TEMPLATE,
                 "--chat-template-kwargs", '{"think": false}']) == 0
    first, second = prompts_seen
    assert first == encoded(tokenizer, "[system:S][user:Hi]<answer>")
    # the second turn: the whole conversation, the first reply included, in the template
    text = tokenizer.decode(second, skip_special_tokens=False)
    assert text.startswith("[system:S][user:Hi][assistant:"), text
    assert text.endswith("][user:More]<answer>"), text
    capsys.readouterr()


def test_local_chat_without_any_template_is_refused(engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="--chat-template"):
        LocalChat(engine)
    LocalChat(engine, chat_template=TEMPLATE)  # one given: fine


def test_remote_chat_sends_the_variables_and_refuses_a_template(capsys):
    class Stream(list):
        def close(self):
            pass

    class Completions:
        def create(self, **kwargs):
            self.kwargs = kwargs
            return Stream()

    class Client:
        chat = type("Chat", (), {"completions": Completions()})()

    client = Client()
    remote = RemoteChat("http://x", "m", client=client, chat_template_kwargs={"think": True})
    list(remote.stream([{"role": "user", "content": "Hi"}], 4, 0.0))
    assert client.chat.completions.kwargs["extra_body"] == {
        "chat_template_kwargs": {"think": True}}
    plain = RemoteChat("http://x", "m", client=client)
    list(plain.stream([{"role": "user", "content": "Hi"}], 4, 0.0))
    assert "extra_body" not in client.chat.completions.kwargs
    # A request cannot carry a template: --url with --chat-template exits 2, saying why.
    assert main(["chat", "--url", "http://127.0.0.1:9", "--chat-template", TEMPLATE]) == 2
    assert "server's template" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "Hi"], ["chat"]])
@pytest.mark.parametrize("flags, words", [
    (["--chat-template", "/no/such/template.jinja"], "could not be read"),
    (["--chat-template", "{% if %}"], "does not compile"),
    (["--chat-template-kwargs", "{think: 1}"], "not JSON"),
    (["--chat-template-kwargs", "[1]"], "JSON object"),
    (["--chat-template-kwargs", '{"messages": []}'], "'messages' is set by"),
    (["--chat-template-kwargs", '{"1x": 1}'], "not a template variable name"),
])
def test_bad_values_exit_2_naming_the_flag(command, flags, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flags[0] in err and words in err, err


def test_defaults_are_none():
    for argv in (["generate", "Hi"], ["chat"]):
        args = build_parser().parse_args(argv)
        assert args.chat_template is None and args.chat_template_kwargs is None
