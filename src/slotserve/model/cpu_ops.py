"""Fused CPU kernels (`slotserve/csrc/`, one C++ file per family), compiled on first use.

`load_cpu_ops()` builds the extension with torch.utils.cpp_extension (g++ and ninja; about
a minute once, then cached under ~/.cache/torch_extensions in a directory named by the CPU and
by a hash of the sources and flags: every checkout with the same kernel shares one build) and
returns its module, or None when it cannot be built: the engine then runs the plain torch ops,
which stay the reference that the tests compare these kernels against.

The module's functions, on the CPU, fp32 but where said:
- rms_norm(x (T, H), weight (H,), eps) -> (T, H); add_rms_norm_(x, delta, weight, eps):
  x += delta in place, then rms_norm(x) (the decode stack's residual add and next norm)
- silu_mul(gate_up (T, 2I)) -> (T, I)
- rotary_(x (T, n, hd), cos, sin (T, hd/2) each): rotate-half RoPE, in place
- write_kv_(k_cache, v_cache, k, v (T, nkv, hd), slot_mapping (T,)): store new K/V (the
  caches float32, or bfloat16: rounded to nearest even as stored, or int8: each head's row
  quantized as attention/kv_int8.py does, codes then a scale per 32)
- paged_decode_attention(q (D, nh, hd), k_cache, v_cache, block_tables (D, maxb),
  context_lens (D,), scale) -> (D, nh, hd), reading K/V straight from the blocks (any
  cache dtype, widened or dequantized to fp32)
- int8_linear(x (T, in), qweight (out, in) int8, scales (out,)) -> (T, out): the int8
  matmul of linear_kernels.Int8WeightOnlyLinear, activations quantized to int16 per token
- pack_panels(weight (out, in)) -> panels; panel_linear(x (T, in), panels, out) -> (T, out):
  the fp32 matmul of linear_kernels.PanelLinear (AVX-512 or AVX2 tiles, the same sums)
- pack_panels_bf16(weight (out, in)) -> bf16 panels; panel_linear_bf16(x, panels, out,
  bf16_activations=False) -> (T, out) fp32: the matmul of linear_kernels.Bf16PanelLinear
  (quantization="bf16"); panel_bf16_vectorised() -> (fp32-activation mode, bf16-activation
  mode) vectorised here; panel_linear_bf16_amx(x, panels, out) on AMX tiles (x rounded to
  bf16) where amx_bf16_usable(); set_force_plain_loops(bool): tests run the fallbacks
- pack_quant_blocks(codes, scales, mins, bits) -> (packed codes, scales_mins: fp16 where
  every value is one, else fp32); quant_block_linear(x, codes, scales_mins, out, block_len,
  bits, activation_bits=8) -> (T, out): GGUF blocks x int8 (or, for 8-bit codes, 16-bit)
  activations (linear_kernels.GGUFBlockLinear);
  quant_blocks_isa(): its path in this build ("avx512vnni", "avx2" or "plain")
- unpack_gguf_blocks(raw (rows, row bytes), ggml type, order=None) -> a GGUF tensor's
  blocks as loader/gguf_blocks.py's BlockWeights arrays (codes, scales, mins, and the
  K-quants' factors), in memory kept for the next call's until release_unpack_memory();
  dequantize_gguf_blocks(raws, types, orders) -> fp32 (rows, cols) of tensors of any
  supported types, rows in turn (gguf-py's dequantize), in the same memory
- DecodeStack: all decoder layers (and the final norm) of an all-decode iteration in one
  call, the GIL released; built by LlamaForCausalLM.build_decode_stack; its linears
  (`linear_weights`) of every kind above, GGUF blocks ("gguf_blocks") included; per layer
  optional q/k norms (`add_layer(..., q_norm=, k_norm=)`, Qwen3's per-head RMSNorms)
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"  # the kernels' .cpp files and headers
# NOTE: -march=native: see _cpu_key for how builds for other CPUs stay apart.
# No -ffast-math: linked into a shared object it flushes denormals for the whole process.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]
# NOTE: a CPU class forced below this CPU's (model/kernels.py, SLOTSERVE_CPU_ISA=avx2) gets a
# build for that class's instructions instead of -march=native: its kernels are then the
# code such a CPU runs (the fallbacks without AVX-512), in a build directory of their own.
NATIVE = "native"
# SLOTSERVE_CPU_OPS=0 turns the kernels off without touching the code (for A/B runs).
ENV_SWITCH = "SLOTSERVE_CPU_OPS"


def _put_venv_scripts_on_path() -> None:
    """torch finds ninja on PATH; the `ninja` dependency installs it next to this Python."""
    scripts = sysconfig.get_path("scripts")
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def _cpu_key() -> str:
    """NOTE: -march=native code runs only on CPUs like the one that built it: the CPU's
    features go into the build's name, so builds for other CPUs stay apart."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            features = next(line for line in cpuinfo if line.startswith("flags"))
    except (OSError, StopIteration):
        features = platform.machine() + platform.processor()
    return hashlib.sha1(features.encode()).hexdigest()[:10]


def kernel_files(csrc: Path = CSRC) -> list[Path]:
    """Every file of the kernels (the .cpp files and the headers they include), sorted by name."""
    return sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h"))


