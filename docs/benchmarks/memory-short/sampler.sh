#!/bin/bash
# sampler.sh BIN OUTDIR: while a benchmark runs, snapshots `betreefs stats` of the mount daemon
# each time its resident size reaches a new high above 290 MiB (sampled every 20 ms)
B=$1; OUT=$2; mkdir -p $OUT; max=0
while true; do
  PID=$(pgrep -n -f "$(basename $B) mount /dev/loop" 2>/dev/null)
  if [ -z "$PID" ]; then sleep 0.2; continue; fi
  MNT=$(tr '\0' ' ' < /proc/$PID/cmdline | awk '{print $4}')
  rss=$(awk '/VmRSS/{print int($2/1024)}' /proc/$PID/status 2>/dev/null)
  if [ -n "$rss" ] && [ "$rss" -gt 290 ] && [ "$rss" -gt "$max" ]; then
    max=$rss; $B stats $MNT > $OUT/peak-$rss.json 2>/dev/null
  fi
  sleep 0.02
done
