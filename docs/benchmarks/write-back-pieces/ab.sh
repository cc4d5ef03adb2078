#!/bin/bash
# alternate old/new builds: untar + write/fsync probe
# run in a directory holding betreefs-old, betreefs-new, probe.py and an empty mnt/
cd "$(dirname "$0")"
for r in 1 2 3; do for b in old new; do
  ./betreefs-$b mkfs --force --size 24G img >/dev/null
  ./betreefs-$b mount img mnt || exit 1
  python3 probe.py mnt > ab-$b-$r.txt 2>&1
  ./betreefs-$b stats mnt > ab-$b-$r.json
  ./betreefs-$b umount mnt
  echo "$b $r $(head -1 ab-$b-$r.txt)" >> ab.log
done; done
echo done >> ab.log
