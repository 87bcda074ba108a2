"""benchmarks/spec_pairs.py: interleaved pairs, order alternating, prompts in turn, ratios."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from benchmarks.spec_pairs import main, run_pairs


class FakeLLM:
    """Answers `tokens` tokens after `seconds`; records the prompts and the call order."""

    def __init__(self, name: str, seconds: float, calls: list, tokens: int = 4) -> None:
        self.name, self.seconds, self.calls, self.tokens = name, seconds, calls, tokens
        # NOTE: what benchmarks.speculative.run_once reads of an LLM's engine
        self.engine = SimpleNamespace(scheduler=SimpleNamespace(speculator=None),
                                      trace=SimpleNamespace(clear=lambda: None),
                                      export_trace=lambda: {})

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append((self.name, prompts[0][0]))
        time.sleep(self.seconds)
        completion = SimpleNamespace(token_ids=list(range(self.tokens)), metrics=None)
        return [SimpleNamespace(outputs=[completion])]


def test_pairs_alternate_and_the_ratio_is_auto_over_off():
    calls: list = []
    engines = {"off": FakeLLM("off", 0.02, calls), "auto": FakeLLM("auto", 0.01, calls)}
    result = run_pairs(engines, [[10], [11], [12]], pairs=4, max_tokens=4, log=lambda _: None)
    assert [name for name, _ in calls] == ["off", "auto", "auto", "off"] * 2
    assert [prompt for _, prompt in calls[::2]] == [10, 11, 12, 10]
    assert [row["first"] for row in result["pairs"]] == ["off", "auto", "off", "auto"]
    assert 1.3 < result["median_ratio"] < 2.5  # auto answers in half the time
    assert result["min_ratio"] <= result["median_ratio"] <= result["max_ratio"]


def test_bad_counts_are_a_usage_error():
    with pytest.raises(SystemExit) as exit_info:
        main(["--pairs", "0"])
    assert exit_info.value.code == 2
