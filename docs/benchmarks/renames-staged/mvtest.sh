#!/bin/bash
# mvtest.sh BIN: a fresh 24 GiB image on a loop device, the kernel tree untarred
# into it (SRC_TAR, default src.tar in WORK) and synced, remounted cold, read
# whole with tar cf to a pipe (as the benchmark's source suite does before its
# mv), then the rename of the tree's root and the fsync of the mount's root
# timed apart, with the engine's counters that moved.
set -e
B=$(readlink -f "$1"); cd "${WORK:?set WORK}"; TAR=${SRC_TAR:-src.tar}
rm -f mimg; truncate -s 24G mimg; L=$(losetup -f --show --direct-io=on mimg)
$B mkfs "$L" --force >/dev/null; mkdir -p mmnt; $B mount "$L" mmnt
mkdir mmnt/src; tar xf "$TAR" -C mmnt/src; sync -f mmnt
$B umount mmnt; echo 3 > /proc/sys/vm/drop_caches; $B mount "$L" mmnt
tar cf - -C mmnt src | cat > /dev/null
$B stats mmnt > mv0.json
python3 -c "
import os, time
t0 = time.perf_counter(); os.rename('mmnt/src', 'mmnt/moved'); t1 = time.perf_counter()
fd = os.open('mmnt', os.O_RDONLY); t2 = time.perf_counter(); os.fsync(fd); t3 = time.perf_counter(); os.close(fd)
print(f'rename {1e3*(t1-t0):.2f} ms, open {1e3*(t2-t1):.2f} ms, fsync {1e3*(t3-t2):.2f} ms')"
$B stats mmnt > mv1.json
$B umount mmnt; losetup -d "$L"; rm -f mimg
python3 - <<'PY'
import json
a, b = json.load(open('mv0.json'))['engine'], json.load(open('mv1.json'))['engine']
keys = ('range_renames_by_surgery', 'range_renames_copied', 'writes_staged', 'work_after_reply',
        'work_after_reply_micros_max', 'apply_micros_max', 'splits', 'merges', 'messages_flushed')
print('  ' + ', '.join(f'{k} {b.get(k, 0) - a.get(k, 0) if not k.endswith("_max") else b.get(k, 0)}' for k in keys))
PY
