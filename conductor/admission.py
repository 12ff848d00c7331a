"""Admission control: when to reject a request, and at which stage.

A request is checked twice: at arrival (before any prefill work is spent)
and when its KV reaches the decode instance. The modes differ in what the
arrival check knows:

- `none`: never reject; decode batches grow past their SLO instead.
- `baseline`: each stage looks only at its own current load. Arrival rejects
  when the predicted TTFT exceeds its SLO; decode rejects when the request
  would break the TBT SLO or memory, and the prefill already spent on it is
  wasted.
- `early`: the decode check moves to arrival, against the decode instance's
  load as it is now. No prefill is spent on a request that decode would
  refuse at this moment, but the decode load at arrival is not the load the
  request will meet a prefill later: while decode is full everything is
  refused and prefill idles, then decode drains, a burst is admitted and
  overloads it again (the oscillation of the paper's section 7).
- `predictive`: the arrival check uses the decode load predicted for the time
  the request would reach decode: residents and requests whose KV arrives
  before then count by the chance that they are still decoding, judged from
  the output lengths of finished requests (never the request's own), plus the
  requests admitted later that will get there first (`overtaking`). This
  damps the oscillation and wastes the least prefill.

The decode-stage check stays in every mode but `none`: memory is physical.
"""
from __future__ import annotations

from dataclasses import dataclass

from conductor.decode import DecodeView
from conductor.policy import Placement

MODES = ("none", "baseline", "early", "predictive")

REJECT_TTFT = "ttft"
REJECT_DECODE = "decode"


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 30.0
    tbt_s: float = 0.1


@dataclass
class Admission:
    mode: str
    slo: Slo

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown admission mode '{self.mode}' "
                             f"(choose from {', '.join(MODES)})")

    def at_arrival(self, now_s: float, placement: Placement, decode: DecodeView,
                   input_length: int, output_estimate: float) -> str | None:
        """The reason to reject at arrival, or None to admit."""
        if self.mode == "none":
            return None
        if placement.ttft_s > self.slo.ttft_s:
            return REJECT_TTFT
        if self.mode == "early":
            load = decode.load()
        elif self.mode == "predictive":
            load = decode.predicted_load(now_s + placement.ttft_s)
        else:
            return None
        if not decode.fits(load, input_length, output_estimate, self.slo.tbt_s):
            return REJECT_DECODE
        return None

    def at_decode(self, decode: DecodeView, input_length: int,
                  output_estimate: float) -> bool:
        """Whether the decode instance takes the request now that its KV has arrived."""
        if self.mode == "none":
            return True
        return decode.fits(decode.load(), input_length, output_estimate, self.slo.tbt_s)
