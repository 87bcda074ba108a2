"""Grammar compilation, the compiled-grammar cache and per-sequence matcher state (llguidance).

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)   # one per engine
    matchers = compiler.matchers(spec, n)  # ValueError naming the field if the spec is rejected
    matcher = compiler.matcher(spec)     # one
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

What a grammar costs (measured, same tokenizer, 2 shared cores): llguidance compiles the
grammar's lexer and parser when an LLMatcher is built (a 337 KB JSON schema: 0.7 s and about
40 MB) and builds lexer states lazily, at the masks (a regex `c{300000}`: 0.25-0.3 s for the
first mask with llguidance's default fuel); `deep_copy` of a matcher takes 0.1 ms and shares
the compiled grammar (16 copies: no measurable memory). So each spec is compiled once, into a
template matcher whose first mask is computed then (`CompiledGrammar`), and every sequence
gets a copy of it; the compile runs wherever `compile` is called (the server calls it off the
event loop and AsyncEngine off the engine thread), and PARSER_LIMITS bound its cost.
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

# llguidance's resource limits (its defaults unless noted): a grammar past them is rejected
# at compile time (400), or fails the one sequence at a later mask, instead of burning seconds.
# initial_lexer_fuel: 200k, not 1M: `c{300000}`'s first mask took 0.25 s with 1M and 0.025 s
# with 200k, while a 337 KB JSON schema (2000 properties) still compiles; max_lexer_states:
# 50k, not 250k (1-2 kB each: at most about 100 MB per grammar).
PARSER_LIMITS = dict(initial_lexer_fuel=200_000, step_lexer_fuel=200_000, step_max_items=50_000,
                     max_items_in_row=2_000, max_lexer_states=50_000, max_grammar_size=500_000)
# The compiled-grammar cache: at most this many entries and about this many bytes (see
# CompiledGrammar.size_bytes; a 337 KB schema's matcher held about 40-60 MB).
DEFAULT_CACHE_SIZE = 256
DEFAULT_CACHE_BYTES = 256 << 20
# A compiled grammar's memory, estimated from its serialized size (measured: about 120-180
# bytes of RSS per byte for large JSON schemas) plus a fixed part for small ones.
BYTES_PER_GRAMMAR_BYTE = 160
BYTES_PER_ENTRY = 64 << 10
# Where JSON allows whitespace, a constrained output may put at most one space (as
# json.dumps does after ":" and ","); see _bounded_whitespace.
WHITESPACE = "[ ]?"


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's limits for every grammar (see PARSER_LIMITS)."""
    return llguidance.LLParserLimits(**PARSER_LIMITS)


