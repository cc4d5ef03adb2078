#!/bin/bash
# micro.sh BIN TAG [suite] [fs]: one suite run
BIN=$1; TAG=$2; SUITE=${3:-micro}; FS=${4:-betreefs}; D=${WORK:-/var/tmp/after-reply}/ab
rm -rf $D/work; mkdir -p $D/work $D/out
${BENCH:-./target/release/betreefs-bench} --fs $FS --suite $SUITE --scale default --rounds 1 --betreefs $BIN --out $D/out --workdir $D/work > $D/log-$TAG.txt 2>&1
f=$(ls -t $D/out/*.md | head -1); cp $f $D/$TAG.md
echo "$TAG: $(grep -E '^\| (tokubench|untar \+ sync|rm -rf \+ sync|sequential|random 4 KiB)' $D/$TAG.md | awk -F'|' '{printf "%s=%s ", $2, $4}')"
