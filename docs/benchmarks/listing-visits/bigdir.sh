#!/bin/bash
# bigdir.sh ROUNDS BIN_A BIN_B: a directory of 50,000 files (made once per build, on its own image);
# readdir of it (ls -f) with the daemon's cache warm and the kernel's dropped; readdir handler time
cd /var/tmp/s20
for B in $2 $3; do
  rm -f img-$(basename $B); truncate -s 4G img-$(basename $B)
  LOOP=$(losetup -f --show --direct-io=on img-$(basename $B)); echo $LOOP > loop-$(basename $B)
  $B mkfs $LOOP --force >/dev/null; $B mount $LOOP mnt; mkdir mnt/big
  (cd mnt/big && seq -f "file-%06g" 50000 | xargs touch); sync; $B umount mnt
done
for r in $(seq $1); do for B in $2 $3; do
  LOOP=$(cat loop-$(basename $B)); $B mount $LOOP mnt; ls -f mnt/big > /dev/null
  echo 3 > /proc/sys/vm/drop_caches; $B stats mnt > a.json
  s=$(date +%s.%N); n=$(ls -f mnt/big | wc -l); e=$(date +%s.%N); $B stats mnt > b.json
  python3 -c "
import json
a=json.load(open('a.json'))['fuse']; b=json.load(open('b.json'))['fuse']
d=lambda op,f: b.get(op,{}).get(f,0)-a.get(op,{}).get(f,0)
print('$(basename $B) $n entries, ls -f %.1f ms; readdir %d x %.1f us, readdirplus %d x %.1f us' % (($e-$s)*1000, d('readdir','count'), d('readdir','nanos')/1e3/max(1,d('readdir','count')), d('readdirplus','count'), d('readdirplus','nanos')/1e3/max(1,d('readdirplus','count'))))"
  $B umount mnt
done; done
for B in $2 $3; do losetup -d $(cat loop-$(basename $B)); rm -f img-$(basename $B) loop-$(basename $B); done
