"""dlrun: launch a distributed deep-learning job on localhost workers, SSH hosts or Spark.

Data flows one way: inventory → probe → plan → render (env/commands) → push → supervise →
view → exit code. Only ``transport``, ``ssh``, ``agent``, ``supervisor``, ``sync``, ``spark``
and ``cli`` touch the outside world; the rest are pure functions over frozen dataclasses.
"""

__version__ = "0.1.0"
