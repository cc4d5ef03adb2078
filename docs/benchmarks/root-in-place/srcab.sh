#!/bin/bash
# srcab.sh ROUNDS BIN...: the source suite (betreefs alone) per build, builds alternated; untar and rm -rf rows
for r in $(seq $1); do for b in "${@:2}"; do
  o=${WORK:-/var/tmp/srcab}/$(basename $b)-$r; rm -rf $o; mkdir -p $o
  ${BENCH:-./target/release/betreefs-bench} --fs betreefs --betreefs $b --suite source --scale default --rounds 1 --out $o --workdir ${WORK:-/var/tmp/srcab}/work > $o/log 2>&1
  echo "$(basename $b) round $r: $(grep -E 'untar \+ sync|rm -rf \+ sync|grep -r|find -name|tar cf' $o/log | sed 's/.*source  //' | tr '\n' ';')"
done; done
