//! The file-system operations over an in-memory device, without FUSE:
//! each test drives `FileSystem` as the kernel would and reopens the store
//! to check what is durable.

mod common;

use std::sync::Arc;

use betreefs_engine::{Options, Store};
use betreefs_fs::{
    AtimePolicy, Caller, Errno, FileSystem, Operations, RenameFlags, SetAttr, ROOT_INO,
};
use betreefs_store::MemDevice;
use common::{options, write_file, ME};

fn fresh() -> (MemDevice, FileSystem) {
    common::format_fs(64 << 20, &options())
}

fn remount(dev: &MemDevice, fs: FileSystem) -> FileSystem {
    fs.close().unwrap();
    common::mount_fs(dev, &options(), "remounting")
}

/// Names and offsets from `offset` on; the `limit`-th entry is seen but
/// refused, as when the kernel's buffer fills.
fn list(fs: &FileSystem, dir: u64, offset: u64, limit: usize) -> Vec<(Vec<u8>, u64)> {
    list_as(fs, dir, offset, limit, false)
}

/// [`list`] by readdir or (`plus`) readdirplus.
fn list_as(
    fs: &FileSystem,
    dir: u64,
    offset: u64,
    limit: usize,
    plus: bool,
) -> Vec<(Vec<u8>, u64)> {
    let mut out = Vec::new();
    fs.readdir(dir, offset, plus, &mut |e| {
        out.push((e.name.to_vec(), e.offset));
        out.len() == limit
    })
    .unwrap();
    out
}

fn names(fs: &FileSystem, dir: u64) -> Vec<Vec<u8>> {
    let out = list(fs, dir, 0, usize::MAX);
    out.into_iter().map(|(n, _)| n).collect()
}

fn set_size(fs: &FileSystem, ino: u64, size: u64) {
    let set = SetAttr {
        size: Some(size),
        ..SetAttr::default()
    };
    fs.setattr(ino, &set).unwrap();
}

fn read_all(fs: &FileSystem, ino: u64) -> Vec<u8> {
    fs.read_to_vec(ino, 0, u32::MAX).unwrap()
}

#[test]
fn write_read_sparse_and_truncate() {
    let (dev, fs) = fresh();
    let (attr, fh) = fs.create(ROOT_INO, b"f", 0o600, 0, ME).unwrap();
    let ino = attr.ino;
    fs.write(ino, fh, 10_000, b"hello", None).unwrap();
    fs.write(ino, fh, 4094, b"straddle", None).unwrap();
    let data = read_all(&fs, ino);
    assert_eq!(data.len(), 10_005);
    assert_eq!(&data[4094..4102], b"straddle");
    assert!(data[..4094].iter().all(|&b| b == 0));
    assert_eq!(&data[10_000..], b"hello");
    set_size(&fs, ino, 4096);
    set_size(&fs, ino, 12_000);
    let data = read_all(&fs, ino);
    assert_eq!(&data[4094..4096], b"st");
    assert!(
        data[4096..].iter().all(|&b| b == 0),
        "truncate left stale bytes"
    );
    set_size(&fs, ino, 4095);
    set_size(&fs, ino, 4096);
    assert_eq!(read_all(&fs, ino)[4095], 0);
    fs.release(fh).unwrap();
    let fs = remount(&dev, fs);
    let attr = fs.lookup(ROOT_INO, b"f").unwrap();
    assert_eq!((attr.ino, attr.size, attr.mode & 0o777), (ino, 4096, 0o600));
}

#[test]
fn rename_moves_a_non_empty_directory() {
    let (dev, fs) = fresh();
    let a = fs.mkdir(ROOT_INO, b"a", 0o755, ME).unwrap().ino;
    let b = fs.mkdir(a, b"b", 0o755, ME).unwrap().ino;
    let f = write_file(&fs, b, b"file", b"content");
    fs.setxattr(b, b"user.tag", b"v", 0).unwrap();
    let dest = fs.mkdir(ROOT_INO, b"dest", 0o755, ME).unwrap().ino;
    fs.rename(a, b"b", dest, b"moved", RenameFlags::default())
        .unwrap();
    assert_eq!(names(&fs, a), vec![b".".to_vec(), b"..".to_vec()]);
    assert_eq!(read_all(&fs, f), b"content");
    assert_eq!(fs.getattr(a).unwrap().nlink, 2);
    assert_eq!(fs.getattr(dest).unwrap().nlink, 3);
    assert_eq!(
        fs.rename(ROOT_INO, b"dest", b, b"x", RenameFlags::default()),
        Err(Errno::EINVAL),
        "into its own subtree"
    );
    let fs = remount(&dev, fs);
    let moved = fs
        .lookup(fs.lookup(ROOT_INO, b"dest").unwrap().ino, b"moved")
        .unwrap();
    assert_eq!(moved.ino, b);
    assert_eq!(fs.getxattr(b, b"user.tag").unwrap(), b"v");
    let file = fs.lookup(b, b"file").unwrap();
    assert_eq!((file.ino, read_all(&fs, f)), (f, b"content".to_vec()));
    let a = fs.lookup(ROOT_INO, b"a").unwrap().ino;
    assert_eq!(fs.lookup(a, b"b"), Err(Errno::ENOENT));
}

#[test]
fn rename_flags_and_replacement() {
    let (_dev, fs) = fresh();
    let x = write_file(&fs, ROOT_INO, b"x", b"xx");
    let y = write_file(&fs, ROOT_INO, b"y", b"yyy");
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
    write_file(&fs, d, b"inner", b"i");
    let noreplace = RenameFlags {
        noreplace: true,
        ..RenameFlags::default()
    };
    let exchange = RenameFlags {
        exchange: true,
        ..RenameFlags::default()
    };
    assert_eq!(
        fs.rename(ROOT_INO, b"x", ROOT_INO, b"y", noreplace),
        Err(Errno::EEXIST)
    );
    assert_eq!(
        fs.rename(ROOT_INO, b"x", ROOT_INO, b"d", RenameFlags::default()),
        Err(Errno::EISDIR)
    );
    fs.rename(ROOT_INO, b"x", ROOT_INO, b"d", exchange).unwrap();
    assert_eq!(fs.lookup(ROOT_INO, b"x").unwrap().ino, d);
    assert_eq!(fs.lookup(ROOT_INO, b"d").unwrap().ino, x);
    assert_eq!(names(&fs, d).len(), 3);
    assert_eq!(fs.lookup(d, b"inner").map(|a| a.size), Ok(1));
    fs.rename(ROOT_INO, b"y", ROOT_INO, b"d", RenameFlags::default())
        .unwrap();
    assert_eq!(read_all(&fs, y), b"yyy");
    assert_eq!(fs.lookup(ROOT_INO, b"y"), Err(Errno::ENOENT));
    assert_eq!(fs.rmdir(ROOT_INO, b"x"), Err(Errno::ENOTEMPTY));
    fs.unlink(d, b"inner").unwrap();
    fs.rmdir(ROOT_INO, b"x").unwrap();
}

/// Unlink, rmdir and rename take an entry the inode table holds from the
/// table (no query of the store) and a directory's key from a cache: both
/// must follow a rename of the entry, of a directory above it, a rename
/// over it, and hard links (whose entries name the inode elsewhere).
#[test]
fn removals_found_in_the_table_follow_renames_and_links() {
    let (dev, fs) = fresh();
    let top = fs.mkdir(ROOT_INO, b"top", 0o755, ME).unwrap().ino;
    let sub = fs.mkdir(top, b"sub", 0o755, ME).unwrap().ino;
    write_file(&fs, sub, b"f", b"f");
    write_file(&fs, sub, b"g", b"g");
    // sub's key is built and remembered before its parent moves.
    write_file(&fs, sub, b"warm", b"w");
    fs.unlink(sub, b"warm").unwrap();
    fs.rename(ROOT_INO, b"top", ROOT_INO, b"moved", RenameFlags::default())
        .unwrap();
    fs.unlink(sub, b"f").unwrap();
    fs.rename(sub, b"g", sub, b"h", RenameFlags::default())
        .unwrap();
    assert_eq!(fs.unlink(sub, b"g"), Err(Errno::ENOENT));
    let x = write_file(&fs, sub, b"x", b"xx");
    fs.rename(sub, b"x", sub, b"h", RenameFlags::default())
        .unwrap();
    assert_eq!(fs.unlink(sub, b"x"), Err(Errno::ENOENT));
    let l = write_file(&fs, sub, b"l", b"ll");
    fs.link(l, sub, b"l1").unwrap();
    fs.unlink(sub, b"l1").unwrap();
    assert_eq!(fs.getattr(l).unwrap().nlink, 1);
    assert_eq!(read_all(&fs, l), b"ll");
    fs.link(l, sub, b"l2").unwrap();
    fs.unlink(sub, b"l").unwrap();
    assert_eq!(fs.getattr(l).unwrap().nlink, 1);
    let empty = fs.mkdir(sub, b"empty", 0o755, ME).unwrap().ino;
    fs.rename(sub, b"empty", top, b"emptied", RenameFlags::default())
        .unwrap();
    assert_eq!(fs.rmdir(sub, b"empty"), Err(Errno::ENOENT));
    fs.rmdir(top, b"emptied").unwrap();
    assert_eq!(fs.getattr(empty).map(|a| a.nlink), Ok(0));
    assert_eq!(fs.lookup(sub, b"h").unwrap().ino, x);

    let fs = remount(&dev, fs);
    let top = fs.lookup(ROOT_INO, b"moved").unwrap().ino;
    assert_eq!(fs.lookup(ROOT_INO, b"top"), Err(Errno::ENOENT));
    assert_eq!(names(&fs, top), [&b"."[..], b"..", b"sub"]);
    let sub = fs.lookup(top, b"sub").unwrap().ino;
    assert_eq!(names(&fs, sub), [&b"."[..], b"..", b"h", b"l2"]);
    assert_eq!(read_all(&fs, fs.lookup(sub, b"h").unwrap().ino), b"xx");
    assert_eq!(read_all(&fs, fs.lookup(sub, b"l2").unwrap().ino), b"ll");
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}

