"""Sleep levels a model stops using after its wakes from them keep failing the wake check.

A wake that answers the check request (`oracle`) wrongly costs the wake, a stop and a cold start.
Where that failure is systematic (a level-2 reload that misses a derived tensor of some
quantisation, a driver that restores pinned copies wrongly), every later wake fails the same way,
and a model put to sleep at each idle period would pay that for ever. So the failures are counted
per model, engine (`Instance.host_key`) and level: after `BAR_AFTER` in a row the level is barred
for that engine, and a level taken in its place (level 2 for a model that can reload its weights)
is barred at its first failure: the model has shown that its wakes fail. With every level barred
the model keeps its engine as if it had no sleep policy (``sleep: null``): idle, it stays awake
until ``idle_timeout_s``, and memory pressure stops it rather than putting it to sleep.

A verified wake resets the count of its level. Nothing clears a bar but an operator
(``POST /admin/models/{name}/wake_check/clear``) or a reload that changes the engine (a new key).
Pure bookkeeping: no asyncio, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Failed checks in a row at one level before that level is barred.
BAR_AFTER = 2

#: (model name, engine key)
Key = tuple[str, str]


@dataclass
class WakeBreaker:
    """Failed wake checks in a row, and the levels barred, per (model, engine)."""

    #: (key, level) -> failed checks in a row at that level.
    failures: dict[tuple[Key, int], int] = field(default_factory=dict)
    #: key -> levels no longer used.
    barred: dict[Key, set[int]] = field(default_factory=dict)

    def failed(self, key: Key, level: int) -> bool:
        """A wake from `level` failed its check; True when that bars the level (now)."""
        count = self.failures.get((key, level), 0) + 1
        self.failures[key, level] = count
        levels = self.barred.setdefault(key, set())
        if level in levels:
            return False
        limit = 1 if levels else BAR_AFTER  # a stand-in level: its first failure bars it
        if count < limit:
            return False
        levels.add(level)
        return True

    def passed(self, key: Key, level: int) -> None:
        """A wake from `level` passed its check: the failures in a row start again."""
        self.failures.pop((key, level), None)

    def allowed(self, key: Key, level: int, reloadable: bool) -> int | None:
        """The level a sleep asked at `level` takes: itself unless barred, else level 2 where
        the model reloads its weights and level 2 is not barred; None: no sleep."""
        levels = self.barred.get(key, set())
        if level not in levels:
            return level
        if level == 1 and reloadable and 2 not in levels:
            return 2
        return None

    def usable(
        self, key: Key, policy: int | None, level: int | None, reloadable: bool
    ) -> int | None:
        """The level a sleep asked at `level` (None: the sleep policy's level, `policy`; None:
        no sleep policy) takes (`allowed`); None: it does not sleep."""
        if policy is None:
            return None
        return self.allowed(key, level or policy, reloadable)

    def levels_barred(self, name: str) -> list[int]:
        """The levels barred for model `name`, whatever its engine."""
        found: set[int] = set()
        for (model, _engine), levels in self.barred.items():
            if model == name:
                found |= levels
        return sorted(found)

    def clear(self, name: str) -> list[int]:
        """An operator's reset of model `name`: every level usable again; returns those that
        were barred."""
        was = self.levels_barred(name)
        for key in [k for k in self.barred if k[0] == name]:
            del self.barred[key]
        for counted in [k for k in self.failures if k[0][0] == name]:
            del self.failures[counted]
        return was

    def status(self, name: str) -> dict[str, object]:
        """For ``/admin/models``: levels barred and the failures in a row by level."""
        counts: dict[str, int] = {}
        for ((model, _engine), level), n in self.failures.items():
            if model == name:
                counts[str(level)] = max(n, counts.get(str(level), 0))
        return {"barred_levels": self.levels_barred(name), "failures_in_a_row": counts}


def barred_note(name: str, level: int, usable: int | None) -> str:
    """What the log says when model `name`'s wakes from `level` have just barred it, with the
    level its sleeps take from now on (`usable`; None: it no longer sleeps)."""
    then = "no longer sleeps" if usable is None else f"sleeps at level {usable} instead"
    return (
        f"model {name}: its wakes from sleep level {level} kept failing the wake check; it"
        f" {then} until an operator clears it (POST /admin/models/{name}/wake_check/clear)"
    )
