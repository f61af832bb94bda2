"""Topology: the frozen records of a host's GPUs, links and NICs (``records``), the parsers that
build them from raw tool output (``parse``), the findings across hosts (``findings``), the text
report (``report``) and the launch preflight (``preflight``).

``records``, ``parse``, ``findings`` and ``report`` are pure. ``probe`` parses what
``dlrun.remote.probe`` prints on a host; ``preflight`` asks hosts through a transport.
"""