def _source_key(csrc: Path = CSRC, cflags: list[str] = CFLAGS,
                ldflags: list[str] = LDFLAGS) -> str:
    """A hash of every kernel file's name and bytes, the compiler and linker flags and torch's
    version.

    Not the files' path: two checkouts with the same kernels share one build. NOTE: the headers
    count too (a changed header must rebuild), and the files go in in name order: the key does
    not depend on the order the directory lists them in.
    """
    import torch

    h = hashlib.sha256()
    for file in kernel_files(csrc):
        h.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    for part in ("--", *cflags, "--", *ldflags, "--", torch.__version__):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:12]


def _build_name(csrc: Path = CSRC, cflags: list[str] = CFLAGS,
                ldflags: list[str] = LDFLAGS) -> str:
    """The extension's name, which is also its build directory's: `slotserve_cpu_ops_<cpu>_<src>`.

    NOTE: keyed by content, never by path. The directory was once keyed by the CPU alone, and
    two checkouts (or two versions) of the project rebuilt each other's kernels on every
    alternate start (~90 s): torch's build.ninja names the source paths, and other paths (or
    other bytes) under the same name meant a rebuild. See also `_stage_sources`.
    """
    return f"slotserve_cpu_ops_{_cpu_key()}_{_source_key(csrc, cflags, ldflags)}"


def _stage_sources(build_dir: Path, csrc: Path = CSRC) -> list[Path]:
    """Every kernel file, copied into the build directory; returns the .cpp copies (what torch
    compiles: their `#include "x.h"` finds the header copies beside them).

    NOTE: compiling the copies makes build.ninja the same for every checkout. A copy is written
    only when missing or different (a fresh mtime alone would make ninja rebuild), and atomically
    (a process killed half-way leaves no truncated source behind).
    """
    staged = []
    for file in kernel_files(csrc):
        copy = build_dir / file.name
        content = file.read_bytes()
        if not (copy.is_file() and copy.read_bytes() == content):
            partial = build_dir / f".{file.name}.{os.getpid()}.tmp"
            partial.write_bytes(content)
            os.replace(partial, copy)
        staged.append(copy)
    return [copy for copy in staged if copy.suffix == ".cpp"]


@contextlib.contextmanager
def exclusive_build(build_dir: Path):
    """Held while loading (and maybe building) the kernels: one slotserve process at a time.

    NOTE: torch builds under a lock file (`lock` in the build directory) and waits without end
    while it exists: a build killed half-way (Ctrl-C during the first start) left it behind
    and every later start hung. This lock is an flock, which the OS releases when its holder
    dies: whoever holds it knows that a torch lock still there is a dead build's.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "slotserve.flock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process's kernel build in %s", build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        leftover = build_dir / "lock"
        if leftover.exists():
            log.warning("removing the lock of a kernel build that did not finish: %s", leftover)
            leftover.unlink(missing_ok=True)
        yield


def cflags_for(march: str = NATIVE) -> list[str]:
    """The compiler flags of a build for `march` (gcc's -march: "native", "x86-64-v3"...)."""
    return [f"-march={march}" if flag == "-march=native" else flag for flag in CFLAGS]


@functools.cache
def load_cpu_ops(march: str = NATIVE):
    """The compiled kernels' module, or None (logged once) if they cannot be built here.

    march: the instructions the build may use (gcc's -march); "native" (the default): all
    of this CPU's. A CPU class forced lower (model/kernels.py) asks for its own.
    """
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        _put_venv_scripts_on_path()
        cflags = cflags_for(march)
        name = _build_name(cflags=cflags)
        build_dir = Path(_get_build_directory(name, verbose=False))
        with exclusive_build(build_dir):
            sources = _stage_sources(build_dir)
            # NOTE: copies of the flag lists: torch appends its own to extra_ldflags, in place.
            module = load(name=name, sources=[str(s) for s in sources], extra_cflags=cflags,
                          extra_ldflags=list(LDFLAGS), build_directory=str(build_dir),
                          verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: fall back, say why
        log.warning("fused CPU kernels unavailable, using plain torch ops: %s", exc)
        return None
    _LOADED.append(module)
    return module


# The builds load_cpu_ops loaded in this process, in order.
_LOADED: list = []


def already_loaded_cpu_ops():
    """The build of the kernels loaded last, or None where none is loaded (never builds
    one: for work that has another way, e.g. dequantizing a GGUF on a GPU engine's host)."""
    return _LOADED[-1] if _LOADED else None


def loaded_cpu_ops():
    """A build of the kernels for work that every build does alike (a GGUF's blocks
    unpacked at load: loader/gguf_blocks.py's to_blocks): the last one loaded, else this
    CPU's (load_cpu_ops()); None where none can be built. NOTE: a CPU class forced lower
    loads a build of its own first (model/kernels.py): this takes it, never building a
    second one for the unpacking."""
    return _LOADED[-1] if _LOADED else load_cpu_ops()


def release_unpack_memory() -> None:
    """Unmap the memory each loaded build keeps for the next GGUF weight's unpacked arrays
    (csrc/gguf_unpack.cpp's NOTE (reused memory)): a model's loading is done."""
    for module in _LOADED:
        module.release_unpack_memory()


def on_cpu_fp32(model) -> bool:
    """Whether the model's parameters are float32 on the CPU (where these kernels apply).
    NOTE: its layers' (a 16-bit embedding table stays as stored: WidenedEmbedding)."""
    import torch

    param = next(p for name, p in model.named_parameters() if not name.startswith("embed"))
    return param.device.type == "cpu" and param.dtype == torch.float32
