"""Programs that run on the hosts: the agent, the topology probe, the push helper and the
TensorFlow server entry point. Standard library only, Python >= 3.8, nothing from dlrun:
each is shipped as its source, never imported on the host.
"""
