#!/bin/bash
# The last device call: unpacks the payload the earlier calls copied to /root/gpu, prepares the model, starts the
# comparison (in a session of its own, so it outlives the call) and py-spy on the worker and first edge, then
# waits up to WAIT_S (default 520) and sends back what there is. A later call `bash docs/bench36/gpu/wait.sh N`
# waits on (the machine stays only while calls follow each other within 30 s).
set -u
G=/root/gpu; source docs/bench36/gpu/env.sh; mkdir -p $G/out
t0=$(date +%s)
if [ ! -d $G/root/site ]; then
  cat $G/p0* | xz -dc -T0 | { mkdir -p $G/root; tar -C $G/root -xf -; } || exit 3
  echo "unpacked in $(( $(date +%s) - t0 )) s"
  python3 -m services.worker.models prepare > $G/prepare.log 2>&1 || { tail -20 $G/prepare.log; exit 4; }
  echo "prepared in $(( $(date +%s) - t0 )) s"
  cp docs/benchmarks.md $G/out/benchmarks.md
  setsid nohup python3 docs/bench36/gpu/compare.py $G/out/benchmarks.md "${ROUNDS:-5}" > $G/bench.log 2>&1 < /dev/null &
  setsid nohup bash docs/bench36/gpu/spy.sh > $G/spy.log 2>&1 < /dev/null &
fi
bash docs/bench36/gpu/wait.sh "${WAIT_S:-520}"
