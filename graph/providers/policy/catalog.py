"""What the agents' catalogs share: the stopping rule (MIN_GAIN), an entry before it becomes a candidate (Option), why
the other entries were left out (Skips), and the profile's gaps they read."""
from __future__ import annotations

from dataclasses import dataclass

from .costview import ms

# The stopping rule: a gap (or a predicted change) worth less than 2% end to end is not worth a round.
MIN_GAIN = 0.02


@dataclass(frozen=True)
class Option:
    """A catalog entry before it becomes a candidate: its patch, why, and the number it is ranked by."""
    patch: dict
    reason: str
    rank: tuple           # smaller first


class Skips(list):
    """Why catalog entries were not proposed, in the catalog's order, each said once: what an agent that proposes
    nothing gives as its reason (the trail shows it next to "proposed 0 candidate(s)")."""

    def add(self, text: str) -> None:
        if text not in self:
            self.append(text)


def short_of_min_gain(skipped: Skips, gain: float, said: str) -> bool:
    """The stopping rule at a catalog entry: True where `gain` (predicted tok/s over today's, less 1) is under
    MIN_GAIN, with `said` and the rule noted in `skipped`; the caller then leaves the entry out."""
    if gain < MIN_GAIN:
        skipped.add(f"{said} (below {MIN_GAIN:.0%})")
        return True
    return False


def _gaps_of(gaps: list[dict], *components: str) -> list[dict]:
    return [g for g in gaps or [] if g.get("component") in components]


def _gap_text(g: dict) -> str:
    return f"{g['component']} {ms(g.get('measured_s', 0.0))} (gain {g.get('gain', 0.0):.1%}: {g.get('reason', '')})"
