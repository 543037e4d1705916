"""The engine state: admission, sequence slots, sleep/wake, aborts and crash counters."""

import asyncio
from collections import deque

from .metrics import Metrics
from .settings import Settings


def _resolve(future: "asyncio.Future[None]") -> None:
    if not future.done():
        future.set_result(None)


class Engine:
    """Admission, sequence slots, sleep state and aborts shared by all request handlers.

    A generation handler calls ``enter()``, then ``admit()`` (parks while the engine sleeps,
    queues while ``max_num_seqs`` requests run) and always ``leave()`` in ``finally``. An admitted
    request gets the current abort epoch; ``abort_running()`` bumps it and cuts token pauses
    short, so a handler that sees a different epoch finishes with ``abort``.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics(settings.served_names[0])
        self.loop = asyncio.get_running_loop()
        self.stopping = False
        self.epoch = 0
        self.started = 0
        self.running = 0
        self.waiting = 0
        self.active = 0
        self.kv_tokens = 0
        self.paused = False
        self.frozen = False
        self.level = 0
        self.asleep_memory: set[str] = set()
        self._awake = asyncio.Event()
        self._awake.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._slots: deque[asyncio.Future[None]] = deque()
        self._timers: set[asyncio.Future[None]] = set()

    def enter(self) -> None:
        self.active += 1
        self._drained.clear()

    async def admit(self, kv_tokens: int) -> int | None:
        """Wait until the request may run; its abort epoch, or None when shutting down."""
        while not self.stopping:
            if self.paused:
                await self._awake.wait()
            elif self.running >= self.settings.max_num_seqs:
                await self._queue_for_slot()
            else:
                self.running += 1
                self.kv_tokens += kv_tokens
                self._idle.clear()
                return self.epoch
        return None

    async def _queue_for_slot(self) -> None:
        slot = self.loop.create_future()
        self._slots.append(slot)
        self.waiting += 1
        try:
            await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self._wake_next_slot()
            raise
        finally:
            self.waiting -= 1

    def _wake_next_slot(self) -> None:
        while self._slots:
            slot = self._slots.popleft()
            if not slot.done():
                slot.set_result(None)
                return

    def leave(self, admitted: bool, kv_tokens: int) -> None:
        if admitted:
            self.running -= 1
            self.kv_tokens -= kv_tokens
            if self.running == 0:
                self._idle.set()
            self._wake_next_slot()
        self.active -= 1
        if self.active == 0:
            self._drained.set()

    async def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if ``abort_running()`` is called meanwhile."""
        timer = self.loop.create_future()
        handle = self.loop.call_later(seconds, _resolve, timer)
        self._timers.add(timer)
        try:
            await timer
        finally:
            handle.cancel()
            self._timers.discard(timer)

    async def hold(self) -> None:
        """Stay still while a ``mode=keep`` sleep freezes running requests."""
        while self.frozen and not self.stopping:
            await self._awake.wait()

    def abort_running(self) -> None:
        self.epoch += 1
        for timer in self._timers:
            _resolve(timer)

    async def sleep(self, level: int, mode: str) -> None:
        self.paused = True
        self.level = level
        self._awake.clear()
        if level >= 1:
            self.asleep_memory = {"weights", "kv_cache"}
        if mode == "abort":
            self.abort_running()
        elif mode == "wait":
            await self._idle.wait()
        else:
            self.frozen = True
        if self.settings.sleep_delay > 0:
            await asyncio.sleep(self.settings.sleep_delay)

    async def wake_up(self, tags: list[str] | None) -> bool:
        """Wake the given memory tags (all when None); True once fully awake."""
        if self.settings.wake_delay > 0:
            await asyncio.sleep(self.settings.wake_delay)
        if tags is None:
            self.asleep_memory.clear()
        else:
            self.asleep_memory.difference_update(tags)
        if self.asleep_memory:
            return False
        self.paused = False
        self.frozen = False
        self.level = 0
        self._awake.set()
        return True

    def shutdown(self) -> None:
        """Abort everything in flight and release every parked or queued request."""
        self.stopping = True
        self.abort_running()
        self._awake.set()
        while self._slots:
            _resolve(self._slots.popleft())

    async def wait_drained(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
        except TimeoutError:
            pass

    def render_metrics(self) -> str:
        capacity = self.settings.max_model_len * self.settings.max_num_seqs
        sleep = {
            "awake": 0 if self.paused else 1,
            "weights_offloaded": int(self.paused and self.level == 1),
            "discard_all": int(self.paused and self.level == 2),
        }
        kv_usage = min(1.0, self.kv_tokens / capacity)
        return self.metrics.render(self.running, self.waiting, kv_usage, sleep)
