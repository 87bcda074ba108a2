"""Speculative decoding in a replay: drafts planned by the real speculator, accepted as the
trace says they were.

A replay computes no logits, so it cannot know which drafts a model would accept; a trace
records, per iteration and slot, how many draft tokens a sequence verified (`proposed`,
among its `tokens`) and how many were accepted (`accepted`). `recorded_verifications` walks
the trace and places each verification at its request's output position t (tokens generated
before it): `(t, proposed, accepted)`.

In the replay the scheduler's own `Speculator` (fixed or "auto", on the replay's clock) plans
drafts; `DraftOracle` stands for the proposer and for the model's verdict. A verification
recorded at t with p drafts and a accepted says the sequence at t had p drafts to offer and
its first a were right; at t + i (i <= a: inside that accepted run, where a replay that drafted
fewer may stand) it had p - i and a - i. A position the trace never drafted at offers none
(its proposer found nothing, or "auto" gave it none). So a replay with the run's own settings
verifies the same drafts in the same iterations as the run did, and one with other settings
(more slots, a fixed length) drafts at most what the proposer offered and accepts what the
model accepted. A verification costs 1 + k rows with logits at each: decode rows in an
iteration of decodes only (the C++ decode stack runs it so), a 1 + k token chunk beside a
prefill (`StepFeatures.of`).

`lab/replay/spec_prediction.py` predicts a measured batch run's on/off tok/s ratio from its
traces.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from slotserve.spec.config import SpeculativeConfig
from slotserve.spec.planner import Speculator
from slotserve.value_checks import is_int

FILLER_DRAFT = 3  # the draft token proposed (never read: only its count matters)
# The config a trace with drafts replays with when none is given: "auto", the default when
# speculation is on (the method only chooses the proposer, which the replay replaces).
TRACE_DEFAULT_CONFIG = '{"method": "ngram", "num_speculative_tokens": "auto"}'

Verification = tuple[int, int, int]  # (output position, drafts proposed, drafts accepted)


def recorded_verifications(iterations: Iterable[dict]) -> dict[str, list[Verification]]:
    """Each request's verifications, at their output positions, from a trace's iterations.

    A request's output position is 1 at its first decode (its last prefill chunk sampled
    one token) and grows by 1 + accepted per decode; a decode after prefill chunks again
    (recomputed after a preemption) follows one more sampled token. ValueError on a slot
    whose counts make no sense.
    """
    position: dict[str, int] = {}
    last_kind: dict[str, str] = {}
    found: dict[str, list[Verification]] = {}
    for iteration in iterations:
        for slot in iteration.get("slots") or ():
            if not slot or slot.get("kind") not in ("prefill", "decode"):
                continue
            request = str(slot["request"])
            kind, before = slot["kind"], last_kind.get(request)
            last_kind[request] = kind
            if kind == "prefill":
                continue
            t = position.get(request, 0) + int(before in (None, "prefill"))
            proposed, accepted = slot_drafts(slot, iteration)
            if proposed:
                found.setdefault(request, []).append((t, proposed, accepted))
            position[request] = t + 1 + accepted
    return found


def slot_drafts(slot: dict, iteration: dict) -> tuple[int, int]:
    proposed, accepted = slot.get("proposed", 0), slot.get("accepted", 0)
    if not (is_int(proposed) and is_int(accepted)) or not 0 <= accepted <= proposed:
        raise ValueError(f"iteration {iteration.get('index')}: slot of "
                         f"{slot.get('request')!r}: proposed {proposed!r} / accepted "
                         f"{accepted!r} must be integers with 0 <= accepted <= proposed")
    return proposed, accepted


class DraftOracle:
    """What each request had to offer and what was right, by output position (see the
    module docstring): the replay's proposer (`propose`) and verdict (`accepted`)."""

    def __init__(self, verifications: Mapping[str, Sequence[Verification]]) -> None:
        self._at: dict[str, dict[int, tuple[int, int]]] = {}
        for request, records in verifications.items():
            at = self._at[request] = {}
            for t, proposed, accepted in records:
                for i in range(accepted + 1):
                    at.setdefault(t + i, (proposed - i, accepted - i))

    def propose(self, seq_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int],
                max_tokens: int) -> list[int]:
        offered, _ = self._at.get(seq_id, {}).get(len(output_ids), (0, 0))
        return [FILLER_DRAFT] * max(0, min(max_tokens, offered))

    def accepted(self, seq_id: str, position: int, num_drafts: int) -> int:
        """Of num_drafts drafts verified at output position `position`, those accepted."""
        _, right = self._at.get(seq_id, {}).get(position, (0, 0))
        return min(right, num_drafts)

    def finish(self, seq_id: str, output_ids: Sequence[int]) -> None:
        pass

    def forget(self, seq_id: str) -> None:
        pass


def make_speculator(config: SpeculativeConfig | None, oracle: DraftOracle
                    ) -> Speculator | None:
    """The scheduler's speculator for a replay (None when speculation is off)."""
    if config is None:
        return None
    return Speculator(config, proposer=oracle)


# ---------------------------------------------------------------------------------------
