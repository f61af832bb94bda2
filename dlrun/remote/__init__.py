"""Programs that run on the hosts: the agent, the topology probe, the push helper and the
TensorFlow server entry point. Standard library only, Python >= 3.8, nothing from dlrun:
each is shipped as its source, never imported on the host.
"""

from __future__ import annotations

from importlib import resources

#: The host programs, by the name the controller ships them under.
PROGRAMS = ("agent", "probe", "push_helper", "tf_server")


def source_of(name: str) -> str:
    """The source of host program ``name``, read from the installed package (a wheel too)."""
    if name not in PROGRAMS:
        raise ValueError(f"no host program {name!r}")
    return resources.files(__name__).joinpath(f"{name}.py").read_text(encoding="utf-8")
