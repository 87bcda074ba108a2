"""Benchmark reports say which CPU they ran on: its model name and kernel-choosing flags."""

from __future__ import annotations

from slotserve.lab.bench.stats import cpu_identity, machine_info

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni xsave
"""


def test_cpu_identity_reads_the_model_and_the_kernel_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert cpu_identity(str(path)) == {
        "cpu_model": "AMD EPYC 9R14",
        "cpu_flags": ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"]}


def test_an_unreadable_cpuinfo_gives_nothing(tmp_path):
    assert cpu_identity(str(tmp_path / "missing")) == {}


def test_machine_info_carries_the_cpu():
    info = machine_info()
    assert info["cpu_count"] >= 1
    assert set(cpu_identity()) <= set(info)
