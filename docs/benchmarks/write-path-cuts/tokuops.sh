#!/bin/bash
# tokuops.sh ROUNDS BIN...: tokubench (100,000 files, 2 processes) on a fresh mount per build, alternated; files/s and the daemon's handling time per opcode (betreefs stats)
cd "${WORK:?set WORK to a directory holding toku (docs/benchmarks/table-share/toku.c, built)}"; N=${N:-100000}; mkdir -p tmnt
for r in $(seq "$1"); do for b in "${@:2}"; do
  rm -f timg; truncate -s 16G timg; L=$(losetup -f --show --direct-io=on timg)
  $b mkfs $L --force > /dev/null; $b mount $L tmnt
  P=$(pgrep -n -f "$(basename $b) mount $L")
  read -r u0 s0 < <(awk '{print $14, $15}' /proc/$P/stat)
  R=$(./toku tmnt $N 2 | awk '{print $5}')
  read -r u1 s1 < <(awk '{print $14, $15}' /proc/$P/stat)
  O=$($b stats tmnt | python3 -c "
import json,sys
f=json.load(sys.stdin)['fuse']
print(' '.join(f'{k} {f[k][\"nanos\"]/f[k][\"count\"]/1000:.2f}' for k in ('create','write','lookup','getxattr','release','getattr') if k in f and f[k]['count']))")
  $b umount tmnt; losetup -d $L; rm -f timg
  echo "$(basename $b) $R files/s user $(( (u1-u0)*10 )) sys $(( (s1-s0)*10 )) ms | us: $O"
done; done
