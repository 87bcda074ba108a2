"""The endpoints' logic over one AsyncEngine (`Server`): models, generation requests from
their bodies to a response, /tokenize, /detokenize, the prefix-cache reset and the drain."""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request

from slotserve.core.context_fit import ContextOverflowError, check_fits_context, max_prompt_tokens
from slotserve.core.scheduling_fields import SchedulingFieldError, SchedulingFields
from slotserve.engine.async_engine import EngineClosedError
from slotserve.engine.client import EngineClient
from slotserve.loader.chat_template import renders_tool_calls, tool_call_format
from slotserve.obs.metrics import ServerMetrics
from slotserve.sampling import SamplingParams
from slotserve.server import protocol as p
from slotserve.server.answers import chat_response, completion_response, whole_answer
from slotserve.server.auth import tenant_of
from slotserve.server.echo import EchoOnlyGenerations
from slotserve.server.generation import Generation, Generations
from slotserve.server.limits import ServerLimits, client_request_id
from slotserve.server.protocol import APIError
from slotserve.server.protocol import responses_api as r
from slotserve.server.responses_api import events_response, response_events, response_object
from slotserve.server.sse import chat_chunks, completion_chunks, sse_response
from slotserve.server.tenants import UserTenants

logger = logging.getLogger("slotserve.server")

# Threads that tokenize prompts and render chat templates (off the event loop).
TOKENIZER_THREADS = 2
# How much a tokenizer's normalizer may shrink text (NFC composes 3-byte Hangul jamo, 9
# bytes, into one 3-byte syllable); the pre-check allows this factor more bytes.
NORMALIZATION_SLACK = 4
# How long POST /reset_prefix_cache waits for the engine thread (one iteration at most).
RESET_TIMEOUT_S = 60


