#!/usr/bin/env python3
"""First file-system figures: betreefs beside ext4, XFS and btrfs on loop
devices, and nullfuse (the no-op FUSE file system with betreefs's FUSE
settings: the ceiling for any FUSE file system), in one run.

Phases, each timed on every file system (medians of --repeat rounds, the
file systems interleaved within a round):
  untar   tar xf of linux-source-6.1 (pre-decompressed on tmpfs) + sync
  find    cold cache: find . -name wait.c
  grep    cold cache: grep -r cpu_to_be64
  mv      mv of the tree root + sync
  rm      rm -rf of the tree + sync
  rand4k  N random 4 KiB writes (block-aligned) into a 1 GiB file + fsync
  rand4b  N random 4-byte writes (block-aligned) into a 1 GiB file + fsync
  seqwrite  one 2 GiB file in 1 MiB writes + fsync
  seqread   cold cache: read it back in 1 MiB reads

"sync" is sync(1) plus fsync of the mount's root directory: FUSE does not
forward syncfs, and an fsync on betreefs makes every earlier operation
durable (one log), so both file systems end each phase durable.
Cold cache: the page cache is dropped; betreefs is also unmounted and
mounted again so that its own node cache is empty.

Run as root. Writes a Markdown table to stdout and raw JSON to --json.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BETREEFS = os.path.join(ROOT, "target", "release", "betreefs")
SOURCE_XZ = "/usr/src/linux-source-6.1.tar.xz"


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def drop_caches():
    run(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Mounted:
    """What every file system under test shares."""

    def cold(self):
        drop_caches()

    def sync(self):
        run(["sync"])
        fsync_path(self.dir)


class Kernel(Mounted):
    """ext4, xfs or btrfs on a loop device over a sparse image."""

    def __init__(self, kind, workdir, size):
        self.name = kind
        self.image = os.path.join(workdir, f"{kind}.img")
        self.dir = os.path.join(workdir, f"mnt-{kind}")
        os.makedirs(self.dir, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(size)
        mkfs = {"ext4": ["mkfs.ext4", "-q", "-F"], "xfs": ["mkfs.xfs", "-q", "-f"], "btrfs": ["mkfs.btrfs", "-q", "-f"]}[kind]
        if shutil.which(mkfs[0]) is None:
            os.unlink(self.image)
            sys.exit(f"{mkfs[0]} is missing (apt-get install -y xfsprogs btrfs-progs)")
        self.loop = run(["losetup", "-f", "--show", self.image], capture_output=True, text=True).stdout.strip()
        try:
            run(mkfs + [self.loop], stdout=subprocess.DEVNULL)
            run(["mount", self.loop, self.dir])
        except BaseException:
            # Never leave a loop device behind.
            subprocess.run(["losetup", "-d", self.loop])
            os.unlink(self.image)
            raise

    def close(self):
        subprocess.run(["umount", self.dir])
        subprocess.run(["losetup", "-d", self.loop])
        os.unlink(self.image)


class Betreefs(Mounted):
    def __init__(self, workdir, size):
        self.name = "betreefs"
        self.image = os.path.join(workdir, "betreefs.img")
        self.dir = os.path.join(workdir, "mnt-betreefs")
        os.makedirs(self.dir, exist_ok=True)
        run([BETREEFS, "mkfs", "--force", "--size", str(size), self.image], stdout=subprocess.DEVNULL)
        self.mount()

    def mount(self):
        run([BETREEFS, "mount", self.image, self.dir])

    def unmount(self):
        run(["umount", self.dir])
        # The daemon writes its final checkpoint and releases the image.
        for _ in range(600):
            if subprocess.run(["fuser", "-s", self.image], stderr=subprocess.DEVNULL).returncode != 0:
                return
            time.sleep(0.05)

    def cold(self):
        self.unmount()
        drop_caches()
        self.mount()

    def close(self):
        self.unmount()
        os.unlink(self.image)


class Nullfuse(Mounted):
    def __init__(self, workdir, size):
        self.name = "nullfuse"
        self.dir = os.path.join(workdir, "mnt-nullfuse")
        os.makedirs(self.dir, exist_ok=True)
        run([BETREEFS, "nullfuse", self.dir])

    def close(self):
        run(["umount", self.dir])


KINDS = {"betreefs": Betreefs, "nullfuse": Nullfuse}
KERNEL = ("ext4", "xfs", "btrfs")


def timed(fn):
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def random_writes(path, count, size, seed):
    """count writes of `size` bytes at random block-aligned offsets of a
    1 GiB file, then one fsync."""
    rng = random.Random(seed)
    payload = os.urandom(size)
    blocks = (1 << 30) // 4096
    fd = os.open(path, os.O_WRONLY)
    try:
        for _ in range(count):
            os.pwrite(fd, payload, rng.randrange(blocks) * 4096)
        os.fsync(fd)
    finally:
        os.close(fd)


def sequential_write(path, mib):
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def sequential_read(path):
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass


def make_big_file(fs, path):
    with open(path, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(1024):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def phases(fs, tar, n_random, seed):
    d = fs.dir
    tree = os.path.join(d, "linux-source-6.1")
    moved = os.path.join(d, "moved")
    out = {}

    def untar():
        run(["tar", "xf", tar, "-C", d])
        fs.sync()

    out["untar"] = timed(untar)
    fs.cold()
    out["find"] = timed(lambda: run(["find", tree, "-name", "wait.c"], stdout=subprocess.DEVNULL))
    fs.cold()
    out["grep"] = timed(lambda: subprocess.run(["grep", "-r", "cpu_to_be64", tree], stdout=subprocess.DEVNULL))
    def mv():
        os.rename(tree, moved)
        fs.sync()
    out["mv"] = timed(mv)
    def rm():
        shutil.rmtree(moved)
        fs.sync()
    out["rm"] = timed(rm)
    big = os.path.join(d, "big")
    make_big_file(fs, big)
    fs.cold()
    out["rand4k"] = timed(lambda: random_writes(big, n_random, 4096, seed))
    out["rand4b"] = timed(lambda: random_writes(big, n_random, 4, seed + 1))
    os.unlink(big)
    fs.sync()
    seq = os.path.join(d, "seq")
    out["seqwrite"] = timed(lambda: sequential_write(seq, 2048))
    fs.cold()
    out["seqread"] = timed(lambda: sequential_read(seq))
    os.unlink(seq)
    fs.sync()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fs", default="betreefs,nullfuse,ext4,xfs,btrfs", help="comma-separated: betreefs, nullfuse, ext4, xfs, btrfs")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--random-writes", type=int, default=20000)
    ap.add_argument("--workdir", default="/var/tmp/betreefs-figures")
    ap.add_argument("--size", type=int, default=20 << 30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    tar = "/dev/shm/linux-source-6.1.tar"
    if not os.path.exists(tar):
        with open(tar, "wb") as f:
            run(["xz", "-dc", SOURCE_XZ], stdout=f)
    kinds = args.fs.split(",")
    results = {k: [] for k in kinds}
    for r in range(args.repeat):
        for kind in kinds:
            make = KINDS.get(kind)
            fs = make(args.workdir, args.size) if make else Kernel(kind, args.workdir, args.size)
            try:
                res = phases(fs, tar, args.random_writes, seed=r)
            finally:
                fs.close()
            results[kind].append(res)
            print(f"round {r} {kind}: " + ", ".join(f"{k} {v:.2f}s" for k, v in res.items()), file=sys.stderr)
    names = list(results[kinds[0]][0].keys())
    med = {k: {p: statistics.median(x[p] for x in results[k]) for p in names} for k in kinds}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": results, "medians": med, "args": vars(args)}, f, indent=1)
    # Ratios to the fastest kernel file system of each row.
    kernels = [k for k in kinds if k in KERNEL] or kinds
    others = [k for k in kinds if k not in KERNEL]
    print("| phase | " + " | ".join(f"{k} (s)" for k in kinds) + " | " + " | ".join(f"{k} / best kernel" for k in others) + " |")
    print("|---|" + "---:|" * (len(kinds) + len(others)))
    for p in names:
        best = min(med[k][p] for k in kernels)
        cells = [f"{med[k][p]:.3f}" for k in kinds]
        ratios = [f"{med[k][p] / best:.2f}×" if best > 0 else "-" for k in others]
        print(f"| {p} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
