"""The GGUF loader on damaged files: ModelFileError (naming the file) or success, nothing else.

A tiny valid GGUF (a one-layer llama with a four-token vocabulary, written with gguf.GGUFWriter)
is truncated and mutated: random bytes in its header, forged counts and lengths. Every outcome
must be a loaded model or a ModelFileError whose message names the file, within a time bound
and without a large allocation (counts read from the header are checked against the file's size
before anything is allocated for them).
"""

from __future__ import annotations

import contextlib
import struct
import tracemalloc

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize as gguf_quantize
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from slotserve.loader import ModelFileError, load_model
from slotserve.loader.gguf import load_gguf

Q = GGMLQuantizationType
FUZZ = settings(deadline=None, database=None, derandomize=True, max_examples=150,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
MAX_ALLOCATION = 32 << 20  # bytes; the valid file needs well under 1 MiB
pytestmark = pytest.mark.timeout(120)  # a hang fails instead of blocking the run

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 32, 2, 1, 64, 4
HEAD_DIM = HIDDEN // HEADS


def tiny_gguf_bytes(tmp_path, *, tokenizer: bool = True, **overrides) -> bytes:
    """A valid one-layer llama GGUF (F32, F16, Q8_0 and Q4_1 tensors), as bytes.

    `overrides` replace tensors' shapes by GGUF name (e.g. to write a wrong-shaped one);
    None leaves the tensor out.
    """
    path = tmp_path / "valid.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["a", "b", "ab", "<|im_end|>"])
        writer.add_token_types([1, 1, 1, 3])
        writer.add_token_merges(["a b"])
        writer.add_eos_token_id(3)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {  # HF order: (rows, row length)
        "token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (q, HIDDEN), "blk.0.attn_k.weight": (kv, HIDDEN),
        "blk.0.attn_v.weight": (kv, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, q),
        "blk.0.ffn_gate.weight": (INTER, HIDDEN), "blk.0.ffn_up.weight": (INTER, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, INTER), "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.ffn_norm.weight": (HIDDEN,),
    } | overrides
    types = [Q.F32, Q.F16, Q.Q8_0, Q.Q4_1]
    rng = np.random.default_rng(0)
    for i, (name, shape) in enumerate((n, s) for n, s in shapes.items() if s is not None):
        qtype = types[i % len(types)] if len(shape) == 2 else Q.F32
        data = gguf_quantize(rng.standard_normal(shape).astype(np.float32), qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    return tiny_gguf_bytes(tmp_path_factory.mktemp("valid"))


@pytest.fixture(scope="module")
def header_size(valid, tmp_path_factory) -> int:
    """Bytes before the tensor data: the header, metadata and tensor descriptions."""
    path = tmp_path_factory.mktemp("size") / "valid.gguf"
    path.write_bytes(valid)
    return GGUFReader(str(path)).data_offset


@contextlib.contextmanager
def bounded_allocation(limit: int):
    """Fails when Python/numpy allocations peak above `limit` bytes inside the block."""
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit, f"peak allocation {peak} bytes"


def load_or_model_file_error(path) -> str:
    """'ok' or 'error'; any exception but ModelFileError (naming `path`) fails the test."""
    # NOTE: a damaged tensor type can turn weights into NaNs: a success, numpy's warning aside.
    with bounded_allocation(MAX_ALLOCATION), np.errstate(all="ignore"):
        try:
            config, weights, _ = load_gguf(str(path))
        except ModelFileError as exc:
            assert str(path) in str(exc) and exc.path == str(path)
            event(f"ModelFileError: {_kind(exc.problem)}")
            return "error"
    assert config.num_hidden_layers >= 1 and "model.embed_tokens.weight" in weights
    event("loaded")
    return "ok"


def _kind(problem: str) -> str:
    """The problem's first words (for hypothesis's statistics)."""
    return " ".join(problem.split()[:2])


def test_the_valid_file_loads(valid, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(valid)
    config, weights, tokenizer = load_gguf(str(path))
    assert (config.hidden_size, config.num_key_value_heads, config.vocab_size) == (32, 1, 4)
    assert len(weights) == 11 and tokenizer.encode("ab") == [2]


@settings(FUZZ)
@given(data=st.data())
def test_truncated_files(valid, tmp_path, data):
    cut = data.draw(st.integers(0, len(valid) - 1))
    path = tmp_path / "m.gguf"
    path.write_bytes(valid[:cut])
    assert load_or_model_file_error(path) == "error"  # every byte of the file is needed


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_random_bytes_in_the_header(valid, header_size, tmp_path, data):
    damaged = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 6))):
        damaged[data.draw(st.integers(0, header_size - 1))] = data.draw(st.integers(0, 255))
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(damaged))
    load_or_model_file_error(path)


FORGED = [0, 1, 2, 3, 7, 8, 9, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40,
          2**62, 2**63 - 1, 2**63, 2**64 - 1]


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_forged_counts_and_lengths(valid, header_size, tmp_path, data):
    """A 4- or 8-byte little-endian integer anywhere in the header replaced by an extreme one:
    counts, string lengths, array lengths, dimension counts, shapes, types, offsets."""
    width = data.draw(st.sampled_from([4, 8]))
    value = data.draw(st.sampled_from(FORGED)) % (1 << (8 * width))
    at = data.draw(st.integers(0, header_size - width))
    damaged = bytearray(valid)
    damaged[at:at + width] = value.to_bytes(width, "little")
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(damaged))
    load_or_model_file_error(path)


