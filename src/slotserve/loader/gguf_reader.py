"""A bounds-checked reader of GGUF v2/v3 files: metadata as plain Python values, tensors as
memory-mapped byte views.

`read_gguf` is a small reader of our own: `gguf.GGUFReader` builds a numpy view per metadata
element and takes seconds on a 49k-token vocabulary; this takes ~0.1 s.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from slotserve.loader.validation import ModelFileError
from slotserve.value_checks import is_int

# GGUF metadata value types (gguf.GGUFValueType).
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_VERSIONS = (2, 3)
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays: deeper than any real file, shallow enough for recursion
# NOTE: the fewest bytes one item can take. Counts read from the header are checked against the
# bytes left before anything is allocated for them: a forged count fails, it never allocates.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_MIN_ITEM_BYTES = {_STRING: 8, _ARRAY: 12}
_U64 = struct.Struct("<Q")  # a string's length


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, its bytes not yet read (a view into the memory-mapped file).

    `shape` is GGUF's order: ne0 (the fastest-varying, a row's length) first.
    `data` is uint8, shaped `(ne[n-1], ..., ne1, bytes per row)`: one row of blocks per line.
    """

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data: np.ndarray
    offset: int = 0  # of `data` in the file
    mapping: mmap.mmap | None = field(default=None, repr=False, compare=False)

    def release(self) -> None:
        """Drop this tensor's resident pages (the whole pages inside its bytes): they stay
        in the page cache and are read again if touched. NOTE: the loading reads each weight
        once or twice (checked, then converted when its kernel packs it), so the file is not
        held resident beside the converted weights (a process's RSS counts mapped pages)."""
        if self.mapping is None:
            return
        begin = -(-self.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (self.offset + self.data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > begin:
            self.mapping.madvise(mmap.MADV_DONTNEED, begin, end - begin)


class _Cursor:
    """Sequential little-endian reads from a buffer, each checked against the buffer's end.

    Every problem is a ModelFileError naming the file and the byte where it was found.
    """

    def __init__(self, buf: Any, path: str) -> None:
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, problem: str) -> ModelFileError:
        return ModelFileError(self.path, problem)

    def need(self, n: int, what: str) -> None:
        """A ModelFileError unless `n` more bytes (for `what`) are left."""
        if n > self.size - self.pos:
            raise self.fail(f"truncated: {what} at byte {self.pos} needs {n} bytes, "
                            f"the file has {self.size - self.pos} left")

    def scalar(self, fmt: str, what: str = "a value") -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str = "a string") -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} at byte {self.pos} is not UTF-8 ({exc.reason})") from None
        self.pos += n
        return text

    def strings(self, n: int, what: str) -> list[str]:
        """`n` strings in a row (an array's items), each read and checked as `string` reads
        it. NOTE: one loop with the cursor in a local: a vocabulary's ~400k tokens and
        merges through `string` took ~1 s to read."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        length_at = _U64.unpack_from
        for _ in range(n):
            if size - pos < 8:
                self.pos = pos
                self.need(8, what)
            (length,) = length_at(buf, pos)
            pos += 8
            if length > size - pos:
                self.pos = pos
                self.need(length, what)
            try:
                out.append(str(buf[pos:pos + length], "utf-8"))
            except UnicodeDecodeError as exc:
                raise self.fail(f"{what} at byte {pos} is not UTF-8 ({exc.reason})") from None
            pos += length
        self.pos = pos
        return out

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            return self.array(what, depth + 1)
        if kind not in _SCALARS:
            raise self.fail(f"{what} has unknown value type {kind}")
        return self.scalar(_SCALARS[kind], what)

    def array(self, what: str, depth: int) -> list[Any]:
        if depth > _MAX_NESTING:
            raise self.fail(f"{what}: arrays nested deeper than {_MAX_NESTING}")
        kind, n = self.scalar("<I", what), self.scalar("<Q", what)
        if kind in (_STRING, _ARRAY):
            self.need(n * _MIN_ITEM_BYTES[kind], f"{what} ({n} items)")
            if kind == _STRING:
                return self.strings(n, what)
            return [self.value(kind, what, depth) for _ in range(n)]
        if kind not in _SCALARS:
            raise self.fail(f"{what} is an array of unknown value type {kind}")
        dtype = np.dtype(_SCALARS[kind])
        self.need(n * dtype.itemsize, f"{what} ({n} items)")
        values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
        self.pos += values.nbytes
        return values.tolist()


def read_gguf(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Metadata (plain Python values) and tensors (memory-mapped) of a GGUF v2/v3 file.

    A malformed file raises ModelFileError (naming the file and the problem), whatever the
    damage: every count and offset is checked against the file's size before it is used.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _HEADER_BYTES:
            raise ModelFileError(path, f"truncated header: {size} bytes, a GGUF header has "
                                       f"{_HEADER_BYTES}")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf, path)
    magic = cur.scalar("<4s", "the magic")
    if magic != b"GGUF":
        raise cur.fail(f"bad magic {magic!r}: not a GGUF file")
    version = cur.scalar("<I", "the version")
    if version not in _VERSIONS:
        raise cur.fail(f"unsupported GGUF version {version} (supported: {_VERSIONS}, "
                       "little-endian)")
    n_tensors = cur.scalar("<Q", "the tensor count")
    n_kv = cur.scalar("<Q", "the metadata count")
    cur.need(n_kv * _MIN_KV_BYTES, f"{n_kv} metadata entries")
    meta = _read_metadata(cur, n_kv)
    cur.need(n_tensors * _MIN_TENSOR_INFO_BYTES, f"{n_tensors} tensor descriptions")
    infos = [_tensor_info(cur) for _ in range(n_tensors)]
    if len({info[0] for info in infos}) != len(infos):
        raise cur.fail("duplicate tensor names")
    align = meta.get("general.alignment", 32)
    if not is_int(align) or align < 1 or align & (align - 1):
        raise cur.fail(f"general.alignment must be a power of two, not {align!r}")
    start = -(-cur.pos // align) * align  # NOTE: tensor data begins at the next aligned byte
    return meta, [_tensor(cur, start, align, *info) for info in infos]


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        if key in meta:
            raise cur.fail(f"duplicate metadata key {key!r}")
        meta[key] = cur.value(cur.scalar("<I", f"the type of {key!r}"), f"metadata {key!r}")
    return meta


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cur.string("a tensor name")
    n_dims = cur.scalar("<I", f"tensor {name!r}'s dimension count")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
    shape = tuple(cur.scalar("<Q", f"tensor {name!r}'s shape") for _ in range(n_dims))
    type_id = cur.scalar("<I", f"tensor {name!r}'s type")
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise cur.fail(f"tensor {name!r} has unknown type {type_id}") from None
    if qtype not in GGML_QUANT_SIZES:
        raise cur.fail(f"tensor {name!r} has unsupported type {qtype.name}")
    return name, shape, qtype, cur.scalar("<Q", f"tensor {name!r}'s offset")


def _tensor(cur: _Cursor, start: int, align: int, name: str, shape: tuple[int, ...],
            qtype: GGMLQuantizationType, offset: int) -> GGUFTensor:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape[0] % block_size:
        raise cur.fail(f"tensor {name!r}: row length {shape[0]} is not a multiple of "
                       f"{qtype.name}'s block size {block_size}")
    if offset % align:
        raise cur.fail(f"tensor {name!r}: offset {offset} is not a multiple of the alignment "
                       f"{align}")
    row_bytes = shape[0] // block_size * type_size
    rows = tuple(reversed(shape[1:]))
    count = row_bytes * math.prod(rows)  # NOTE: Python ints: a forged shape cannot overflow
    if start + offset + count > cur.size:
        raise cur.fail(f"tensor {name!r} out of bounds: bytes {start + offset} to "
                       f"{start + offset + count}, the file has {cur.size}")
    data = np.frombuffer(cur.buf, dtype=np.uint8, count=count, offset=start + offset)
    return GGUFTensor(name, shape, qtype, data.reshape(*rows, row_bytes), start + offset,
                      cur.buf)
