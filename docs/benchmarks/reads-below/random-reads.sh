#!/bin/bash
# random-reads.sh BIN: 10 MiB file, remount cold, 2560 random 4 KiB preads; device sectors read and daemon stats
W=${WORK:-/var/tmp/reads-below}; mkdir -p $W/mnt; cd $W
B=$1
rm -f img; truncate -s 4G img; LOOP=$(losetup -f --show --direct-io=on img)
$B mkfs $LOOP --force >/dev/null; $B mount $LOOP mnt
head -c 10485760 /dev/urandom > mnt/readable; sync mnt/readable
$B umount mnt; $B mount $LOOP mnt; sync; echo 3 > /proc/sys/vm/drop_caches
dev=$(basename $LOOP)
$B stats mnt > st0.json
r0=$(awk '{print $3}' /sys/block/$dev/stat)
python3 -c "
import os,random
r=random.Random(31)
fd=os.open('mnt/readable',os.O_RDONLY)
for _ in range(2560): os.pread(fd,4096,r.randrange(0,2560)*4096)
"
r1=$(awk '{print $3}' /sys/block/$dev/stat)
$B stats mnt > st1.json
echo "$(basename $B) read $(( (r1-r0)*512 )) bytes = $(python3 -c "print(round(($r1-$r0)*512/10485760,2))")x"
python3 - <<'PY'
import json
a=json.load(open('st0.json')); b=json.load(open('st1.json'))
a=a.get('engine',a); b=b.get('engine',b)
for k in b:
    if isinstance(b[k],(int,float)) and b[k]!=a.get(k) and ('read' in k or 'chunk' in k or 'cache' in k):
        print(k, b[k]-a.get(k,0))
    if isinstance(b[k],list) and 'read' in k: print(k,[x-y for x,y in zip(b[k],a[k])])
PY
$B umount mnt; losetup -d $LOOP; rm -f img
