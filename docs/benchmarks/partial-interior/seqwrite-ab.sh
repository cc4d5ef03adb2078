#!/bin/bash
# sequential write A/B: fresh 8 GiB image per run, 2 GiB in 1 MiB writes + fsync
cd /var/tmp/seqw
for round in 1 2; do for b in "$@"; do
  rm -f img; truncate -s 8G img; LOOP=$(losetup -f --show --direct-io=on img)
  ./$b mkfs $LOOP --force >/dev/null; ./$b mount $LOOP mnt
  python3 -c "
import time,os
chunk=open('/dev/shm/chunk','rb').read()
t=time.time()
fd=os.open('mnt/seq',os.O_WRONLY|os.O_CREAT|os.O_TRUNC)
n=0
while n < 2<<30:
    os.write(fd,chunk[(n%(64<<20)):(n%(64<<20))+(1<<20)]); n+=1<<20
os.fsync(fd); os.close(fd)
print('$b', round((2<<30)/1e6/(time.time()-t),1), 'MB/s')
"
  ./$b umount mnt; losetup -d $LOOP
done; done
