"""Speculative decoding without a second model (issue 35).

- `proposers.py` (no torch): n-gram prompt lookup (vLLM's `ngram`) and suffix decoding over
  the sequence plus a bounded store of recent outputs (vLLM's `suffix`);
- `config.py` (no torch): `SpeculativeConfig`, vLLM's `--speculative-config` JSON form;
- `planner.py` (no torch): `Speculator`, what the scheduler asks every iteration: which
  running decodes speculate, how many tokens (fixed, or "auto" from a step-cost model and
  each sequence's observed acceptance), and their acceptance statistics;
- `verify.py` (torch, the runner's): the acceptance rule over the k + 1 rows of logits of a
  verified sequence (greedy: the argmax; sampled: point-mass proposal rejection sampling).

NOTE: this package's `__init__` imports nothing, so core/ may import the torch-free modules.
"""