/// rmdir (and a rename over a directory) answers from the table's count
/// of a directory's entries when it has one — from the directory's making,
/// or from a listing that went from its first entry to its end — kept by
/// every way an entry comes or goes. Debug builds check each answer from a
/// count against the tree as well.
#[test]
fn rmdir_answers_from_counted_entries() {
    let (dev, fs) = fresh();
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
    assert_eq!(fs.entries_known(d), Some(0));
    for name in [&b"a"[..], b"b", b"c"] {
        write_file(&fs, d, name, name);
    }
    fs.mkdir(d, b"s", 0o755, ME).unwrap();
    assert_eq!(fs.entries_known(d), Some(4));
    let fs = remount(&dev, fs);
    let d = fs.lookup(ROOT_INO, b"d").unwrap().ino;
    assert_eq!(fs.entries_known(d), None);
    // A listing cut short (the kernel's buffer full) counts nothing; one
    // resumed from an entry's offset neither.
    let first = list(&fs, d, 0, 4);
    assert_eq!(fs.entries_known(d), None);
    let resume = first.last().map(|(_, off)| *off).unwrap_or_default();
    list(&fs, d, resume, usize::MAX);
    assert_eq!(fs.entries_known(d), None);
    assert_eq!(names(&fs, d).len(), 6);
    assert_eq!(fs.entries_known(d), Some(4));
    assert_eq!(fs.rmdir(ROOT_INO, b"d"), Err(Errno::ENOTEMPTY));
    fs.unlink(d, b"a").unwrap();
    let b = fs.lookup(d, b"b").unwrap().ino;
    // A first hard link elsewhere leaves the entry where it is.
    fs.link(b, ROOT_INO, b"b-link").unwrap();
    fs.unlink(d, b"b").unwrap();
    // Renamed within the directory: still one entry; over another: one.
    fs.rename(d, b"c", d, b"c2", RenameFlags::default())
        .unwrap();
    assert_eq!(fs.entries_known(d), Some(2));
    write_file(&fs, d, b"t", b"t");
    assert_eq!(fs.entries_known(d), Some(3));
    fs.rename(d, b"t", d, b"c2", RenameFlags::default())
        .unwrap();
    assert_eq!(fs.entries_known(d), Some(2));
    fs.rename(d, b"c2", d, b"s", RenameFlags::default())
        .map(|_| panic!("a file renamed over a directory"))
        .unwrap_or_else(|e| assert_eq!(e, Errno::EISDIR));
    let e = fs.mkdir(ROOT_INO, b"e", 0o755, ME).unwrap().ino;
    // An exchange across directories moves no count.
    let exchange = RenameFlags {
        exchange: true,
        ..RenameFlags::default()
    };
    fs.rename(d, b"s", ROOT_INO, b"e", exchange).unwrap();
    assert_eq!(fs.entries_known(d), Some(2));
    // The whiteout takes the old name: the directory keeps its count.
    let whiteout = RenameFlags {
        whiteout: Some(ME),
        ..RenameFlags::default()
    };
    fs.rename(d, b"c2", ROOT_INO, b"c3", whiteout).unwrap();
    assert_eq!(fs.entries_known(d), Some(2));
    assert_eq!(fs.rmdir(ROOT_INO, b"d"), Err(Errno::ENOTEMPTY));
    fs.unlink(d, b"c2").unwrap();
    // What came back from the exchange (e, empty) moves out; a directory
    // renamed over an empty one.
    assert_eq!(fs.lookup(d, b"s").unwrap().ino, e);
    let f = fs.mkdir(ROOT_INO, b"f", 0o755, ME).unwrap().ino;
    write_file(&fs, f, b"x", b"x");
    assert_eq!(
        fs.rename(d, b"s", ROOT_INO, b"f", RenameFlags::default()),
        Err(Errno::ENOTEMPTY)
    );
    fs.unlink(f, b"x").unwrap();
    fs.rename(d, b"s", ROOT_INO, b"f", RenameFlags::default())
        .unwrap();
    assert_eq!(fs.entries_known(d), Some(0));
    fs.rmdir(ROOT_INO, b"d").unwrap();
    assert_eq!(names(&fs, ROOT_INO).len(), 6, "., .., b-link, c3, e, f");
    let fs = remount(&dev, fs);
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}

/// A file written from its start with no gap has data everywhere and its
/// one hole at the end (answered from its flags, without reading its
/// blocks); extended by truncate, the new part is a hole.
#[test]
fn seeking_data_and_holes_of_a_file_without_gaps() {
    let (_dev, fs) = fresh();
    let f = write_file(&fs, ROOT_INO, b"dense", &[1; 10_000]);
    assert_eq!(fs.seek_data_or_hole(f, 0, libc::SEEK_DATA), Ok(0));
    assert_eq!(fs.seek_data_or_hole(f, 5_000, libc::SEEK_DATA), Ok(5_000));
    assert_eq!(fs.seek_data_or_hole(f, 0, libc::SEEK_HOLE), Ok(10_000));
    assert_eq!(fs.seek_data_or_hole(f, 9_999, libc::SEEK_HOLE), Ok(10_000));
    assert_eq!(
        fs.seek_data_or_hole(f, 10_000, libc::SEEK_DATA),
        Err(Errno::ENXIO)
    );
    set_size(&fs, f, 100_000);
    assert_eq!(fs.seek_data_or_hole(f, 0, libc::SEEK_HOLE), Ok(12_288));
    assert_eq!(
        fs.seek_data_or_hole(f, 12_288, libc::SEEK_DATA),
        Err(Errno::ENXIO)
    );
    assert_eq!(fs.seek_data_or_hole(f, 50_000, libc::SEEK_HOLE), Ok(50_000));
}

#[test]
fn hard_links_share_data_and_count() {
    let (dev, fs) = fresh();
    let f = write_file(&fs, ROOT_INO, b"one", b"shared");
    let attr = fs.link(f, ROOT_INO, b"two").unwrap();
    assert_eq!((attr.ino, attr.nlink), (f, 2));
    let fh = fs.open(f, libc::O_WRONLY, None).unwrap();
    fs.write(f, fh, 6, b"!", None).unwrap();
    fs.release(fh).unwrap();
    let fs = remount(&dev, fs);
    let two = fs.lookup(ROOT_INO, b"two").unwrap();
    assert_eq!((two.ino, two.nlink), (f, 2));
    assert_eq!(read_all(&fs, f), b"shared!");
    fs.unlink(ROOT_INO, b"one").unwrap();
    assert_eq!(fs.getattr(f).unwrap().nlink, 1);
    assert_eq!(read_all(&fs, f), b"shared!");
    fs.unlink(ROOT_INO, b"two").unwrap();
    assert_eq!(names(&fs, ROOT_INO).len(), 2);
}

#[test]
fn an_open_unlinked_file_stays_readable_until_closed() {
    let (dev, fs) = fresh();
    let f = write_file(&fs, ROOT_INO, b"tmp", b"still here");
    let fh = fs.open(f, libc::O_RDWR, None).unwrap();
    fs.unlink(ROOT_INO, b"tmp").unwrap();
    assert_eq!(fs.lookup(ROOT_INO, b"tmp"), Err(Errno::ENOENT));
    assert_eq!(read_all(&fs, f), b"still here");
    fs.write(f, fh, 0, b"STILL", None).unwrap();
    assert_eq!(read_all(&fs, f), b"STILL here");
    // Crash with the file still open: the next mount removes it.
    fs.fsync().unwrap();
    let inodes = fs.statfs().inodes;
    let fs = remount(&dev, fs);
    assert_eq!(fs.statfs().inodes, inodes - 1, "orphan purged at mount");
}

/// The table keeps an inode while the kernel holds references to it:
/// a batch of forgets drops each inode whose count reaches zero (and a
/// directory only once no child in the table needs it for paths), one
/// with references left stays; a forgotten file is found again by lookup.
#[test]
fn forgets_drop_what_the_kernel_no_longer_holds() {
    let (_dev, fs) = fresh();
    let dir = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
    let a = write_file(&fs, dir, b"a", b"1");
    let b = write_file(&fs, dir, b"b", b"2");
    assert_eq!(fs.lookup(dir, b"b").unwrap().ino, b, "b: two references");
    fs.forget_many(&[(a, 1), (b, 1), (dir, 1)]);
    // The directory stays: b still needs it for its path.
    assert_eq!(fs.getattr(a), Err(Errno::ESTALE));
    assert_eq!(fs.getattr(b).unwrap().ino, b);
    assert_eq!(fs.getattr(dir).unwrap().ino, dir);
    fs.forget(b, 1);
    assert_eq!(fs.getattr(b), Err(Errno::ESTALE));
    assert_eq!(fs.getattr(dir), Err(Errno::ESTALE));
    let dir = fs.lookup(ROOT_INO, b"d").unwrap().ino;
    assert_eq!(fs.lookup(dir, b"a").unwrap().ino, a);
    assert_eq!(read_all(&fs, a), b"1");
}

/// Past its limit the inode table names entries for the kernel to drop,
/// oldest first and enough to come back to three quarters of the limit:
/// files only, never an open one, each once until the kernel looks it up
/// again; the FORGETs that follow shrink the table, and a released file
/// is found again by lookup.
#[test]
fn a_table_past_its_limit_names_the_oldest_unused_files_for_release() {
    let (_dev, fs) = fresh();
    assert!(fs.entries_to_release().is_empty(), "no limit by default");
    let dir = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
    let files: Vec<u64> = (0..2000)
        .map(|i| write_file(&fs, dir, format!("f{i:04}").as_bytes(), b"x"))
        .collect();
    // The oldest file held open.
    let open = fs.open(files[0], libc::O_RDONLY, None).unwrap();
    let table = fs.store().stats().memory_beside_cache_bytes as usize;
    fs.set_table_limit(table * 2);
    assert!(fs.entries_to_release().is_empty(), "within the limit");
    fs.set_table_limit(table / 2);
    let released = fs.entries_to_release();
    let names: Vec<Vec<u8>> = released
        .iter()
        .map(|(parent, name)| {
            assert_eq!(*parent, dir, "only files: the directory stays");
            name.clone()
        })
        .collect();
    let expected: Vec<Vec<u8>> = (1..=names.len())
        .map(|i| format!("f{i:04}").into_bytes())
        .collect();
    assert_eq!(
        names, expected,
        "the oldest files, the open one passed over"
    );
    assert!(
        names.len() > 1000 && names.len() < 1900,
        "{} released to bring {table} bytes to three quarters of {}",
        names.len(),
        table / 2
    );
    assert!(
        fs.entries_to_release().is_empty(),
        "released entries count as gone until their FORGETs come"
    );
    // The kernel forgets them: the table is within three quarters of the
    // limit (its maps keep their capacity).
    let forgets: Vec<(u64, u64)> = (1..=names.len()).map(|i| (files[i], 1)).collect();
    fs.forget_many(&forgets);
    assert_eq!(fs.getattr(files[1]), Err(Errno::ESTALE));
    let after = fs.store().stats().memory_beside_cache_bytes as usize;
    assert!(
        after < table,
        "the table holds {after} bytes after the forgets, {table} before"
    );
    // Found again, a released file can be released again.
    assert_eq!(fs.lookup(dir, b"f0001").unwrap().ino, files[1]);
    assert_eq!(read_all(&fs, files[1]), b"x");
    fs.set_table_limit(1);
    let again = fs.entries_to_release();
    assert!(
        again.iter().any(|(_, name)| name == b"f0001"),
        "a file looked up after its release is released again"
    );
    assert!(
        !again.iter().any(|(_, name)| name == b"f0000"),
        "an open file is never released"
    );
    fs.release(open).unwrap();
}

