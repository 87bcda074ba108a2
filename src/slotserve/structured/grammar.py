"""Grammar compilation, the compiled-grammar cache and per-sequence matcher state (llguidance).

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)   # one per engine
    matcher = compiler.matcher(spec)     # ValueError naming the field if the spec is rejected
    fill_bitmasks([(matcher, row)], bitmask)   # allowed next tokens, one bit each
    matcher.advance(output_token_ids)    # consume the tokens it has not seen yet

Why llguidance (measured on the embedded SmolLM2 tokenizer, 49,152 tokens, a 3-property JSON
schema, 28 tokens, 2 shared CPU cores): llguidance 1.9 computed a mask in 10 us (median;
mean 19 us on a second matcher, 67 us on the first, whose lazily built lexer states made its
first mask 1.4 ms), xgrammar 0.2.9 in 2.5 us (mean 5 us); compile: 0.9 ms vs 5 ms, vocabulary
0.2-0.4 s vs 0.06 s. Both are far below a forward of the model (milliseconds), so the mask
time does not decide; llguidance has no dependencies (a 7.6 MB wheel) while xgrammar pulls
triton (1 GB) and apache-tvm-ffi and imports transformers (1.5 s to import), and llguidance
reads the tokenizer's own tokenizer.json and takes Lark and GBNF grammars alike.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.numpy
import numpy as np

from slotserve.structured.params import StructuredOutputs

# llguidance.grammar_from's format for each StructuredOutputs kind.
_FORMATS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex",
            "choice": "choice", "grammar": "grammar"}
_ANY_JSON_OBJECT = '{"type": "object"}'
# Where JSON allows whitespace, a constrained output may put at most one space (as
# json.dumps does after ":" and ","); see _bounded_whitespace.
WHITESPACE = "[ ]?"


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer and caches the results by spec.

    The vocabulary (each token's bytes, from the tokenizer's tokenizer.json) is built on first
    use (about 0.3 s for 49k tokens) and kept. Compiled grammars are cached by `spec.key`
    (least recently used first out, `cache_size` kept); a rejected spec is cached too, so a
    client repeating a bad schema costs a dict lookup.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = 256) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()  # NOTE: the server may compile on another thread
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], str | ValueError] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _build_ll_tokenizer(self._tokenizer, self.vocab_size,
                                                         self.eos_token_ids)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputs) -> str:
        """The llguidance grammar of `spec`; ValueError naming the field if it is rejected."""
        key = spec.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            cached = self._compile_uncached(spec)
            with self._lock:
                self._cache[key] = cached
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(cached, ValueError):
            raise ValueError(str(cached))
        return cached

    def _compile_uncached(self, spec: StructuredOutputs) -> str | ValueError:
        kind = spec.kind
        text = _ANY_JSON_OBJECT if kind == "json_object" else spec.key[1]
        if _FORMATS[kind] == "json_schema":
            text = _bounded_whitespace(text)
        try:
            grammar = llguidance.grammar_from(_FORMATS[kind], text)
        except Exception as exc:  # llguidance raises ValueError (or others) on unusable text
            return ValueError(f"structured_outputs.{kind}: {exc}")
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            return ValueError(f"structured_outputs.{kind}: {_summary(error)}")
        problem = self._probe_forced_start(grammar)
        if problem:
            return ValueError(f"structured_outputs.{kind}: {problem}")
        return grammar

    def _probe_forced_start(self, grammar: str) -> str | None:
        """Walk the grammar's forced start (while its mask allows at most FORCED_WIDTH
        tokens, up to PROBE_STEPS tokens) and check that the matcher accepts every token its
        mask allows there; the problem found, or None.

        NOTE: see GrammarRejectedToken: llguidance 1.9 can mask a wrong byte where a pattern
        forces a rare multi-byte character; such a constraint is refused (400) up front.
        """
        matcher = GrammarMatcher(llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0),
                                 None)
        for _ in range(PROBE_STEPS):
            if matcher.is_finished or matcher.ll_matcher.is_error():
                return None
            bitmask = allocate_bitmask(1, self.vocab_size)
            fill_bitmasks([(matcher, 0)], bitmask)
            allowed = np.flatnonzero(unpack_bitmask(bitmask, self.vocab_size)[0]).tolist()
            if not allowed or len(allowed) > FORCED_WIDTH:
                return None
            for token in allowed:
                if matcher.ll_matcher.validate_tokens([token]) != 1:
                    return ("the grammar engine cannot follow this constraint with this "
                            f"model's tokenizer (its mask allows token {token}, which its "
                            "matcher then refuses)")
            matcher.ll_matcher.consume_token(allowed[0])
        return None

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher for one sequence (compiling `spec`, or taking it from the cache)."""
        grammar = self.compile(spec)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():  # NOTE: validate_grammar passed, so only a resource limit
            raise ValueError(f"structured_outputs.{spec.kind}: {matcher.get_error()}")
        return GrammarMatcher(matcher, spec)


