"""The network-programming latency: from a change's trigger time to when it is served."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class LatencyTracker:
    """Trigger times -> one observation each (seconds), taken when the change is served.

    A change that listeners and pools serve alone is measured at once; one that needs a rule
    commit (a new, changed or removed service port) is served only once the rules name the new
    ports, so it waits for the commit of the rule generation it asked for.
    """

    def __init__(self, observe: Callable[[float], None]) -> None:
        self._observe = observe
        # Trigger times of changes that wait for a rule commit, with the rule generation
        # that commit must reach.
        self._awaiting_rules: list[tuple[int, float]] = []

    def served(
        self,
        trigger_times: Sequence[float],
        *,
        at: float,
        awaiting: int | None,
        committed: int,
    ) -> None:
        """Measure the changes of one sync or apply, served at `at` (time.time).

        `awaiting`: the rule generation they wait for (None: nothing waits for rules);
        `committed`: the rule generation the last successful commit carried.
        """
        if awaiting is not None:
            self._awaiting_rules.extend((awaiting, t) for t in trigger_times)
        else:
            for trigger in trigger_times:
                self._observe(max(0.0, at - trigger))
        if self._awaiting_rules:
            waiting = []
            for generation, trigger in self._awaiting_rules:
                if generation <= committed:
                    self._observe(max(0.0, at - trigger))
                else:
                    waiting.append((generation, trigger))
            self._awaiting_rules = waiting