/// Every offset a listing returned resumes right after its entry, in any
/// order and from cookies long out of the recent window (seekdir to what
/// telldir said, in a directory read in pieces).
#[test]
fn readdir_resumes_after_any_returned_offset() {
    let (_dev, fs) = fresh();
    let d = fs.mkdir(ROOT_INO, b"big", 0o755, ME).unwrap().ino;
    for i in 0..5000 {
        write_file(&fs, d, format!("entry-{i:05}").as_bytes(), b"");
    }
    let all = list(&fs, d, 0, usize::MAX);
    assert_eq!(all.len(), 5002);
    let offsets: std::collections::HashSet<u64> = all.iter().map(|e| e.1).collect();
    assert_eq!(offsets.len(), all.len(), "offsets are distinct");
    // Far apart, backwards, the oldest first: each resumes after its entry.
    for &i in &[4999usize, 3, 2500, 0, 1, 5000, 17, 4096] {
        let rest = list(&fs, d, all[i].1, usize::MAX);
        assert_eq!(rest, all[i + 1..].to_vec(), "resuming after entry {i}");
    }
}

/// readdirplus lists what readdir lists, with the offsets readdir gives
/// and the attributes a lookup gives, also read in pieces (each resumed
/// after the last entry taken) past the entries read ahead of the table's
/// lock, over a remount (entries read from the device).
#[test]
fn readdirplus_lists_what_readdir_lists() {
    let (dev, fs) = fresh();
    let d = fs.mkdir(ROOT_INO, b"mixed", 0o755, ME).unwrap().ino;
    let other = fs.mkdir(ROOT_INO, b"other", 0o755, ME).unwrap().ino;
    for i in 0..700 {
        let name = format!("e{i:04}");
        match i % 7 {
            0 => drop(fs.mkdir(d, name.as_bytes(), 0o700, ME).unwrap()),
            1 => drop(fs.symlink(d, name.as_bytes(), b"somewhere", ME).unwrap()),
            2 => {
                let target = write_file(&fs, other, name.as_bytes(), b"linked");
                fs.link(target, d, name.as_bytes()).unwrap();
            }
            _ => drop(write_file(&fs, d, name.as_bytes(), &vec![b'x'; i])),
        }
    }
    let fs = remount(&dev, fs);
    let d = fs.lookup(ROOT_INO, b"mixed").unwrap().ino;
    let plain = list(&fs, d, 0, usize::MAX);
    assert_eq!(plain.len(), 702);
    for piece in [37usize, 500, usize::MAX] {
        let mut seen: Vec<(Vec<u8>, u64)> = Vec::new();
        let mut offset = 0;
        loop {
            let mut got = Vec::new();
            fs.readdir(d, offset, true, &mut |e| {
                if got.len() == piece {
                    return true;
                }
                assert_eq!(e.attr.map_or(e.ino, |a| a.ino), e.ino);
                got.push((e.name.to_vec(), e.offset, e.attr.cloned()));
                false
            })
            .unwrap();
            let Some(last) = got.last() else { break };
            offset = last.1;
            for (name, offset, attr) in got {
                match attr {
                    Some(attr) => {
                        let looked = fs.lookup(d, &name).unwrap();
                        let shown = String::from_utf8_lossy(&name);
                        assert_eq!(attr.ino, looked.ino, "{shown}");
                        assert_eq!(attr.size, looked.size, "{shown}");
                        assert_eq!(attr.mode, looked.mode, "{shown}");
                        assert_eq!(attr.nlink, looked.nlink, "{shown}");
                    }
                    None => assert!(name == b"." || name == b".."),
                }
                seen.push((name, offset));
            }
        }
        assert_eq!(seen, plain, "read {piece} entries at a time");
    }
}

/// A listing asked to go on from its last entry finds whatever came into
/// the directory since, however it came: the kernel asks once more after
/// every listing's last entry, and that ask is answered without the store
/// while nothing was written (`listing::DirCookies::end`).
#[test]
fn readdir_from_the_end_finds_what_came_since() {
    let (_dev, fs) = fresh();
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
    let other = fs.mkdir(ROOT_INO, b"other", 0o755, ME).unwrap().ino;
    let linked = write_file(&fs, other, b"linked", b"L");
    let from = |offset: u64, plus: bool| list_as(&fs, d, offset, usize::MAX, plus);
    // Names of a later round and a later kind sort after the earlier.
    for (round, plus) in [(b'a', false), (b'b', true)] {
        // Empty but for the dots, or as far as the last round left it.
        let mut end = from(0, plus).last().unwrap().1;
        for kind in b'0'..=b'4' {
            // The listing before marked the directory's access (its
            // mtime had moved): a write, which this ask sees.
            assert!(from(end, plus).is_empty(), "nothing past the end yet");
            let store_visits = fs.store().stats().cache_hits;
            assert!(from(end, !plus).is_empty(), "asked again: still nothing");
            assert_eq!(
                fs.store().stats().cache_hits,
                store_visits,
                "the end is known without the store while nothing was written"
            );
            let name = [round, kind];
            match kind {
                b'0' => drop(write_file(&fs, d, &name, b"")),
                b'1' => drop(fs.mkdir(d, &name, 0o755, ME).unwrap()),
                b'2' => drop(fs.link(linked, d, &name).unwrap()),
                b'3' => {
                    write_file(&fs, other, &name, b"M");
                    fs.rename(other, &name, d, &name, RenameFlags::default())
                        .unwrap();
                }
                _ => drop(fs.symlink(d, &name, b"t", ME).unwrap()),
            }
            let got = from(end, plus);
            assert_eq!(got.len(), 1, "what came in is listed from the end");
            assert_eq!(got[0].0, name.to_vec());
            end = got[0].1;
        }
    }
    // An entry that went away from before the end leaves the end as it
    // was; one that came in before it is not listed from the end (it is
    // from the start).
    let end = from(0, false).last().unwrap().1;
    fs.unlink(d, b"a0").unwrap();
    write_file(&fs, d, b"0-first", b"");
    assert!(from(end, false).is_empty());
    let names: Vec<Vec<u8>> = from(0, false).into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&b"0-first".to_vec()) && !names.contains(&b"a0".to_vec()));
}

#[test]
fn readdir_offsets_survive_changes() {
    let (_dev, fs) = fresh();
    for i in 0..300 {
        write_file(&fs, ROOT_INO, format!("f{i:03}").as_bytes(), b"");
    }
    let first = list(&fs, ROOT_INO, 0, 100);
    assert_eq!(first.len(), 100, "stops when the buffer is full");
    let resume = first[98].1; // the last entry actually taken is index 98
    fs.unlink(ROOT_INO, b"f299").unwrap();
    write_file(&fs, ROOT_INO, b"f150a", b"");
    let rest = list(&fs, ROOT_INO, resume, usize::MAX);
    let all: Vec<Vec<u8>> = first[..99]
        .iter()
        .chain(&rest)
        .map(|(n, _)| n.clone())
        .collect();
    let expected = names(&fs, ROOT_INO);
    assert_eq!(all, expected, "no entry lost or repeated");
    assert!(expected.contains(&b"f150a".to_vec()) && !expected.contains(&b"f299".to_vec()));
}

#[test]
fn odd_names_and_limits() {
    let (dev, fs) = fresh();
    let long = vec![b'n'; 255];
    let odd = b"\x01\x02\x03\xff name".to_vec();
    write_file(&fs, ROOT_INO, &long, b"L");
    let d = fs.mkdir(ROOT_INO, &odd, 0o700, ME).unwrap().ino;
    write_file(&fs, d, &odd, b"O");
    assert_eq!(fs.lookup(ROOT_INO, &[b'n'; 256]), Err(Errno::ENAMETOOLONG));
    let fs = remount(&dev, fs);
    assert_eq!(fs.lookup(ROOT_INO, &long).unwrap().size, 1);
    let d = fs.lookup(ROOT_INO, &odd).unwrap().ino;
    assert_eq!(names(&fs, d)[2], odd);
}

#[test]
fn xattrs_follow_the_flags() {
    let (_dev, fs) = fresh();
    let f = write_file(&fs, ROOT_INO, b"f", b"");
    assert_eq!(fs.getxattr(f, b"user.a"), Err(Errno::ENODATA));
    assert_eq!(
        fs.setxattr(f, b"user.a", b"1", libc::XATTR_REPLACE),
        Err(Errno::ENODATA)
    );
    fs.setxattr(f, b"user.a", b"1", libc::XATTR_CREATE).unwrap();
    assert_eq!(
        fs.setxattr(f, b"user.a", b"2", libc::XATTR_CREATE),
        Err(Errno::EEXIST)
    );
    fs.setxattr(f, b"user.b", &[7; 65536], 0).unwrap();
    assert_eq!(fs.setxattr(f, b"user.c", &[7; 65537], 0), Err(Errno::E2BIG));
    assert_eq!(fs.listxattr(f).unwrap(), b"user.a\0user.b\0");
    fs.removexattr(f, b"user.a").unwrap();
    assert_eq!(fs.removexattr(f, b"user.a"), Err(Errno::ENODATA));
    assert_eq!(fs.getxattr(f, b"user.b").unwrap().len(), 65536);
}

#[test]
fn fsck_is_clean_after_every_kind_of_change_and_finds_damage() {
    let (dev, fs) = fresh();
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
    let e = fs.mkdir(d, b"e", 0o755, ME).unwrap().ino;
    let f = write_file(&fs, e, b"f", &[5; 10_000]);
    fs.link(f, ROOT_INO, b"hard").unwrap();
    write_file(&fs, d, b"g", b"g");
    fs.setxattr(d, b"user.x", b"1", 0).unwrap();
    fs.symlink(ROOT_INO, b"ln", b"d/g", ME).unwrap();
    fs.rename(ROOT_INO, b"d", ROOT_INO, b"d2", RenameFlags::default())
        .unwrap();
    let open = write_file(&fs, ROOT_INO, b"open", b"o");
    let fh = fs.open(open, libc::O_RDONLY, None).unwrap();
    fs.unlink(ROOT_INO, b"open").unwrap();
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!(report.directories, 3);
    fs.release(fh).unwrap();
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);

    // Damage: a data block without its file.
    fs.store()
        .put(
            betreefs_engine::KeySpace::Data,
            &betreefs_fs::schema::data_key(b"\x00nofile", 0),
            b"x",
        )
        .unwrap();
    let fs = remount(&dev, fs);
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(report.problems[0].what.contains("missing file"));
    assert_eq!(report.fixable(), 1);
}

