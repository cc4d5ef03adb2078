#!/bin/bash
# mount time with and without warming, on an image holding the kernel tree and a 2 GiB file
B=${B:-target/release/betreefs}
W=${WORK:-/var/tmp/warm-mount}; mkdir -p $W/mnt
if [ "$SETUP" = 1 ]; then
  rm -f $W/img; truncate -s 24G $W/img
  LOOP=$(losetup -f --show --direct-io=on $W/img); echo $LOOP > $W/loopdev
  $B mkfs $LOOP --force >/dev/null
  $B mount $LOOP $W/mnt
  tar xf /dev/shm/linux.tar -C $W/mnt
  head -c 2147483648 /dev/urandom > $W/mnt/big
  sync $W/mnt
  $B umount $W/mnt
fi
LOOP=$(cat $W/loopdev)
for round in 1 2 3; do
  for warm in 0 default; do
    opt=""; [ $warm = 0 ] && opt="-o warm=0"
    s=$(date +%s%N); $B mount $LOOP $W/mnt $opt; e=$(date +%s%N)
    st=$($B stats $W/mnt | python3 -c "import json,sys; e=json.load(sys.stdin)['engine']; print(e['nodes_warmed'], e['warm_bytes_read'], e['tree_heights'])")
    r0=$($B stats $W/mnt | python3 -c "import json,sys; e=json.load(sys.stdin)['engine']; print(e['device_bytes_read'])")
    python3 -c "
import os,random
fd=os.open('$W/mnt/big',os.O_RDONLY)
os.pread(fd,4096,random.randrange(0,2147483648//4096)*4096)"
    r=$($B stats $W/mnt | python3 -c "import json,sys; e=json.load(sys.stdin)['engine']; print(e['device_bytes_read'])")
    echo "warm=$warm round $round: mount $(( (e-s)/1000000 )) ms; warmed nodes, bytes, heights: $st; one cold 4 KiB read read $((r-r0)) bytes"
    $B umount $W/mnt
  done
done
