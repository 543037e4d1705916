"""GPU planning: what an engine will take, what each device holds, and who goes next.

Pure decisions (`planner.plan`, the `queueing` rules, the `footprint` estimate) and the books
they read (`memory.Memory`, `hostmem.HostRam`, `gpu.NvmlMonitor`). Nothing here starts, stops or
talks to an engine; it imports only the package's shared modules (config, errors, metrics,
adapters).
"""
