"""An external scaffold's failures: each is its own trial's, and only too many in a step fail the job.

    AgentTrials.group ── a training group's trials, each "" or its scaffold error ──> ScaffoldErrors.count
        total, last       the job's running count (Collector.counters() -> the step's `scaffold_errors`)
                          and the last error with its output tail
        the window        a step's worth of training trials (num_prompts_per_step × num_generations_per_prompt,
                          counted as groups finish); more than env.scaffold.max_error_fraction of it scaffold
                          errors ──> ScaffoldFailing (a RuntimeError: the job fails, naming the scaffold
                          and its last error), raised as soon as the window can no longer stay below it

Guarantees: a scaffold error never fails a job by itself, and a window holding more than the fraction
always does (1.0: never); validation trials are not counted (they are never trained on); the counts
only grow, so a step's figure is a difference of two readings.
"""

from __future__ import annotations


class ScaffoldFailing(RuntimeError):
    """More than env.scaffold.max_error_fraction of a step's worth of trials were scaffold errors."""


class ScaffoldErrors:
    def __init__(self, scaffold: str, max_fraction: float, window: int) -> None:
        self.scaffold, self.max_fraction, self.window = scaffold, max_fraction, max(window, 1)
        self.total = 0  # scaffold errors since the job started
        self.trials = 0  # training trials counted since the job started
        self.last = ""  # the last error, as the job's message would give it
        self._in_window = self._errors_in_window = 0

    def count(self, errors: list[str]) -> None:
        """One entry per finished trial: "" when its scaffold ran, else its error (and output tail)."""
        for error in errors:
            self.trials += 1
            self._in_window += 1
            if error:
                self.total += 1
                self._errors_in_window += 1
                self.last = error
            if self._errors_in_window > self.max_fraction * self.window:
                raise ScaffoldFailing(
                    f"the scaffold {self.scaffold} failed in {self._errors_in_window} of the last "
                    f"{self._in_window} training trials, more than env.scaffold.max_error_fraction="
                    f"{self.max_fraction:g} of a step's {self.window}; its last error: {self.last}"
                )
            if self._in_window >= self.window:
                self._in_window = self._errors_in_window = 0
