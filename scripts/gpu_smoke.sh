#!/usr/bin/env bash
# Smoke-test dlrun on a GPU machine: `dlrun topo`, `dlrun topo --bench` (GEMM, HBM, PCIe copies,
# NCCL all-reduce beside the expected values; its JSON in /tmp/gpu_smoke.bench.json), an NCCL DDP job over every local GPU (also
# detached) and a Lightning GPU job, each also under torchrun with the same script, with
# throughput side by side; then a rank stuck in a CUDA op that `dlrun stack` must find (as this
# user and, when run as root, as a plain login user, where Yama's ptrace_scope applies) and an
# idle-GPU hang that `--hang-timeout` must stop (exit 124); and, after topo, the launch cost: a
# no-op NCCL job (launch, init, barrier, exit) timed under dlrun, torchrun and bare python,
# interleaved, NOOP_ROUNDS times (default 3); last, jobs in trouble: a CUDA error and an OOM in
# the root cause, torch's flight recorder dump time, NCCL hangs whose dumps must come back
# (attached and detached), and a busy GPU that is no hang.
#   scripts/gpu_smoke.sh [python]      (default python3; needs torch, and lightning for its part)
#   SMOKE_PARTS="stacks trouble" scripts/gpu_smoke.sh   runs those parts alone (of: topo visible noop
#   bench ddp lightning stacks trouble), e.g. to rerun one inside a lent machine's minutes
# Prints what each one did; exits non-zero when a dlrun job fails. docs/gpu.md records its runs.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${1:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
parts=" ${SMOKE_PARTS:-topo visible noop bench ddp lightning stacks trouble} "
want() { [[ $parts == *" $1 "* ]]; }  # SMOKE_PARTS="stacks trouble" runs those parts alone (after "machine")
section() { printf '\n===== %s\n' "$*"; }
timed() {  # timed LABEL CMD...: run, show the last lines, record wall time and exit code
  local label=$1; shift
  local start end code
  start=$EPOCHREALTIME
  "$@" >"/tmp/gpu_smoke.$label.log" 2>&1; code=$?
  end=$EPOCHREALTIME
  grep -E 'facts |img/s|lightning global rank|noop: |fr-dump: |Error|error' "/tmp/gpu_smoke.$label.log" | tail -n 12
  awk -v l="$label" -v c="$code" -v s="$start" -v e="$end" 'BEGIN { printf "%s: exit %s, %.1f s\n", l, c, e - s }'
  awk -v l="$label" -v c="$code" -v s="$start" -v e="$end" 'BEGIN { printf "%s %s %.3f\n", l, c, e - s }' >>/tmp/gpu_smoke.times
  return "$code"
}

section machine
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || exit 1
nvidia-smi | sed -n 3p
"$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))'
ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs visible to torch: $ngpu"
[ "$ngpu" -ge 1 ] || { echo "no GPU: nothing to smoke-test"; exit 1; }
echo "kernel.yama.ptrace_scope = $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo 'absent (no Yama)')"
# dlrun ships the client's py-spy to the hosts; an offline machine needs one brought along:
# DLRUN_PY_SPY=<path>, or a py-spy beside $py or on PATH (a copy at ./py-spy in the tree is used)
if [ -z "${DLRUN_PY_SPY:-}" ] && [ -x ./py-spy ]; then export DLRUN_PY_SPY=$PWD/py-spy; fi
"$py" -c 'import os, shutil, sys; p = os.environ.get("DLRUN_PY_SPY") or shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy"); print("py-spy:", p); sys.exit(p is None)' \
  || echo "py-spy: none (the stack steps fail: copy a py-spy binary to ./py-spy)"

if want topo; then
section "dlrun topo"
timed topo "$py" -m dlrun topo || status=1
tail -n 25 /tmp/gpu_smoke.topo.log

fi

