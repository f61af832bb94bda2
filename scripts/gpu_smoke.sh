#!/usr/bin/env bash
# Smoke-test dlrun on a GPU machine: `dlrun topo`, an NCCL DDP job over every local GPU (also
# detached) and a Lightning GPU job, each also under torchrun with the same script, with
# throughput side by side; and the launch cost: a no-op NCCL job (launch, init, barrier, exit)
# timed under dlrun, torchrun and bare python, interleaved, NOOP_ROUNDS times (default 3).
#   scripts/gpu_smoke.sh [python]      (default python3; needs torch, and lightning for its part)
# Prints what each one did; exits non-zero when a dlrun job fails. docs/gpu.md records its runs.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${1:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
section() { printf '\n===== %s\n' "$*"; }
timed() {  # timed LABEL CMD...: run, show the last lines, record wall time and exit code
  local label=$1; shift
  local start end code
  start=$EPOCHREALTIME
  "$@" >"/tmp/gpu_smoke.$label.log" 2>&1; code=$?
  end=$EPOCHREALTIME
  grep -E 'facts |img/s|lightning global rank|noop: |Error|error' "/tmp/gpu_smoke.$label.log" | tail -n 12
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

section "dlrun topo"
timed topo "$py" -m dlrun topo || status=1
tail -n 25 /tmp/gpu_smoke.topo.log

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

section "Lightning Trainer(accelerator='gpu', strategy='ddp'), $ngpu rank(s)"
if "$py" -c 'import lightning' 2>/dev/null || "$py" -c 'import pytorch_lightning' 2>/dev/null; then
  timed lightning-dlrun "$py" -m dlrun launch --plain --framework torch --np "$ngpu" scripts/gpu_lightning.py || status=1
  timed lightning-torchrun "$py" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" scripts/gpu_lightning.py
else
  echo "lightning is not installed: skipped"
fi

section result
[ "$status" -eq 0 ] && echo "gpu smoke: every dlrun job passed" || echo "gpu smoke: a dlrun job FAILED (logs in /tmp/gpu_smoke.*.log)"
exit "$status"
