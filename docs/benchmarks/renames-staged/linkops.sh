#!/bin/bash
# linkops.sh ROUNDS SIZE BIN...: per build, alternated: a fresh 24 GiB image on a
# loop device, 100,000 files made by tokubench (TOKU: docs/benchmarks/table-share/toku.c,
# built) and synced, then linkloop.py (20 first links of fresh SIZE-byte files,
# each with an fsync of the directory), and the daemon's handling time per LINK
# request from `betreefs stats`.
cd "${WORK:?set WORK}"; HERE=$(dirname "$(readlink -f "$0")")
for r in $(seq "$1"); do for b in "${@:3}"; do
  B=$(readlink -f "$b"); rm -f limg; truncate -s 24G limg; L=$(losetup -f --show --direct-io=on limg)
  $B mkfs "$L" --force >/dev/null; mkdir -p lmnt; $B mount "$L" lmnt
  mkdir -p lmnt/toku lmnt/link; "${TOKU:?set TOKU}" lmnt/toku 100000 2 >/dev/null; sync -f lmnt
  $B stats lmnt > l0.json; T=$(python3 "$HERE/linkloop.py" lmnt/link "$2" 20); $B stats lmnt > l1.json
  $B umount lmnt; losetup -d "$L"; rm -f limg
  H=$(python3 -c "
import json
a, b = json.load(open('l0.json'))['fuse'].get('link', {}), json.load(open('l1.json'))['fuse']['link']
print(f\"{(b['nanos'] - a.get('nanos', 0)) / (b['count'] - a.get('count', 0)) / 1e3:.1f}\")")
  echo "$(basename "$b") link + fsync $T | link handled in $H us"
done; done
