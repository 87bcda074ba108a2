"""The GPU path's kernels, in Triton (the optional `gpu` extra: `pip install slotserve[gpu]`).

`triton_ops` holds them, each the GPU twin of an op the CPU path has in plain torch
(attention/torch_paged.py, model/layers.py) and tested against that op. The engine runs
them on CUDA (model/kernels.cuda_kernels); nothing imports this package on a CPU-only path.

NOTE: Triton decides at decoration time, i.e. when `triton_ops` is first imported, whether
its kernels are compiled (CUDA tensors) or run by Triton's interpreter (CPU tensors; set
TRITON_INTERPRET=1 before that import, as tests/gpu/conftest.py does on a machine without
CUDA). `triton_ops.INTERPRETED` says which.
"""