if want visible; then
section "the machine's own CUDA_VISIBLE_DEVICES: slots and each rank's GPU follow it"
# CUDA_VISIBLE_DEVICES=0: one rank, GPU 0's UUID; empty: no GPU, one CPU rank without the variable
uuid0=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0)
CUDA_VISIBLE_DEVICES=0 "$py" -m dlrun launch --dry-run --json --framework torch --hosts localhost scripts/gpu_noop.py \
  >/tmp/gpu_smoke.visible.json 2>/tmp/gpu_smoke.visible.log
CUDA_VISIBLE_DEVICES= "$py" -m dlrun launch --dry-run --json --framework torch --hosts localhost scripts/gpu_noop.py \
  >/tmp/gpu_smoke.visible-none.json 2>>/tmp/gpu_smoke.visible.log
UUID0=$uuid0 "$py" - <<'PY' || status=1
import json, os
one = json.load(open("/tmp/gpu_smoke.visible.json"))["ranks"]
none = json.load(open("/tmp/gpu_smoke.visible-none.json"))["ranks"]
print("visible=0:", len(one), "rank(s),", [r["env"].get("CUDA_VISIBLE_DEVICES") for r in one])
print("visible='':", len(none), "rank(s),", [r["env"].get("CUDA_VISIBLE_DEVICES") for r in none])
ok = [r["env"].get("CUDA_VISIBLE_DEVICES") for r in one] == [os.environ["UUID0"]] and len(none) == 1 \
    and "CUDA_VISIBLE_DEVICES" not in none[0]["env"]
print("visible:", "as expected" if ok else "NOT as expected")
raise SystemExit(0 if ok else 1)
PY
CUDA_VISIBLE_DEVICES=0 timed visible-run "$py" -m dlrun launch --plain --framework torch scripts/gpu_noop.py || status=1

fi

if want noop; then
section "launch cost: a no-op NCCL job (init, barrier, exit), $ngpu rank(s); goal: dlrun <= bare + 0.5 s"
bare() {  # every rank started by hand, as torchrun would set them up; fails if any rank fails
  local port pids=() code=0 r
  port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for ((r = 0; r < ngpu; r++)); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$ngpu LOCAL_WORLD_SIZE=$ngpu MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$py" scripts/gpu_noop.py & pids+=($!)
  done
  for r in "${pids[@]}"; do wait "$r" || code=1; done
  return "$code"
}
rm -f /tmp/gpu_smoke.times
for ((round = 1; round <= ${NOOP_ROUNDS:-3}; round++)); do  # interleaved: load hits all three alike
  timed "noop-dlrun-$round" "$py" -m dlrun launch --plain --framework torch --np "$ngpu" scripts/gpu_noop.py || status=1
  timed "noop-torchrun-$round" "$py" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" scripts/gpu_noop.py
  timed "noop-bare-$round" bare
done
noop_median() {  # the median seconds of the runs of one tool that exited 0 (empty: none did)
  awk -v t="noop-$1-" 'index($1, t) == 1 && $2 == 0 { print $3 }' /tmp/gpu_smoke.times | sort -n |
    awk '{ v[NR] = $1 } END { if (NR) printf "%.2f", v[int((NR + 1) / 2)] }'
}
for tool in dlrun torchrun bare; do echo "noop $tool: median $(noop_median "$tool") s"; done
d=$(noop_median dlrun) b=$(noop_median bare)
[ -n "$d" ] && [ -n "$b" ] && awk -v d="$d" -v b="$b" \
  'BEGIN { printf "noop dlrun - bare: %+.2f s (goal <= +0.50 s): %s\n", d - b, (d - b <= 0.5 ? "met" : "NOT met") }'

fi

