#!/usr/bin/env bash
# CI: a real one-node Slurm on this host, and sweeps through it (docs/cluster.md).
#
# Installs Debian's slurm-wlm and munge (when missing) and hydra-submitit-launcher (when missing),
# writes a one-node slurm.conf for this host into a temporary folder (its own ports, munge key and
# socket, state, logs and pid files: nothing under /etc is changed and a Slurm already running here
# is not touched), starts munged, slurmctld and slurmd as root in the background, waits until sinfo
# shows the node idle, runs a 4-point sweep of 2 groups through hydra/launcher=slurm and checks that
# every row landed exactly once, from one cluster job per group (none idle), then tests/test_cluster.py's Slurm test (a cancelled job, then the re-run)
# against the same cluster. The daemons it started are stopped on exit, whatever happened; run it
# again and it starts afresh. The local launcher's tests run in the main pytest run, which finds the
# plugin this script installed (so .ci/run calls this script before it).
#
#   bash .ci/slurm.sh                  the checks above (about 1.5 min on 2 cores, +15 s for apt-get)
#   bash .ci/slurm.sh CMD ARGS...      CMD inside the cluster instead (SLURM_CONF and PATH set), e.g. a sweep
#
# Accounting is off (no slurmdbd: AccountingStorageType=accounting_storage/none), so Slurm's sacct
# answers "Slurm accounting storage is disabled". submitit asks `sacct -o JobID,State,NodeList
# --parsable2 -j <ids>` about every job it waits on, logs "Bypassing sacct error" at each poll when
# that fails, and then never sees a job that died before writing its result as finished. So a small
# sacct for this cluster stands in front of Slurm's on PATH: it answers that question from squeue,
# which keeps finished jobs for MinJobAge (an hour here). The sweep's output must not mention sacct.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

fail() { echo "slurm.sh: FAILED: $*" >&2; exit 1; }
say() { echo "slurm.sh: $* ($(($(date +%s) - started)) s)"; }

[ "$(id -u)" -eq 0 ] || fail "run as root: it installs packages and starts munged, slurmctld and slurmd as root"
command -v python >/dev/null || fail "no python on PATH: activate the project's virtual environment first"

# --- packages -------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get -qq -o DPkg::Lock::Timeout=300 update || fail "apt-get update"
  apt-get -qq -y -o DPkg::Lock::Timeout=300 install --no-install-recommends slurm-wlm munge >/dev/null \
    || fail "apt-get install slurm-wlm munge"
  say "installed slurm-wlm and munge"
fi
python -c "import hydra_plugins.hydra_submitit_launcher" 2>/dev/null \
  || pip install -q "hydra-submitit-launcher==1.2.0" || fail "pip install hydra-submitit-launcher==1.2.0"

# --- a one-node cluster in a temporary folder ----------------------------------------------------
work=$(mktemp -d /tmp/ci-slurm.XXXXXX)
mkdir -p "$work/munge" "$work/state" "$work/spool" "$work/bin" "$work/results"
chmod 700 "$work/munge"

stop() {
  local status=$?
  trap - EXIT
  if [ -n "${SLURM_CONF:-}" ] && [ -f "$work/slurmctld.pid" ]; then  # this cluster's jobs first
    scancel --quiet --partition=ci 2>/dev/null || true
    for _ in $(seq 50); do
      [ -z "$(squeue --noheader --partition=ci --states=PD,R,CG --format=%i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  local name pid
  for name in slurmd slurmctld munged; do
    pid=$(cat "$work/$name.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    fi
  done
  if [ "$status" -ne 0 ]; then
    for log in slurmctld.log slurmd.log munged.log; do
      [ -s "$work/$log" ] && { echo "--- last lines of $log"; tail -n 15 "$work/$log"; } >&2
    done
  fi
  rm -rf "$work"
  exit "$status"
}
trap stop EXIT

host=$(hostname -s)
read -r ctld_port slurmd_port < <(python - <<'EOF'
import socket
sockets = [socket.socket() for _ in range(2)]
for s in sockets:
    s.bind(("", 0))
print(*(s.getsockname()[1] for s in sockets))
EOF
)
node=$(slurmd -C | head -n 1)  # NodeName=<host> CPUs=... RealMemory=...: this host as slurmd sees it
[[ "$node" == NodeName=* ]] || fail "slurmd -C printed no node line: $node"

head -c 1024 /dev/urandom >"$work/munge/munge.key"
chmod 400 "$work/munge/munge.key"
munged --force --key-file="$work/munge/munge.key" --socket="$work/munge/munge.socket" \
  --pid-file="$work/munged.pid" --log-file="$work/munged.log" --seed-file="$work/munge/seed" \
  || fail "munged did not start"

export SLURM_CONF="$work/slurm.conf"
cat >"$SLURM_CONF" <<EOF
ClusterName=ci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$work/munge/munge.socket
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
MinJobAge=3600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

# sacct for this accounting-less cluster (see the header): JobID|State|NodeList of the asked jobs.
cat >"$work/bin/sacct" <<'EOF'
#!/usr/bin/env bash
# Answers `sacct -o JobID,State,NodeList --parsable2 -j ID ...` (what submitit asks) from squeue.
jobs=()
while [ $# -gt 0 ]; do
  case "$1" in
    -j|--jobs) jobs+=("$2"); shift 2 ;;
    -j*) jobs+=("${1#-j}"); shift ;;
    --jobs=*) jobs+=("${1#--jobs=}"); shift ;;
    *) shift ;;
  esac
