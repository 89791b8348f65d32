"""Load shapes as tables of stages, scaled by Locust's own ``--users`` and ``--run-time``.

Each table lists stages as (end of stage, users, how they arrive), with time and
users given as fractions of the run time and the peak user count, so one table
serves a 2-minute CI run and a 10-minute benchmark alike. ``--users`` is the peak
and ``--spawn-rate`` the arrival rate where a stage ramps at the "given" rate.

======== ===========================================================
steady   ``--users`` for the whole run (plain Locust behaviour)
ramp     0 → peak over 80% of the run at a constant rate, then hold
step     a quarter of the peak more every quarter of the run
spike    30% of the peak; the peak at once for 20% of the run; back
======== ===========================================================

Select one with ``--shape NAME`` (env ``GPUSCOPE_LOAD_SHAPE``). Pure logic, no Locust
import: the Locust shape class in ``locustfile`` calls :func:`stage_at`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Arrival = Literal["given", "even", "burst"]

#: Run time assumed when a shape other than steady runs without ``--run-time``.
DEFAULT_RUN_TIME_S = 300.0


@dataclass(frozen=True)
class Stage:
    """One row of a stage table.

    ``until`` and ``users`` are fractions of the run time and the peak user count.
    ``arrival`` says how users reach the stage's count: at ``--spawn-rate``
    ("given"), evenly over the stage ("even": a linear ramp), or within one second
    ("burst": a spike must not be smeared out by a slow spawn rate).
    """

    until: float
    users: float
    arrival: Arrival = "given"


SHAPES: dict[str, tuple[Stage, ...]] = {
    "steady": (Stage(1.0, 1.0),),
    "ramp": (Stage(0.8, 1.0, "even"), Stage(1.0, 1.0)),
    "step": (Stage(0.25, 0.25, "burst"), Stage(0.5, 0.5, "burst"),
             Stage(0.75, 0.75, "burst"), Stage(1.0, 1.0, "burst")),
    "spike": (Stage(0.4, 0.3, "burst"), Stage(0.6, 1.0, "burst"), Stage(1.0, 0.3, "burst")),
}


def shape_names() -> list[str]:
    return list(SHAPES)


def stage_at(name: str, elapsed_s: float, run_time_s: float | None, peak_users: int,
             spawn_rate: float) -> tuple[int, float] | None:
    """(users, spawn rate) for this moment of the run, or None once the run is over.

    ``steady`` without a run time goes on until stopped, as plain Locust does.
    """
    table = SHAPES[name]
    if run_time_s is None:
        if name == "steady":
            return max(1, peak_users), spawn_rate
        run_time_s = DEFAULT_RUN_TIME_S
    start = 0.0
    previous_users = 0
    for stage in table:
        end = stage.until * run_time_s
        users = max(1, round(stage.users * peak_users))
        if elapsed_s < end:
            if stage.arrival == "burst":
                rate = float(max(users, 1))
            elif stage.arrival == "even":
                rate = max(abs(users - previous_users) / max(end - start, 1e-9), 0.01)
            else:
                rate = spawn_rate
            return users, rate
        start, previous_users = end, users
    return None

