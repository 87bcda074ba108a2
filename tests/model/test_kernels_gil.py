"""The long fused kernels (the panel linears, the GGUF block and int8 linears, argmax_rows)
release the GIL (csrc/bindings.cpp's `release_gil`): other Python threads run meanwhile, and
two threads calling them at once get exactly what each gets alone.

Whether a call released the GIL is observed, not timed: with the interpreter's switch
interval raised to 60 s, a thread that holds the GIL keeps it until it blocks or ends, so
the main thread can run Python while the worker is inside a kernel only if the kernel let the
GIL go. No speed is compared (two busy threads on a shared 2-core machine time unreliably).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from slotserve.loader.gguf_blocks import to_blocks
from slotserve.model.linear_kernels import GGUFBlockLinear, gguf_block_kernel_available

Kernel = Callable[[torch.Tensor], torch.Tensor]
IN, OUT = 1024, 1040  # 1040: the last panel of 16 (or 32) outputs partly padding


def _weight(seed: int = 0) -> torch.Tensor:
    return 0.05 * torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed))


def _gguf_blocks(ops) -> GGUFBlockLinear:
    from tests.model.test_gguf_quant import raw_tensor

    q4_k = GGMLQuantizationType.Q4_K
    return GGUFBlockLinear(to_blocks(raw_tensor(q4_k, OUT, IN, seed=1), q4_k, "w", "t.gguf"),
                           None, ops)


def kernels(ops) -> dict[str, Kernel]:
    """name -> x (T, IN) -> (T, OUT) (argmax_rows: (T,)) for each kernel that runs here."""
    found: dict[str, Kernel] = {}
    weight = _weight()
    panels = ops.pack_panels(weight)
    found["panel_linear"] = lambda x: ops.panel_linear(x, panels, OUT)
    bf16 = ops.pack_panels_bf16(weight)
    found["panel_linear_bf16"] = lambda x: ops.panel_linear_bf16(x, bf16, OUT)
    found["panel_linear_bf16 (x in bf16)"] = lambda x: ops.panel_linear_bf16(x, bf16, OUT, True)
    if ops.amx_bf16_usable():
        found["panel_linear_bf16_amx"] = lambda x: ops.panel_linear_bf16_amx(x, bf16, OUT)
    scales = weight.abs().amax(dim=1) / 127
    qweight = torch.round(weight / scales[:, None]).to(torch.int8)
    found["int8_linear"] = lambda x: ops.int8_linear(x, qweight, scales)
    if gguf_block_kernel_available(ops):
        blocks = _gguf_blocks(ops)
        found["quant_block_linear"] = lambda x: ops.quant_block_linear(
            x, blocks.codes, blocks.scales_mins, OUT, blocks.block_len, blocks.bits,
            blocks.activation_bits)
    found["argmax_rows"] = ops.argmax_rows  # (T, IN) logits here; wider_logits below
    return found


def _inputs(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, IN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def all_kernels(cpu_ops) -> dict[str, Kernel]:
    return kernels(cpu_ops)


@pytest.fixture
def long_switch_interval():
    """The GIL changes hands only when its holder blocks (or ends) while the test runs; the
    kernels run on one thread, leaving a core to the main thread (2 cores here)."""
    interval, threads = sys.getswitchinterval(), torch.get_num_threads()
    sys.setswitchinterval(60.0)
    torch.set_num_threads(1)
    yield
    sys.setswitchinterval(interval)
    torch.set_num_threads(threads)


def ran_python_during_the_call(kernel: Kernel, x: torch.Tensor) -> bool:
    """Whether the main thread ran Python while a worker thread was inside `kernel(x)`.

    NOTE: the worker takes the GIL after `ready.set()` and, the switch interval being 60 s,
    keeps it through the call unless the call releases it; the main thread, woken by
    `ready`, waits for the GIL, then notes the time and sleeps (which lets the worker back
    in after the call). A note strictly between the worker's before and after times is
    therefore only possible if the kernel released the GIL.
    """
    ready, window, notes = threading.Event(), [], []

    def worker():
        ready.set()
        start = time.perf_counter()
        result = kernel(x)
        window.extend((start, time.perf_counter()))
        del result  # NOTE: after the end time: freeing a tensor lets the GIL go (torch)

    thread = threading.Thread(target=worker)
    thread.start()
    ready.wait()
    while thread.is_alive():
        notes.append(time.perf_counter())
        time.sleep(0.0005)
    thread.join()
    start, end = window
    return any(start < note < end for note in notes)


@pytest.mark.parametrize("name", ["panel_linear", "panel_linear_bf16",
                                  "panel_linear_bf16 (x in bf16)", "panel_linear_bf16_amx",
                                  "int8_linear", "quant_block_linear", "argmax_rows"])
def test_the_kernel_releases_the_gil(all_kernels, long_switch_interval, name):
    if name not in all_kernels:
        pytest.skip(f"{name} does not run here")
    # argmax_rows: 64 rows of 256 K logits; the linears 512 rows: calls of 5-50 ms on one
    # thread, long enough for the main thread to be scheduled during them
    x = (torch.randn(64, 256 * 1024, generator=torch.Generator().manual_seed(2))
         if name == "argmax_rows" else _inputs(512, seed=2))
    # NOTE: 8 tries: a call whose whole duration passes before the OS wakes the main thread
    # (a loaded machine) is not a failure; a kernel that keeps the GIL never succeeds.
    assert any(ran_python_during_the_call(all_kernels[name], x) for _ in range(8))


def test_the_test_sees_a_call_that_keeps_the_gil(long_switch_interval):
    """The observation itself can fail: a pure-Python busy loop (which never releases the
    GIL under a 60 s switch interval) is not seen as releasing it."""
    def busy(x):
        deadline = time.perf_counter() + 0.05
        while time.perf_counter() < deadline:
            pass

    assert not ran_python_during_the_call(busy, torch.empty(0))


def in_two_threads(kernel: Kernel, inputs: list[list[torch.Tensor]], repeats: int = 4
                   ) -> list[list[list[torch.Tensor]]]:
    """Thread t calls `kernel` on each of inputs[t], `repeats` times, both threads starting
    together: per thread, per repeat, the outputs."""
    results: list[list[list[torch.Tensor]]] = [[], []]
    barrier = threading.Barrier(2)

    def run(t):
        barrier.wait()
        for _ in range(repeats):
            results[t].append([kernel(x) for x in inputs[t]])

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_two_threads_at_once_get_what_each_gets_alone(all_kernels):
    """Every kernel, called from two threads at once on different inputs (batches of 1 to 70
    rows, the decode and prefill tiles), gives the bits it gives called alone."""
    inputs = [[_inputs(rows, seed=10 * t + rows) for rows in (1, 3, 16, 33, 70)]
              for t in range(2)]
    for name, kernel in all_kernels.items():
        expected = [[kernel(x) for x in xs] for xs in inputs]
        results = in_two_threads(kernel, inputs)
        for t in range(2):
            assert len(results[t]) == 4, name
            for got in results[t]:
                assert all(torch.equal(g, e) for g, e in zip(got, expected[t], strict=True)), (
                    name, t)


def test_a_failed_check_with_the_gil_released_is_a_python_error(cpu_ops):
    """A kernel's argument check throws while the GIL is released: a RuntimeError naming the
    problem, and the interpreter still runs."""
    panels = cpu_ops.pack_panels(_weight())
    with pytest.raises(RuntimeError, match="disagree on in_features"):
        cpu_ops.panel_linear(torch.randn(2, IN + 1), panels, OUT)
    with pytest.raises(RuntimeError, match="logits must be"):
        cpu_ops.argmax_rows(torch.empty(3, 0))
    assert np.array_equal(cpu_ops.argmax_rows(torch.eye(3)).numpy(), [0, 1, 2])
