#!/bin/bash
# waits up to $1 s for the bench to end, then sends back what there is
G=/root/gpu; t0=$(date +%s)
while [ $(( $(date +%s) - t0 )) -lt $1 ]; do
  pgrep -f bench36/gpu/compare.py > /dev/null || break
  sleep 5
done
pgrep -f bench36/gpu/compare.py > /dev/null && echo "STILL RUNNING after $1 s" || echo "bench ended"
sleep 3
cp $G/bench.log $OUT/ 2>/dev/null; cat $G/spy.log $G/spy-*.log > $OUT/spy.log 2>/dev/null
cp $G/out/*.md $G/out/*.png $G/out/*.json $OUT/ 2>/dev/null
d=$(grep -oP 'logs in \K\S+' $G/bench.log | head -1); [ -n "$d" ] && tar -czf $OUT/logs.tgz -C $d . 2>/dev/null
ls -la $OUT; tail -60 $G/bench.log