/// File handles: an inode is found by its number alone after a remount
/// (the table empty), through back pointers that follow renames; a
/// removed one is stale.
#[test]
fn inodes_are_found_by_number_after_renames_and_remounts() {
    let (dev, fs) = fresh();
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
    let e = fs.mkdir(d, b"e", 0o755, ME).unwrap().ino;
    let f = write_file(&fs, e, b"f", b"by number");
    let linked = write_file(&fs, ROOT_INO, b"one", b"linked");
    fs.link(linked, d, b"two").unwrap();
    fs.rename(ROOT_INO, b"d", ROOT_INO, b"d2", RenameFlags::default())
        .unwrap();
    fs.rename(e, b"f", d, b"g", RenameFlags::default()).unwrap();
    let fs = remount(&dev, fs);
    assert_eq!(fs.lookup_by_number(f).unwrap().ino, f);
    assert_eq!(fs.read_to_vec(f, 0, 100).unwrap(), b"by number");
    assert_eq!(fs.lookup_by_number(linked).unwrap().ino, linked);
    assert_eq!(fs.lookup_by_number(e).unwrap().ino, e);
    assert_eq!(fs.lookup_parent(e).unwrap().ino, d);
    assert_eq!(fs.lookup_parent(d).unwrap().ino, ROOT_INO);
    assert_eq!(fs.lookup_parent(f), Err(Errno::ENOTDIR));
    assert_eq!(fs.lookup_by_number(123_456), Err(Errno::ESTALE));
    // Removed while the table still counts it open (the kernel sends a
    // release after close returns): stale already, not only after the
    // release.
    let fh = fs.open(f, libc::O_RDONLY, None).unwrap();
    fs.unlink(d, b"g").unwrap();
    assert_eq!(fs.lookup_by_number(f), Err(Errno::ESTALE));
    assert_eq!(fs.read_to_vec(f, 0, 100).unwrap(), b"by number");
    fs.release(fh).unwrap();
    assert_eq!(fs.lookup_by_number(f), Err(Errno::ESTALE));
    let fs = remount(&dev, fs);
    assert_eq!(fs.lookup_by_number(f), Err(Errno::ESTALE));
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}

/// Every repairable kind of damage at once: repair passes leave a clean
/// image, and what the damage did not touch is kept (entries of a lost
/// directory come back under a recreated one).
#[test]
fn fsck_repairs_what_it_can() {
    use betreefs_engine::{KeySpace, WriteBatch};
    use betreefs_fs::schema;
    let (dev, fs) = fresh();
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
    let sub = fs.mkdir(d, b"sub", 0o755, ME).unwrap().ino;
    write_file(&fs, sub, b"kept", b"still here");
    let f = write_file(&fs, ROOT_INO, b"f", b"f");
    let (p, fh) = fs.create(ROOT_INO, b"p", 0o644, 0, ME).unwrap();
    fs.fallocate(p.ino, 0, 10 * 4096, 0, None).unwrap();
    fs.release(fh).unwrap();
    let fs = remount(&dev, fs);
    let d_key = schema::entry_key(b"", b"d");
    let f_key = schema::entry_key(b"", b"f");
    let mut damage = WriteBatch::new();
    damage
        // A directory's record lost: "sub" and "sub/kept" have no parent.
        .delete(KeySpace::Meta, &d_key)
        // Stray keys of every kind.
        .put(KeySpace::Data, &schema::data_key(b"\x00nofile", 0), b"x")
        .put(
            KeySpace::Data,
            &schema::xattr_key(b"\x00nofile", b"user.a"),
            b"x",
        )
        .put(KeySpace::Meta, &schema::orphan_key(999_999), b"")
        .put(
            KeySpace::Meta,
            &schema::entry_key(b"", b"dangling"),
            &betreefs_fs::record::Record::Link {
                ino: 888_888,
                mode: libc::S_IFREG | 0o644,
            }
            .encode(),
        )
        // Counts overwritten: the inode count wrong, the reserved one lost.
        .put(KeySpace::Meta, schema::COUNTS_KEY, &77u64.to_le_bytes())
        // Reservations of no file, and of a file not preallocated (over
        // its stored block).
        .put(
            KeySpace::Data,
            &schema::reservation_key(b"\x00nofile", 5),
            &2u64.to_le_bytes(),
        )
        .put(
            KeySpace::Data,
            &schema::reservation_key(&f_key, 1),
            &0u64.to_le_bytes(),
        )
        // Back pointers: one missing, one wrong, one of no inode.
        .delete(KeySpace::Meta, &schema::back_pointer_key(f))
        .put(
            KeySpace::Meta,
            &schema::back_pointer_key(sub),
            &betreefs_fs::record::BackPointer {
                parent: 5,
                name: b"elsewhere".to_vec(),
            }
            .encode(),
        )
        .put(
            KeySpace::Meta,
            &schema::back_pointer_key(777_777),
            b"\x01\0\0\0\0\0\0\0x",
        )
        .delete(KeySpace::Meta, schema::INFO_KEY);
    fs.store().write(&damage).unwrap();
    // Without its identity record the image does not mount: check the store.
    fs.close().unwrap();
    let store = Store::open_on(Arc::new(dev.clone()), options()).unwrap();
    let mut report = betreefs_fs::fsck::check(&store, |_| {}).unwrap();
    assert!(report.problems.len() >= 10, "{:?}", report.problems);
    assert_eq!(
        report.fixable(),
        report.problems.len(),
        "{:?}",
        report.problems
    );
    for _pass in 0..4 {
        if report.is_clean() {
            break;
        }
        betreefs_fs::fsck::repair(&store, &report).unwrap();
        report = betreefs_fs::fsck::check(&store, |_| {}).unwrap();
    }
    assert!(report.is_clean(), "{:?}", report.problems);
    store.close().unwrap();
    let fs = common::mount_fs(&dev, &options(), "reopening");
    let d = fs.lookup(ROOT_INO, b"d").unwrap();
    assert!(d.is_dir());
    let sub = fs.lookup(d.ino, b"sub").unwrap();
    let kept = fs.lookup(sub.ino, b"kept").unwrap();
    assert_eq!(fs.read_to_vec(kept.ino, 0, 100).unwrap(), b"still here");
    assert_eq!(
        fs.lookup(ROOT_INO, b"dangling"),
        Err(betreefs_fs::Errno::ENOENT)
    );
    // The sound reservation is counted again, and held back at mount.
    assert_eq!(fs.store().stats().promised_bytes, 10 * 2 * (4096 + 512));
}

#[test]
fn listing_continues_after_the_directory_itself_is_renamed() {
    let (_dev, fs) = fresh();
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
    for i in 0..50 {
        write_file(&fs, d, format!("f{i:02}").as_bytes(), b"");
    }
    let mut seen = list(&fs, d, 0, 21);
    let resume = seen[19].1;
    seen.truncate(20);
    fs.rename(ROOT_INO, b"d", ROOT_INO, b"e", RenameFlags::default())
        .unwrap();
    seen.extend(list(&fs, d, resume, usize::MAX));
    assert_eq!(seen.len(), 52, "., .. and all 50 entries once");
}

#[derive(Clone, Debug)]
enum DataOp {
    Write {
        at: u64,
        len: u64,
        byte: u8,
    },
    Punch {
        at: u64,
        len: u64,
    },
    Zero {
        at: u64,
        len: u64,
        keep_size: bool,
    },
    Truncate {
        size: u64,
    },
    Preallocate {
        at: u64,
        len: u64,
        keep_size: bool,
    },
    /// copy_file_range between the file and a second one (`to_other`: from
    /// the file to it); whole blocks at one offset are cloned, anything
    /// else copied (the strategy makes both often).
    Copy {
        to_other: bool,
        at: u64,
        out_at: u64,
        len: u64,
    },
}

