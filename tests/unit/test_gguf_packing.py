"""Which GGUF types pack alike (`packing`), and the row segments a fused weight keeps."""

from __future__ import annotations

from slotserve.loader.gguf_blocks import LazyBlocks, packing


def _part(qtype: str, rows: int) -> LazyBlocks:
    def unused():
        raise AssertionError("segments() must not load blocks")
    return LazyBlocks((qtype,), (rows, 64), unused)


def test_packing_tells_types_apart_that_tie_on_block_and_bits():
    # Q4_K and Q4_1: blocks of 32 at 4 bits; factored int8 scales against fp16 ones
    assert packing(("Q4_K",)) != packing(("Q4_1",))
    assert len(packing(("Q4_K", "Q4_1"))) == 2  # sorts: the scales' form is a number
    assert packing(("Q4_0", "Q4_0")) == packing(("Q4_0",))


def test_segments_keep_each_packing_and_fuse_neighbours_that_share_one():
    qkv = LazyBlocks.fused([_part("Q4_K", 32), _part("Q4_K", 16), _part("Q6_K", 16)])
    assert [(s.types, s.shape) for s in qkv.segments()] == [
        (("Q4_K",), (48, 64)), (("Q6_K",), (16, 64))]
    mixed = LazyBlocks.fused([_part("Q4_K", 32), _part("Q4_1", 16)])
    assert [s.types for s in mixed.segments()] == [("Q4_K",), ("Q4_1",)]
    same = LazyBlocks.fused([_part("Q4_0", 32), _part("Q4_0", 16)])
    assert same.segments() == [same]
