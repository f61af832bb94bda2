#!/usr/bin/env bash
# Smoke-test dlrun on a GPU machine: `dlrun topo`, `dlrun topo --bench` (GEMM, HBM, PCIe copies,
# NCCL all-reduce beside the expected values; its JSON in /tmp/gpu_smoke.bench.json), an NCCL DDP job over every local GPU (also
# detached) and a Lightning GPU job, each also under torchrun with the same script, with
# throughput side by side.
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
  grep -E 'facts |img/s|lightning global rank|Error|error' "/tmp/gpu_smoke.$label.log" | tail -n 12
  awk -v l="$label" -v c="$code" -v s="$start" -v e="$end" 'BEGIN { printf "%s: exit %s, %.1f s\n", l, c, e - s }'
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

section "dlrun topo --bench (bf16 GEMM, HBM copy, H2D/D2H, NCCL all-reduce across the GPUs)"
# exit 1 here means a finding (a number far below the expectation), which is a result to read,
# not a broken dlrun: the JSON keeps every number for docs/gpu.md
timed bench "$py" -m dlrun topo --bench --bench-seconds 40
tail -n 30 /tmp/gpu_smoke.bench.log
"$py" -m dlrun topo --bench --bench-seconds 20 --json >/tmp/gpu_smoke.bench.json 2>/tmp/gpu_smoke.bench-json.log
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