fn data_op() -> impl proptest::strategy::Strategy<Value = DataOp> {
    use proptest::prelude::*;
    // Offsets around a few blocks, so edges and whole blocks both occur.
    let at = 0u64..40_000;
    let len = 1u64..20_000;
    prop_oneof![
        (at.clone(), len.clone(), 1u8..255).prop_map(|(at, len, byte)| DataOp::Write {
            at,
            len,
            byte
        }),
        (at.clone(), len.clone()).prop_map(|(at, len)| DataOp::Punch { at, len }),
        (at.clone(), len, any::<bool>()).prop_map(|(at, len, keep_size)| DataOp::Zero {
            at,
            len,
            keep_size
        }),
        at.clone().prop_map(|size| DataOp::Truncate { size }),
        (at.clone(), 1u64..30_000, any::<bool>())
            .prop_map(|(at, len, keep_size)| { DataOp::Preallocate { at, len, keep_size } }),
        (any::<bool>(), at.clone(), at, 1u64..60_000, any::<bool>()).prop_map(
            |(to_other, at, out_at, len, aligned)| {
                let (at, out_at, len) = if aligned {
                    let at = at / 4096 * 4096;
                    (at, at, len.div_ceil(4096) * 4096)
                } else {
                    (at, out_at, len)
                };
                DataOp::Copy {
                    to_other,
                    at,
                    out_at,
                    len,
                }
            }
        ),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// Writes, punched holes, zeroed ranges and truncates against a byte
    /// vector: reads match, and SEEK_DATA/SEEK_HOLE agree with the bytes
    /// (a hole always reads as zeros; data never lies past the size) and
    /// with each other — before and after a remount.
    #[test]
    fn holes_and_zeroed_ranges_match_a_model(ops in proptest::collection::vec(data_op(), 1..24)) {
        let (dev, mut fs) = fresh();
        let (attr, fh) = fs.create(ROOT_INO, b"f", 0o644, 0, ME).unwrap();
        let ino = attr.ino;
        let (other, other_fh) = fs.create(ROOT_INO, b"g", 0o644, 0, ME).unwrap();
        let mut model: Vec<u8> = Vec::new();
        let mut other_model: Vec<u8> = Vec::new();
        for op in &ops {
            match *op {
                DataOp::Copy { to_other, at, out_at, len } => {
                    let (from, to, to_fh) = if to_other {
                        (ino, other.ino, other_fh)
                    } else {
                        (other.ino, ino, fh)
                    };
                    let (src, dst) = if to_other {
                        (&model, &mut other_model)
                    } else {
                        (&other_model, &mut model)
                    };
                    let n = len.min((src.len() as u64).saturating_sub(at));
                    let copied = fs.copy_range(from, at, to, to_fh, out_at, len, None).unwrap();
                    proptest::prop_assert_eq!(copied, n);
                    if n > 0 {
                        let end = (out_at + n) as usize;
                        if dst.len() < end {
                            dst.resize(end, 0);
                        }
                        dst[out_at as usize..end]
                            .copy_from_slice(&src[at as usize..(at + n) as usize]);
                    }
                }
                DataOp::Write { at, len, byte } => {
                    fs.write(ino, fh, at, &vec![byte; len as usize], None).unwrap();
                    let end = (at + len) as usize;
                    if model.len() < end {
                        model.resize(end, 0);
                    }
                    model[at as usize..end].fill(byte);
                }
                DataOp::Punch { at, len } => {
                    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                    fs.fallocate(ino, at, len, mode, None).unwrap();
                    let end = ((at + len) as usize).min(model.len());
                    if (at as usize) < end {
                        model[at as usize..end].fill(0);
                    }
                }
                DataOp::Zero { at, len, keep_size } => {
                    let mut mode = libc::FALLOC_FL_ZERO_RANGE;
                    if keep_size {
                        mode |= libc::FALLOC_FL_KEEP_SIZE;
                    }
                    fs.fallocate(ino, at, len, mode, None).unwrap();
                    let end = (at + len) as usize;
                    let clipped = end.min(model.len());
                    if (at as usize) < clipped {
                        model[at as usize..clipped].fill(0);
                    }
                    if !keep_size && model.len() < end {
                        model.resize(end, 0);
                    }
                }
                DataOp::Truncate { size } => {
                    set_size(&fs, ino, size);
                    model.resize(size as usize, 0);
                }
                DataOp::Preallocate { at, len, keep_size } => {
                    let mode = if keep_size { libc::FALLOC_FL_KEEP_SIZE } else { 0 };
                    fs.fallocate(ino, at, len, mode, None).unwrap();
                    let end = (at + len) as usize;
                    if !keep_size && model.len() < end {
                        model.resize(end, 0);
                    }
                }
            }
        }
        for round in 0..2 {
            proptest::prop_assert_eq!(fs.getattr(ino).unwrap().size, model.len() as u64);
            proptest::prop_assert!(read_all(&fs, ino) == model, "contents after {:?}", ops);
            proptest::prop_assert!(
                read_all(&fs, other.ino) == other_model,
                "the other file's contents after {:?}",
                ops
            );
            let size = model.len() as u64;
            let mut offset = 0;
            // Walk data/hole boundaries from the start to the end.
            while offset < size {
                let data = fs.seek_data_or_hole(ino, offset, libc::SEEK_DATA);
                let hole = fs.seek_data_or_hole(ino, offset, libc::SEEK_HOLE).unwrap();
                proptest::prop_assert!(hole >= offset && hole <= size);
                // Everything from offset up to the next data reads as zeros.
                let next_data = match data {
                    Ok(d) => d,
                    Err(e) => {
                        proptest::prop_assert_eq!(e, Errno(libc::ENXIO));
                        size
                    }
                };
                proptest::prop_assert!(next_data >= offset);
                proptest::prop_assert!(
                    model[offset as usize..next_data as usize].iter().all(|&b| b == 0),
                    "nonzero bytes before SEEK_DATA's answer {} from {}", next_data, offset
                );
                if next_data == offset {
                    proptest::prop_assert!(hole > offset, "data at {} but a hole there", offset);
                    offset = hole;
                } else {
                    proptest::prop_assert_eq!(hole, offset, "a hole before data at {}", next_data);
                    offset = next_data;
                }
            }
            proptest::prop_assert_eq!(
                fs.seek_data_or_hole(ino, size, libc::SEEK_HOLE),
                Err(Errno(libc::ENXIO))
            );
            // Reservations: disjoint, over no stored block, adding up to
            // the count the store holds back.
            let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
            proptest::prop_assert!(report.is_clean(), "{:?} after {:?}", report.problems, ops);
            if round == 0 {
                fs.release(fh).unwrap();
                fs.release(other_fh).unwrap();
                fs = remount(&dev, fs);
                proptest::prop_assert_eq!(fs.lookup(ROOT_INO, b"f").unwrap().ino, ino);
                proptest::prop_assert_eq!(fs.lookup(ROOT_INO, b"g").unwrap().ino, other.ino);
            }
        }
    }
}

fn free_blocks(fs: &FileSystem) -> u64 {
    fs.statfs().blocks_free
}

fn promised(fs: &FileSystem) -> u64 {
    fs.store().stats().promised_bytes
}

/// Writes `byte` over [`at`, `at + len`) in 64 KiB requests; the bytes
/// written before the first error, and that error.
fn fill(fs: &FileSystem, ino: u64, fh: u64, at: u64, len: u64, byte: u8) -> (u64, Option<Errno>) {
    let chunk = vec![byte; 64 << 10];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(chunk.len() as u64) as usize;
        match fs.write(ino, fh, at + done, &chunk[..n], None) {
            Ok(0) => return (done, Some(Errno(libc::ENOSPC))),
            Ok(w) => done += u64::from(w),
            Err(e) => return (done, Some(e)),
        }
    }
    (done, None)
}

/// fallocate mode 0 holds the space back: other writes run out of room
/// first, and every write into the preallocated range then succeeds —
/// also after a remount; freeing the file (or cutting it short) gives
/// the promise back.
#[test]
fn preallocated_blocks_stay_writable_on_a_full_device() {
    const RANGE: u64 = 4 << 20;
    let (dev, fs) = fresh();
    let before = free_blocks(&fs);
    let (a, fa) = fs.create(ROOT_INO, b"a", 0o644, 0, ME).unwrap();
    fs.fallocate(a.ino, 0, RANGE, 0, None).unwrap();
    assert_eq!(fs.getattr(a.ino).unwrap().size, RANGE);
    assert!(
        before - free_blocks(&fs) >= RANGE / 4096,
        "df shows the range taken: {before} -> {}",
        free_blocks(&fs)
    );
    let held = promised(&fs);
    assert!(held >= RANGE, "{held}");
    // A power cut after fsync keeps the promise: it is in the log.
    fs.fsync().unwrap();
    let crashed = MemDevice::from_image(dev.crash_image(betreefs_store::CrashMode::DropUnsynced));
    let store = Store::open_on(Arc::new(crashed), options()).unwrap();
    let recovered = FileSystem::mount(store, AtimePolicy::Relatime).unwrap();
    assert_eq!(promised(&recovered), held, "after a power cut");
    drop(recovered);
    // More than is left: refused, nothing changes.
    let (big, fbig) = fs.create(ROOT_INO, b"big", 0o644, 0, ME).unwrap();
    assert_eq!(
        fs.fallocate(big.ino, 0, 1 << 30, 0, None),
        Err(Errno(libc::ENOSPC))
    );
    assert_eq!(fs.getattr(big.ino).unwrap().size, 0);
    assert_eq!(promised(&fs), held);

    // Another file fills the device.
    let (filled, err) = fill(&fs, big.ino, fbig, 0, 1 << 30, 7);
    assert_eq!(err, Some(Errno(libc::ENOSPC)), "after {filled} bytes");
    assert!(filled > 8 << 20, "{filled}");
    // The preallocated range takes all of its bytes.
    let (wrote, err) = fill(&fs, a.ino, fa, 0, RANGE, 1);

    assert_eq!((wrote, err), (RANGE, None));
    assert_eq!(promised(&fs), 0, "every reserved block was written");
    let fs = {
        fs.release(fa).unwrap();
        fs.release(fbig).unwrap();
        remount(&dev, fs)
    };
    let a = fs.lookup(ROOT_INO, b"a").unwrap().ino;
    assert!(read_all(&fs, a).iter().all(|&b| b == 1));
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);

    // Room again; a KEEP_SIZE reservation past the end survives a remount.
    fs.unlink(ROOT_INO, b"big").unwrap();
    let fh = fs.open(a, libc::O_RDWR, None).unwrap();
    fs.fallocate(a, RANGE, RANGE, libc::FALLOC_FL_KEEP_SIZE, None)
        .unwrap();
    assert_eq!(fs.getattr(a).unwrap().size, RANGE);
    let held = promised(&fs);
    fs.release(fh).unwrap();
    let fs = remount(&dev, fs);
    assert_eq!(promised(&fs), held, "the promise is kept across a remount");
    let a = fs.lookup(ROOT_INO, b"a").unwrap().ino;
    let (c, fc) = fs.create(ROOT_INO, b"c", 0o644, 0, ME).unwrap();
    let (_, err) = fill(&fs, c.ino, fc, 0, 1 << 30, 3);
    assert_eq!(err, Some(Errno(libc::ENOSPC)));
    let fh = fs.open(a, libc::O_RDWR, None).unwrap();
    let (wrote, err) = fill(&fs, a, fh, RANGE, RANGE, 2);
    assert_eq!((wrote, err), (RANGE, None));
    assert_eq!(promised(&fs), 0);

    // Promises go back when the blocks are cut off or the file removed.
    fs.release(fc).unwrap();
    fs.unlink(ROOT_INO, b"c").unwrap();
    let (d, fd) = fs.create(ROOT_INO, b"d", 0o644, 0, ME).unwrap();
    fs.fallocate(d.ino, 0, RANGE, libc::FALLOC_FL_KEEP_SIZE, None)
        .unwrap();
    assert!(promised(&fs) >= RANGE);
    // As ext4: truncate to the same size or less frees what lies past the
    // end; growing keeps it.
    set_size(&fs, d.ino, 4096);
    assert!(promised(&fs) > 0);
    set_size(&fs, d.ino, 4096);
    let one_block = 2 * (4096 + 512);
    assert_eq!(
        promised(&fs),
        one_block,
        "truncate frees the blocks past the end; block 0 is inside"
    );
    fs.fallocate(d.ino, 0, RANGE, 0, None).unwrap();
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    fs.fallocate(d.ino, 0, RANGE / 2, punch, None).unwrap();
    let half = promised(&fs);
    assert_eq!(
        half,
        RANGE / 2 / 4096 * one_block,
        "punching frees its half"
    );
    fs.unlink(ROOT_INO, b"d").unwrap();
    assert_eq!(promised(&fs), half, "still open");
    fs.release(fd).unwrap();
    assert_eq!(promised(&fs), 0, "freed with the file");
    fs.release(fh).unwrap();
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}