# -- each problem's message ---------------------------------------------------------------------


def _u64_after(valid: bytes, marker: bytes) -> int:
    """Position of the 8-byte length just before `marker` (a string's bytes) in the file."""
    return valid.index(marker) - 8


@pytest.mark.parametrize("damage,message", [
    (lambda v: v[:10], "truncated header"),
    (lambda v: b"GGUX" + v[4:], "bad magic"),
    (lambda v: v[:4] + struct.pack("<I", 7) + v[8:], "unsupported GGUF version 7"),
    (lambda v: v[:4] + struct.pack(">I", 3) + v[8:], "unsupported GGUF version"),  # big-endian
    (lambda v: v[:8] + struct.pack("<Q", 2**63) + v[16:], "9223372036854775808 tensor"),
    (lambda v: v[:16] + struct.pack("<Q", 2**40) + v[24:], "1099511627776 metadata entries"),
    (lambda v: v[:-1], "out of bounds"),
])
def test_each_problem_is_named(valid, tmp_path, damage, message):
    path = tmp_path / "m.gguf"
    path.write_bytes(damage(valid))
    with pytest.raises(ModelFileError, match=message) as info:
        load_gguf(str(path))
    assert str(info.value).startswith(f"{path}: ")


def test_a_string_arrays_items_are_checked_as_lone_strings(valid, tmp_path):
    """The token list's items (read in one loop: the reader's `strings`): a token that is
    not UTF-8, and a token's length past the file's end, named where they are."""
    at = valid.index(b"<|im_end|>")  # the last token's bytes, after its 8-byte length
    path = tmp_path / "m.gguf"
    path.write_bytes(valid[:at] + b"\xff" + valid[at + 1:])
    with pytest.raises(ModelFileError, match=rf"metadata 'tokenizer.ggml.tokens' at byte "
                                             rf"{at} is not UTF-8"):
        load_gguf(str(path))
    path.write_bytes(valid[:at - 8] + struct.pack("<Q", 2**40) + valid[at:])
    with pytest.raises(ModelFileError, match=rf"truncated: metadata 'tokenizer.ggml.tokens' "
                                             rf"at byte {at} needs 1099511627776 bytes"):
        load_gguf(str(path))


def test_a_forged_string_length_is_not_allocated(valid, tmp_path):
    at = _u64_after(valid, b"general.architecture")
    damaged = valid[:at] + struct.pack("<Q", 2**62) + valid[at + 8:]
    path = tmp_path / "m.gguf"
    path.write_bytes(damaged)
    with bounded_allocation(MAX_ALLOCATION), pytest.raises(ModelFileError, match="truncated"):
        load_gguf(str(path))


def test_missing_key_and_wrong_shape(tmp_path):
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(tiny_gguf_bytes(tmp_path, **{"blk.0.ffn_up.weight": (INTER, 2 * HIDDEN)}))
    with pytest.raises(ModelFileError, match=r"wrong shape for blk\.0\.ffn_up\.weight: "
                                             r"\(64, 64\), expected \(64, 32\)"):
        load_gguf(str(wrong))

    valid = tiny_gguf_bytes(tmp_path)
    at = valid.index(b"llama.feed_forward_length")
    renamed = valid[:at] + b"llama.feed_forward_lengtX" + valid[at + 25:]
    missing = tmp_path / "missing.gguf"
    missing.write_bytes(renamed)
    with pytest.raises(ModelFileError, match="missing key llama.feed_forward_length"):
        load_gguf(str(missing))


def test_missing_and_unknown_tensors_are_named(tmp_path):
    missing = tmp_path / "missing.gguf"
    missing.write_bytes(tiny_gguf_bytes(tmp_path, **{"blk.0.ffn_down.weight": None}))
    with pytest.raises(ModelFileError, match=r"missing tensor blk\.0\.ffn_down\.weight"):
        load_gguf(str(missing))

    valid = tiny_gguf_bytes(tmp_path)
    at = valid.index(b"blk.0.ffn_down.weight")
    renamed = valid[:at] + b"blk.0.ffn_dowX.weight" + valid[at + 21:]
    path = tmp_path / "m.gguf"
    path.write_bytes(renamed)
    with pytest.raises(ModelFileError, match="unsupported GGUF tensor 'blk.0.ffn_dowX.weight'"):
        load_gguf(str(path))


def test_load_model_raises_the_same_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(tiny_gguf_bytes(tmp_path)[:-1])
    with pytest.raises(ModelFileError, match="out of bounds"):
        load_model(str(path))
    assert issubclass(ModelFileError, ValueError)  # callers that catch ValueError still do


def test_load_model_reads_a_files_header_once(valid, tmp_path, monkeypatch):
    """Kept in blocks, a file's header (a large vocabulary's: ~0.5 s) is read once, for
    blocks_kept and load_gguf both."""
    import slotserve.loader as loader
    from slotserve.loader import gguf
    from slotserve.loader.gguf_reader import read_gguf

    path = tmp_path / "m.gguf"
    path.write_bytes(valid)
    reads = []
    monkeypatch.setattr(loader, "read_gguf", lambda p: reads.append(p) or read_gguf(p))
    monkeypatch.setattr(gguf, "read_gguf", None)  # a second read would fail
    loaded = load_model(str(path), keep_quantized=True)
    assert reads == [str(path)]
    assert "model.layers.0.mlp.up_proj.weight" in loaded.weights
