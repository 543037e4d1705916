"""An instance's states as data: every state, the groups the rest of the proxy asks about, the
transitions allowed between them (`TRANSITIONS`) and the planner's phase of each (`PHASES`).
`Instance._set_state` is the one place a state changes, and it refuses any change this table
does not list.

The twelve states are the instance's own; operators see seven (`State.public`: the metrics
labels and the admin API's ``state``), the exact one as the admin API's ``phase``.
"""

from __future__ import annotations

import enum

from ..planning.planner import Phase


class State(enum.Enum):
    """Every state an instance can be in; `public` is the coarser one operators see."""

    #: Created, not started yet (no process, no memory).
    NEW = "new"
    #: In admission, spawned, or waiting for readiness and the warm-up.
    STARTING = "starting"
    #: Serving: takes new requests.
    RUNNING = "running"
    #: Retired (a reload, a removed model): takes no new request, its leases run out.
    DRAINING = "draining"
    #: The /sleep call is in flight: its memory still counts as awake.
    FALLING_ASLEEP = "falling_asleep"
    #: Asleep (the /sleep call returned): it holds only what the sleep left.
    SLEEPING = "sleeping"
    #: A wake in admission: queued for memory, or its victims freeing it; nothing sent yet.
    WAKE_WAITING = "wake_waiting"
    #: The wake was admitted: /wake_up (and the warm-up) in flight.
    WAKING = "waking"
    STOPPING = "stopping"
    #: Ended after a stop, or a start that admission refused (no process was started).
    STOPPED = "stopped"
    #: Ended: killed after failed health checks (or put to sleep by someone else).
    UNHEALTHY = "unhealthy"
    #: Ended: crashed, or failed to start.
    ERROR = "error"

    @property
    def public(self) -> State:
        """The state operators see (metrics labels, the admin API's ``state``): one of
        stopped, starting, running, sleeping, waking, stopping, error."""
        return _PUBLIC.get(self, self)


def awake_state(retired: bool) -> State:
    """Where a start or a wake ends: RUNNING, or DRAINING for an instance retired meanwhile."""
    return State.DRAINING if retired else State.RUNNING


_PUBLIC = {
    State.NEW: State.STOPPED,
    State.DRAINING: State.RUNNING,
    State.FALLING_ASLEEP: State.SLEEPING,
    State.WAKE_WAITING: State.WAKING,
    State.UNHEALTHY: State.ERROR,
}
#: States in which the instance has ended: no process, no memory; it never runs again.
DOWN = frozenset({State.STOPPED, State.UNHEALTHY, State.ERROR})
#: States with a live engine process that may be asked to sleep, wake or stop.
LIVE = frozenset(
    {State.RUNNING, State.DRAINING, State.FALLING_ASLEEP, State.SLEEPING, State.WAKE_WAITING,
     State.WAKING}
)  # fmt: skip
#: RUNNING or DRAINING: up and awake, its leases served.
AWAKE = frozenset({State.RUNNING, State.DRAINING})
#: Put to sleep by the proxy, or on the way back: woken before any cold start.
DORMANT = frozenset({State.FALLING_ASLEEP, State.SLEEPING, State.WAKE_WAITING, State.WAKING})
#: Put to sleep by the proxy: asleep, or its /sleep call in flight.
ASLEEP_OR_FALLING = frozenset({State.FALLING_ASLEEP, State.SLEEPING})
_LIVE_END = frozenset({State.STOPPING, State.UNHEALTHY, State.ERROR})
#: The allowed transitions. An instance starts once (NEW -> STARTING) and ends in STOPPED,
#: UNHEALTHY or ERROR; a restart is a new instance. Every live state may crash (ERROR) or be
#: stopped (STOPPING).
TRANSITIONS: dict[State, frozenset[State]] = {
    State.NEW: frozenset({State.STARTING}),
    # STARTING -> STOPPED: admission refused (no GPU memory in time); no process was started.
    # STARTING -> DRAINING: it became ready after it was retired.
    State.STARTING: frozenset(
        {State.RUNNING, State.DRAINING, State.STOPPING, State.ERROR, State.STOPPED}
    ),
    State.RUNNING: frozenset({State.DRAINING, State.FALLING_ASLEEP, *_LIVE_END}),
    State.DRAINING: _LIVE_END,
    # A wake asked for meanwhile waits for the call to return (`Instance.wake_asked`).
    State.FALLING_ASLEEP: frozenset({State.SLEEPING, *_LIVE_END}),
    State.SLEEPING: frozenset({State.WAKE_WAITING, *_LIVE_END}),
    # WAKE_WAITING -> SLEEPING: no GPU memory for the wake in time (nothing was sent).
    State.WAKE_WAITING: frozenset({State.WAKING, State.SLEEPING, State.STOPPING, State.ERROR}),
    # WAKING -> DRAINING: awake again after it was retired.
    State.WAKING: frozenset({State.RUNNING, State.DRAINING, State.STOPPING, State.ERROR}),
    State.STOPPING: frozenset({State.STOPPED}),
    State.STOPPED: frozenset(),
    State.UNHEALTHY: frozenset(),
    State.ERROR: frozenset(),
}


#: The planner's phase of each state of a placed instance (one that holds a memory claim): what
#: admission tells `planner.plan()`, in the proxy and in the density benchmark. NEW and the
#: ended states hold no memory and have none.
PHASES: dict[State, Phase] = {
    State.STARTING: Phase.STARTING,
    State.RUNNING: Phase.RUNNING,
    State.DRAINING: Phase.RUNNING,
    State.FALLING_ASLEEP: Phase.FALLING_ASLEEP,
    State.SLEEPING: Phase.ASLEEP,
    State.WAKE_WAITING: Phase.WAKING,
    State.WAKING: Phase.WAKING,
    State.STOPPING: Phase.STOPPING,
}


class InvalidTransition(RuntimeError):
    pass