/// Version 2 and 3 images (before reservations, before the key bound)
/// mount; a read-write mount upgrades the identity record to the current
/// version and writes the key bound found by a scan of the metadata keys,
/// a read-only one leaves both.
#[test]
fn older_images_are_upgraded_by_a_read_write_mount() {
    use betreefs_engine::KeySpace;
    use betreefs_fs::record::{KeyBound, FS_VERSION};
    use betreefs_fs::schema;
    for old in [2u8, 3] {
        let (dev, fs) = fresh();
        write_file(&fs, ROOT_INO, b"f", b"kept");
        // A path longer than the least bound.
        let mut dir = ROOT_INO;
        for _ in 0..3 {
            dir = fs.mkdir(dir, &[b'd'; 200], 0o755, ME).unwrap().ino;
        }
        write_file(&fs, dir, b"deep", b"deep");
        let mut info = fs
            .store()
            .get(KeySpace::Meta, schema::INFO_KEY)
            .unwrap()
            .unwrap();
        info[8] = old;
        fs.store()
            .put(KeySpace::Meta, schema::INFO_KEY, &info)
            .unwrap();
        fs.store()
            .delete(KeySpace::Meta, schema::KEY_BOUND_KEY)
            .unwrap();
        fs.close().unwrap();
        let version = |store: &Store| {
            let info = store
                .get(KeySpace::Meta, schema::INFO_KEY)
                .unwrap()
                .unwrap();
            u32::from_le_bytes(info[8..12].try_into().unwrap())
        };
        let bound = |store: &Store| {
            store
                .get(KeySpace::Meta, schema::KEY_BOUND_KEY)
                .unwrap()
                .map(|v| KeyBound::decode(&v).unwrap().0)
        };
        let read_only = Options {
            read_only: true,
            ..options()
        };
        let fs = common::mount_fs(&dev, &read_only, "opening read-only");
        assert_eq!(version(fs.store()), u32::from(old));
        assert_eq!(bound(fs.store()), None);
        let f = fs.lookup(ROOT_INO, b"f").unwrap().ino;
        assert_eq!(read_all(&fs, f), b"kept");
        fs.close().unwrap();
        let fs = common::mount_fs(&dev, &options(), "reopening");
        assert_eq!(version(fs.store()), FS_VERSION);
        let found = bound(fs.store()).expect("the key bound, written by the upgrade");
        // Three directory names of 200 bytes and their separators.
        assert!((605..=704).contains(&found), "bound {found}");
        let fs = remount(&dev, fs);
        assert_eq!(version(fs.store()), FS_VERSION);
        assert_eq!(bound(fs.store()), Some(found));
        fs.close().unwrap();
        let store = Store::open_on(Arc::new(dev.clone()), options()).unwrap();
        let report = betreefs_fs::fsck::check(&store, |_| {}).unwrap();
        assert!(report.is_clean(), "{report:?}");
    }
}

/// A rename adds no data, so a full device takes it like a delete: files
/// and directories of many leaves move (by tree surgery, their data
/// unread), an exchange swaps two, and a file's first hard link moves its
/// data under its inode key — all with the device full, all fsck-clean
/// and intact after a remount.
#[test]
fn renames_and_first_links_work_on_a_full_device() {
    let (dev, fs) = fresh();
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
    let pattern = |n: usize, seed: u8| -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    };
    let big = pattern(3 << 20, 1);
    let other = pattern(2 << 20, 2);
    write_file(&fs, d, b"big", &big);
    write_file(&fs, d, b"other", &other);
    write_file(&fs, ROOT_INO, b"loose", &other);
    fs.fsync().unwrap();
    let (filler, fh) = fs.create(ROOT_INO, b"filler", 0o644, 0, ME).unwrap();
    let (_, err) = fill(&fs, filler.ino, fh, 0, 1 << 30, 9);
    assert_eq!(err, Some(Errno(libc::ENOSPC)));
    fs.release(fh).unwrap();
    let surgeries_before = fs.store().stats().range_renames_by_surgery;

    fs.rename(d, b"big", ROOT_INO, b"moved", RenameFlags::default())
        .unwrap();
    fs.rename(ROOT_INO, b"d", ROOT_INO, b"e", RenameFlags::default())
        .unwrap();
    let e = fs.lookup(ROOT_INO, b"e").unwrap().ino;
    let exchange = RenameFlags {
        exchange: true,
        ..RenameFlags::default()
    };
    fs.rename(ROOT_INO, b"moved", ROOT_INO, b"loose", exchange)
        .unwrap();
    let loose = fs.lookup(ROOT_INO, b"loose").unwrap().ino;
    fs.link(loose, e, b"second-name").unwrap();
    assert!(
        fs.store().stats().range_renames_by_surgery > surgeries_before,
        "multi-leaf files move by surgery"
    );
    fs.fsync().unwrap();

    let fs = remount(&dev, fs);
    let e = fs.lookup(ROOT_INO, b"e").unwrap().ino;
    let loose = fs.lookup(ROOT_INO, b"loose").unwrap().ino;
    assert_eq!(read_all(&fs, loose), big);
    assert_eq!(fs.lookup(e, b"second-name").unwrap().ino, loose);
    assert_eq!(fs.getattr(loose).unwrap().nlink, 2);
    let moved = fs.lookup(ROOT_INO, b"moved").unwrap().ino;
    assert_eq!(read_all(&fs, moved), other);
    let kept = fs.lookup(e, b"other").unwrap().ino;
    assert_eq!(read_all(&fs, kept), other);
    let mut listed = names(&fs, e);
    listed.sort();
    assert_eq!(
        listed,
        [&b"."[..], b"..", b"other", b"second-name"].map(<[u8]>::to_vec)
    );
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}

/// copy_file_range of whole blocks at the same offset is a range clone:
/// the copy shares the source's data (the node region grows by far less
/// than the bytes copied), reads back equal, holes included, and writes,
/// truncates and punches on either side leave the other as it was —
/// across a remount, with fsck clean (reference counts included). Ranges
/// a clone cannot express exactly (other offsets, a partial last block
/// before more of the destination) are copied and come out the same.
#[test]
fn copy_range_clones_whole_blocks_and_copies_stay_independent() {
    let (dev, fs) = fresh();
    let pattern = |n: usize, seed: u8| -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
            .collect()
    };
    let mut data = pattern(6 << 20, 3);
    let src = write_file(&fs, ROOT_INO, b"src", &data);
    // A hole of 1 MiB in the middle.
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    fs.fallocate(src, 2 << 20, 1 << 20, punch, None).unwrap();
    data[2 << 20..3 << 20].fill(0);
    fs.fsync().unwrap();
    fs.store().checkpoint().unwrap();
    let used_before = fs.store().stats().node_region_used_bytes;
    let clones_before = fs.store().stats().range_clones_by_surgery;

    let (dst, fh) = fs.create(ROOT_INO, b"dst", 0o644, 0, ME).unwrap();
    let len = data.len() as u64;
    assert_eq!(
        fs.copy_range(src, 0, dst.ino, fh, 0, len, None).unwrap(),
        len
    );
    fs.fsync().unwrap();
    fs.store().checkpoint().unwrap();
    fs.store().checkpoint().unwrap();
    assert!(fs.store().stats().range_clones_by_surgery > clones_before);
    let grown = fs.store().stats().node_region_used_bytes - used_before;
    assert!(
        grown < 2 << 20,
        "a clone of 6 MiB grew the node region by {grown} bytes"
    );
    assert_eq!(read_all(&fs, dst.ino), data);
    assert_eq!(fs.getattr(dst.ino).unwrap().size, len);
    assert_eq!(
        fs.seek_data_or_hole(dst.ino, 0, libc::SEEK_HOLE).unwrap(),
        2 << 20,
        "the hole came along"
    );

    // Writes into the clone, a truncate of the source and a punch into it.
    let mut copy = data.clone();
    fs.write(dst.ino, fh, 100_000, &[0xaa; 300_000], None)
        .unwrap();
    copy[100_000..400_000].fill(0xaa);
    fs.write(dst.ino, fh, (5 << 20) + 7, &[0xbb; 10], None)
        .unwrap();
    copy[(5 << 20) + 7..(5 << 20) + 17].fill(0xbb);
    set_size(&fs, src, 4 << 20);
    data.truncate(4 << 20);
    fs.fallocate(src, 0, 1 << 20, punch, None).unwrap();
    data[..1 << 20].fill(0);
    assert_eq!(read_all(&fs, dst.ino), copy);
    assert_eq!(read_all(&fs, src), data);

    // Not whole blocks at one offset: copied, same bytes.
    let (odd, odd_fh) = fs.create(ROOT_INO, b"odd", 0o644, 0, ME).unwrap();
    fs.write(odd.ino, odd_fh, 0, &[0x11; 5000], None).unwrap();
    let clones =
        fs.store().stats().range_clones_by_surgery + fs.store().stats().range_clones_copied;
    assert_eq!(
        fs.copy_range(dst.ino, 4096, odd.ino, odd_fh, 100, 3000, None)
            .unwrap(),
        3000
    );
    let mut odd_expect = vec![0x11; 5000];
    odd_expect[100..3100].copy_from_slice(&copy[4096..7096]);
    assert_eq!(read_all(&fs, odd.ino), odd_expect);
    assert_eq!(
        fs.store().stats().range_clones_by_surgery + fs.store().stats().range_clones_copied,
        clones,
        "other offsets are copied, not cloned"
    );
    fs.release(fh).unwrap();
    fs.release(odd_fh).unwrap();
    fs.fsync().unwrap();

    let fs = remount(&dev, fs);
    let src = fs.lookup(ROOT_INO, b"src").unwrap().ino;
    let dst = fs.lookup(ROOT_INO, b"dst").unwrap().ino;
    assert_eq!(read_all(&fs, src), data);
    assert_eq!(read_all(&fs, dst), copy);
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    // Removing both frees what they shared.
    fs.unlink(ROOT_INO, b"src").unwrap();
    fs.unlink(ROOT_INO, b"dst").unwrap();
    fs.fsync().unwrap();
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}

/// What a tree holds, by path: type and permission bits, owner, size,
/// times, link count, data (or a symlink's target) and xattrs, with the
/// inode number kept apart (a clone's differ).
type TreeView = std::collections::BTreeMap<
    Vec<u8>,
    (betreefs_fs::record::Attr, Vec<u8>, Vec<(Vec<u8>, Vec<u8>)>),
>;

fn tree_view(fs: &FileSystem, dir: u64) -> TreeView {
    fn walk(fs: &FileSystem, dir: u64, path: &[u8], out: &mut TreeView) {
        for name in names(fs, dir) {
            if name == b"." || name == b".." {
                continue;
            }
            let attr = fs.lookup(dir, &name).unwrap();
            let here = [path, b"/", &name].concat();
            let kind = attr.mode & libc::S_IFMT;
            let content = match kind {
                libc::S_IFREG => read_all(fs, attr.ino),
                libc::S_IFLNK => fs.readlink(attr.ino).unwrap(),
                _ => Vec::new(),
            };
            let xattrs = fs
                .listxattr(attr.ino)
                .unwrap()
                .split(|&b| b == 0)
                .filter(|n| !n.is_empty())
                .map(|n| (n.to_vec(), fs.getxattr(attr.ino, n).unwrap()))
                .collect();
            if kind == libc::S_IFDIR {
                walk(fs, attr.ino, &here, out);
            }
            out.insert(here, (attr, content, xattrs));
        }
    }
    let mut out = TreeView::new();
    walk(fs, dir, b"", &mut out);
    out
}

