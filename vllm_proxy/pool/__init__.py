"""The pool of models on this server: names and aliases (`manager.Manager`) and admission to the
GPU (`admission.Admission`: the one queue, the plan over every live instance, turns). It asks
instances to sleep, stop or start; the request path asks it for a lease (`lease.Lease`), which
yields a handle on the engine (`lease.Upstream`), and the pages read `views`.
"""
