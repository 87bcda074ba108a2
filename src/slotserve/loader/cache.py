"""On-disk cache of converted models, so a GGUF is dequantized once, not on every start.

Layout: `<cache root>/<key>/` holds `weights.safetensors` (float32, 16-bit as the file stores
them; HF names), `config.json`
(the ModelConfig), `tokenizer.json` + `tokenizer_meta.json` (when the model has a tokenizer)
and `manifest.json` (format version and every file's size), written last.

The cache root is `$SLOTSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/slotserve`, else
`~/.cache/slotserve`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from slotserve.config import ModelConfig
from slotserve.loader.safetensors import load_weights, save_weights
from slotserve.loader.tokenizer import Tokenizer
from slotserve.paths import cache_root

# NOTE: bump when the converted content changes (names, layout, tokenizer rules): old entries
# then miss and get rebuilt under a new key.
CACHE_VERSION = 1
HASH_SPAN = 4 << 20  # bytes hashed at each end of the source file
STALE_TEMP_S = 3600  # temp dirs older than this are leftovers of killed processes

WEIGHTS_FILE = "weights.safetensors"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"

Converted = tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]


def source_key(path: str) -> str:
    """Cache key of a source file: a fast content fingerprint, not a full hash.

    blake2b (128-bit) over the cache version, the file size, its first and its last 4 MiB.
    A GGUF's head holds all metadata and its tail the last tensors' bytes, so a different model
    or quantization changes the key; the path and mtime do not enter (a copied or re-downloaded
    file hits the same entry).
    """
    size = os.path.getsize(path)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"slotserve-cache-v{CACHE_VERSION}:{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(HASH_SPAN))
        f.seek(max(size - HASH_SPAN, 0))
        h.update(f.read(HASH_SPAN))
    return h.hexdigest()


def entry_dir(path: str) -> str:
    """Where the converted form of source file `path` lives (whether or not it exists yet)."""
    return os.path.join(cache_root(), source_key(path))


def cached_convert(path: str, convert: Callable[[str], Converted]) -> Converted:
    """`convert(path)`, read from the cache when a valid entry exists, else computed and stored.

    A missing, partial or corrupt entry is ignored and rebuilt; a cache that cannot be written
    (read-only disk, full disk) only costs a warning.
    """
    entry = entry_dir(path)
    hit = read_entry(entry)
    if hit is not None:
        return hit
    result = convert(path)
    try:
        write_entry(entry, *result, source=path)
    except OSError as e:
        warnings.warn(f"slotserve: could not write model cache {entry}: {e}", stacklevel=2)
    return result


def read_entry(entry: str) -> Converted | None:
    """The cached model in `entry`, or None (and the entry removed) when missing or invalid."""
    if not os.path.isdir(entry):
        return None
    try:
        files = _check_manifest(entry)
        config = _config_from_json(_read_json(os.path.join(entry, CONFIG_FILE)))
        weights = load_weights(os.path.join(entry, WEIGHTS_FILE))
        tokenizer = Tokenizer.load(entry) if "tokenizer.json" in files else None
    except Exception as e:  # NOTE: any damage means "rebuild", never a failed start
        warnings.warn(f"slotserve: ignoring invalid model cache {entry}: {e}", stacklevel=3)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return config, weights, tokenizer


def write_entry(
    entry: str,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer: Tokenizer | None,
    source: str = "",
) -> None:
    """Write a cache entry atomically: fill a temp dir beside it, then rename it into place.

    NOTE: a killed process leaves at most a `.tmp-*` dir (swept later), never a partial entry.
    If another process renamed its entry in first, ours is discarded.
    """
    root = os.path.dirname(entry)
    os.makedirs(root, exist_ok=True)
    _sweep_stale_temps(root)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(entry)}-", dir=root)
    try:
        _fill_entry(tmp, config, weights, tokenizer, source)
        os.rename(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(entry):  # a lost race is fine; anything else is an error
            raise


def _fill_entry(
    folder: str,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer: Tokenizer | None,
    source: str,
) -> None:
    save_weights(weights, os.path.join(folder, WEIGHTS_FILE))
    _write_json(os.path.join(folder, CONFIG_FILE), dataclasses.asdict(config))
    if tokenizer is not None:
        tokenizer.save(folder)
    files = {name: os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)}
    manifest = {"version": CACHE_VERSION, "source": source, "files": files}
    _write_json(os.path.join(folder, MANIFEST_FILE), manifest)  # NOTE: last: marks complete


def _check_manifest(entry: str) -> dict[str, int]:
    """The manifest's {file: size}; raises if the version or any file's size differs."""
    manifest = _read_json(os.path.join(entry, MANIFEST_FILE))
    if manifest.get("version") != CACHE_VERSION:
        raise ValueError(f"cache version {manifest.get('version')} != {CACHE_VERSION}")
    files: dict[str, int] = manifest["files"]
    for name, size in files.items():
        if os.path.getsize(os.path.join(entry, name)) != size:
            raise ValueError(f"{name} has the wrong size")
    if WEIGHTS_FILE not in files or CONFIG_FILE not in files:
        raise ValueError("incomplete entry")
    return files


def _config_from_json(data: dict[str, Any]) -> ModelConfig:
    data["eos_token_ids"] = tuple(data["eos_token_ids"])
    data["sliding_windows"] = tuple(data.get("sliding_windows", ()))  # JSON has lists
    return ModelConfig(**data)


def _sweep_stale_temps(root: str) -> None:
    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            if name.startswith(".tmp-") and now - os.path.getmtime(path) > STALE_TEMP_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # another process swept it first


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
