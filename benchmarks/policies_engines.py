"""The engines benchmarks.policies drives: the real LLMEngine in real time, or `SimEngine`, the
engine's scheduling on a virtual clock (the replay simulator's pieces); a factory of fresh
engines per scheduling policy for each."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.policies_workloads import BATCH, Settings
from slotserve.config import EngineConfig, engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.outputs import RequestMetrics
from slotserve.lab.bench.report import model_name
from slotserve.lab.replay import VirtualEngineCore
from slotserve.request import Request
from slotserve.sampling import SamplingParams


class RealClock:
    """Wall-clock time for the real engine's runs."""

    @staticmethod
    def now() -> float:
        return time.monotonic()

    @staticmethod
    def sleep_until(t: float) -> None:
        time.sleep(max(0.0, t - time.monotonic()))


@dataclass


class SimOutput:
    """What `drive` reads of a RequestOutput, for a simulated request."""

    request_id: str
    finished: bool
    finish_reason: str | None
    token_ids: list[int]
    metrics: RequestMetrics


class SimEngine:
    """The engine's scheduling on a virtual clock (the replay simulator's pieces): the real
    `Scheduler`, KV manager and policy object of the same config, and a `FakeRunner` that
    moves the clock by the calibrated profile's time for each planned iteration.

    It offers what `drive` and `calibrate` use of an `LLMEngine` (add_request, step,
    has_unfinished_requests, scheduler, scheduler_config) and its clock (now, sleep_until),
    so a simulated run goes through the same driver and statistics as a measured one.
    """

    def __init__(self, config: EngineConfig, cost_model) -> None:
        # NOTE: the replay simulator's core: the scheduler reads the virtual clock, so SLO
        # deadlines, slack and the deadline policy's learnt iteration time are all in
        # simulated seconds; a KV pool not given is the engine's default when memory is
        # plentiful (every slot can hold a max_model_len sequence), as the benchmark's
        # engines are sized.
        self.core = VirtualEngineCore(config.scheduler, config.cache, cost_model)
        self.clock, self.kv = self.core.clock, self.core.kv
        self.scheduler, self.runner = self.core.scheduler, self.core.runner

    @property
    def scheduler_config(self):
        return self.scheduler.config

    def now(self) -> float:
        return self.clock.now

    def sleep_until(self, t: float) -> None:
        self.clock.advance_to(t)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    arrival: float, priority: int = 0, tenant: str = "default",
                    slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> None:
        request = Request(request_id, list(prompt), params, priority=priority, tenant=tenant,
                          slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
        request.times.arrival = arrival
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[SimOutput]:
        plan, updated = self.core.step()
        if plan.is_empty:
            raise RuntimeError(f"the scheduler planned nothing with "
                               f"{len(self.scheduler.requests)} requests unfinished")
        return [SimOutput(r.request_id, r.is_finished, r.finish_reason,
                          list(r.output_token_ids), RequestMetrics.of(r)) for r in updated]

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


Engine = LLMEngine | SimEngine
EngineFactory = Callable[[str], Engine]  # scheduling policy -> a fresh engine


def clock_of(engine: Engine):
    """The clock a run of this engine is timed by (virtual for a SimEngine)."""
    return engine if isinstance(engine, SimEngine) else RealClock


def engine_factory(tiny: bool, s: Settings) -> tuple[EngineFactory, int, str]:
    """(policy -> fresh engine, vocabulary size, model description); weights loaded once."""
    if tiny:
        model_config, weights = tiny_random_model()
        tokenizer, source = None, "tiny random llama (hidden 64, 3 layers)"
    else:
        from slotserve.loader import load_model

        loaded = load_model()
        model_config, weights, tokenizer = loaded.config, loaded.weights, loaded.tokenizer
        source = f"{model_config.name} ({model_name(loaded.source)})"

    def make(policy: str) -> LLMEngine:
        return LLMEngine(config_for(policy, s), model_config, weights, tokenizer)

    return make, model_config.vocab_size, source


def config_for(policy: str, s: Settings) -> EngineConfig:
    """The engine configuration of every run (measured or simulated) of a policy."""
    max_len = BATCH.prompt_max + BATCH.max_tokens + 16
    return engine_config(max_num_seqs=s.slots, max_num_batched_tokens=s.budget,
                         max_model_len=max_len, scheduling_policy=policy)


class SimFactory:
    """policy -> a fresh SimEngine on the profile; `seconds` sums the simulated time of
    every engine made (calibrations and warm-ups included): the real run's predicted time."""

    def __init__(self, s: Settings, cost_model) -> None:
        self.settings, self.cost_model = s, cost_model
        self.engines: list[SimEngine] = []

    def __call__(self, policy: str) -> SimEngine:
        engine = SimEngine(config_for(policy, self.settings), self.cost_model)
        self.engines.append(engine)
        return engine

    @property
    def seconds(self) -> float:
        return sum(engine.clock.now for engine in self.engines)


def tiny_random_model():
    """A small random-weight Llama (as tests/conftest.py's), for quick runs of this script."""
    import torch
    import transformers

    from slotserve.config import ModelConfig

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ModelConfig.from_hf_dict(cfg.to_dict(), name="tiny"), weights
