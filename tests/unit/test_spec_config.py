"""speculative_config (EngineConfig, --speculative-config): vLLM's JSON form, off by
default, hostile values refused with a ValueError naming the key (and exit 2 on the CLI)."""

from __future__ import annotations

import json

import pytest

from slotserve.cli import main
from slotserve.config import engine_config
from slotserve.spec.config import (
    AUTO_MAX_SPECULATIVE_TOKENS,
    MAX_SPECULATIVE_TOKENS,
    SpeculativeConfig,
    parse,
)


def test_off_by_default():
    assert engine_config().speculative_config is None
    assert engine_config().speculative is None
    assert engine_config(speculative_config="").speculative is None
    assert engine_config(speculative_config="null").speculative is None


def test_vllms_json_form():
    text = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
            '"prompt_lookup_max": 5}')
    config = engine_config(speculative_config=text)
    spec = config.speculative
    assert spec == SpeculativeConfig("ngram", 4, 2, 5)
    assert not spec.auto and spec.max_tokens == 4
    # stored canonically: the same setting from a dict compares equal
    same = engine_config(speculative_config=json.loads(text))
    assert same == config and isinstance(config.speculative_config, str)
    auto = engine_config(speculative_config={"method": "suffix"}).speculative
    assert auto.auto and auto.method == "suffix" and auto.max_tokens == AUTO_MAX_SPECULATIVE_TOKENS
    assert parse({"method": "ngram", "prompt_lookup_max": 3}).prompt_lookup_min == 3
    assert parse({"method": "ngram", "prompt_lookup_min": 3}).prompt_lookup_max == 3


HOSTILE = [
    ({"method": "eagle"}, "method"),
    ({}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -3}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1},
     "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 10**30}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "AUTO"}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_max": 10**9}, "prompt_lookup_max"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_min": "2"}, "prompt_lookup_min"),
    ({"method": "ngram", "suffix_decoding_max_tree_depth": 4}, "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "prompt_lookup_max": 4}, "prompt_lookup_max"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1},
     "suffix_decoding_max_cached_requests"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": float("nan")},
     "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5},
     "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0},
     "suffix_decoding_max_spec_factor"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": float("inf")},
     "suffix_decoding_max_spec_factor"),
    ({"method": "ngram", "draft_model": "x"}, "draft_model"),
]


@pytest.mark.parametrize(("value", "key"), HOSTILE)
def test_hostile_values_name_the_key(value, key):
    for form in (value, json.dumps(value)):
        with pytest.raises(ValueError, match=key):
            engine_config(speculative_config=form)


@pytest.mark.parametrize("text", ["{", "[1, 2]", "4", '"ngram"', "{'method': 'ngram'}"])
def test_not_an_object(text):
    with pytest.raises(ValueError, match="speculative_config"):
        engine_config(speculative_config=text)


def test_cli_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    assert "--speculative-config" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--speculative-config", '{"method": "eagle"}'])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and "method" in err
