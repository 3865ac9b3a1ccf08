"""What a check yields: a `CheckResult` per check, and the table `miles plugins check` prints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Status = Literal["PASS", "FAIL", "SKIP"]

# The checks, in the order they run and are reported.
CHECKS = (
    "builds",
    "declarations",
    "sample inputs",
    "empty response",
    "garbage responses",
    "score_group",
    "picklable",
    "deterministic",
)


@dataclass(frozen=True)
class CheckResult:
    """One check of one component. ``detail`` says what was checked, or what is wrong."""

    component: str  # "reward/NAME"
    check: str  # one of CHECKS
    status: Status
    detail: str = ""

    @property
    def passed(self) -> bool:
        """True unless the check failed (a skipped check does not fail)."""
        return self.status != "FAIL"

    @property
    def message(self) -> str:
        """One line naming the component, e.g. "reward 'bad': returned nan for an empty response"."""
        kind, _, name = self.component.partition("/")
        return (
            f"{kind} {name!r}: {self.detail}" if self.detail else f"{kind} {name!r}: {self.check}"
        )


def format_results(results: Sequence[CheckResult]) -> str:
    """A plain-text table: COMPONENT, CHECK, RESULT, DETAIL."""
    rows = [("COMPONENT", "CHECK", "RESULT", "DETAIL")]
    rows += [(r.component, r.check, r.status, r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        "  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[3]]).rstrip()
        for row in rows
    )