class CompiledGrammar:
    """A spec compiled for one tokenizer: the llguidance grammar and a template matcher
    (grammar compiled, first mask computed), which `new_matcher` copies.

    NOTE: the template is never advanced; deep_copy only reads it, so copies may be taken
    from any thread.
    """

    def __init__(self, spec: StructuredOutputs, grammar: str,
                 template: llguidance.LLMatcher) -> None:
        self.spec = spec
        self.grammar = grammar
        self._template = template
        # NOTE: an estimate (llguidance does not report its memory): see BYTES_PER_*
        self.size_bytes = (BYTES_PER_ENTRY + len(spec.key[1])
                           + BYTES_PER_GRAMMAR_BYTE * len(grammar))

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher for one sequence (a copy of the template: 0.1 ms)."""
        return GrammarMatcher(self._template.deep_copy(), self.spec)


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer and caches the results by spec.

    The vocabulary (each token's bytes, from the tokenizer's tokenizer.json) is built on first
    use (about 0.3 s for 49k tokens) and kept. Compiled grammars are cached by `spec.key`,
    least recently used first out, at most `cache_size` entries and about `cache_bytes`
    bytes (`CompiledGrammar.size_bytes`; one entry larger than that is not kept); a rejected
    spec is cached too, so a client repeating a bad schema costs a dict lookup.
    Thread-safe: the server and AsyncEngine compile on worker threads.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()  # NOTE: the server may compile on another thread
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar | ValueError] = OrderedDict()
        self._cached_bytes = 0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _build_ll_tokenizer(self._tokenizer, self.vocab_size,
                                                         self.eos_token_ids)
            return self._ll_tokenizer

    @property
    def cached_bytes(self) -> int:
        """The cache's estimated size in bytes (see CompiledGrammar.size_bytes)."""
        with self._lock:
            return self._cached_bytes

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """`spec` compiled (from the cache if it is there); ValueError naming the field if
        it is rejected. Slow for a large spec: call it off the event loop and the engine
        thread."""
        key = spec.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            cached = self._compile_uncached(spec)
            self._keep(key, cached)
        if isinstance(cached, ValueError):
            raise ValueError(str(cached))
        return cached

    def _keep(self, key: tuple[str, str], entry: CompiledGrammar | ValueError) -> None:
        """Cache `entry`, then drop the least recently used entries past either bound."""
        with self._lock:
            old = self._cache.pop(key, None)  # NOTE: two threads may compile one spec
            if old is not None:
                self._cached_bytes -= _entry_bytes(old)
            self._cache[key] = entry
            self._cached_bytes += _entry_bytes(entry)
            while self._cache and (len(self._cache) > self.cache_size
                                   or self._cached_bytes > self.cache_bytes):
                _, dropped = self._cache.popitem(last=False)
                self._cached_bytes -= _entry_bytes(dropped)

    def _compile_uncached(self, spec: StructuredOutputs) -> CompiledGrammar | ValueError:
        kind = spec.kind
        text = _ANY_JSON_OBJECT if kind == "json_object" else spec.key[1]
        if _FORMATS[kind] == "json_schema":
            text = _bounded_whitespace(text)
        try:
            grammar = llguidance.grammar_from(_FORMATS[kind], text)
        except Exception as exc:  # llguidance raises ValueError (or others) on unusable text
            return ValueError(f"structured_outputs.{kind}: {exc}")
        limits = parser_limits()
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer, limits=limits)
        if error:
            return ValueError(f"structured_outputs.{kind}: {_summary(error)}")
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=limits)
        compiled = CompiledGrammar(spec, grammar, template)
        problem = self._first_mask_problem(compiled) or self._probe_forced_start(compiled)
        if problem:
            return ValueError(f"structured_outputs.{kind}: {problem}")
        return compiled

    def _first_mask_problem(self, compiled: CompiledGrammar) -> str | None:
        """Compute the template's first mask (its lexer states are then built, and every
        copy starts with them); the problem if the matcher fails (a resource limit)."""
        template = compiled._template
        if not template.is_error():
            llguidance.numpy.fill_next_token_bitmask(
                template, allocate_bitmask(1, self.vocab_size), 0)
        return _summary(template.get_error()) if template.is_error() else None

    def _probe_forced_start(self, compiled: CompiledGrammar) -> str | None:
        """Walk the grammar's forced start (while its mask allows at most FORCED_WIDTH
        tokens, up to PROBE_STEPS tokens) on a copy of the template and check that the
        matcher accepts every token its mask allows there and does not fail on it; the
        problem found, or None.

        NOTE: see GrammarRejectedToken: llguidance 1.9 can mask a wrong byte where a pattern
        forces a rare multi-byte character; such a constraint is refused (400) up front. A
        grammar whose matcher fails within its forced start (a resource limit: `c{300000}`
        hits "too many expressions" at its second token) is refused too.
        """
        matcher = compiled.new_matcher()
        for _ in range(PROBE_STEPS):
            if matcher.ll_matcher.is_error():
                return _summary(matcher.ll_matcher.get_error())
            if matcher.is_finished:
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

    def matchers(self, spec: StructuredOutputs, n: int) -> list[GrammarMatcher]:
        """`n` fresh matchers (one per completion): `spec` compiled once (or taken from the
        cache), then copied. ValueError naming the field if the spec is rejected."""
        compiled = self.compile(spec)
        return [compiled.new_matcher() for _ in range(n)]

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher for one sequence (compiling `spec`, or taking it from the cache)."""
        return self.matchers(spec, 1)[0]


def _entry_bytes(entry: CompiledGrammar | ValueError) -> int:
    if isinstance(entry, CompiledGrammar):
        return entry.size_bytes
    return BYTES_PER_ENTRY // 16 + len(str(entry))


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