PROBE_STEPS = 32  # forced tokens walked by _probe_forced_start at compile time
FORCED_WIDTH = 4  # a mask allowing at most this many tokens counts as forced


class GrammarRejectedToken(ValueError):
    """The matcher refused a token its own mask allowed.

    NOTE: seen with llguidance 1.9 on SmolLM2's byte-level vocabulary for a regex whose
    forced bytes start a rare 4-byte character (U+85346): the first mask allowed the
    character's second byte. The request that asked for that constraint fails alone (the
    server answers 400, param structured_outputs); nobody else is touched.
    """


class GrammarMatcher:
    """One sequence's position in its grammar.

    NOTE: `num_consumed` counts the output tokens already fed to the matcher; `advance` takes
    the whole output and feeds only the rest, so a preempted sequence, whose generated tokens
    are recomputed but not re-sampled, is never advanced twice.
    """

    def __init__(self, matcher: llguidance.LLMatcher, spec: StructuredOutputs) -> None:
        self._matcher = matcher
        self.spec = spec
        self.num_consumed = 0

    def advance(self, output_token_ids: list[int]) -> None:
        """Consume the tokens after the first `num_consumed`; ValueError if one is rejected."""
        new = output_token_ids[self.num_consumed:]
        if not new:
            return
        if not self._matcher.consume_tokens(new):
            raise GrammarRejectedToken(f"the grammar rejected a sampled token: "
                                       f"{_summary(self._matcher.get_error())}")
        self.num_consumed = len(output_token_ids)

    @property
    def is_finished(self) -> bool:
        """Nothing more may follow (the output is complete, or the matcher is in error)."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    def check(self) -> None:
        """ValueError if the matcher is in an error state (it then allows no token)."""
        if self._matcher.is_error():
            raise ValueError(f"structured output failed: {_summary(self._matcher.get_error())}")

    @property
    def ll_matcher(self) -> llguidance.LLMatcher:
        return self._matcher


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """(rows, ceil(vocab / 32)) int32, one bit per token (bit t % 32 of word t // 32)."""
    return np.zeros((rows, (vocab_size + 31) // 32), dtype=np.int32)


def fill_bitmasks(rows: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
    """Write each matcher's allowed next tokens into its row of `bitmask` (in parallel; the
    GIL is released meanwhile). ValueError if a matcher is in an error state."""
    for matcher, _ in rows:
        matcher.check()
    pairs = [(m.ll_matcher, row) for m, row in rows]
    llguidance.numpy.fill_next_token_bitmask_par(_executor(), pairs, bitmask)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """(rows, words) int32 -> (rows, vocab_size) bool: True where the token is allowed."""
    as_bytes = np.ascontiguousarray(bitmask).astype("<i4", copy=False).view(np.uint8)
    bits = np.unpackbits(as_bytes, axis=1, bitorder="little")
    if bits.shape[1] < vocab_size:  # NOTE: tokens past the grammar's vocabulary: disallowed
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    return bits[:, :vocab_size].astype(bool)


_EXECUTOR: list[llguidance.LLExecutor] = []
_EXECUTOR_LOCK = threading.Lock()


def _bounded_whitespace(schema_text: str) -> str:
    """The schema with llguidance's whitespace pattern set to WHITESPACE (unless the schema
    sets its own "x-guidance" options). NOTE: with free whitespace a model may emit
    whitespace until max_tokens (random weights always do), so the output never parses."""
    schema = json.loads(schema_text)
    if schema is True:
        schema = {}
    if not isinstance(schema, dict) or "x-guidance" in schema:
        return schema_text
    return json.dumps({"x-guidance": {"whitespace_pattern": WHITESPACE}, **schema})


def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool for many rows' masks at once (one per process)."""
    with _EXECUTOR_LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(llguidance.LLExecutor())
        return _EXECUTOR[0]


def _build_ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]
                        ) -> llguidance.LLTokenizer:
    if tokenizer is None:
        raise ValueError("structured_outputs: this model has no tokenizer, so no grammar can "
                         "be applied")
    backend = getattr(tokenizer, "backend", tokenizer)  # slotserve's Tokenizer or `tokenizers`
    eos = list(eos_token_ids) or None
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)


def _summary(message: str, limit: int = 400) -> str:
    """llguidance's message on one line (it spans several, with a caret under the spot)."""
    text = " ".join(message.split())
    return (text[:limit] + " ...") if len(text) > limit else (text or "unknown error")
