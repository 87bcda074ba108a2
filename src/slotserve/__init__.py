"""slotserve: continuous batching over a paged KV cache, readable end to end."""

import os

# NOTE: before torch allocates its first CPU tensor (it reads this once, then): torch's CPU
# allocator then backs tensors of 2 MB and more with transparent huge pages. A decode step
# streams all the weights from memory; with 4 KB pages that costs a TLB miss every 4 KB.
# Batch-1 decode with int8 weights ran 8% faster with it here (fp32: within the noise;
# benchmarks/PERF.md). THP_MEM_ALLOC_ENABLE=0 keeps 4 KB pages; importing slotserve after
# torch has allocated a tensor leaves them too.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from slotserve.engine.llm import LLM  # noqa: E402
from slotserve.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from slotserve.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
