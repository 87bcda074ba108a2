"""Chaos: a victim workload beside an adversary that sends every bad input it can; the victim
must not notice.

    .venv/bin/python -m benchmarks.chaos --victims 16 --rounds 3 --json chaos.json

Starts `slotserve serve` on loopback (the embedded SmolLM2-135M, the soak's engine settings)
with an API key for the victim, another for the adversary (two tenants, `--api-keys-file`),
an `--admin-key` (for /metrics) and `--max-waiting 64`. Then, `--rounds` times, interleaved
so that the machine's drift hits both alike:

- solo: the victim alone: `--victims` streaming greedy completions at once (distinct prompts,
  `--max-tokens` tokens each, ignore_eos), each with its own X-Request-Id;
- chaos: the same victim requests while the adversary (one client, one attack at a time,
  `--gap` seconds apart, cycling through ATTACKS until the victim is done and every attack
  ran at least once) sends: top_k 10**30, temperature 1e-50, top_p 1e-50, n=128, 45k stop
  strings, a 500k-character stop string, a 1 MB prompt (and chat message), a 2 MB body, a
  victim's live X-Request-Id, a seed past int64, logprobs 10**6, malformed JSON, wrong
  types, an unknown model, no key, a wrong key, /metrics with a non-admin key, a stream it
  leaves after two events, a request it leaves before the first token; the other tenant's
  holes of issue 29: the victim's prompt probed for a prefix-cache hit, a regex slow to
  build with n=16, a priority outside its key's range, 100k stop_token_ids, a logprobs
  volume past the cap, slo_tpot_ms 0.001, tool-call arguments nested 200k deep, a foreign
  Host header; issue 34's fields at hostile sizes: a logit_bias of 60k entries, 150k and
  10**6 bad_words, 10**6 stop strings, 150k allowed_token_ids, 10**4 prompts in one list,
  1000 prompts past the waiting bound, echo of a 1 MB prompt, a long prompt scored (echo,
  logprobs, max_tokens 0); and, through the whole phase, slow-loris uploads (a valid
  request's body dribbled a few bytes at a time, then abandoned; one without a key).

Checked (each failure is listed; exit status 1 if any):
- victim: 0 errors (HTTP 200, `[DONE]`, finish_reason length, max_tokens tokens, its
  X-Request-Id echoed), outputs equal to its solo run's, TPOT p99 (pooled over the rounds)
  within `--tpot-ratio` (1.25) of solo's;
- adversary: every attack answered as ATTACKS expects: bad input 4xx (status codes listed
  per attack), values that validation clamps by design (top_k past the vocabulary,
  temperature below 1e-5, tiny top_p, a reused X-Request-Id) 200, temperature 1e-50 and
  top_p 1e-50 with the greedy output; no 5xx, no hang (each request has a timeout); each
  stream left mid-way was aborted in the server's log;
- after: /health 200, nothing running or waiting and every KV block free (/metrics with the
  admin key: kv_blocks_free == kv_blocks_total), no traceback in the server's log.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.chaos_adversary import ATTACKS, adversary_process
from benchmarks.chaos_attacks_clients import SLOW_LORIS, slow_loris
from benchmarks.chaos_checks import (
    check_after,
    check_log,
    check_victim,
    percentiles_ms,
    tally_attacks,
)
from benchmarks.chaos_kit import (
    ADMIN_KEY,
    ADVERSARY_KEY,
    AUTH,
    MAX_WAITING,
    REQUEST_TIMEOUT_S,
    VICTIM_KEY,
    Context,
    Outcome,
    small,
)
from benchmarks.chaos_victim import VictimResult, run_victim, victim_bodies
from benchmarks.soak import ENGINE_FLAGS, REPO
from slotserve.lab.bench.server import ServerProcess, ServerStartError, cli_flags

# NOTE: the pieces are benchmarks/chaos_kit.py (keys, Outcome, Context, post), chaos_victim.py,
# chaos_attacks_fields.py, chaos_attacks_clients.py, chaos_adversary.py (ATTACKS and its
# process) and chaos_checks.py; the names tests use stay importable from here.
__all__ = ["ADMIN_KEY", "ADVERSARY_KEY", "ATTACKS", "SLOW_LORIS", "VICTIM_KEY", "ChaosReport",
           "chaos", "main", "server_flags", "slow_loris", "small", "write_keys_file"]


# --------------------------------------------------------------------------- one run
@dataclass
class ChaosReport:
    victims: int
    rounds: int
    max_tokens: int
    solo_tpot_ms: dict
    chaos_tpot_ms: dict
    tpot_p99_ratio: float | None
    tpot_p50_ratio: float | None
    victim_errors: int
    victim_outputs_differing: int
    attacks: dict  # name -> {"expect": [...], "statuses": {status: count}, "notes": [...]}
    attacks_sent: int
    health_after: int
    final_metrics: dict
    server_log: dict
    seconds: float
    failures: list[str]

    def summary(self) -> str:
        lines = [f"victim: {self.victims} streams x {self.rounds} rounds, {self.max_tokens} "
                 f"tokens; errors {self.victim_errors}, outputs differing from solo "
                 f"{self.victim_outputs_differing}",
                 f"TPOT ms solo {self.solo_tpot_ms}, chaos {self.chaos_tpot_ms}",
                 f"TPOT ratio chaos/solo: p99 {_x(self.tpot_p99_ratio)}, "
                 f"p50 {_x(self.tpot_p50_ratio)}",
                 f"adversary: {self.attacks_sent} requests"]
        for name, a in self.attacks.items():
            lines.append(f"  {name:<42} {a['statuses']} (expect {a['expect']})")
        lines += [f"after: /health {self.health_after}, {self.final_metrics}",
                  f"server log: {self.server_log}", f"{self.seconds:.1f}s",
                  f"failures: {len(self.failures)}"]
        lines += [f"  - {f}" for f in self.failures[:40]]
        return "\n".join(lines)


def _x(value: float | None) -> str:
    return "-" if value is None else f"x{value:.2f}"


def chaos_phase(url: str, bodies: list[dict], tag: str, greedy_text: str, gap_s: float,
                min_passes: int) -> tuple[list[VictimResult], list[tuple[str, Outcome]]]:
    """The victim with the adversary (and its slow-loris clients) beside it.

    NOTE: the adversary is another process, as a hostile client would be: building its
    megabyte bodies must not stall the victim's event loop (that would stretch the victim's
    measured TPOT on the client side, not the server's)."""
    mp = multiprocessing.get_context("spawn")
    ready, done, results = mp.Event(), mp.Event(), mp.Queue()
    ctx = Context(url, greedy_text, tag, probe_prompts=probe_prompts_of(bodies))
    proc = mp.Process(target=adversary_process, daemon=True,
                      args=(ctx, gap_s, min_passes, ready, done, results))
    proc.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the adversary process did not start")
        time.sleep(0.1)  # the attacks are under way when the victim starts
        victims = asyncio.run(run_victim(url, bodies, tag))
    finally:
        done.set()
        try:
            outcomes = results.get(timeout=2 * REQUEST_TIMEOUT_S)
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return victims, outcomes


