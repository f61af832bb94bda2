"""The ps/worker process of ParameterServerStrategy: a ``tf.distribute.Server`` that joins forever.

Run as ``python -m dlrun.remote.tf_server`` where dlrun is installed, or — what ``dlrun launch
--framework tf-ps`` does, so hosts need no dlrun — as ``python -c <this file's source>``.
It reads the task from ``TF_CONFIG`` (rendered by dlrun), starts the gRPC server for it and
blocks. These servers never exit on their own: dlrun stops them when the chief exits.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    task = config.get("task", {})
    if task.get("type") not in ("ps", "worker"):
        sys.exit(f"dlrun.remote.tf_server: TF_CONFIG task must be ps or worker, got {task!r}")
    import tensorflow as tf  # type: ignore[import-untyped]

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol=resolver.rpc_layer or "grpc",
        start=True,
    )
    print(f"dlrun.remote.tf_server: {resolver.task_type} {resolver.task_id} serving {server.target}", flush=True)
    server.join()


def server_source() -> str:
    """This file's source, for ``python -c``."""
    with open(__file__, encoding="utf-8") as fh:
        return fh.read()


if __name__ == "__main__":
    main()
