#!/usr/bin/env bash
# Build (once) a Horovod 0.28.1 wheel with gloo + PyTorch, without MPI, TensorFlow or MXNet,
# against torch 2.13.0 CPU, and keep it in a cache directory.
#
#   scripts/build_horovod.sh [PYTHON]        # PYTHON defaults to python3
#
# Cache: ${DLRUN_WHEEL_CACHE:-$HOME/.cache/dlrun-wheels}/horovod-0.28.1-torch2.13.0/
# If a wheel for PYTHON's tag (cp311, ...) is already there, nothing is built.
# Progress and build output go to stderr (and a log file in the cache); the ONLY line on
# stdout is the wheel's absolute path, printed last:  WHEEL=$(scripts/build_horovod.sh "$PY")
#
# Why the patches: Horovod 0.28.1 (its last release) predates torch 2, whose headers say
# "#error C++17 or later compatible compiler is required to use PyTorch".
# horovod/torch/CMakeLists.txt sets CMAKE_CXX_STANDARD 14 and third_party/gloo/CMakeLists.txt
# forces -std=c++11 (and inherits the top level's CMAKE_CXX_STANDARD 14); both are switched to
# C++17 in the unpacked sdist (see the patch step below).
#
# Any failure exits non-zero with a message on stderr; it never "skips".
set -euo pipefail

HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
PY=${1:-python3}
CACHE_ROOT=${DLRUN_WHEEL_CACHE:-$HOME/.cache/dlrun-wheels}
CACHE_DIR="$CACHE_ROOT/horovod-$HOROVOD_VERSION-torch$TORCH_VERSION"
JOBS=${DLRUN_BUILD_JOBS:-2}

say() { printf 'build_horovod: %s\n' "$*" >&2; }
die() { printf 'build_horovod: ERROR: %s\n' "$*" >&2; exit 1; }

command -v "$PY" >/dev/null 2>&1 || die "python '$PY' not found"
PY=$(command -v "$PY")
PYTAG=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])') \
    || die "'$PY' does not run"

mkdir -p "$CACHE_DIR" || die "cannot create cache dir $CACHE_DIR"
CACHE_DIR=$(cd "$CACHE_DIR" && pwd)

find_cached() {
    local f
    for f in "$CACHE_DIR"/horovod-"$HOROVOD_VERSION"-"$PYTAG"-"$PYTAG"-*.whl; do
        if [[ -f $f ]]; then printf '%s\n' "$f"; return 0; fi
    done
    return 1
}

if wheel=$(find_cached); then
    say "cached wheel found, not building"
    printf '%s\n' "$wheel"
    exit 0
fi

# One build at a time per cache (parallel CI jobs on one machine share it).
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE_DIR/.lock"
    flock 9
    if wheel=$(find_cached); then
        say "wheel built by a concurrent run, not building"
        printf '%s\n' "$wheel"
        exit 0
    fi
fi

# torch must be importable by the building python, and be exactly the version the wheel is for.
have_torch=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [[ -z $have_torch ]]; then
    say "installing torch==$TORCH_VERSION (CPU) into $PY"
    "$PY" -m pip install "torch==$TORCH_VERSION" >&2 || die "pip install torch==$TORCH_VERSION failed"
    have_torch=$("$PY" -c 'import torch; print(torch.__version__)') || die "torch does not import"
fi
case $have_torch in
    "$TORCH_VERSION" | "$TORCH_VERSION"+*) ;;
    *) die "$PY has torch $have_torch; this wheel must be built against torch $TORCH_VERSION" ;;
esac
command -v cmake >/dev/null 2>&1 || die "cmake not found on PATH"
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || die "no C++ compiler found"

SDIST="$CACHE_DIR/horovod-$HOROVOD_VERSION.tar.gz"
if [[ ! -f $SDIST ]]; then
    say "downloading the horovod $HOROVOD_VERSION sdist"
    dl=$(mktemp -d "$CACHE_DIR/.dl.XXXXXX")
    "$PY" -m pip download --no-deps --no-binary :all: -d "$dl" "horovod==$HOROVOD_VERSION" >&2 \
        || { rm -rf "$dl"; die "pip download horovod==$HOROVOD_VERSION failed"; }
    mv "$dl/horovod-$HOROVOD_VERSION.tar.gz" "$SDIST" || die "sdist not where expected in $dl"
    rm -rf "$dl"
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/build-horovod.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
tar -xzf "$SDIST" -C "$WORK" || die "cannot unpack $SDIST"
SRC="$WORK/horovod-$HOROVOD_VERSION"

say "patching CMake files for C++17"
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$SRC/horovod/torch/CMakeLists.txt"
# gloo: -std=c++17 alone is not enough, the top-level CMAKE_CXX_STANDARD 14 is appended after it
# and wins; store.cc then defines Store::kDefaultTimeout out of line while C++17 code (http_store.cc)
# emits it as an inline variable: "multiple definition of gloo::rendezvous::Store::kDefaultTimeout".
# So do what Horovod's own CMakeLists.txt does for its "compatible17_gloo": both edits.
sed -i 's/-std=c++11/-std=c++17/g' "$SRC/third_party/gloo/CMakeLists.txt"
sed -i '1i set(CMAKE_CXX_STANDARD 17)' "$SRC/third_party/gloo/CMakeLists.txt"
grep -q 'set(CMAKE_CXX_STANDARD 17)' "$SRC/horovod/torch/CMakeLists.txt" \
    || die "patch of horovod/torch/CMakeLists.txt did not apply"
grep -q -- '-std=c++17' "$SRC/third_party/gloo/CMakeLists.txt" \
    || die "patch of third_party/gloo/CMakeLists.txt did not apply"
[[ $(head -n 1 "$SRC/third_party/gloo/CMakeLists.txt") == 'set(CMAKE_CXX_STANDARD 17)' ]] \
    || die "patch of third_party/gloo/CMakeLists.txt (CMAKE_CXX_STANDARD) did not apply"
if grep -q -- '-std=c++11' "$SRC/third_party/gloo/CMakeLists.txt"; then
    die "third_party/gloo/CMakeLists.txt still forces -std=c++11"
fi

LOG="$CACHE_DIR/build-$PYTAG.log"
say "building with $PY (torch $have_torch, MAKEFLAGS=-j$JOBS); log: $LOG"
start=$(date +%s)
if ! env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        MAKEFLAGS="-j$JOBS" \
        "$PY" -m pip wheel --no-deps --no-build-isolation -v -w "$WORK/dist" "$SRC" \
        >"$LOG" 2>&1; then
    tail -n 80 "$LOG" >&2
    die "horovod $HOROVOD_VERSION build failed after $(( $(date +%s) - start )) s; full log: $LOG"
fi
say "built in $(( $(date +%s) - start )) s"

shopt -s nullglob
built=("$WORK"/dist/horovod-"$HOROVOD_VERSION"-*.whl)
[[ ${#built[@]} -eq 1 ]] || die "expected one horovod wheel in $WORK/dist, found ${#built[@]}"
name=$(basename "${built[0]}")
cp "${built[0]}" "$CACHE_DIR/.$name.part"
mv "$CACHE_DIR/.$name.part" "$CACHE_DIR/$name"
printf '%s\n' "$CACHE_DIR/$name"