/// Two views with the same paths, contents and attributes but for what a
/// clone changes: inode numbers, change and birth times, and the link
/// count of files linked from outside the tree (given per path); access
/// times are left out (the walk itself reads the files).
fn assert_same_tree(a: &TreeView, b: &TreeView, nlink_b: &[(&[u8], u32)]) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (path, (attr_a, data_a, x_a)) in a {
        let (attr_b, data_b, x_b) = &b[path];
        let nlink = nlink_b
            .iter()
            .find(|(p, _)| *p == path.as_slice())
            .map_or(attr_a.nlink, |&(_, n)| n);
        let strip = |a: &betreefs_fs::record::Attr, nlink| betreefs_fs::record::Attr {
            ino: 0,
            ctime: Default::default(),
            crtime: Default::default(),
            // Reads move it (relatime: the clone's ctime is newer).
            atime: Default::default(),
            flags: a.flags & betreefs_fs::record::INODE_FLAGS,
            stored_blocks: None,
            nlink,
            ..a.clone()
        };
        let p = String::from_utf8_lossy(path);
        assert_eq!(strip(attr_a, nlink), strip(attr_b, attr_b.nlink), "{p}");
        assert!(data_a == data_b, "{p}: contents differ");
        assert_eq!(x_a, x_b, "{p}");
        assert_ne!(attr_a.ino, attr_b.ino, "{p}: the clone has its own inode");
    }
}

/// `betreefs clone`: a directory tree (subdirectories, small and large
/// files, hard links inside and out of it, a symlink, a fifo, xattrs, a
/// preallocated file) copied into an empty directory: same contents and
/// attributes, new inode numbers, data shared by one range clone, and
/// each side independent of the other after writes, through a remount,
/// with fsck clean throughout.
#[test]
fn clone_tree_copies_a_directory_tree_with_new_inodes() {
    const ROOT: Caller = Caller::new(0, 0);
    let (dev, fs) = fresh();
    let src = fs.mkdir(ROOT_INO, b"src", 0o755, ME).unwrap().ino;
    let a = fs.mkdir(src, b"a", 0o750, ME).unwrap().ino;
    let b = fs.mkdir(a, b"b", 0o755, ME).unwrap().ino;
    let c = fs.mkdir(src, b"c", 0o700, ME).unwrap().ino;
    let mut small = Vec::new();
    for i in 0..30u8 {
        small.push(write_file(&fs, a, format!("f{i}").as_bytes(), &[i; 3000]));
    }
    let big_data: Vec<u8> = (0..3 << 20).map(|i: u32| (i % 251) as u8).collect();
    let big = write_file(&fs, b, b"big", &big_data);
    fs.link(small[1], c, b"hard1").unwrap();
    fs.link(small[2], ROOT_INO, b"outside").unwrap();
    fs.symlink(c, b"sym", b"../a/f2", ME).unwrap();
    fs.mknod(c, b"fifo", libc::S_IFIFO | 0o644, 0, ME).unwrap();
    fs.setxattr(src, b"user.top", b"dir", 0).unwrap();
    fs.setxattr(small[3], b"user.x", b"hello", 0).unwrap();
    let (p, p_fh) = fs.create(src, b"prealloc", 0o600, 0, ME).unwrap();
    fs.fallocate(p.ino, 0, 64 << 10, 0, None).unwrap();
    fs.write(p.ino, p_fh, 8192, b"written", None).unwrap();
    fs.release(p_fh).unwrap();
    fs.fsync().unwrap();
    // Refused: not root, not empty, into itself, not a directory.
    let dst = fs.mkdir(ROOT_INO, b"dst", 0o700, ME).unwrap().ino;
    assert_eq!(fs.clone_tree_into(src, dst, ME), Err(Errno::EPERM));
    let full = fs.mkdir(ROOT_INO, b"full", 0o755, ME).unwrap().ino;
    write_file(&fs, full, b"x", b"x");
    assert_eq!(fs.clone_tree_into(src, full, ROOT), Err(Errno::ENOTEMPTY));
    let inner = fs.mkdir(b, b"inner", 0o755, ME).unwrap().ino;
    assert_eq!(fs.clone_tree_into(src, inner, ROOT), Err(Errno::EINVAL));
    fs.rmdir(b, b"inner").unwrap();
    assert_eq!(fs.clone_tree_into(big, dst, ROOT), Err(Errno::ENOTDIR));

    // The first walk moves directories' atimes (relatime); the second
    // sees what the clone will copy.
    tree_view(&fs, src);
    let before = tree_view(&fs, src);
    let promised_before = promised(&fs);
    let surgeries = fs.store().stats().range_clones_by_surgery;

    let attr = fs.clone_tree_into(src, dst, ROOT).unwrap();
    assert_eq!(attr.ino, dst);
    assert_eq!(attr.mode, fs.getattr(src).unwrap().mode);
    assert!(fs.store().stats().range_clones_by_surgery > surgeries);
    let dst_a = fs.lookup(dst, b"a").unwrap().ino;
    let (f5, dst_f5) = (
        fs.lookup(a, b"f5").unwrap(),
        fs.lookup(dst_a, b"f5").unwrap(),
    );
    assert_eq!((f5.atime, f5.mtime), (dst_f5.atime, dst_f5.mtime));
    assert!(dst_f5.ctime > f5.ctime);
    let outside_link: &[(&[u8], u32)] = &[(b"/a/f2", 1)];
    assert_same_tree(&before, &tree_view(&fs, dst), outside_link);
    assert_eq!(fs.getxattr(dst, b"user.top").unwrap(), b"dir");
    let hard = (
        fs.lookup(a, b"f1").unwrap(),
        fs.lookup(c, b"hard1").unwrap(),
    );
    assert_eq!(hard.0.ino, hard.1.ino);
    let dst_c = fs.lookup(dst, b"c").unwrap().ino;
    let cloned_hard = (
        fs.lookup(dst_a, b"f1").unwrap(),
        fs.lookup(dst_c, b"hard1").unwrap(),
    );
    assert_eq!(cloned_hard.0.ino, cloned_hard.1.ino, "links stay linked");
    assert_ne!(cloned_hard.0.ino, hard.0.ino);
    assert_eq!(cloned_hard.0.nlink, 2);
    // The clone holds no preallocation: nothing more is promised.
    assert_eq!(promised(&fs), promised_before);
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);

    // Independent: writes, unlinks and xattrs on either side.
    let dst_b = fs.lookup(dst_a, b"b").unwrap().ino;
    let dst_big = fs.lookup(dst_b, b"big").unwrap().ino;
    let fh = fs.open(dst_big, libc::O_RDWR, None).unwrap();
    fs.write(dst_big, fh, 1 << 20, &[0xee; 70_000], None)
        .unwrap();
    fs.release(fh).unwrap();
    let fh = fs.open(small[1], libc::O_RDWR, None).unwrap();
    fs.write(small[1], fh, 0, b"source only", None).unwrap();
    fs.release(fh).unwrap();
    fs.unlink(a, b"f4").unwrap();
    let dst_f3 = fs.lookup(dst_a, b"f3").unwrap().ino;
    fs.setxattr(dst_f3, b"user.x", b"clone only", 0).unwrap();
    let mut expected_big = big_data.clone();
    expected_big[1 << 20..(1 << 20) + 70_000].fill(0xee);
    let check = |fs: &FileSystem| {
        let (src, dst) = (
            fs.lookup(ROOT_INO, b"src").unwrap().ino,
            fs.lookup(ROOT_INO, b"dst").unwrap().ino,
        );
        let dst_a = fs.lookup(dst, b"a").unwrap().ino;
        let dst_b = fs.lookup(dst_a, b"b").unwrap().ino;
        let src_a = fs.lookup(src, b"a").unwrap().ino;
        let src_b = fs.lookup(src_a, b"b").unwrap().ino;
        assert_eq!(
            read_all(fs, fs.lookup(src_b, b"big").unwrap().ino),
            big_data
        );
        assert_eq!(
            read_all(fs, fs.lookup(dst_b, b"big").unwrap().ino),
            expected_big
        );
        let src_f1 = read_all(fs, fs.lookup(src_a, b"f1").unwrap().ino);
        assert_eq!(&src_f1[..11], b"source only");
        assert_eq!(
            read_all(fs, fs.lookup(dst_a, b"f1").unwrap().ino),
            [1; 3000]
        );
        assert_eq!(fs.lookup(src_a, b"f4").err(), Some(Errno::ENOENT));
        assert_eq!(
            read_all(fs, fs.lookup(dst_a, b"f4").unwrap().ino),
            [4; 3000]
        );
        let src_f3 = fs.lookup(src_a, b"f3").unwrap().ino;
        let dst_f3 = fs.lookup(dst_a, b"f3").unwrap().ino;
        assert_eq!(fs.getxattr(src_f3, b"user.x").unwrap(), b"hello");
        assert_eq!(fs.getxattr(dst_f3, b"user.x").unwrap(), b"clone only");
        let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
        assert!(report.is_clean(), "{:?}", report.problems);
    };
    check(&fs);
    fs.fsync().unwrap();
    let fs = remount(&dev, fs);
    check(&fs);
    fs.store().verify().unwrap();
}

/// A tree whose records do not fit in one log record is refused with
/// EFBIG before anything is written: the destination stays empty, the
/// image clean, and a smaller clone works afterwards.
#[test]
fn clone_tree_of_too_many_records_is_refused_whole() {
    const ROOT: Caller = Caller::new(0, 0);
    let dev = MemDevice::new(64 << 20);
    let small_log = Options {
        log_bytes: Some(1 << 20),
        ..options()
    };
    let store = Store::create_on(Arc::new(dev.clone()), small_log).unwrap();
    FileSystem::format(&store, ME).unwrap();
    let fs = FileSystem::mount(store, AtimePolicy::Relatime).unwrap();
    let big = fs.mkdir(ROOT_INO, b"big", 0o755, ME).unwrap().ino;
    for i in 0..2000 {
        let name = format!("a-file-with-a-name-of-some-length-{i:05}");
        fs.mknod(big, name.as_bytes(), libc::S_IFREG | 0o644, 0, ME)
            .unwrap();
    }
    let dst = fs.mkdir(ROOT_INO, b"dst", 0o755, ME).unwrap().ino;
    assert_eq!(fs.clone_tree_into(big, dst, ROOT), Err(Errno::EFBIG));
    assert_eq!(names(&fs, dst).len(), 2, "only . and ..");
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    let small = fs.mkdir(ROOT_INO, b"small", 0o755, ME).unwrap().ino;
    write_file(&fs, small, b"f", b"data");
    fs.clone_tree_into(small, dst, ROOT).unwrap();
    let f = fs.lookup(dst, b"f").unwrap().ino;
    assert_eq!(read_all(&fs, f), b"data");
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}