def probe_prompts_of(bodies: list[dict]) -> tuple[str, ...]:
    """The victim's longest prompts (up to 8; each more than a KV block): what the prefix
    probe asks for, one a round."""
    return tuple(sorted((b["prompt"] for b in bodies), key=len)[-8:])


def greedy_reference(url: str) -> str:
    r = httpx.post(url + "/v1/completions", json=small(temperature=0.0),
                   headers=AUTH, timeout=REQUEST_TIMEOUT_S)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def chaos(url: str, *, victims: int = 16, rounds: int = 3, max_tokens: int = 64,
          gap_s: float = 0.25, min_passes: int = 1, tpot_ratio: float | None = 1.25,
          log_path: Path | None = None, progress: bool = False) -> ChaosReport:
    """Warm up, then `rounds` x (solo, chaos); check everything. tpot_ratio: the bound on
    chaos/solo TPOT p99 (None: reported, not checked)."""
    start = time.monotonic()
    bodies = victim_bodies(victims, max_tokens)
    asyncio.run(run_victim(url, bodies, "warmup"))
    greedy_text = greedy_reference(url)
    solo, attacked, outcomes = [], [], []
    for round_ in range(rounds):
        solo.append(asyncio.run(run_victim(url, bodies, f"solo{round_}")))
        victims_chaos, got = chaos_phase(url, bodies, f"chaos{round_}", greedy_text, gap_s,
                                         min_passes)
        attacked.append(victims_chaos)
        outcomes += got
        if progress:
            print(f"  round {round_ + 1}/{rounds}: {len(got)} attacks", flush=True)
    failures: list[str] = []
    errors, differing = check_victim(solo, attacked, failures)
    attacks = tally_attacks(outcomes, failures)
    solo_tpot = [r.tpot_s for run in solo for r in run if r.tpot_s is not None]
    chaos_tpot = [r.tpot_s for run in attacked for r in run if r.tpot_s is not None]
    s, c = percentiles_ms(solo_tpot), percentiles_ms(chaos_tpot)
    p99 = c["p99"] / s["p99"] if s and c else None
    p50 = c["p50"] / s["p50"] if s and c else None
    if tpot_ratio is not None and (p99 is None or p99 > tpot_ratio):
        failures.append(f"victim TPOT p99 chaos/solo {_x(p99)} > x{tpot_ratio}")
    health, final = check_after(url, failures)
    server_log = check_log(log_path, outcomes, failures) if log_path else {}
    return ChaosReport(victims, rounds, max_tokens, s, c, p99, p50, errors, differing, attacks,
                       len(outcomes), health, final, server_log, time.monotonic() - start,
                       failures)


