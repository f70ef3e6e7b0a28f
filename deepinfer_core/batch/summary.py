"""The counts of one ``run-batch`` run and its one-line summary."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BatchSummary:
    """Counts of one run.

    Attributes:
        lines: non-blank input lines read.
        completed: lines answered with a result in this run.
        failed: lines answered with an error in this run.
        skipped: lines the results file already held (``skipped_failed`` of them errors).
        engine_requests: requests (samples) added to the engine in this run.
        generated_tokens: tokens the engine generated for them.
        seconds: wall time of the run (engine start-up excluded).
        first_error: the first error of this run (``custom_id: message``), or ``None``.
    """

    lines: int = 0
    completed: int = 0
    failed: int = 0
    skipped: int = 0
    skipped_failed: int = 0
    engine_requests: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    first_error: str | None = None

    @property
    def exit_status(self) -> int:
        """0 when every line of the results file succeeded, else 1."""
        return 1 if self.failed or self.skipped_failed else 0

    def line(self) -> str:
        """The one-line summary printed at the end of ``deepinfer run-batch``."""
        rate = self.lines / self.seconds if self.seconds > 0 else 0.0
        tok = self.generated_tokens / self.seconds if self.seconds > 0 else 0.0
        skipped = f"{self.skipped} skipped (already in the results"
        skipped += f", {self.skipped_failed} of them failed)" if self.skipped_failed else ")"
        return (
            f"run-batch: {self.lines} lines: {self.completed} completed, {self.failed} failed, {skipped}; "
            f"{self.engine_requests} engine requests, {self.generated_tokens} tokens generated in "
            f"{self.seconds:.1f} s ({rate:.1f} lines/s, {tok:.1f} output tok/s)"
        )
