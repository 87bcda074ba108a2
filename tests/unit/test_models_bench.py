"""benchmarks/models.py (families x formats: fp32 equality with HF, bf16 / int8 agreement,
speed) in its --quick mode: the report's fields, and a family whose HF tokens differ is
reported unequal at the right position."""

from __future__ import annotations

import json

import pytest

from benchmarks import models


def test_quick_report_fields(tmp_path, capsys):
    out = tmp_path / "models.json"
    models.main(["--quick", "--families", "qwen3,mistral", "--out", str(out)])
    report = json.loads(out.read_text())
    assert {"date", "machine", "command", "settings", "seconds"} <= set(report)
    assert report["settings"]["shape"] == models.QUICK_SHAPE
    qwen3, mistral = report["families"]
    assert (qwen3["family"], mistral["family"]) == ("qwen3", "mistral")
    assert set(qwen3["formats"]) == {"hf", "gguf"} and qwen3["formats"]["gguf"]["arch"] == "qwen3"
    assert "skipped" in mistral["formats"]["gguf"]  # no GGUF architecture of its own
    assert mistral["config"]["sliding_window"] == models.WINDOW
    for result in (qwen3["formats"]["hf"], qwen3["formats"]["gguf"], mistral["formats"]["hf"]):
        assert result["fp32_equal"] is True and result["first_difference"] is None
        assert result["prompts_equal"] == result["prompts"] == 1
        assert result["tokens"] == models.QUICK_SETTINGS.new_tokens
        assert 1 <= result["distinct_tokens"] <= result["tokens"]
        for key in ("bf16_agreement", "int8_agreement"):
            assert 0.0 <= result[key] <= 1.0
        assert result["batch1_ms_per_token"] > 0 and result["w_output_tok_s"] > 0
    table = capsys.readouterr().out
    assert table.count("\n| Qwen3") == 2 and "| Mistral (window 32) | GGUF |" in table


def test_a_family_unequal_to_hf_is_reported_so(monkeypatch, capsys):
    """HF's tokens changed at output index 2 (what a wrong model would give): the report says
    not equal, first difference at 2, and the table says so."""
    real = models.hf_greedy

    def wrong_hf_greedy(model, prompt, max_new):
        tokens = real(model, prompt, max_new)
        tokens[2] = (tokens[2] + 1) % model.config.vocab_size
        return tokens

    monkeypatch.setattr(models, "hf_greedy", wrong_hf_greedy)
    (gemma2,) = models.main(["--quick", "--families", "gemma2", "--formats", "hf",
                             "--no-speed"])
    result = gemma2["formats"]["hf"]
    assert result["fp32_equal"] is False and result["first_difference"] == 2
    assert result["prompts_equal"] == 0 and "batch1_ms_per_token" not in result
    assert "**no**: 0/1 prompts, first difference at token 2" in capsys.readouterr().out


def test_first_difference():
    assert models.first_difference([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) is None
    assert models.first_difference([[1, 2, 3], [4, 5]], [[1, 9, 3], [7, 5]]) == 0
    assert models.first_difference([[1, 2, 3]], [[1, 2]]) == 2  # shorter: differs at its end
    assert models.first_difference([[1, 2, 3]], [[5, 2]]) == 0


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        models.parse_args(["--families", "llama,gpt2"])
    with pytest.raises(SystemExit):
        models.parse_args(["--formats", "onnx"])