# --------------------------------------------------------------------------- the server
def server_flags(keys_file: Path) -> list[str]:
    """The soak's engine settings, two tenants' keys, the admin key, --max-waiting."""
    return [*cli_flags(**ENGINE_FLAGS), f"--api-keys-file={keys_file}",
            f"--admin-key={ADMIN_KEY}", f"--max-waiting={MAX_WAITING}"]


def write_keys_file(path: Path) -> Path:
    path.write_text(f"{VICTIM_KEY} victim\n{ADVERSARY_KEY} adversary\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--victims", type=int, default=16, help="victim streams at once")
    ap.add_argument("--rounds", type=int, default=3, help="solo + chaos phases, interleaved")
    ap.add_argument("--max-tokens", type=int, default=64, help="each victim stream's tokens")
    ap.add_argument("--gap", type=float, default=0.25, help="seconds between attacks")
    ap.add_argument("--tpot-ratio", type=float, default=1.25,
                    help="bound on the victim's TPOT p99, chaos / solo")
    ap.add_argument("--log", default="chaos-server.log", help="the server's log")
    ap.add_argument("--json", default=None, help="write the report here (write_report)")
    args = ap.parse_args(argv)
    log_path = Path(args.log)
    keys = write_keys_file(log_path.with_name(log_path.stem + "-keys.txt"))
    server = ServerProcess.launch(log_path, *server_flags(keys), cwd=REPO)
    try:
        server.wait_ready()
        report = chaos(server.url, victims=args.victims, rounds=args.rounds,
                       max_tokens=args.max_tokens, gap_s=args.gap,
                       tpot_ratio=args.tpot_ratio, log_path=log_path, progress=True)
    except ServerStartError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        code = server.stop()
    print(report.summary())
    print(f"server exit code after SIGTERM: {code}")
    if args.json:
        from slotserve.lab.bench import write_report

        write_report(args.json, **asdict(report), exit_code=code)
    return 1 if report.failures or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
