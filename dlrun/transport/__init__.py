"""How dlrun reaches a host: the ``Transport``/``Channel`` seam, this machine's subprocesses,
and SSH (the only paramiko importer). Imports nothing from ``topo``, ``push`` or ``run``.
"""