if want bench; then
section "dlrun topo --bench (bf16 GEMM, HBM copy, H2D/D2H, NCCL all-reduce across the GPUs)"
# exit 1 here means a finding (a number far below the expectation), which is a result to read,
# not a broken dlrun: the JSON keeps every number for docs/gpu.md
timed bench "$py" -m dlrun topo --bench --bench-seconds 20
tail -n 30 /tmp/gpu_smoke.bench.log
"$py" -m dlrun topo --bench --bench-seconds 10 --json >/tmp/gpu_smoke.bench.json 2>/tmp/gpu_smoke.bench-json.log
"$py" - <<'PY' || status=1
import json
doc = json.load(open("/tmp/gpu_smoke.bench.json"))["bench"]
print("bench level:", doc["level_text"])
for m in doc["measures"]:
    exp = m["expected"]
    print(f"  {m['kind']:15} {m['subject']:14} {m['value'] if m['value'] is None else round(m['value'], 1)!s:>8}"
          f" {m['unit']:8} expected {exp['value'] if exp else '-'} ({exp['basis'] if exp else 'peers'})"
          f" {m['error'] or ''}")
failed = [m for m in doc["measures"] if m["error"]]
assert not failed, f"a bench measurement failed: {failed}"
assert doc["level"] == "torch-cuda", doc["level"]
PY

fi

if want ddp; then
section "DDP on NCCL, $ngpu rank(s), cuda:LOCAL_RANK"
timed ddp-dlrun "$py" -m dlrun launch --plain --framework torch --np "$ngpu" scripts/gpu_ddp.py || status=1
timed ddp-torchrun "$py" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" scripts/gpu_ddp.py
timed ddp-dlrun-no-pidns "$py" -m dlrun launch --plain --no-pidns --framework torch --np "$ngpu" scripts/gpu_ddp.py

section "DDP on NCCL, detached: launch --detach, then attach (each host's keeper starts the ranks)"
detached() {
  local job
  job=$("$py" -m dlrun launch --detach --framework torch --np "$ngpu" scripts/gpu_ddp.py | sed -n 's/^dlrun: detached job //p')
  [ -n "$job" ] || return 1
  "$py" -m dlrun attach "$job"
}
timed ddp-dlrun-detached detached || status=1

fi

if want lightning; then
section "Lightning Trainer(accelerator='gpu', strategy='ddp'), $ngpu rank(s)"
if "$py" -c 'import lightning' 2>/dev/null || "$py" -c 'import pytorch_lightning' 2>/dev/null; then
  timed lightning-dlrun "$py" -m dlrun launch --plain --framework torch --np "$ngpu" scripts/gpu_lightning.py || status=1
  timed lightning-torchrun "$py" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" scripts/gpu_lightning.py
else
  echo "lightning is not installed: skipped"
fi

fi

