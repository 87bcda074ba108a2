"""slotserve.loader.Tokenizer on the default model's GGUF vocabulary vs HF transformers, the
chat template, HF-directory tokenizers, and IncrementalDetokenizer."""

from __future__ import annotations

import os
import random

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import pre_tokenizers

from slotserve.loader import IncrementalDetokenizer, Tokenizer, default_model_path
from slotserve.loader.gguf import read_gguf

# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tok(gguf_path) -> Tokenizer:
    """Ours, built from the GGUF metadata (no cache involved)."""
    meta, _ = read_gguf(gguf_path)
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def hf(gguf_path):
    """HF transformers' tokenizer from the same GGUF (the oracle; ~5 s to build)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                         gguf_file=os.path.basename(gguf_path))


@pytest.fixture(scope="module")
def hf_smollm(hf) -> Backend:
    """HF's backend with SmolLM2's own pre-tokenizer (its tokenizer.json on the Hub).

    NOTE: transformers' GGUF loader ignores `tokenizer.ggml.pre == "smollm"` and splits with
    GPT-2's regex alone, so it differs from SmolLM2's tokenizer.json (and from llama.cpp, whose
    "smollm" rule splits every digit first) where a whitespace run precedes a digit: "a   1" is
    a|ĠĠĠ|1 for SmolLM2 and a|ĠĠ|Ġ1 -> a|ĠĠ|Ġ|1 for transformers. We follow SmolLM2.
    """
    backend = Backend.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


# No whitespace run right before a digit here: transformers agrees with SmolLM2 on these.
TEXTS = [
    "Hello, world!",
    "The year 12345 had 3.14159 and -42 (x=1,000,000).",
    "naïve café, Straße, Ελληνικά, русский",
    "emoji 🦙🔥👩‍👩‍👧 and flags 🇫🇷",
    "中文测试，日本語のテキスト、한국어",
    "spaces:    many     here\tand\ttabs  ",
    "new\nlines\n\n\nand\r\nCRLF\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "code: def f(x):\n    return x**2  # ok",
    "it's they're we'll I'd don't",
    "",
    " leading space",
    "<|endoftext|><repo_name>x<file_sep>",
]

FIXTURES_OK = [HealthCheck.function_scoped_fixture]
TEXT_CHARS = st.characters(exclude_categories=("Cs",))  # no lone surrogates: not UTF-8

# Where the two differ (see hf_smollm); expected ids from the "smollm" rule.
SMOLLM_SPLIT = {"a   1": [81, 333, 33], "ok    999": [2231, 289, 41, 41, 41]}


# -- encode / decode vs HF -------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tok, hf, text):
    assert tok.encode(text) == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_hf_and_round_trips(tok, hf, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text,ids", SMOLLM_SPLIT.items())
def test_digits_split_like_smollm2(tok, hf_smollm, text, ids):
    assert tok.encode(text) == ids == hf_smollm.encode(text, add_special_tokens=False).ids


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURES_OK)
@given(st.text(alphabet=st.sampled_from(list(" \t\n0123456789aZé€🦙中.,'-_")) | TEXT_CHARS,
               max_size=40))
def test_random_text_matches_smollm2_tokenizer(tok, hf_smollm, text):
    ids = tok.encode(text)
    assert ids == hf_smollm.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == hf_smollm.decode(
        ids, skip_special_tokens=False)


def test_lone_surrogates_become_replacement_characters(tok):
    assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")
    assert tok.encode("\ud83e\udd99") == tok.encode("\U0001f999")  # a valid pair stays one char


def test_properties_match_hf(tok, hf):
    assert tok.bos_token_id == hf.bos_token_id == 1
    assert tok.eos_token_ids[0] == hf.eos_token_id == 2
    assert 0 in tok.eos_token_ids  # <|endoftext|> ends generation too (as in llama.cpp)
    assert tok.vocab_size == len(hf) == 49152
    special = sorted(i for i, t in hf.added_tokens_decoder.items() if t.special)
    assert list(tok.all_special_ids) == special == list(range(17))
    for i in (0, 1, 2, 100, 4000, 49151):
        assert tok.id_to_token(i) == hf.convert_ids_to_tokens(i)
    assert not tok.add_bos_token  # tokenizer.ggml.add_bos_token = false


# -- chat template -------------------------------------------------------------------------------

CHATS = [
    [{"role": "user", "content": "What is continuous batching?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name three colors."},
     {"role": "assistant", "content": "Red, green, blue."},
     {"role": "user", "content": "Two more 🙂"}],
    [{"role": "user", "content": "line one\nline two"},
     {"role": "assistant", "content": "ok"}],
]


@pytest.mark.parametrize("chat", CHATS)
def test_chat_template_matches_hf(tok, hf, chat):
    for gen in (True, False):
        ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
        assert ours == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    prompt = tok.apply_chat_template(chat)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.encode(prompt) == hf.encode(prompt)


def test_chat_template_errors(tok):
    bare = Tokenizer(tok.backend, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHATS[0])
    strict = Tokenizer(tok.backend, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        strict.apply_chat_template(CHATS[0])
    sandboxed = Tokenizer(tok.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        sandboxed.apply_chat_template(CHATS[0])


def test_chat_template_sees_bos_eos_and_tojson(tok):
    t = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=[2],
                  chat_template="{{ bos_token }}{{ messages | tojson }}{{ eos_token }}")
    out = t.apply_chat_template([{"role": "user", "content": "<b>é</b>"}])
    assert out == '<|im_start|>[{"role": "user", "content": "<b>é</b>"}]<|im_end|>'


# -- HF directory tokenizers ---------------------------------------------------------------------


def test_hf_dir_tokenizer_matches_hf(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    ours = Tokenizer.from_hf_dir(str(tmp_path))
    assert ours is not None
    for text in [*TEXTS, "a   1"]:  # the saved tokenizer.json is transformers' own: same splits
        assert ours.encode(text) == hf.encode(text)
    for chat in CHATS:
        assert ours.apply_chat_template(chat) == hf.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True)
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,) and not ours.add_bos_token
    assert Tokenizer.from_hf_dir(str(tmp_path / "missing")) is None


def test_hf_dir_add_bos_token(hf, tmp_path):
    import json

    hf.save_pretrained(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(cfg))
    ours = Tokenizer.from_hf_dir(str(tmp_path), extra_eos_ids=[0])
    assert ours.encode("hi") == [1, *ours.encode("hi", add_special_tokens=False)]
    assert ours.eos_token_ids == (2, 0)


def test_save_load_round_trip(tok, tmp_path):
    tok.save(str(tmp_path))
    again = Tokenizer.load(str(tmp_path))
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    assert again.apply_chat_template(CHATS[1]) == tok.apply_chat_template(CHATS[1])
    assert (again.bos_token_id, again.eos_token_ids, again.add_bos_token) == (
        tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token)


# -- IncrementalDetokenizer ------------------------------------------------------------------------

STREAM_TEXTS = [
    "Hello there! How are you doing today?",
    "🦙🦙 llamas 🔥 and 👩‍👩‍👧 families, 中文 and 日本語",
    "Numbers 1234567890 with  double  spaces\n\nand new lines.",
    "é̃ combining marks and € signs ™",
]


def stream(tok, ids, chunks, prompt=None, skip=True):
    """Feed `ids` in chunks of the given sizes; return the deltas and the detokenizer."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, i = [], 0
    for n in chunks:
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    assert i >= len(ids)
    return deltas, detok


