"""One benchmark run against a running stack: build the workload, send it, summarize."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from services.bench.datasets import (
    REPEAT_HEAD,
    REPEAT_TAIL,
    BenchRequest,
    arrival_gaps,
    prefix_requests,
    random_requests,
    repeat_requests,
)
from services.bench.driver import DriverOptions, run_requests, token_pool, tokenize
from services.bench.metrics import summarize
from services.bench.stats import SchedulerGate, SchedulerProbe
from services.common.errors import ConfigError
from services.common.security import ClientSecurity

logger = logging.getLogger(__name__)

DATASETS = ("random", "prefix", "repeat")


@dataclass(slots=True)
class Workload:
    """What to send (vLLM's `bench serve` names)."""

    dataset: str = "random"
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 64
    """prefix dataset: tokens shared by the prompts of one prefix."""
    num_prefixes: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset={self.dataset!r}: choose one of {', '.join(DATASETS)}")
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    def build(
        self, pool: list[int], repeat_ids: tuple[list[int], list[int]] = ([], [])
    ) -> list[BenchRequest]:
        """The requests; `repeat_ids`: the repeat dataset's instruction (head, tail) ids."""
        if self.dataset == "repeat":
            head, tail = repeat_ids
            return repeat_requests(
                pool,
                self.num_prompts,
                self.input_len,
                self.output_len,
                head,
                tail,
                self.range_ratio,
                self.seed,
            )
        if self.dataset == "prefix":
            return prefix_requests(
                pool,
                self.num_prompts,
                self.prefix_len,
                self.input_len,
                self.output_len,
                self.num_prefixes,
                self.range_ratio,
                self.seed,
            )
        return random_requests(
            pool, self.num_prompts, self.input_len, self.output_len, self.range_ratio, self.seed
        )


@dataclass(slots=True)
class BenchTarget:
    """Where to send it: the router, and optionally the scheduler for pipeline stats."""

    server: str
    scheduler: str | None = None
    options: DriverOptions = field(default_factory=DriverOptions)
    scheduler_security: ClientSecurity = field(default_factory=ClientSecurity)
    """TLS to the scheduler and its internal token (for its GetStats, Pause, Unpause)."""
    release_at_once: bool = False
    """A burst is held in the scheduler's queue and released at once (`SchedulerGate`)."""

    def __post_init__(self) -> None:
        if self.release_at_once and self.scheduler is None:
            raise ConfigError(
                "--release-at-once holds the burst in the scheduler: give --scheduler"
            )
        if self.release_at_once and self.options.request_rate != float("inf"):
            raise ConfigError(
                "--release-at-once holds a burst (every request at once): leave out --request-rate"
            )
        if self.release_at_once and self.options.max_concurrency:
            raise ConfigError(
                "--release-at-once holds every request at once: leave out --max-concurrency"
            )


async def build_requests(
    server: str,
    workload: Workload,
    security: ClientSecurity | None = None,
    backend: str = "grpc",
) -> list[BenchRequest]:
    """The workload's requests, with prompt ids the served tokenizer produces."""
    pool = await token_pool(server, security=security, backend=backend)
    repeat_ids: tuple[list[int], list[int]] = ([], [])
    if workload.dataset == "repeat":
        repeat_ids = (
            await tokenize(server, REPEAT_HEAD, security, backend),
            await tokenize(server, REPEAT_TAIL, security, backend),
        )
    return workload.build(pool, repeat_ids)


async def run_benchmark(target: BenchTarget, requests: list[BenchRequest], seed: int = 0) -> dict:
    """Sends `requests`; returns the summary plus, with a scheduler, its pipeline stats
    measured over the run."""
    probe = (
        SchedulerProbe(target.scheduler, target.scheduler_security) if target.scheduler else None
    )
    gate = None
    if target.release_at_once:  # the measurement window opens at the release
        gate = SchedulerGate(
            target.scheduler, target.scheduler_security, before_release=probe.start
        )
    elif probe:
        await probe.start()
    gaps = arrival_gaps(len(requests), target.options.request_rate, seed)
    outputs, duration = await run_requests(target.server, requests, gaps, target.options, gate)
    result = summarize(outputs, duration)
    if gate is not None:
        result["released_at_once"] = True
    if probe:
        result |= await probe.finish()
        if result.get("total_output_tokens"):
            cpu_us = 1e6 * result["scheduler_cpu_s"]
            result["scheduler_cpu_per_token_us"] = cpu_us / result["total_output_tokens"]
    errors = sorted({o.error for o in outputs if not o.success})
    if errors:
        result["errors"] = errors[:5]
    return result