class Server:
    """The endpoints' logic, over one engine client (an AsyncEngine or a ReplicaFront)."""

    def __init__(self, engine: EngineClient, model_name: str, aliases: tuple[str, ...],
                 metrics: ServerMetrics, retry_after_s: int,
                 limits: ServerLimits | None = None, user_tenants: bool = True) -> None:
        """user_tenants: a request's `user` field names its tenant (no API keys are set)."""
        self.engine = engine
        self.model_name = model_name
        self.accepted_names = {model_name, *aliases}
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.limits = limits or ServerLimits()
        self.draining = False
        self.user_tenants = UserTenants(self.limits.max_user_tenants if user_tenants else 0)
        # NOTE: weak, so a generation that ends by any path (error, disconnect, ...) leaves.
        self._generations: weakref.WeakSet[Generation] = weakref.WeakSet()
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS,
                                                  thread_name_prefix="slotserve-tokenize")
        # NOTE: computed here, at startup, not on the event loop at the first request.
        self.max_prompt_bytes = self._max_prompt_bytes()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @functools.cached_property
    def chat_template(self) -> str | None:
        """The chat template requests are rendered with: --chat-template, else the model's."""
        if self.limits.chat_template is not None:
            return self.limits.chat_template
        return None if self.tokenizer is None else self.tokenizer.chat_template

    @property
    def max_prompt_tokens(self) -> int:
        """A prompt must leave room for one output token (core.context_fit)."""
        return max_prompt_tokens(self.engine.max_total_tokens)

    def _max_prompt_bytes(self) -> int | None:
        """The most UTF-8 bytes a prompt of max_prompt_tokens tokens can span (None: no
        tokenizer). A token stands for at most `max_token_bytes` bytes of normalized text and
        normalization shrinks text by at most NORMALIZATION_SLACK, so longer text surely has
        too many tokens and is refused without tokenizing it."""
        if self.tokenizer is None:
            return None
        return self.max_prompt_tokens * self.tokenizer.max_token_bytes * NORMALIZATION_SLACK

    def models(self) -> p.ModelList:
        limit = self.engine.max_total_tokens
        return p.ModelList(data=[p.ModelCard(id=self.model_name, max_model_len=limit)])

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names:
            raise APIError(f"The model `{name}` does not exist. This server serves "
                           f"`{self.model_name}`.", 404, param="model", code="model_not_found")

    async def reset_prefix_cache(self) -> dict:
        """Ask the engine thread to drop the cached free blocks (at the next iteration
        boundary); running requests keep theirs. 503 if the engine does not answer."""
        try:
            dropped = await asyncio.wait_for(self.engine.reset_prefix_cache(),
                                             RESET_TIMEOUT_S)
        except (EngineClosedError, asyncio.TimeoutError) as exc:
            raise APIError(f"the prefix cache was not reset: {exc or 'no answer'}", 503,
                           "service_unavailable") from exc
        logger.info("prefix cache reset: %d cached free blocks dropped", dropped)
        return {"status": "ok", "blocks_dropped": dropped}

    # ---------------------------------------------------------------- shutdown
    def begin_drain(self) -> None:
        """Graceful shutdown starts: new generations get 503, /health answers 503; the
        running ones go on (wait for `num_in_flight` to reach 0)."""
        self.draining = True
        self.engine.stop_accepting()

    @property
    def num_in_flight(self) -> int:
        """Generations admitted and not ended (their engine streams are open)."""
        return self.engine.num_active

    def abort_in_flight(self) -> int:
        """Abort every generation still running (the drain timed out); their clients get
        a 503 error. Call from the event loop's thread. Returns how many."""
        generations = [g for g in self._generations if g.is_open]
        for generation in generations:
            self.engine.abort(generation.request_id)
        return len(generations)

    # ---------------------------------------------------------------- endpoints
    def _generation(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    prompt_param: str, request: Request,
                    body: p.CompletionRequest | p.ChatCompletionRequest,
                    prompt_text: str | None = None) -> Generation:
        """One engine request. NOTE: it takes the engine and the Retry-After value, not the
        Server (no import cycle between the server's modules)."""
        tenant = self._tenant(request, body)
        generation = Generation(self.engine, self.retry_after_s, request_id, prompt_ids, params,
                                prompt_param, tenant=tenant,
                                client_id=client_request_id(request.scope),
                                scheduling=scheduling_fields(body, tenant),
                                prompt_text=prompt_text)
        self._generations.add(generation)
        return generation

    def _tenant(self, request: Request,
                body: p.CompletionRequest | p.ChatCompletionRequest) -> str:
        """The request's tenant: its API key's, else its `user` field's (UserTenants)."""
        return self.user_tenants.tenant(tenant_of(request), body.user)

    def _sampling_params(self, body: p.CompletionRequest | p.ChatCompletionRequest
                         ) -> SamplingParams:
        self.check_model(body.model)
        body.check_stop(self.limits.max_stop_strings, self.limits.max_stop_chars)
        return self.limits.sampling_params(body, self.engine.max_total_tokens)

    async def completions(self, body: p.CompletionRequest, request: Request):
        """One choice per prompt and per n (see CompletionRequest); every prompt is admitted
        or none (Generations)."""
        params = self._sampling_params(body)
        prompts = body.engine_prompts(self.limits.max_prompts)
        bound = self.engine.queue_bound(self._tenant(request, body))
        self.limits.check_queueable(len(prompts), params.n, bound)
        await self._check_structured(params, body.structured_spec()[1])
        ids = await asyncio.gather(*(self._prompt_ids(prompt) for prompt in prompts))
        self.limits.check_prompt_logprobs_volume(params, sum(map(len, ids)))
        texts = await self._prompt_texts(prompts, ids) if body.echo else [None] * len(ids)
        request_id = p.new_id("cmpl")
        answer_type = EchoOnlyGenerations if body.echo_only else Generations
        stream = answer_type(request_id, [
            self._generation(request_id if len(ids) == 1 else f"{request_id}-{i}", prompt_ids,
                             params, "prompt", request, body, text)
            for i, (prompt_ids, text) in enumerate(zip(ids, texts))])
        firsts = await stream.start(request)
        if body.stream:
            return sse_response(completion_chunks(stream, firsts, body, self.tokenizer,
                                                  self.model_name), stream)
        finals = await stream.collect(request, firsts)
        return await whole_answer(completion_response, stream, finals, body, self.tokenizer,
                                  self.model_name)

    async def _prompt_texts(self, prompts: list[str | list[int]], ids: list[list[int]]
                            ) -> list[str]:
        """Each prompt's text (echo): as sent, or its token ids decoded (off the loop)."""
        if self.tokenizer is None:
            return [prompt if isinstance(prompt, str) else "" for prompt in prompts]
        return [prompt if isinstance(prompt, str) else
                await self._off_loop(self.tokenizer.decode, prompt_ids,
                                     skip_special_tokens=False)
                for prompt, prompt_ids in zip(prompts, ids)]

    async def chat(self, body: p.ChatCompletionRequest, request: Request):
        body.use_tool_call_format(tool_call_format(self.chat_template))
        params = self._sampling_params(body)
        await self._check_structured(params, body.constraint_param())
        ids = await self._chat_ids(body)
        stream = self._generation(p.new_id("chatcmpl"), ids, params, "messages", request, body)
        first = await stream.start(request)
        if body.stream:
            return sse_response(chat_chunks(stream, first, body, self.tokenizer,
                                            self.model_name), stream)
        finals = await stream.collect(request, first)
        return await whole_answer(chat_response, stream, finals, body, self.tokenizer,
                                  self.model_name)

    async def responses(self, body: r.ResponsesRequest, request: Request):
        """POST /v1/responses (stateless): the request runs as its chat request (template,
        sampling, tools, structured outputs and their pre-check); errors name this API's
        fields (input, max_output_tokens, text.format)."""
        body.check()  # NOTE: the body's own fields, named as sent (not renamed)
        try:
            chat = body.to_chat()
            params = self._sampling_params(chat)
            await self._check_structured(params, chat.constraint_param())
            ids = await self._chat_ids(chat)
        except APIError as exc:
            raise r.renamed(exc) from exc
        plan = chat.tool_plan()
        stream = self._generation(r.new_response_id(), ids, params, "input", request, chat)
        first = await stream.start(request)
        if body.stream:
            return events_response(response_events(stream, first, body, plan,
                                                   self.model_name), stream)
        finals = await stream.collect(request, first)
        return await whole_answer(response_object, stream, finals, body, plan,
                                  self.model_name)

    async def _check_structured(self, params: SamplingParams, param: str | None) -> None:
        """A constrained request's pre-check, before it is admitted: the size caps
        (ServerLimits.structured), then the grammar compiled by the engine client (off the
        event loop and off the engine thread; cached, so the request's matchers are then
        copies). Past a cap, or a schema, regex or grammar the grammar engine rejects: a 400
        naming the request's field (`n` for too many constrained completions)."""
        spec = params.structured_outputs
        if spec is None:
            return
        caps = self.limits.structured
        try:
            caps.check_n(params.n)
        except ValueError as exc:
            raise APIError(str(exc), param="n") from exc
        try:
            caps.check(spec)
            await self.engine.check_structured(spec)
        except ValueError as exc:
            raise p.structured_error(str(exc), param or "structured_outputs") from exc
        except EngineClosedError as exc:
            raise APIError(str(exc), 503, "service_unavailable") from exc

    # ---------------------------------------------------------------- tokenize
    async def tokenize(self, body: p.TokenizeRequest) -> p.TokenizeResponse:
        """vLLM's /tokenize: the prompt's token ids (messages: the chat template's)."""
        self.check_model(body.model)
        body.check()
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer", param="prompt")
        if body.messages is not None:
            structured = renders_tool_calls(self.chat_template)
            messages = [m.as_template_dict(structured) for m in body.messages]
            kwargs = body.template_kwargs()  # NOTE: checks chat_template_kwargs (400)
            self._check_text_size(sum(len(m["content"].encode("utf-8", "surrogatepass"))
                                      for m in messages), "messages")
            try:
                ids = await self._off_loop(self.tokenizer.encode_chat, messages,
                                           add_generation_prompt=body.add_generation_prompt,
                                           chat_template=self.limits.chat_template, **kwargs)
            except Exception as exc:  # a template may raise on an unusual conversation
                raise APIError(f"messages: the chat template failed: {exc}",
                               param="messages") from exc
        else:
            self._check_text_size(len(body.prompt.encode("utf-8", "surrogatepass")), "prompt")
            ids = await self._off_loop(self.tokenizer.encode, body.prompt,
                                       add_special_tokens=body.add_special_tokens)
        return p.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_total_tokens,
                                  tokens=ids)

    async def detokenize(self, body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        """vLLM's /detokenize: the text of token ids (special tokens kept)."""
        self.check_model(body.model)
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"tokens: {bad} is not a token id of this model (0..{vocab - 1})",
                           param="tokens")
        text = await self._off_loop(self.tokenizer.decode, body.tokens,
                                    skip_special_tokens=False)
        return p.DetokenizeResponse(prompt=text)

    # ---------------------------------------------------------------- prompts
    async def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids; text is tokenized off the event loop, after the
        cheap size check, announced to the engine meanwhile (EngineClient.incoming). APIError
        (400, param "prompt") if it cannot fit."""
        if not isinstance(prompt, str):
            self._check_token_count(len(prompt), "prompt")
            return prompt
        self._check_text_size(len(prompt.encode("utf-8", "surrogatepass")), "prompt")
        try:
            with self.engine.incoming():
                _, ids = await self._off_loop(self.engine.tokenize, prompt)
        except ValueError as exc:
            raise p.invalid_request(str(exc)) from exc
        self._check_token_count(len(ids), "prompt")
        return ids

    async def _chat_ids(self, body: p.ChatCompletionRequest) -> list[int]:
        """The conversation's prompt ids: the template rendered and tokenized off the event
        loop (Tokenizer.encode_chat, the offline LLM.chat's path too), after a size check on
        the messages' text (a template shows each message's content); announced to the engine
        meanwhile (EngineClient.incoming)."""
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer, so no chat template; use "
                           "/v1/completions with token ids", param="messages")
        messages = body.template_messages(renders_tool_calls(self.chat_template))
        kwargs = body.template_kwargs()  # NOTE: checks chat_template_kwargs (400)
        self._check_text_size(sum(len(m["content"].encode("utf-8", "surrogatepass"))
                                  for m in messages), "messages")
        try:
            with self.engine.incoming():
                ids = await self._off_loop(self.tokenizer.encode_chat, messages,
                                           add_generation_prompt=True,
                                           chat_template=self.limits.chat_template, **kwargs)
        except Exception as exc:  # a template may raise on an unusual conversation
            raise APIError(f"messages: the chat template failed: {exc}",
                           param="messages") from exc
        self._check_token_count(len(ids), "messages")
        return ids

    async def _off_loop(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool,
                                          functools.partial(fn, *args, **kwargs))

    def _check_text_size(self, num_bytes: int, param: str) -> None:
        bound = self.max_prompt_bytes
        if bound is not None and num_bytes > bound:
            raise APIError(
                f"{param} is too long: {num_bytes} bytes of text is more than "
                f"{self.max_prompt_tokens} tokens (this server's limit per sequence, less one "
                "output token) can hold", param=param, code="context_length_exceeded")

    def _check_token_count(self, num_tokens: int, param: str) -> None:
        try:
            check_fits_context(num_tokens, self.engine.max_total_tokens, field=param)
        except ContextOverflowError as exc:
            raise APIError(str(exc), param=param, code="context_length_exceeded") from exc


def scheduling_fields(body: p.CompletionRequest | p.ChatCompletionRequest,
                      tenant: str) -> SchedulingFields:
    """The request's scheduling fields (checked once, here); a 400 naming a bad one."""
    try:
        return SchedulingFields(body.priority, tenant, body.slo_ttft_ms, body.slo_tpot_ms,
                                body.cache_salt)
    except SchedulingFieldError as exc:
        raise APIError(str(exc), param=exc.field) from exc
