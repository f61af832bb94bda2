"""Topology: the frozen records of a host's GPUs, links and NICs, the parsers that build them
from raw tool output, the findings across hosts, the text report, and the launch preflight.

``records``, ``findings`` and ``report`` are pure. ``probe`` parses what
``dlrun.remote.probe`` prints on a host; ``preflight`` asks hosts through a transport.
"""
