#!/bin/bash
# waits for the bench's "tokenbus: front end: ..." line (the engines are up), then samples the worker and the first
# edge for SPY_S seconds (default 240: warm-up and the first rounds), 25 times a second without stopping them
G=/root/gpu
for i in $(seq 1 600); do line=$(grep -m1 '^tokenbus: front end:' $G/bench.log 2>/dev/null) && break; sleep 1; done
echo "found: $line"
w=$(echo "$line" | grep -oP 'worker: [^(]*\(\K[0-9]+'); e=$(echo "$line" | grep -oP 'edge: [^(]*\(\K[0-9]+')
echo "worker $w edge $e"
py-spy record -d ${SPY_S:-240} -r 25 --nonblocking -f speedscope -o $G/out/worker-spy.json -p $w > $G/spy-worker.log 2>&1 &
py-spy record -d ${SPY_S:-240} -r 25 --nonblocking -f speedscope -o $G/out/edge-spy.json -p $e > $G/spy-edge.log 2>&1 &
wait
