"""Test infrastructure shared by the tests and the benchmarks (not part of the slotserve package).

- `launch`: `slotserve serve` as a subprocess on a free loopback port.
- `gguf_once`: HF transformers' loads of one GGUF file with its metadata parsed once.
"""
