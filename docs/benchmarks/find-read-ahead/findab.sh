#!/bin/bash
# findab.sh ROUNDS BIN...: cold mount, find -name wait.c, per build alternated; wall and daemon CPU
cd "${WORK:?set WORK to a directory with loop.txt (a loop device holding a betreefs with the kernel tree untarred) and rmnt/}"; LOOP=$(cat loop.txt)
for r in $(seq "$1"); do for b in "${@:2}"; do
  $b mount "$LOOP" rmnt; echo 3 > /proc/sys/vm/drop_caches
  pid=$(pgrep -n -f "$(basename $b) mount $LOOP")
  read -r u0 s0 < <(awk '{print $14, $15}' /proc/$pid/stat)
  s=$(date +%s.%N); find rmnt/linux-source-6.1 -name wait.c >/dev/null; e=$(date +%s.%N)
  read -r u1 s1 < <(awk '{print $14, $15}' /proc/$pid/stat)
  $b umount rmnt
  echo "$(basename $b) find $(echo "($e - $s)*1000" | bc | cut -c1-6) ms daemon cpu $(( (u1-u0)+(s1-s0) ))0 ms"
done; done
