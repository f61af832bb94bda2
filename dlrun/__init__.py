"""dlrun: launch a distributed deep-learning job on localhost workers, SSH hosts or Spark.

Data flows one way, and the folders follow it:

- ``inventory``: the hosts file (``hosts.toml``, hostfiles, ``h1:2`` lists), validated;
- ``topo/``: what each host has (GPUs, links, NICs) and what is wrong across hosts;
- ``plan``: ranks placed on hosts; ``render``: each rank's env and command (pure);
- ``push/``: code and data shards to the hosts, only what changed;
- ``run/``: the launch pipeline, the host agents' supervisor, the terminal view, the exit code;
- ``transport/``: how a host is reached (this machine, SSH);
- ``remote/``: the programs that run on the hosts (standard library only);
- ``spark/``: the Spark barrier stage as an engine under ``run/``.

``cli`` is a thin layer over the pipeline; ``errors`` holds the one exception tree.
"""

__version__ = "0.1.0"