done
echo "JobID|State|NodeList"
[ ${#jobs[@]} -eq 0 ] && exit 0
IFS=, ; exec squeue --noheader --array --states=all --jobs="${jobs[*]}" --format='%i|%T|%N' 2>/dev/null
EOF
chmod 755 "$work/bin/sacct"
export PATH="$work/bin:$PATH"

slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start"
slurmd -f "$SLURM_CONF" -N "$host" || fail "slurmd did not start"
for _ in $(seq 150); do
  state=$(sinfo --noheader --nodes="$host" --format=%t 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 0.2
done
[ "$state" = idle ] || fail "node $host is '${state:-not reported}' after 30 s, not idle"
say "one-node Slurm up: node $host idle (slurmctld port $ctld_port, slurmd port $slurmd_port)"

if [ $# -gt 0 ]; then
  "$@"
  exit
fi

# --- the sweep through the Slurm launcher --------------------------------------------------------
results="$work/results"
log="$work/sweep.log"
status=0
timeout 300 python -m harness.run -m hydra/launcher=slurm hydra.launcher.partition=ci hydra.launcher.timeout_min=10 \
  model=tiny strategy=contiguous,paged batch=1,2 ctx=16 decode_tokens=4 device=cpu results_dir="$results" \
  >"$log" 2>&1 || status=$?
if [ "$status" -ne 0 ]; then
  tail -n 40 "$log" >&2
  [ "$status" -eq 124 ] && fail "the sweep through hydra/launcher=slurm was still running after 300 s"
  fail "the sweep through hydra/launcher=slurm exited $status"
fi
if grep -n -i "sacct" "$log" >&2; then
  fail "submitit warned about sacct (lines above)"
fi
# The parent measured nothing itself: its closing line must count the rows that landed in results_dir.
grep -q "4 point(s) in .*: 4 ok\. .*Report: python -m harness.report results_dir=" "$log" \
  || { tail -n 5 "$log" >&2; fail "the parent's closing line does not count the 4 rows that landed"; }
# A group whose window was slow beside the others is measured again as one more job (docs/cluster.md):
# N groups make N jobs plus one per such group, which the log names.
again=$(grep -c "^.*group [0-9a-f]*: measuring again" "$log" || true)
python - "$results" "$again" <<'EOF' || { tail -n 40 "$log" >&2; fail "the rows of the Slurm sweep"; }
import sys
from pathlib import Path

import pandas as pd

results = Path(sys.argv[1])
files = sorted(results.glob("*.parquet"))
frame = pd.read_parquet(results)
print(f"slurm.sh: {len(files)} row files, {len(frame)} rows:", frame[["strategy", "batch", "status", "point_key",
                                                                       "hostname"]].to_string(index=False), sep="\n")
assert len(files) == 4 and len(frame) == 4, f"expected 4 rows, one file each; got {len(frame)} in {len(files)} files"
assert frame.point_key.nunique() == 4, f"point_key not distinct: {sorted(frame.point_key)}"
assert (frame.status == "ok").all(), frame[["strategy", "batch", "status", "reason"]].to_string()
assert (frame.sweep_parallelism == 256).all(), f"rows must say their jobs could run at once: {frame.sweep_parallelism}"
assert not list(results.glob(".*.tmp-*")), "a temporary row file was left behind"
sweeps = list((results / "_hydra" / "multirun").iterdir())
assert len(sweeps) == 1, f"expected the sweep's one log folder under _hydra/multirun/, found {sweeps}"
assert frame.group_id.nunique() == 2, f"expected 2 groups (contiguous beside paged per batch): {frame.group_id}"
again = int(sys.argv[2])  # groups measured again for a slow window: one job each
folders = sorted((p.name for p in sweeps[0].iterdir() if p.name.isdigit()), key=int)
assert folders == [str(i) for i in range(2 + again)], f"Hydra's job logs: one per group (+{again} measured again): {folders}"
jobs = sorted(p.parent.name for p in sweeps[0].glob(".submitit/*/*_result.pkl"))
arrays = {job.split("_")[0] for job in jobs if "_" in job}
first = [job for job in jobs if job.startswith(min(arrays, key=int) + "_")] if arrays else []
assert len(jobs) == 2 + again and len(first) == 2, \
    f"expected one cluster job per group, the 2 tasks of one Slurm job array (+{again} measured again), found {jobs}"
print(f"slurm.sh: one job array, tasks {', '.join(jobs)}; logs under {sweeps[0].relative_to(results)}")
EOF
say "Slurm sweep: 4 rows, each once, all ok, from 2 cluster jobs (one per group), $again measured again"

HARNESS_REQUIRE_SLURM=1 python -m pytest -q -p no:cacheprovider -m slow tests/test_cluster.py -k slurm \
  || fail "tests/test_cluster.py's Slurm test against the cluster"
say "done"
