#!/bin/bash
# toku.sh: B=binary NT=client threads N=files; tokubench (toku.c: N files of 200 bytes in
# directories of 128, NT threads) on a fresh image of the mount daemon B, request counts after.
# Build toku.c: gcc -O2 -o toku toku.c -lpthread
HERE=$(dirname "$0")
B=${B:-/work/main/target/release/betreefs}
IMG=${IMG:-/var/tmp/toku.img}; MNT=${MNT:-/tmp/toku-mnt}; mkdir -p $MNT; rm -f $IMG
$B mount $IMG $MNT --foreground 2>/tmp/toku-daemon.err & DP=$!
for i in $(seq 100); do mountpoint -q $MNT && break; sleep 0.1; done
NT=${NT:-2} $HERE/toku $MNT ${N:-200000}
$B stats $MNT > /tmp/toku-stats.json
umount $MNT; wait $DP; rm -f $IMG
