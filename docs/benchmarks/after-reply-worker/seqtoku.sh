#!/bin/bash
# seqtoku.sh BIN TAG: the micro suite's order by hand: 2 GiB seq write, remount, read, 20K random 4K writes + fsync, 20K 4-byte, rm, sync, tokubench 100K
BIN=$1; TAG=$2; N=100000; D=${WORK:-/var/tmp/after-reply}/toku; M=$D/mnt; mkdir -p $M
IMG=$D/img; rm -f $IMG; truncate -s 16G $IMG; LOOP=$(losetup -f --show --direct-io=on $IMG)
$BIN mkfs $LOOP --force > /dev/null; $BIN mount $LOOP $M
dd if=/dev/urandom of=/dev/shm/seq1m bs=1M count=1 2>/dev/null
python3 - $M/seq <<'PY'
import os,sys
b=open('/dev/shm/seq1m','rb').read(); fd=os.open(sys.argv[1],os.O_WRONLY|os.O_CREAT,0o644)
for i in range(2048): os.write(fd,b)
os.fsync(fd); os.close(fd)
PY
$BIN umount $M; echo 3 > /proc/sys/vm/drop_caches; $BIN mount $LOOP $M
cat $M/seq > /dev/null
$BIN umount $M; echo 3 > /proc/sys/vm/drop_caches; $BIN mount $LOOP $M
python3 - $M/seq <<'PY'
import os,sys,random
fd=os.open(sys.argv[1],os.O_WRONLY); blocks=os.fstat(fd).st_size//4096
for size,seed in ((4096,11),(4,12)):
  r=random.Random(seed); p=os.urandom(size)
  for i in range(20000): os.pwrite(fd,p,r.randrange(blocks)*4096)
  os.fsync(fd)
os.close(fd)
PY
rm $M/seq; sync
$BIN stats $M > $D/pre-$TAG.json
R=$($D/toku $M $N 2)   # built with: cc -O2 -o $D/toku docs/benchmarks/table-share/toku.c
$BIN stats $M > $D/post-$TAG.json
$BIN umount $M; losetup -d $LOOP; rm -f $IMG
echo "$TAG $R"