if want stacks; then
section "stuck ranks: dlrun stack and --hang-timeout (docs/stacks.md)"
stuck_stack() {  # stuck_stack [RUNNER...]: a rank stuck in a CUDA op, `dlrun stack` from a second process
  local log job pid code
  log=$(mktemp /tmp/gpu_smoke.stuck-job.XXXXXX)
  chmod 666 "$log"
  "$@" "$py" -m dlrun launch --plain --framework torch --np 1 scripts/gpu_stuck.py "${STUCK_MODE:-cuda}" >"$log" 2>&1 &
  pid=$!  # the runner words exec one another: this is dlrun's pid
  for _ in $(seq 120); do grep -q '] ready' "$log" && break; sleep 1; done
  job=$(sed -n 's#.*logs in dlrun-logs/\([^/]*\)/.*#\1#p' "$log" | head -n 1)
  "$@" "$py" -m dlrun stack "$job" | tee /tmp/gpu_smoke.stack.out
  grep -q "${STUCK_WHERE:-stuck_in_cuda_op}" /tmp/gpu_smoke.stack.out && grep -q 'taken by py-spy' /tmp/gpu_smoke.stack.out \
    && grep -q "${STUCK_ALSO:-taken by}" /tmp/gpu_smoke.stack.out
  code=$?
  kill -TERM "$pid"; wait "$pid"
  return "$code"
}
timed stack-as-$(id -un) stuck_stack || status=1
cat /tmp/gpu_smoke.stack.out
# NCCL's RAS (NCCL >= 2.24) at the job's own NCCL_RAS_ADDR: one more line, and nccl-ras.txt beside the stacks
echo "NCCL: $("$py" -c 'import torch; print(".".join(map(str, torch.cuda.nccl.version())))' 2>&1)"
STUCK_MODE=nccl STUCK_WHERE=stuck_in_data_loading STUCK_ALSO='^NCCL RAS (' timed stack-nccl-ras stuck_stack || status=1
cat /tmp/gpu_smoke.stack.out
cat "$(sed -n 's#^dlrun: full stacks in \(.*\)/$#\1#p' /tmp/gpu_smoke.stack.out | head -n 1)/nccl-ras.txt" 2>&1 | head -n 40
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && command -v useradd >/dev/null; then
  # Yama's scope 1 binds only a tracer without CAP_SYS_PTRACE: prove it as a plain login user
  id dlrun-smoke >/dev/null 2>&1 || useradd -m -s /bin/sh dlrun-smoke
  work=/tmp/dlrun-smoke-repo
  rm -rf "$work" && mkdir -p "$work" && cp -r dlrun scripts "$work"/ && chown -R dlrun-smoke: "$work"
  if [ -n "${DLRUN_PY_SPY:-}" ]; then cp "$DLRUN_PY_SPY" "$work/py-spy" && chmod 755 "$work/py-spy"; fi
  as_user=(setpriv --reuid dlrun-smoke --regid dlrun-smoke --init-groups env HOME=/home/dlrun-smoke PYTHONPATH="$work${PYTHONPATH#"$PWD"}")
  [ -n "${DLRUN_PY_SPY:-}" ] && as_user+=(DLRUN_PY_SPY="$work/py-spy")
  if "${as_user[@]}" "$py" -c 'import torch' 2>/dev/null; then
    (cd "$work" && timed stack-as-login-user stuck_stack "${as_user[@]}") || status=1
    cat /tmp/gpu_smoke.stack.out
  else
    echo "stack as a login user: skipped ($py cannot import torch as dlrun-smoke)"
  fi
fi
hang_timeout() {  # an idle GPU and a rank in stuck_in_data_loading: --hang-timeout 15 must stop it, exit 124
  "$py" -m dlrun launch --plain --framework torch --np 1 --hang-timeout 15 scripts/gpu_stuck.py cpu \
    >/tmp/gpu_smoke.hang.out 2>&1
  local code=$?
  grep -E 'root cause|no output for|stuck_in' /tmp/gpu_smoke.hang.out
  [ "$code" = 124 ] && grep -q 'root cause: job hung: .*stuck_in_data_loading' /tmp/gpu_smoke.hang.out
}
timed hang-timeout hang_timeout || status=1

