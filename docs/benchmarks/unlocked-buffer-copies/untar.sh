#!/bin/bash
# untar.sh: time of untar of linux-6.1 + sync on a fresh image (B=binary)
B=${B:-/work/main/target/release/betreefs}
IMG=/var/tmp/s11/u.img; MNT=/tmp/s11-u; mkdir -p $MNT; rm -f $IMG
$B mount $IMG $MNT || exit 1
mkdir $MNT/src; s=$(date +%s.%N); (cd $MNT/src && tar xf /var/tmp/linux.tar); sync -f $MNT; e=$(date +%s.%N)
echo "untar+sync $(echo "$e - $s" | bc) s; settle_step_max $($B stats $MNT | python3 -c 'import json,sys; print(json.load(sys.stdin)["engine"]["settle_step_micros_max"])')"
umount $MNT
