"""Engines: one vLLM process per `instance.Instance`, its life and its replicas.

The process and its guard (`engine`, `guard`, `registry`), an instance's states and its sleep and
wake (`instance`, `oracle`, `lora`), and a model's set of instances (`model`, `autoscale`,
`backoff`). Instances claim memory from `planning`; they never decide who is admitted.
"""
