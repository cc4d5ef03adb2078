#!/bin/bash
BIN=$1; TAG=$2; FS=${3:-betreefs}; D=${WORK:-/var/tmp/after-reply}/ab
rm -rf $D/work; mkdir -p $D/work $D/out
${BENCH:-./target/release/betreefs-bench} --fs $FS --suite source --scale default --rounds 1 --betreefs $BIN --out $D/out --workdir $D/work > $D/log-$TAG.txt 2>&1
f=$(ls -t $D/out/*.md | head -1); cp $f $D/$TAG.md
echo "$TAG: $(grep -E '^\| (untar \+ sync|rm -rf \+ sync|find|grep|tar cf|4 KiB write \+ fsync during untar: p99.9)' $D/$TAG.md | awk -F'|' '{printf "%s=%s; ", $2, $4}')"
