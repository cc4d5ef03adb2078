#!/bin/bash
# toku-cpu.sh BIN TAG FILES: tokubench (timed toku.c, 2 processes) on a fresh default mount; files/s, client p99.9/longest, daemon CPU seconds during the run, and its CPU per file
# TOKU: docs/benchmarks/table-share/toku.c built (default $D/toku); D: a scratch directory
BIN=$1; TAG=$2; N=${3:-100000}; D=${D:-/var/tmp/staged-once}; M=$D/mnt; mkdir -p $M
IMG=$D/img; rm -f $IMG; truncate -s 16G $IMG; LOOP=$(losetup -f --show --direct-io=on $IMG)
$BIN mkfs $LOOP --force > /dev/null; $BIN mount $LOOP $M
P=$(pgrep -n -f "$(basename $BIN) mount $LOOP")
cpu() { awk '{print $14+$15}' /proc/$P/stat; }
C0=$(cpu); R=$(${TOKU:-$D/toku} $M $N 2); C1=$(cpu)
$BIN stats $M > $D/stats-$TAG.json
$BIN umount $M; losetup -d $LOOP; rm -f $IMG
T=$(getconf CLK_TCK)
echo "$TAG $R | daemon cpu $(echo "scale=2; ($C1-$C0)/$T" | bc) s, $(echo "scale=2; ($C1-$C0)*1000000/$T/$N" | bc) us/file"
