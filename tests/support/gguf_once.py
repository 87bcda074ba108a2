"""HF transformers' loads of one GGUF file, its metadata parsed once."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While open, `gguf.GGUFReader(path)` gives one reader per file (path, size, mtime).

    transformers' `from_pretrained(dir, gguf_file=...)` builds a reader for the config, for
    the weights and for the tokenizer in turn, and gguf-py parses the metadata element by
    element: ~23 s a reader for Gemma 3's 262k-token vocabulary on a 2-core host. HF's code
    path is unchanged; the same file is parsed once. NOTE: for files no test rewrites (a
    rewrite within one mtime tick would hand back the old reader).
    """
    import gguf

    make_reader = gguf.GGUFReader
    readers = {}

    def reader(path, mode="r"):
        stat = os.stat(path)
        key = (os.path.realpath(path), mode, stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        yield
