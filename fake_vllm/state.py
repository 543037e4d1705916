"""The engine state: admission, sequence slots, sleep/wake, aborts and crash counters."""

import asyncio
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from .gpu import DeviceMemory, GpuError
from .metrics import Metrics
from .protocol import ApiError, error
from .settings import MEMORY_TAGS, Settings
from .simengine import MemoryLost, SimGpu

ASLEEP_MESSAGE = "The engine is sleeping; wake it up with POST /wake_up first."


def _resolve(future: "asyncio.Future[None]") -> None:
    if not future.done():
        future.set_result(None)


class Engine:
    """Admission, sequence slots, sleep state and aborts shared by all request handlers.

    A generation handler calls ``enter()``, then ``admit()`` (parks while the engine sleeps, or
    answers 503 with ``FAKE_ENGINE_ASLEEP=reject``; queues while ``max_num_seqs`` requests run),
    then ``step()``, and always ``leave()`` in ``finally``. An admitted request gets the current
    abort epoch; ``abort_running()`` bumps it and cuts token pauses short, so a handler that sees
    a different epoch finishes with ``abort``.

    The engine is asleep (``paused``) from the start of ``sleep()`` until a ``wake_up()`` has
    woken every memory tag; a level-2 sleep loses the weights (``weights_lost``) until
    ``reload_weights()``. Without ``--enable-sleep-mode`` a sleep only pauses (vLLM has no CuMem
    pool to release). Sleep, wake and reload run one at a time.

    A simulated sleep that fails after memory was unmapped leaves the scheduler paused but the
    executor awake (vLLM sets its sleeping tags only on success, ``v1/executor/abstract.py:
    400-407``): ``/is_sleeping`` stays true (``v1/engine/core.py:1078-1080``), a ``/wake_up``
    maps nothing ("Executor is not sleeping", ``abstract.py:412-415``) and resumes scheduling,
    and the next forward pass runs on unmapped memory and kills the engine.
    """

    def __init__(self, settings: Settings, gpu: DeviceMemory | None = None) -> None:
        self.settings = settings
        self.gpu = gpu
        self.sim = gpu if isinstance(gpu, SimGpu) else None
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
        self.weights_lost = False
        self._operation = asyncio.Lock()
        self._stopped = asyncio.Event()
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
        """Wait until the request may run; its abort epoch, or None when shutting down.

        Raises a 503 ``ApiError`` while the engine sleeps with ``FAKE_ENGINE_ASLEEP=reject``.
        """
        counted = False
        while not self.stopping:
            if self.paused:
                if not counted:
                    self.metrics.requests_while_asleep += 1
                    counted = True
                if self.settings.asleep == "reject":
                    raise error(503, ASLEEP_MESSAGE, "ServiceUnavailableError", None)
                await self._awake.wait()
            elif self.running >= self.settings.max_num_seqs:
                await self._queue_for_slot()
            else:
                self._regrow_peak()
                self.running += 1
                self.kv_tokens += kv_tokens
                self._idle.clear()
                return self.epoch
        return None

    def _regrow_peak(self) -> None:
        """GPU mode: the first request after a start or a wake takes the activation peak back,
        as vLLM's first batch does; no memory for it answers 500. Done on the event loop, with
        no await since the check of ``paused``, so it never overlaps a sleep or a wake."""
        regrow = getattr(self.gpu, "regrow_peak", None)
        if regrow is None:
            return
        try:
            regrow()
        except GpuError as exc:
            raise _failure(f"CUDA out of memory in the model's forward pass: {exc}") from None

    async def step(self) -> None:
        """The forward pass of an admitted request, over the batch now running: in sim mode it
        may regrow the transient peak. Raises `EngineFault` when the engine cannot go on."""
        sim = self.sim
        if sim is not None and sim.needs_step(self.kv_tokens):
            await asyncio.to_thread(sim.step, self.kv_tokens)

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

    @contextmanager
    def _in_flight(self, operation: str) -> Iterator[None]:
        self.metrics.in_flight[operation] += 1
        try:
            yield
        finally:
            self.metrics.in_flight[operation] -= 1

    def _resume(self) -> None:
        self.paused = False
        self.frozen = False
        self.level = 0
        self._awake.set()

    async def sleep(self, level: int, mode: str) -> None:
        """Pause, deal with running requests by ``mode``, then free the memory of ``level``."""
        with self._in_flight("sleep"):
            async with self._operation:
                if self.settings.sleep_fail:
                    await self._delay(self.settings.sleep_delay)
                    raise _failure("Sleep failed (fake: FAKE_ENGINE_SLEEP_FAIL=1).")
                self.paused = True
                self.level = level
                self._awake.clear()
                if mode == "abort":
                    self.abort_running()
                elif mode == "wait":
                    await self._idle.wait()
                else:
                    self.frozen = True
                offload = self.settings.enable_sleep_mode
                if self.gpu is not None:
                    try:
                        await asyncio.to_thread(self.gpu.sleep, level, offload)
                    except MemoryLost as exc:
                        self.asleep_memory = set()  # the executor believes it is awake
                        raise _failure(f"Sleep failed: {exc}") from None
                    except GpuError as exc:
                        self._fail_sleep(level)
                        raise _failure(f"Sleep failed: {exc}") from None
                if level >= 1 and offload:
                    self.asleep_memory = set(MEMORY_TAGS)
                    self.weights_lost = self.weights_lost or level == 2
                await self._delay(self.settings.sleep_delay)
                self.metrics.sleeps[level] += 1

    def _fail_sleep(self, level: int) -> None:
        """After a failed sleep: awake again if the memory is still there, else asleep without
        it (vLLM asserts on its accounting only after the allocator released the memory)."""
        assert self.gpu is not None
        gone = self.gpu.asleep_tags()
        if not gone:
            self._resume()
            return
        self.asleep_memory = gone
        self.weights_lost = self.weights_lost or (level == 2 and "weights" in gone)

    async def wake_up(self, tags: list[str] | None) -> bool:
        """Wake the given memory tags (all when None); True once fully awake."""
        with self._in_flight("wake"):
            if self.settings.wake_hang:
                await self._stopped.wait()
                raise error(503, "The server is shutting down.", "ServiceUnavailableError", None)
            async with self._operation:
                await self._delay(self.settings.wake_delay)
                if self.settings.wake_fail:
                    raise _failure("Wake up failed (fake: FAKE_ENGINE_WAKE_FAIL=1).")
                if self.settings.wake_lies:
                    self.metrics.wakes += 1
                    return True
                waking = self.asleep_memory if tags is None else self.asleep_memory & set(tags)
                if self.gpu is not None and waking:  # else vLLM's executor does nothing
                    try:
                        await asyncio.to_thread(
                            self.gpu.wake, [t for t in MEMORY_TAGS if t in waking]
                        )
                    except GpuError as exc:
                        self.asleep_memory &= self.gpu.asleep_tags()
                        raise _failure(f"Wake up failed: {exc}") from None
                self.asleep_memory -= waking
                self.metrics.wakes += 1
                if self.asleep_memory:
                    return False
                self._resume()
                return True

    async def reload_weights(self) -> None:
        """Write the weights again; they must be awake (allocated) for that."""
        async with self._operation:
            if "weights" in self.asleep_memory:
                message = "Call to collective_rpc method failed: the weights are asleep."
                raise _failure(message)
            if self.gpu is not None:
                try:
                    await asyncio.to_thread(self.gpu.reload)
                except GpuError as exc:
                    raise _failure(f"Call to collective_rpc method failed: {exc}") from None
            self.weights_lost = False
            self.metrics.reload_weights += 1

    async def _delay(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    def shutdown(self) -> None:
        """Abort everything in flight and release every parked or queued request."""
        self.stopping = True
        self._stopped.set()
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
        gpu_bytes = 0 if self.gpu is None else self.gpu.held_bytes()
        return self.metrics.render(self.running, self.waiting, kv_usage, sleep, gpu_bytes)


def _failure(message: str) -> ApiError:
    return error(500, message, "InternalServerError", None)
