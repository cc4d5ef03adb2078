#!/bin/bash
# seqwrite.sh: dd of 2 GiB in 1 MiB writes + fsync into a fresh image; the daemon's CPU.
. "$(dirname "$0")/common.sh"
IMG=$W/seq.img; MNT=$W/seq-mnt; rm -f $IMG
mount_bt $IMG $MNT; c0=($(daemon_cpu))
dd if=/dev/zero of=$MNT/big bs=1M count=2048 conv=fsync 2>&1 | tail -1 | tr '\n' ';'
c1=($(daemon_cpu)); echo " daemon user $((c1[0]-c0[0])) sys $((c1[1]-c0[1])) ticks"
umount $MNT; wait $DP; rm -f $IMG
