"""The kernel build's locks (a build killed half-way must not hang the next start) and its
name (checkouts with the same kernel share one build)."""

from __future__ import annotations

import os
import threading
import time

from slotserve.model.cpu_ops import (
    CFLAGS,
    LDFLAGS,
    SOURCE,
    _build_name,
    _stage_source,
    exclusive_build,
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


def _checkout(root, source_text: str):
    """A copy of the kernel source where a checkout at `root` would hold it."""
    source = root / "slotserve" / "csrc" / "cpu_ops.cpp"
    source.parent.mkdir(parents=True)
    source.write_text(source_text)
    return source


def test_build_name_follows_source_content_not_path(tmp_path):
    text = SOURCE.read_text()
    a = _checkout(tmp_path / "checkout_a", text)
    b = _checkout(tmp_path / "checkout_b", text)
    changed = _checkout(tmp_path / "checkout_c", text + "\n// one more line\n")

    assert _build_name(a) == _build_name(b) == _build_name(SOURCE)
    assert _build_name(changed) != _build_name(a)
    assert _build_name(a).startswith("slotserve_cpu_ops_")
    assert _build_name(a).isidentifier()  # it is also the extension module's name


def test_build_name_follows_flags():
    assert _build_name(SOURCE, cflags=[*CFLAGS, "-DEXTRA"]) != _build_name(SOURCE)
    assert _build_name(SOURCE, cflags=CFLAGS, ldflags=[*LDFLAGS, "-lm"]) != _build_name(SOURCE)
    assert _build_name(SOURCE, cflags=list(CFLAGS), ldflags=list(LDFLAGS)) == _build_name(SOURCE)


def test_staged_source_is_copied_once(tmp_path):
    a = _checkout(tmp_path / "checkout_a", "int a;\n")
    b = _checkout(tmp_path / "checkout_b", "int a;\n")
    build_dir = tmp_path / "build"
    build_dir.mkdir()

    staged = _stage_source(build_dir, a)
    assert staged == build_dir / "cpu_ops.cpp" and staged.read_text() == "int a;\n"
    os.utime(staged, (1_000_000, 1_000_000))
    assert _stage_source(build_dir, b) == staged  # another checkout, the same bytes
    assert staged.stat().st_mtime == 1_000_000  # untouched: ninja sees nothing new

    staged.write_text("int trunc")  # damaged: replaced by the source's bytes
    assert _stage_source(build_dir, a).read_text() == "int a;\n"
    assert sorted(p.name for p in build_dir.iterdir()) == ["cpu_ops.cpp"]  # no temp file left