fi
if want trouble; then
section "jobs in trouble: a CUDA error and an OOM in the root cause, an NCCL hang's flight recorder, a busy GPU is no hang"
root_cause() {  # root_cause MODE TEXT: a rank fails on the GPU; a non-zero exit and a root cause naming TEXT
  local out=/tmp/gpu_smoke.fail-$1.out code
  "$py" -m dlrun launch --plain --framework torch --np 1 scripts/gpu_fail.py "$1" >"$out" 2>&1
  code=$?
  echo "exit $code"
  sed -n '/root cause/,/^rank /p' "$out"
  [ "$code" != 0 ] && [ "$code" != 124 ] && sed -n '/root cause/,/^rank /p' "$out" | grep -qF "$2"
}
timed fail-assert root_cause assert 'device-side assert triggered' || status=1
cat /tmp/gpu_smoke.fail-assert.log
timed fail-oom root_cause oom 'OutOfMemoryError' || status=1
cat /tmp/gpu_smoke.fail-oom.log
flight_files() {  # flight_files DIR: the flight recorder dumps under DIR, each with its size
  find "$1" -path '*flight-recorder*' -type f -printf '%p %s bytes\n' 2>/dev/null
}
# how long torch takes to write a dump asked for through its pipe, the ring full (dlrun holds a
# hang's stop for the dumps up to RECORD_WAIT, dlrun/remote/rankpolicy.py)
timed fr-dump "$py" scripts/gpu_fr_dump.py 3000 || status=1
hang_nccl() {  # an NCCL rank idle: --hang-timeout stops it (124) and torch's flight recorder dump comes back
  local out=/tmp/gpu_smoke.hang-nccl.out code logs
  "$py" -m dlrun launch --plain --framework torch --np 1 --hang-timeout 15 scripts/gpu_stuck.py nccl >"$out" 2>&1
  code=$?
  logs=$(sed -n 's#^dlrun: logs in \(.*\)/$#\1#p' "$out" | tail -n 1)
  grep -E 'root cause|flight|NCCL RAS|exit code' "$out"
  flight_files "$logs" | tee /tmp/gpu_smoke.hang-nccl.flight
  ls -la /tmp/dlrun-*/flight-recorder/ 2>&1 | head -n 5  # a dump written after the job's end stays here
  [ "$code" = 124 ] && [ -s /tmp/gpu_smoke.hang-nccl.flight ] && grep -q 'flight recorder dumps: ' "$out" && "$py" - "$logs" <<'PY'
import pathlib, sys
from dlrun.remote.stack_groups import read_dump
for path in sorted(pathlib.Path(sys.argv[1]).rglob("flight-recorder/*")):
    dump = read_dump(path.read_bytes())
    assert dump is not None, f"{path}: not read"
    print(path.name, "read:", sorted(dump)[:8], "entries", len(dump.get("entries") or []), "pg_status", dump.get("pg_status"))
PY
}
timed hang-nccl hang_nccl || status=1
cat /tmp/gpu_smoke.hang-nccl.log
hang_nccl_detached() {  # the same, detached: the keeper stops it, attach says 124, the dump is in the job's folder
  local job code
  job=$("$py" -m dlrun launch --detach --framework torch --np 1 --hang-timeout 15 scripts/gpu_stuck.py nccl \
    | sed -n 's/^dlrun: detached job //p')
  [ -n "$job" ] || return 1
  "$py" -m dlrun attach "$job"
  code=$?
  echo "attach exit $code"
  flight_files "$HOME/.dlrun/jobs/$job" | tee /tmp/gpu_smoke.hang-detached.flight
  [ "$code" = 124 ] && [ -s /tmp/gpu_smoke.hang-detached.flight ]
}
timed hang-nccl-detached hang_nccl_detached || status=1
cat /tmp/gpu_smoke.hang-nccl-detached.log
busy_is_no_hang() {  # a spinning kernel and no output for 40 s: --hang-timeout 10 must wait; SIGTERM leaves nothing
  local log=/tmp/gpu_smoke.busy.out pid alive left
  "$py" -m dlrun launch --plain --framework torch --np 1 --hang-timeout 10 scripts/gpu_stuck.py cuda >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do grep -q '] ready' "$log" && break; sleep 1; done
  sleep 40
  kill -0 "$pid" 2>/dev/null && alive=yes || alive=no
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader
  kill -TERM "$pid"; wait "$pid"
  echo "alive after 40 s: $alive; dlrun's exit on SIGTERM: $?"
  sleep 3
  left=$(pgrep -f 'gpu_stuck.py' || true)
  echo "processes left: ${left:-none}; GPU apps left: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | tr '\n' ' ')"
  cat "$log"
  [ "$alive" = yes ] && ! grep -q 'job hung' "$log" && [ -z "$left" ]
}
timed busy-no-hang busy_is_no_hang || status=1
cat /tmp/gpu_smoke.busy-no-hang.log
fi

section result
[ "$status" -eq 0 ] && echo "gpu smoke: every dlrun job passed" || echo "gpu smoke: a dlrun job FAILED (logs in /tmp/gpu_smoke.*.log)"
exit "$status"
