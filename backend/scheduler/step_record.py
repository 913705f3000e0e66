"""What the scheduler remembers about each step: one record per forward, counters, a JSON-lines log.

Every step is recorded, decode steps included, and nothing is throttled: the seed bug report's
engine logged prefill every step but decode only every 20th, so interleaved decode steps were
invisible and interleaving looked broken while it worked. Here one forward is one record is one
log line.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, fields


class StepKind(str, enum.Enum):
    """What a forward carries, read off its chunks (not off the policy)."""

    PREFILL = "prefill"  # prefill chunks only
    DECODE = "decode"  # decode tokens only
    MIXED = "mixed"  # both

    @classmethod
    def of(cls, num_prefill_tokens: int, num_decode_tokens: int) -> "StepKind":
        if num_prefill_tokens and num_decode_tokens:
            return cls.MIXED
        return cls.PREFILL if num_prefill_tokens else cls.DECODE

@dataclass
class StepTiming:
    """One step's times, each filled where it is measured, kept whole by the step's record (StepRecord.timing)."""

    host_s: float = 0.0  # the engine's time to schedule, build and launch the step
    duration_s: float = 0.0  # the step's device time (speculative decoding: its draft passes included)
    # Host time of the constrained rows' grammars. Filling their token masks (beside the forward; speculative decoding:
    # every verify position's and draft's, the matchers' tentative steps through the drafts included) ...
    mask_fill_s: float = 0.0
    # ... and advancing them by the emitted tokens (after sampling; speculative decoding: rolling the drafts back too)
    grammar_accept_s: float = 0.0
    draft_s: float = 0.0  # the draft layer's forwards (inside duration_s)
    static_shape: bool = False  # the step ran at a static shape (StaticKey; a CUDA graph's replay on CUDA)
    static_drafts: bool = False  # the step's drafts came from one static chain (DraftChain; a CUDA graph on CUDA)
    # Data-parallel attention: the rows every rank's MoE exchange computed for nothing in this step (each rank padded
    # to the largest rank's tokens: ranks x largest - all tokens)
    dp_padding_tokens: int = 0


@dataclass
class StepRecord:
    """One forward, as scheduled; its `timing` and its verifies are filled in when its output is in."""

    step_index: int
    kind: StepKind
    time: float  # the `now` given to schedule()
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int  # running set during this forward
    num_waiting: int  # waiting queue after this step was scheduled
    num_preempted: int  # sequences preempted while scheduling this step
    num_aborted: int  # sequences the scheduler ended while scheduling this step
    decode_stalled: bool  # a running decode was runnable but got no token in this step
    pool_usage: dict[str, float] = field(default_factory=dict)  # pool name -> fraction used
    predicted_s: float | None = None  # the step-cost model's prediction, when it has data
    itl_infeasible: bool = False  # the ITL target was out of reach even with the minimum prefill chunk
    num_cached_tokens: int = 0  # prompt positions this step's admissions took from the prefix cache
    timing: StepTiming | None = None  # the step's times (filled in when its output is in)
    # Speculative decoding (filled in with the output): its verifies, the draft tokens they checked and accepted,
    # the tokens a verify emitted on average (accepted + 1; None without verifies).
    num_verifies: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_accepted_length: float | None = None
    rank: int = 0  # the data-parallel rank whose step this is (each rank's scheduler records its own)

    def to_json(self) -> str:
        """One flat JSON object: the record's fields and its timing's."""
        data = asdict(self)
        data["kind"] = self.kind.value
        data.update(data.pop("timing") or {})
        return json.dumps(data, sort_keys=True)


@dataclass
class StepCounters:
    """Running totals over all steps; `prefill_streak` also drives the decode-interleave period."""

    steps_by_kind: dict[str, int] = field(default_factory=lambda: {kind.value: 0 for kind in StepKind})
    prefill_streak: int = 0  # consecutive PREFILL steps ending at the latest step
    longest_prefill_streak: int = 0
    decode_stalls: int = 0  # steps with decode_stalled set
    # Counted where they happen (a preemption or a timeout can also occur in a step that ends up
    # carrying no forward, which has no record).
    num_preemptions: int = 0
    num_timed_out: int = 0
    num_itl_infeasible: int = 0  # steps with itl_infeasible set
    # Speculative decoding: verifies, the draft tokens they checked and those accepted (counted as outputs come in).
    num_verifies: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_accepted_length(self) -> float | None:
        return mean_accepted_length(self.num_verifies, self.num_accepted_tokens)

    @property
    def num_steps(self) -> int:
        return sum(self.steps_by_kind.values())

    @classmethod
    def total(cls, many: list["StepCounters"]) -> "StepCounters":
        """Several schedulers' counters as one (data-parallel ranks: their steps and events add up; the longest
        prefill streak is the longest of any rank's)."""
        if len(many) == 1:
            return many[0]
        out = cls()
        for one in many:
            for kind, count in one.steps_by_kind.items():
                out.steps_by_kind[kind] += count
            for f in fields(cls):  # every other count adds up; the streaks are each rank's own
                if f.name != "steps_by_kind" and not f.name.endswith("prefill_streak"):
                    setattr(out, f.name, getattr(out, f.name) + getattr(one, f.name))
            out.longest_prefill_streak = max(out.longest_prefill_streak, one.longest_prefill_streak)
        return out

    def observe(self, record: StepRecord) -> None:
        self.steps_by_kind[record.kind.value] += 1
        # A mixed step carries decodes, so it ends a prefill streak just like a decode step.
        self.prefill_streak = self.prefill_streak + 1 if record.kind is StepKind.PREFILL else 0
        self.longest_prefill_streak = max(self.longest_prefill_streak, self.prefill_streak)
        self.decode_stalls += record.decode_stalled
        self.num_itl_infeasible += record.itl_infeasible


def mean_accepted_length(num_verifies: int, num_accepted_tokens: int) -> float | None:
    """Tokens a verify emits on average: its accepted drafts plus the one sampled after them (None: no verify)."""
    return 1.0 + num_accepted_tokens / num_verifies if num_verifies else None


class StepLog:
    """Appends one JSON line per step to a file, flushed per line (a crash loses no step)."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed by close())

    def write(self, record: StepRecord) -> None:
        self._file.write(record.to_json() + "\n")

    def close(self) -> None:
        self._file.close()
