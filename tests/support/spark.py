"""A SparkContext for the Spark tests: this interpreter as PYSPARK_PYTHON, the local-cluster
work dirs removed afterwards, and the executors waited for."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dlrun.spark.driver import count_slots


def spark_test_context(master: str, conf: dict[str, str], *, app: str = "dlrun-tests",
                       executors: int = 0) -> Iterator[Any]:
    """Yield a context on ``master`` with ``conf``, once ``executors`` executors registered
    (their JVMs come a few seconds after the context; 120 s at most)."""
    import pyspark

    old = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark_conf = pyspark.SparkConf().setMaster(master).setAppName(app)
    for key, value in {"spark.ui.showConsoleProgress": "false", **conf}.items():
        spark_conf.set(key, value)
    sc = pyspark.SparkContext(conf=spark_conf)
    try:
        deadline = time.monotonic() + 120
        while count_slots(sc).executors < executors and time.monotonic() < deadline:
            time.sleep(0.2)
        yield sc
    finally:
        app_id = sc.applicationId
        sc.stop()
        shutil.rmtree(Path(pyspark.__file__).parent / "work" / app_id, ignore_errors=True)
        if old is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = old
