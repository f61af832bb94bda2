"""dlrun: launch a distributed deep-learning job on localhost workers, SSH hosts or Spark.

Data flows one way, and the folders follow it:

- ``inventory``: the hosts file (``hosts.toml``, hostfiles, ``h1:2`` lists), validated;
- ``topo/``: what each host has (GPUs, links, NICs) and what is wrong across hosts;
- ``plan``: ranks placed on hosts; ``render``: each rank's env and command (pure);
- ``push/``: code and data shards to the hosts, only what changed; results and checkpoints
  back (``push/pull``) and between them (``push/checkpoint``);
- ``run/``: the launch pipeline, the host agents' supervisor, the terminal view, the exit code,
  detached jobs (``run/detach``: the hosts' keepers run the job);
- ``transport/``: how a host is reached (this machine, SSH);
- ``remote/``: the programs that run on the hosts (standard library only);
- ``spark/``: the Spark barrier stage as an engine under ``run/``.

``api`` is dlrun from Python (``dlrun.launch``, ``dlrun.topo``, ``dlrun.push``, ``dlrun.pull``), with
its option records in ``options`` (``dlrun.JobOptions``, ``dlrun.SSHOptions`` …); ``cli`` is a
thin layer over it; ``errors`` holds the one exception tree; ``tls`` makes a job's pinned
certificate.
"""

__version__ = "0.1.0"

import types as _types
from typing import TYPE_CHECKING

from dlrun import push as _push_package
from dlrun import topo as _topo_package

if TYPE_CHECKING:
    from dlrun.api import TopoResult as TopoResult
    from dlrun.api import launch as launch
    from dlrun.api import pull as pull
    from dlrun.api import push as push
    from dlrun.api import topo as topo
    from dlrun.options import JobOptions as JobOptions
    from dlrun.options import OutputOptions as OutputOptions
    from dlrun.options import PushOptions as PushOptions
    from dlrun.options import SparkOptions as SparkOptions
    from dlrun.options import SSHOptions as SSHOptions
    from dlrun.run.result import RunResult as RunResult


_OPTIONS = ("JobOptions", "OutputOptions", "PushOptions", "SSHOptions", "SparkOptions")


def __getattr__(name: str) -> object:
    """The API, imported when first used: ``import dlrun`` stays cheap."""
    if name in ("launch", "pull", "TopoResult"):
        from dlrun import api

        return getattr(api, name)
    if name in _OPTIONS:
        from dlrun import options

        return getattr(options, name)
    if name == "RunResult":
        from dlrun.run.result import RunResult

        return RunResult
    raise AttributeError(f"module 'dlrun' has no attribute {name!r}")


class _CallablePackage(_types.ModuleType):
    """``dlrun.topo`` and ``dlrun.push`` are packages and also the API functions of
    ``dlrun.api`` of the same name: ``dlrun.topo(hosts=...)``, ``dlrun.push("hosts.toml", code=...)``."""

    def __call__(self, *args: object, **kwargs: object) -> object:
        from dlrun import api

        return getattr(api, self.__name__.rpartition(".")[2])(*args, **kwargs)


_push_package.__class__ = _CallablePackage
_topo_package.__class__ = _CallablePackage

__all__ = ["JobOptions", "OutputOptions", "PushOptions", "RunResult", "SSHOptions", "SparkOptions", "TopoResult",
           "__version__", "launch", "pull", "push", "topo"]
