"""benchmarks.cpu_classes' arithmetic part: the in-cache linear it times and its table."""

import pytest
import torch

from benchmarks import cpu_classes
from slotserve.model.cpu_ops import load_cpu_ops

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="fused CPU kernels unavailable")


@pytest.mark.parametrize("variant", ["fp32", "bf16 widen", "int8"])
def test_the_in_cache_linear_fills_its_bytes_and_computes_x_at_w(variant):
    linear, weight_bytes = cpu_classes.arithmetic_linear(variant, ops)
    assert weight_bytes == torch.get_num_threads() * cpu_classes.ARITHMETIC_BYTES_PER_THREAD
    out = weight_bytes // (cpu_classes.ARITHMETIC_IN * cpu_classes.WEIGHT_BYTES[variant])
    weights = torch.randn(cpu_classes.ARITHMETIC_IN, out,
                          generator=torch.Generator().manual_seed(1)) * 0.05
    x = torch.randn(1, cpu_classes.ARITHMETIC_IN)
    reference = x @ weights
    assert (linear(x) - reference).norm() / reference.norm() < 0.02  # int8: ~0.5%


def test_the_table_has_a_rate_per_variant_and_pass(monkeypatch):
    monkeypatch.setattr(cpu_classes, "ARITHMETIC_CALLS", 3)
    table = cpu_classes.arithmetic_table(("fp32", "bf16 widen"), passes=2)
    assert set(table) == {"fp32", "bf16 widen"}
    assert all(len(rates) == 2 and all(r > 0 for r in rates) for rates in table.values())


def test_the_amx_variant_is_asked_for_and_refused_where_amx_is_not_usable(monkeypatch, capsys):
    assert cpu_classes.AMX_VARIANT in cpu_classes.MATMUL_VARIANTS
    assert cpu_classes.AMX_VARIANT not in cpu_classes.DEFAULT_VARIANTS
    monkeypatch.setattr(cpu_classes, "amx_usable", lambda cpu_isa: False)
    monkeypatch.setattr("sys.argv", ["cpu_classes", "--variants", "bf16 widen,bf16 amx",
                                     "--shapes", ""])
    with pytest.raises(SystemExit):
        cpu_classes.main()
    assert "AMX-BF16 is not usable" in capsys.readouterr().err


@pytest.mark.skipif(not cpu_classes.amx_usable(None), reason="AMX-BF16 not usable here")
def test_the_amx_variant_runs_amx_tiles_at_every_row_count():
    linear = cpu_classes.MATMUL_VARIANTS[cpu_classes.AMX_VARIANT](torch.randn(64, 40) * 0.05, ops)
    x = torch.randn(3, 64)
    assert torch.equal(linear(x), ops.panel_linear_bf16_amx(x, linear.panels, 40))