def test_emoji_is_split_across_byte_tokens(tok):
    ids = tok.encode("🦙")
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_one_token_at_a_time(tok, text):
    ids = tok.encode(text)
    deltas, detok = stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == tok.decode(ids) == text == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.flush() == ""
    assert detok.output_token_ids == ids


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_after_a_chat_prompt(tok, text):
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi 🦙"}]))
    ids = tok.encode(text) + [2]  # ends with <|im_end|> (special: skipped)
    deltas, detok = stream(tok, ids, [1] * len(ids), prompt=prompt)
    assert "".join(deltas) == text == detok.text


def test_stream_keeps_special_tokens_when_asked(tok):
    ids = tok.encode("a<|im_end|>b")
    deltas, _ = stream(tok, ids, [1] * len(ids), skip=False)
    assert "".join(deltas) == "a<|im_end|>b"


def test_stream_ending_inside_a_character_flushes(tok):
    ids = tok.encode("ok 🦙")[:-1]  # the llama's last byte never comes
    deltas, detok = stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == "ok"  # " " and the partial emoji held back
    tail = detok.flush()
    assert "".join(deltas) + tail == tok.decode(ids) and tail.endswith("\ufffd")


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURES_OK)
@given(text=st.text(alphabet=st.sampled_from(list("ab 1\n🦙🔥中é€")) | TEXT_CHARS,
                    max_size=30),
       seed=st.integers(0, 2**16))
def test_stream_random_text_and_chunking(tok, text, seed):
    ids = tok.encode(text)
    rng = random.Random(seed)
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(rng.randint(0, 3))
    deltas, detok = stream(tok, ids, chunks)
    full = tok.decode(ids)
    assert "".join(deltas) + detok.flush() == full
    assert full == text or not covered(tok, text)
    assert not any(d.endswith("\ufffd") for d in deltas if d) or "\ufffd" in full


def covered(tok: Tokenizer, text: str) -> bool:
    """Whether every UTF-8 byte of `text` has a token: SmolLM2's vocabulary lacks 21 byte
    tokens (0xF1.. lead bytes among them), which HF drops as silently as we do."""
    return tok.decode(tok.encode(text)) == text
