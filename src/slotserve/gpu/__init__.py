"""The GPU path's kernels, in Triton (the optional `gpu` extra: `pip install slotserve[gpu]`).

`triton_ops` holds them, each the GPU twin of an op the CPU path has in plain torch
(attention/torch_paged.py, model/layers.py) and tested against that op. Nothing else in
slotserve imports this package yet: the engine does not run on CUDA (issue 36, item 1).

NOTE: Triton decides at decoration time, i.e. when `triton_ops` is first imported, whether
its kernels are compiled (CUDA tensors) or run by Triton's interpreter (CPU tensors; set
TRITON_INTERPRET=1 before that import, as tests/gpu/conftest.py does on a machine without
CUDA). `triton_ops.INTERPRETED` says which.
"""
