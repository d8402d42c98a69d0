"""When a role process that died is started again (`disagg up --serve`, `--restart`): as a
kubelet restarts a container, after a back-off that doubles with each restart in a row
(`BASE_S`, 2x, 4x, ... at most `MAX_S`) and starts over once a process has run for
`RESET_S`. Pure bookkeeping; supervisor.py spawns the processes.

While a replica is down it is out of the peers file (senders move the requests it held:
routing/migration.py); the restarted one joins again once its /readyz answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BASE_S = 0.5
MAX_S = 30.0
RESET_S = 60.0


def backoff_s(in_a_row: int) -> float:
    """Seconds to wait before the restart that follows `in_a_row` restarts in a row."""
    return float(min(MAX_S, BASE_S * 2.0 ** max(0, in_a_row)))


@dataclass
class _Replica:
    in_a_row: int = 0
    total: int = 0
    due: float | None = None  # when to start it again (None: running)


@dataclass
class Restarts:
    """Per replica (its label, "role/index"): restarts so far and when the next is due."""

    replicas: dict[str, _Replica] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)  # what happened, for the run summary

    def died(self, label: str, code: int, *, now: float, ran_s: float) -> float:
        """Record a death; the seconds until its restart is due."""
        replica = self.replicas.setdefault(label, _Replica())
        if ran_s >= RESET_S:
            replica.in_a_row = 0
        delay = backoff_s(replica.in_a_row)
        replica.due = now + delay
        self.events.append(f"{label} exited with code {code}; restarting in {delay:.1f} s")
        return delay

    def due(self, now: float) -> list[str]:
        """Replicas whose restart is due now (each is then counted as restarted)."""
        out = []
        for label, replica in self.replicas.items():
            if replica.due is not None and replica.due <= now:
                replica.due = None
                replica.in_a_row += 1
                replica.total += 1
                out.append(label)
        return out

    def down(self) -> list[str]:
        """Replicas waiting for their restart."""
        return [label for label, r in self.replicas.items() if r.due is not None]

    def counts(self) -> dict[str, int]:
        """Restarts per replica so far."""
        return {label: r.total for label, r in self.replicas.items() if r.total}
