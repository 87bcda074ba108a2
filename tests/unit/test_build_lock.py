"""The kernel build's locks (a build killed half-way must not hang the next start) and its
name (checkouts with the same kernel share one build)."""

from __future__ import annotations

import os
import threading
import time

from slotserve.model.cpu_ops import (
    CFLAGS,
    CSRC,
    LDFLAGS,
    _build_name,
    _stage_sources,
    exclusive_build,
    kernel_files,
)


def test_the_lock_of_a_dead_build_is_removed(tmp_path):
    leftover = tmp_path / "lock"  # torch's lock file, its builder gone (no flock held)
    leftover.touch()
    start = time.monotonic()

    with exclusive_build(tmp_path):
        assert not leftover.exists()

    assert time.monotonic() - start < 0.5


def test_waits_for_a_build_in_progress(tmp_path):
    holding, release = threading.Event(), threading.Event()

    def other_process_building():
        with exclusive_build(tmp_path):
            (tmp_path / "lock").touch()  # torch's lock, held by a live build
            holding.set()
            release.wait()
            (tmp_path / "lock").unlink()  # the build finished

    builder = threading.Thread(target=other_process_building)
    builder.start()
    holding.wait()
    threading.Timer(0.5, release.set).start()
    start = time.monotonic()

    with exclusive_build(tmp_path):
        waited = time.monotonic() - start

    builder.join()
    assert waited >= 0.4  # it waited for the live build instead of removing its lock


# -- the build's name: keyed by the kernel's content and flags, never by the checkout's path -----


def _checkout(root, files: dict[str, str]):
    """The kernel files `files` (name: text) where a checkout at `root` would hold them."""
    csrc = root / "slotserve" / "csrc"
    csrc.mkdir(parents=True)
    for name, text in files.items():
        (csrc / name).write_text(text)
    return csrc


def _real_files() -> dict[str, str]:
    return {file.name: file.read_text() for file in kernel_files(CSRC)}


def test_kernel_files_are_every_source_and_header_in_name_order():
    names = [file.name for file in kernel_files(CSRC)]
    assert names == sorted(names)
    assert "bindings.cpp" in names and "common.h" in names
    assert {file.suffix for file in CSRC.iterdir() if file.name[0] != "."} <= {".cpp", ".h"}


def test_build_name_follows_source_content_not_path(tmp_path):
    files = _real_files()
    a = _checkout(tmp_path / "checkout_a", files)
    b = _checkout(tmp_path / "checkout_b", files)
    changed_source = _checkout(tmp_path / "checkout_c",
                               {**files, "bindings.cpp": files["bindings.cpp"] + "\n// one more\n"})
    changed_header = _checkout(tmp_path / "checkout_d",
                               {**files, "common.h": files["common.h"] + "\n// one more\n"})
    renamed = dict(files)
    renamed["zz_common.h"] = renamed.pop("common.h")
    changed_name = _checkout(tmp_path / "checkout_e", renamed)

    assert _build_name(a) == _build_name(b) == _build_name(CSRC)
    others = {_build_name(d) for d in (changed_source, changed_header, changed_name)}
    assert len(others) == 3 and _build_name(a) not in others
    assert _build_name(a).startswith("slotserve_cpu_ops_")
    assert _build_name(a).isidentifier()  # it is also the extension module's name


def test_build_name_follows_flags():
    assert _build_name(CSRC, cflags=[*CFLAGS, "-DEXTRA"]) != _build_name(CSRC)
    assert _build_name(CSRC, cflags=CFLAGS, ldflags=[*LDFLAGS, "-lm"]) != _build_name(CSRC)
    assert _build_name(CSRC, cflags=list(CFLAGS), ldflags=list(LDFLAGS)) == _build_name(CSRC)


def test_staged_sources_are_copied_once(tmp_path):
    files = {"a.cpp": "#include \"a.h\"\n", "a.h": "int a;\n", "b.cpp": "int b;\n"}
    a = _checkout(tmp_path / "checkout_a", files)
    b = _checkout(tmp_path / "checkout_b", files)
    build_dir = tmp_path / "build"
    build_dir.mkdir()

    staged = _stage_sources(build_dir, a)
    assert staged == [build_dir / "a.cpp", build_dir / "b.cpp"]  # what torch compiles
    assert {p.name: p.read_text() for p in build_dir.iterdir()} == files  # the header too
    header = build_dir / "a.h"
    for copy in (*staged, header):
        os.utime(copy, (1_000_000, 1_000_000))
    assert _stage_sources(build_dir, b) == staged  # another checkout, the same bytes
    for copy in (*staged, header):
        assert copy.stat().st_mtime == 1_000_000  # untouched: ninja sees nothing new

    header.write_text("int trunc")  # damaged: replaced by the source's bytes
    _stage_sources(build_dir, a)
    assert header.read_text() == "int a;\n"
    assert sorted(p.name for p in build_dir.iterdir()) == sorted(files)  # no temp file left
