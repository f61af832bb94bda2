"""The launch pipeline: plan, push, start every host's agent, supervise the ranks, show them,
and turn the result into an exit code. Engines (hosts over a transport, a Spark stage) place
the ranks; policies above them are written once.

May import everything below it: ``topo``, ``push``, ``transport``, the pure core.
"""
