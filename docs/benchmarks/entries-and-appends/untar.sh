#!/bin/bash
# untar.sh: untar + sync of /var/tmp/linux.tar on a fresh image; the daemon's CPU and
# the requests' time in the daemon.
. "$(dirname "$0")/common.sh"
IMG=$W/untar.img; MNT=$W/untar-mnt; rm -f $IMG
mount_bt $IMG $MNT; mkdir $MNT/src; $B stats $MNT > $W/untar-before.json; c0=($(daemon_cpu))
s=$(date +%s.%N); (cd $MNT/src && tar xf /var/tmp/linux.tar); sync -f $MNT; e=$(date +%s.%N)
c1=($(daemon_cpu)); $B stats $MNT > $W/untar-after.json
echo "untar+sync $(echo "$e - $s" | bc) s; daemon user $((c1[0]-c0[0])) sys $((c1[1]-c0[1])) ticks"
python3 $HERE/opdiff.py $W/untar-before.json $W/untar-after.json | grep -E "^(write|setattr|create|total) "
umount $MNT; wait $DP; rm -f $IMG
