#!/bin/sh
# Install what `dlrun launch --backend spark` needs on the driver machine (and, for local
# masters, the executors): a Java 17+ runtime and pyspark. Idempotent; run as root for apt.
#   scripts/install_spark.sh [PYTHON]      (default: python3)
set -eu
PYTHON=${1:-python3}

if ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
    echo "install_spark: installing openjdk-17-jre-headless" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openjdk-17-jre-headless
fi
java -version 2>&1 | head -1

if ! "$PYTHON" -c "import pyspark" >/dev/null 2>&1; then
    echo "install_spark: installing pyspark into $("$PYTHON" -c 'import sys; print(sys.prefix)')" >&2
    "$PYTHON" -m pip install --quiet "pyspark>=3.5"
fi
"$PYTHON" -c "import pyspark; print('pyspark', pyspark.__version__)"
