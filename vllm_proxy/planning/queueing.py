"""The admission queue: its tickets and its rules, as pure functions (no clock of their own).

`admission.Admission` applies these rules to the live instances; the density benchmark
(`benchmarks/density.py`) applies the same functions to simulated ones. A request whose model
serves at once never waits here. Every other request holds a `Ticket` from the moment it has
to wait (for a start, a wake, GPU memory, or a swap it must let go first) until it is served
or gives up, and every start or wake that waits for memory holds one for its instance. The
rules:

* **Order.** Models waiting to be brought up are served by ``(model priority, key priority,
  arrival of their oldest waiting request)``: FIFO among equals. Lower values go first (vLLM's
  rule for its own ``priority`` field): the model's ``priority``, then the best ``priority`` of
  the API keys whose requests wait for it (``server.api_keys``), both set by the operator, so
  a batch key waits behind interactive ones for the same memory. A request's
  own ``priority`` orders requests within its model (the engine does that, with
  ``--scheduling-policy priority``) and takes no part here: a client could otherwise rank its
  model ahead of every other and, with ``holds``, keep them from their turn for good. A
  model's requests are grouped: all of them ride on its one start or wake, whatever came in
  between.
* **No needless waits.** A request for a model that serves is sent at once, ahead of swaps it
  does not need: unless a waiter before it in that order needs this very engine's memory and
  has used up its reorder window (``max_reorder_s`` after it arrived, at most half the queue
  timeout). From then on requests for that engine are held (they queue behind the waiter);
  the engine drains, and the waiter takes its place. So no request is passed by requests that
  came after it for longer than ``max_reorder_s``, and neither side starves.
* **Minimum residency.** An engine that started or woke less than ``min_resident_s`` ago and is
  in use (a request in flight or queued for it, or one ended within ``idle_grace_s``) is not
  put to sleep or stopped for a waiter whose window is still open: the gaps between a client's
  back-to-back requests do not hand the GPU to another model after each answer.
* **Turns** (`turn`). Among starts and wakes waiting for memory, the first in order goes as
  soon as its plan fits. One behind it may go meanwhile where what it takes leaves the first
  one's plan intact: once its own plan has been carried out, the first still fits with busy
  engines drained and waits for no engine busy now that it did not wait for already. It may
  take free memory, and, when its bring-up is quick (no longer than the reorder window, so
  its turn on the device delays the first by no more), idle engines the first does not need;
  it delays no one, whenever it came. Where the first cannot be placed even with busy engines
  drained, one behind may put engines to sleep or stop them, but never if it began waiting
  more than the reorder window after the first. Only a waiter that may go holds requests
  (`may_hold`).

The victims themselves are chosen by `planner.plan()` (price order: restore seconds per idle
second, priorities first). Every wait here is bounded: by ``admission.queue_timeout_s`` for
memory and for a held request, by the model's start and wake timeouts for the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace

#: A ticket's rank: (model priority, API key priority); lower goes first. Only what the
#: operator sets ranks a ticket, never what a client writes in its body.
Rank = tuple[int, int]


@dataclass(frozen=True)
class Rules:
    """The admission settings (config ``admission`` and each model's ``min_resident_s``)."""

    #: How long requests that came later may be served ahead of a waiter (0: strict FIFO).
    max_reorder_s: float = 10.0
    #: An engine with nothing in flight or queued for this long counts as idle.
    idle_grace_s: float = 1.0
    #: ``admission.queue_timeout_s``: a waiter's window is at most half of it, so that a
    #: waiter always has its turn before it gives up (0: no window at all).
    queue_timeout_s: float = 30.0
    #: ``admission.max_wait_s``: the client's patience. A waiter whose turn is expected later
    #: than its queue timeout waits on (`give_up_at`), never longer than this.
    max_wait_s: float = 300.0

    @property
    def window_s(self) -> float:
        """The reorder window in force."""
        return min(self.max_reorder_s, self.queue_timeout_s / 2)


@dataclass(frozen=True)
class Waiter:
    """One model as the queue sees it: its best rank and its oldest waiting request."""

    model: str
    rank: Rank
    #: Monotonic time its oldest waiting request arrived (or its bring-up began).
    since: float
    seq: int = 0


def order(waiters: Iterable[Waiter]) -> list[Waiter]:
    """The queue in serving order: rank, then arrival, then ticket number."""
    return sorted(waiters, key=lambda w: (w.rank, w.since, w.seq))


def overdue(w: Waiter, now: float, rules: Rules) -> bool:
    """Whether `w`'s reorder window is used up: nothing that came later goes ahead of it now."""
    return now - w.since >= rules.window_s


def spare_s(queue_timeout_s: float, rules: Rules) -> float:
    """How long a waiter waits for busy and changing engines rather than stop idle ones that
    waiting would spare (see `Admission._spare_stops`): its queue timeout less one reorder
    window, so that it still stops what it must in time to be placed (0: it never waits)."""
    return max(queue_timeout_s - rules.window_s, 0.0)


def give_up_at(started: float, expected_end: float, timeout_s: float, rules: Rules) -> float:
    """When a waiter that began at `started` gives up (a 503): a queue timeout after the
    bring-ups ahead of it (the waiters before it, the starts and wakes under way) are expected
    to end (`expected_end`; `started` when nothing was ahead of it: memory held by busy or
    protected engines), never later than `Rules.max_wait_s` after it began; at once for a
    timeout of 0."""
    if timeout_s <= 0:
        return started
    patience = started + max(rules.max_wait_s, timeout_s)
    return min(max(started, expected_end) + timeout_s, patience)


def in_use(leases: int, queued: int, used_at: float, now: float, rules: Rules) -> bool:
    """A request in flight or queued, or one that ended within the idle grace."""
    return leases > 0 or queued > 0 or now - used_at < rules.idle_grace_s


def protected(
    resident_since: float,
    min_resident_s: float,
    busy: bool,
    now: float,
    waiter: Waiter | None,
    rules: Rules,
) -> bool:
    """Whether an engine is kept from `waiter` by its minimum residency: it came up less than
    `min_resident_s` ago, it is in use (`busy`, see `in_use`) and the waiter's window is open."""
    if min_resident_s <= 0 or not busy or now - resident_since >= min_resident_s:
        return False
    return waiter is None or not overdue(waiter, now, rules)


def next_deadline(
    waiters: Iterable[Waiter],
    residents: Iterable[tuple[float, float, float]],
    now: float,
    rules: Rules,
) -> float | None:
    """The next moment a decision may change with nothing else happening: a waiter's window
    ending, or a resident's (``resident_since``, ``min_resident_s``, ``used_at``) residency or
    idle grace running out."""
    times = [w.since + rules.window_s for w in waiters]
    for since, minimum, used_at in residents:
        if minimum > 0:
            times += [since + minimum, used_at + rules.idle_grace_s]
    later = [t for t in times if t > now]
    return min(later) if later else None


#: `turn()`'s answers.
GO, WAIT, IF_FIRST_STILL_FITS = "go", "wait", "if_first_still_fits"


def turn(me: Waiter, first: Waiter, rules: Rules, *, first_placeable: bool,
         reclaims: bool, quick: bool = False) -> str:  # fmt: skip
    """Whether `me`, waiting for memory behind `first` (the first in order), may act now on its
    plan: `GO`, `WAIT`, or `IF_FIRST_STILL_FITS` (go only where, once its plan has been carried
    out, `first`'s plan with busy engines drained still fits and waits for no engine busy now
    that it did not wait for already: see `planner.after`).

    The first always goes. Where the first can be placed once busy engines drain
    (`first_placeable`), it waits for them; meanwhile one behind it may use what the first's
    plan leaves: memory that is free, or (`quick`: its wake or start takes no longer than the
    reorder window, so its turn on the device delays the first by no more than that) idle
    engines the first does not need. That delays no one, so it goes whenever it came: a head
    stuck behind a long stream does not hold back a wake that could put an idle engine to
    sleep. Otherwise no one that began waiting more than the reorder window after the first
    goes ahead of it (the bound on reordering); within that, one behind may go when the first
    cannot be placed even with busy engines drained (it waits for something else)."""
    if me.model == first.model:
        return GO
    if first_placeable:
        return IF_FIRST_STILL_FITS if (not reclaims or quick) else WAIT
    if not reclaims:
        return GO
    return WAIT if me.since - first.since > rules.window_s else GO


def may_hold(waiter: Waiter, first: Waiter, rules: Rules, *, first_placeable: bool) -> bool:
    """Whether `waiter` is one that may hold requests for engines its plan takes: the first
    in order when it can be placed once busy engines drain, else one that `turn` lets go
    ahead of it."""
    if waiter.model == first.model:
        return first_placeable
    return not first_placeable and waiter.since - first.since <= rules.window_s


def holds(waiter: Waiter, rank: Rank, arrived: float, victims: Iterable[str], instance: str,
          now: float, rules: Rules) -> bool:  # fmt: skip
    """Whether a request (of `rank`, arrived at `arrived`) for the serving `instance` waits
    behind `waiter`: the waiter goes before it in the queue's order (a better rank, or the same
    rank and here first), its window is used up, and its plan (with busy engines drained) takes
    that instance's memory (`victims`)."""
    first = (waiter.rank, waiter.since) <= (rank, arrived)
    return first and overdue(waiter, now, rules) and instance in victims


@dataclass(eq=False)
class Ticket:
    """One waiting request (or a start or wake waiting for memory)."""

    model: str
    rank: Rank
    since: float
    seq: int
    #: Held behind a swap (its model serves, but must give way), not waiting for a bring-up.
    held: bool = False
    instance: str | None = field(default=None)


class Queue:
    """The tickets of everything that waits, and the wake-up call for those waiting on it.

    The queue owns only the tickets; what each waiter waits for (a bring-up, memory, a swap)
    is decided by the manager with the functions above. `changed()` is called on every event
    that may change a decision (a ticket in or out, capacity back, a state change); waiters
    block in `wait()` until then or until the next deadline.
    """

    def __init__(self, rules: Rules | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.rules = rules or Rules()
        #: The one clock of admission, holds and instance timestamps (monotonic seconds); the
        #: density benchmark replaces it with its event loop's virtual time.
        self.clock = clock
        self.tickets: dict[int, Ticket] = {}
        self._seq = itertools.count(1)
        self._event = asyncio.Event()

    @property
    def timeout_s(self) -> float:
        """``admission.queue_timeout_s``: the bound on a wait for memory and on a hold."""
        return self.rules.queue_timeout_s

    def enter(self, model: str, rank: Rank, since: float | None = None, *, held: bool = False,
              instance: str | None = None) -> Ticket:  # fmt: skip
        """A ticket for a request of `model` that arrived at `since` (monotonic; now if None)."""
        seq = next(self._seq)
        when = self.clock() if since is None else since
        ticket = Ticket(model, rank, when, seq, held, instance)
        self.tickets[seq] = ticket
        if not held:  # held tickets change no decision
            self.changed()
        return ticket

    def leave(self, ticket: Ticket) -> None:
        if self.tickets.pop(ticket.seq, None) is not None and not ticket.held:
            self.changed()

    def waiters(self, *, bringing: Iterable[str] | None = None) -> list[Waiter]:
        """The models that wait to be brought up (each with its best rank and oldest
        ticket), in order; `bringing` limits them to those models. A model's rank is its
        requests' best (their API keys' priorities included); a start or wake that no request
        waits for (an admin load, a replica) has the model's own."""
        keep = set(bringing) if bringing is not None else None
        best: dict[str, Waiter] = {}
        asked: dict[str, Rank] = {}
        for t in self.tickets.values():
            if t.held or (keep is not None and t.model not in keep):
                continue
            if t.instance is None:  # a request's ticket
                asked[t.model] = min(asked.get(t.model, t.rank), t.rank)
            cur = best.get(t.model)
            w = Waiter(t.model, t.rank, t.since, t.seq)
            if cur is None:
                best[t.model] = w
            else:
                best[t.model] = Waiter(t.model, min(cur.rank, w.rank), min(cur.since, w.since),
                                       min(cur.seq, w.seq))  # fmt: skip
        for model, rank in asked.items():
            best[model] = replace(best[model], rank=rank)
        return order(best.values())

    def waiting(self, model: str) -> int:
        """Tickets of `model` waiting for a bring-up (held ones not counted)."""
        return sum(1 for t in self.tickets.values() if t.model == model and not t.held)

    def rerank(self, model: str, priority: int) -> None:
        """`model`'s priority was reloaded: its tickets take it (the request's own stays)."""
        for t in self.tickets.values():
            if t.model == model and t.rank[0] != priority:
                t.rank = (priority, t.rank[1])
        self.changed()

    def changed(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def changes(self) -> Awaitable[bool]:
        """Until the next change after this call (bound now, as in `wait`), unbounded."""
        return self._event.wait()

    def wait(self, timeout: float) -> Awaitable[None]:
        """Until the next change after this call, at most `timeout` seconds (the change is
        bound now, not when the awaitable first runs)."""
        return _wait(self._event, timeout)


async def _wait(event: asyncio.Event, timeout: float) -> None:
    if timeout <= 0:
        return
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        pass
