#!/bin/bash
# tokuab.sh ROUNDS BIN...: tokubench by hand (100,000 200-byte files, 2 processes, then syncfs) on a fresh mount, per build alternated; "nullfuse" as BIN runs it on nullfuse (with the first real BIN)
cd "${WORK:?set WORK to a directory holding toku (docs/benchmarks/table-share/toku.c, built)}"; N=${N:-100000}; mkdir -p tmnt
REAL=$(for b in "${@:2}"; do [ "$b" != nullfuse ] && echo $b && break; done)
for r in $(seq "$1"); do for b in "${@:2}"; do
  if [ "$b" = nullfuse ]; then
    $REAL nullfuse tmnt & sleep 1
    R=$(/usr/bin/time -f "toku-cpu %U %S" ./toku tmnt $N 2 2>&1 | tr "\n" " "); fusermount3 -u tmnt; wait
  else
    rm -f timg; truncate -s 16G timg; L=$(losetup -f --show --direct-io=on timg)
    $b mkfs $L --force > /dev/null; $b mount $L tmnt
    P=$(pgrep -n -f "$(basename $b) mount $L")
    read -r u0 s0 < <(awk '{print $14, $15}' /proc/$P/stat)
    R=$(/usr/bin/time -f "toku-cpu %U %S" ./toku tmnt $N 2 2>&1 | tr "\n" " ")
    read -r u1 s1 < <(awk '{print $14, $15}' /proc/$P/stat)
    R="$R | daemon cpu user $(( (u1-u0)*10 )) sys $(( (s1-s0)*10 )) ms"
    $b umount tmnt; losetup -d $L; rm -f timg
  fi
  echo "$(basename $b) $R"
done; done
