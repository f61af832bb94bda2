"""Pushing code and data shards to hosts: manifests and ignore rules, shard policies, the
push protocol with ``dlrun.remote.push_helper``, and the push's progress view.

Imports ``transport`` and the pure core; nothing from ``run`` or ``topo``.
"""