/// Plan, then commit: an operation the store refuses (ENOSPC on a full
/// device) leaves the inode table as it was — the attributes of every
/// inode it would have changed, and the inode numbers. A refused create
/// that carried the reservation of the next numbers must not keep that
/// reservation in memory only: the next file would get a number no
/// record reserves, and after a crash another file the same number.
#[test]
fn refused_operations_leave_the_inode_table_as_it_was() {
    let (dev, fs) = fresh();
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
    let f = write_file(&fs, d, b"f", b"data");
    let (filler, fh) = fs.create(ROOT_INO, b"filler", 0o644, 0, ME).unwrap();
    let (_, err) = fill(&fs, filler.ino, fh, 0, 1 << 30, 9);
    assert_eq!(err, Some(Errno(libc::ENOSPC)));
    fs.release(fh).unwrap();
    // After a mount the first new inode reserves the next numbers.
    let fs = remount(&dev, fs);
    assert_eq!(fs.lookup(ROOT_INO, b"d").unwrap().ino, d);
    assert_eq!(fs.lookup(d, b"f").unwrap().ino, f);
    let table = |fs: &FileSystem| [ROOT_INO, d, f].map(|i| fs.getattr(i).unwrap());
    let before = table(&fs);
    let enospc = Some(Errno(libc::ENOSPC));
    assert_eq!(fs.create(d, b"new", 0o644, 0, ME).err(), enospc);
    assert_eq!(fs.mkdir(d, b"sub", 0o755, ME).err(), enospc);
    assert_eq!(fs.symlink(ROOT_INO, b"s", b"target", ME).err(), enospc);
    let grow = SetAttr {
        size: Some(1 << 20),
        mode: Some(0o600),
        ..SetAttr::default()
    };
    assert_eq!(fs.setattr(f, &grow).err(), enospc);
    assert_eq!(fs.setxattr(f, b"user.a", &[7; 3000], 0).err(), enospc);
    let fh = fs.open(f, libc::O_WRONLY, None).unwrap();
    assert_eq!(fs.write(f, fh, 0, &[1; 8192], None).err(), enospc);
    fs.release(fh).unwrap();
    assert_eq!(table(&fs), before, "a refused operation changed the table");

    // Room again: the next file is numbered from the reservation on disk.
    fs.unlink(ROOT_INO, b"filler").unwrap();
    let made = fs.create(d, b"g", 0o644, 0, ME).unwrap();
    fs.release(made.1).unwrap();
    let g = made.0.ino;
    fs.fsync().unwrap();
    let crashed = MemDevice::from_image(dev.crash_image(betreefs_store::CrashMode::DropUnsynced));
    drop(fs);
    let store = Store::open_on(Arc::new(crashed), options()).unwrap();
    let fs = FileSystem::mount(store, AtimePolicy::Relatime).unwrap();
    assert_eq!(fs.lookup(ROOT_INO, b"d").unwrap().ino, d);
    assert_eq!(fs.lookup(d, b"g").unwrap().ino, g);
    // More files than the refused operations could have skipped numbers.
    for i in 0..16 {
        let name = format!("h{i}");
        let (attr, fh) = fs.create(d, name.as_bytes(), 0o644, 0, ME).unwrap();
        fs.release(fh).unwrap();
        assert_ne!(attr.ino, g, "{name} got the number of g after a crash");
    }
}

/// The stored key bound (`record::KeyBound`).
fn key_bound(fs: &FileSystem) -> usize {
    use betreefs_engine::KeySpace;
    let v = fs
        .store()
        .get(KeySpace::Meta, betreefs_fs::schema::KEY_BOUND_KEY)
        .unwrap()
        .expect("a key bound record");
    betreefs_fs::record::KeyBound::decode(&v).unwrap().0
}

/// A rename that lengthens a directory's keys is refused with
/// ENAMETOOLONG exactly when a key below it would pass the key limit,
/// whether the key bound answers or a walk does; the bound follows the
/// keys up, is found again once keys near the limit are gone, and fsck
/// checks it (and repairs one forged too low).
#[test]
fn renames_keep_every_key_within_the_limit() {
    let (dev, fs) = fresh();
    let component = [b'x'; 255];
    // A chain of directories as deep as the key limit allows, and in the
    // deepest a file whose key is exactly at the limit.
    let top = fs.mkdir(ROOT_INO, b"a", 0o755, ME).unwrap().ino;
    let mut chain = vec![(ROOT_INO, b"a".to_vec(), top)];
    loop {
        let parent = chain.last().unwrap().2;
        match fs.mkdir(parent, &component, 0o755, ME) {
            Ok(attr) => chain.push((parent, component.to_vec(), attr.ino)),
            Err(e) => {
                assert_eq!(e, Errno::ENAMETOOLONG);
                break;
            }
        }
    }
    let deepest = chain.last().unwrap().2;
    let mut name_len = 1;
    while name_len <= 255
        && fs
            .mknod(deepest, &vec![b'f'; name_len], 0o644, 0, ME)
            .is_ok()
    {
        name_len += 1;
    }
    assert!(
        name_len > 1 && name_len <= 255,
        "the limit falls inside a name"
    );
    let limit_bound = key_bound(&fs);
    // Lengthening by one byte passes the limit: refused, by the bound
    // or by a walk; the same length, or shorter, is fine.
    for longer in [&b"ab"[..], &[b'a'; 200]] {
        assert_eq!(
            fs.rename(ROOT_INO, b"a", ROOT_INO, longer, RenameFlags::default()),
            Err(Errno::ENAMETOOLONG)
        );
    }
    fs.rename(ROOT_INO, b"a", ROOT_INO, b"b", RenameFlags::default())
        .unwrap();
    // A shallow directory renamed longer: a walk says yes (the bound is
    // past the limit), and finds the bound again (still at the limit).
    let shallow = fs.mkdir(ROOT_INO, b"s", 0o755, ME).unwrap().ino;
    write_file(&fs, shallow, b"file", b"x");
    fs.rename(
        ROOT_INO,
        b"s",
        ROOT_INO,
        b"s-longer",
        RenameFlags::default(),
    )
    .unwrap();
    // Found again and grown by this rename's lengthening, conservatively.
    let found = key_bound(&fs);
    assert!(
        (limit_bound..=limit_bound + 64).contains(&found),
        "{found}: still held up by the long keys"
    );
    let fs = remount(&dev, fs);
    let store = fs.store();
    assert!(betreefs_fs::fsck::check(store, |_| {}).unwrap().is_clean());

    // The long keys gone, the next walk finds the bound again, low.
    let mut at = fs.lookup(ROOT_INO, b"b").unwrap().ino;
    let mut dirs = vec![(ROOT_INO, b"b".to_vec(), at)];
    while let Ok(attr) = fs.lookup(at, &component) {
        dirs.push((at, component.to_vec(), attr.ino));
        at = attr.ino;
    }
    for n in 1..name_len {
        fs.unlink(at, &vec![b'f'; n]).unwrap();
    }
    for (parent, name, _) in dirs.iter().rev() {
        fs.rmdir(*parent, name).unwrap();
    }
    fs.rename(
        ROOT_INO,
        b"s-longer",
        ROOT_INO,
        b"s-longer-still",
        RenameFlags::default(),
    )
    .unwrap();
    let low = key_bound(&fs);
    assert!(low < 1024, "bound {low} once the long keys are gone");
    // From now on the bound answers; it follows a lengthening rename up.
    let sub = fs.lookup(ROOT_INO, b"s-longer-still").unwrap().ino;
    let d = fs.mkdir(sub, &component, 0o755, ME).unwrap().ino;
    write_file(&fs, d, &component, b"y");
    let raised = key_bound(&fs);
    assert!(raised >= 2 * 256 + 14, "bound {raised}");
    fs.rename(
        ROOT_INO,
        b"s-longer-still",
        ROOT_INO,
        &[b's'; 255],
        RenameFlags::default(),
    )
    .unwrap();
    assert!(key_bound(&fs) >= raised + 255 - 14);
    let fs = remount(&dev, fs);
    assert!(betreefs_fs::fsck::check(fs.store(), |_| {})
        .unwrap()
        .is_clean());

    // A bound forged too low is a problem fsck finds and repairs.
    use betreefs_engine::KeySpace;
    let forged = betreefs_fs::record::KeyBound(256).encode();
    fs.store()
        .put(KeySpace::Meta, betreefs_fs::schema::KEY_BOUND_KEY, &forged)
        .unwrap();
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(!report.is_clean());
    betreefs_fs::fsck::repair(fs.store(), &report).unwrap();
    assert!(betreefs_fs::fsck::check(fs.store(), |_| {})
        .unwrap()
        .is_clean());
    assert!(key_bound(&fs) >= 3 * 256);
}

/// A damaged key bound record refuses the mount, naming the repair;
/// fsck finds it and `--repair` writes the bound again, after which the
/// file system mounts with its files.
#[test]
fn a_damaged_key_bound_is_refused_and_repaired() {
    use betreefs_engine::KeySpace;
    let (dev, fs) = fresh();
    write_file(&fs, ROOT_INO, b"f", b"kept");
    fs.store()
        .put(
            KeySpace::Meta,
            betreefs_fs::schema::KEY_BOUND_KEY,
            b"\x01bad",
        )
        .unwrap();
    fs.close().unwrap();
    let store = Store::open_on(Arc::new(dev.clone()), options()).unwrap();
    let refused = FileSystem::mount(store, AtimePolicy::Relatime).err();
    let message = refused.expect("a damaged key bound refuses the mount");
    assert!(
        message.contains("key bound") && message.contains("fsck --repair"),
        "{message}"
    );
    let store = Store::open_on(Arc::new(dev.clone()), options()).unwrap();
    let report = betreefs_fs::fsck::check(&store, |_| {}).unwrap();
    assert!(!report.is_clean());
    betreefs_fs::fsck::repair(&store, &report).unwrap();
    assert!(betreefs_fs::fsck::check(&store, |_| {}).unwrap().is_clean());
    store.close().unwrap();
    let fs = common::mount_fs(&dev, &options(), "reopening");
    assert_eq!(key_bound(&fs), 256);
    let f = fs.lookup(ROOT_INO, b"f").unwrap().ino;
    assert_eq!(read_all(&fs, f), b"kept");
}
