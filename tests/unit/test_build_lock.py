"""The kernel build's locks: a build killed half-way must not hang the next start."""

from __future__ import annotations

import threading
import time

from slotserve.model.cpu_ops import exclusive_build


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
