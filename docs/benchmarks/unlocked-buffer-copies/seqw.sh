#!/bin/bash
B=${B:-/work/main/target/release/betreefs}
IMG=/var/tmp/s11/w.img; MNT=/tmp/s11-w; mkdir -p $MNT; rm -f $IMG
$B mount $IMG $MNT || exit 1
dd if=/dev/urandom of=/var/tmp/s11/rand.bin bs=1M count=64 status=none 2>/dev/null; 
python3 - $MNT/f <<'PY'
import os,sys,time
buf=open('/var/tmp/s11/rand.bin','rb').read()
mv=memoryview(buf)
fd=os.open(sys.argv[1],os.O_CREAT|os.O_WRONLY,0o644); t=time.time(); n=0
for i in range(2048):
    o=(i%64)*1048576; os.write(fd, mv[o:o+1048576]); n+=1048576
os.fsync(fd); d=time.time()-t; print(f"seq write {n/d/1e6:.0f} MB/s")
PY
umount $MNT
