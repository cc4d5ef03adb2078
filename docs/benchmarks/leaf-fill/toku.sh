#!/bin/bash
# Tokubench by hand, as root:  toku.sh ROUNDS N BIN...
# per round and build: a fresh image file, `toku MNT N 2` (N 200-byte
# files, two threads; TOKU= the binary of ../table-share/toku.c, built with
# `gcc -O2 -o toku toku.c`), then the daemon's longest request, the splits
# and merges, and the leaves' bytes written so far (`betreefs stats`).
# WORK: a scratch directory.
set -eu
work=${WORK:-/var/tmp/leaf-fill}
toku=${TOKU:?the toku binary}
mkdir -p "$work/tmnt"
for r in $(seq "$1"); do for b in "${@:3}"; do
  "$b" mkfs --force --size 24G "$work/timg" > /dev/null; chmod 600 "$work/timg"
  "$b" mount "$work/timg" "$work/tmnt"
  out=$("$toku" "$work/tmnt" "$2" 2 2>&1 | tail -1)
  s=$("$b" stats "$work/tmnt" | python3 -c "
import json,sys; s=json.load(sys.stdin); l=s['fuse']['latency']; e=s['engine']
print('max_ms %.1f %s splits %d merges %d leafMBw %d' % (l['max_nanos']/1e6, l['max_opcode'], e['splits'], e['merges'], e['node_bytes_written_per_level'][0]/1e6))")
  echo "$(basename "$b") $out $s"
  "$b" umount "$work/tmnt"
done; done
rm -f "$work/timg"
