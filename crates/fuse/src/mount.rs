//! Mounting: a `/dev/fuse` connection and the kernel mount that uses it.
//! As root the mount is made directly with mount(2); otherwise through
//! the setuid `fusermount3`, which mounts and hands back the connection's
//! descriptor over a socket (`_FUSE_COMMFD`), as libfuse does.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Kernel mount flags a user can ask for (`-o ro,nosuid,...`). Like a
/// kernel file system, a mount made as root has set-ID bits and device
/// nodes working unless `nosuid`/`nodev` are given; `fusermount3` (a
/// mount made by another user) always adds both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MountFlags {
    pub read_only: bool,
    pub nosuid: bool,
    pub nodev: bool,
    pub noexec: bool,
    pub noatime: bool,
    pub nodiratime: bool,
    pub sync: bool,
    pub dirsync: bool,
    pub lazytime: bool,
}

impl MountFlags {
    /// The `MS_*` bits for mount(2).
    fn ms_flags(&self) -> libc::c_ulong {
        let mut f = 0;
        for (on, bit) in [
            (self.read_only, libc::MS_RDONLY),
            (self.nosuid, libc::MS_NOSUID),
            (self.nodev, libc::MS_NODEV),
            (self.noexec, libc::MS_NOEXEC),
            (self.noatime, libc::MS_NOATIME),
            (self.nodiratime, libc::MS_NODIRATIME),
            (self.sync, libc::MS_SYNCHRONOUS),
            (self.dirsync, libc::MS_DIRSYNC),
            (self.lazytime, libc::MS_LAZYTIME),
        ] {
            if on {
                f |= bit;
            }
        }
        f
    }

    /// Changes the flags of the mount on `mountpoint` (mount(2) with
    /// `MS_REMOUNT`): the kernel refuses writes at once when `read_only`.
    /// Root only; the daemon is told separately.
    pub fn remount(&self, mountpoint: &Path) -> io::Result<()> {
        let target = cstring(mountpoint.as_os_str().as_encoded_bytes(), "the mountpoint")?;
        // SAFETY: valid NUL-terminated target; no source, type or data
        // (a FUSE remount takes no options through the old API).
        let r = unsafe {
            libc::mount(
                std::ptr::null(),
                target.as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT | self.ms_flags(),
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The same as `fusermount3 -o` words.
    fn words(&self) -> Vec<&'static str> {
        let mut w = vec![if self.read_only { "ro" } else { "rw" }];
        for (on, word) in [
            (self.nosuid, "nosuid"),
            (self.nodev, "nodev"),
            (self.noexec, "noexec"),
            (self.noatime, "noatime"),
            (self.nodiratime, "nodiratime"),
            (self.sync, "sync"),
            (self.dirsync, "dirsync"),
            (self.lazytime, "lazytime"),
        ] {
            if on {
                w.push(word);
            }
        }
        w
    }
}

/// What the kernel mount is made of.
pub struct MountRequest<'a> {
    pub mountpoint: &'a Path,
    /// Shown as the mount's source (the image path).
    pub fs_name: &'a str,
    /// The mount shows as `fuse.<subtype>`.
    pub subtype: &'a str,
    pub allow_other: bool,
    pub flags: MountFlags,
}

fn cstring(bytes: &[u8], what: &str) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what} contains a NUL byte"),
        )
    })
}

/// An option value for fusermount3, with the option separator (and the
/// escape character itself) escaped by a backslash, which it undoes.
fn escape_option(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c == ',' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Opens `/dev/fuse` and mounts it on the mountpoint; returns the
/// connection.
pub fn mount(req: &MountRequest<'_>) -> io::Result<OwnedFd> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        mount_directly(req)
    } else {
        mount_with_fusermount(req)
    }
}

fn mount_directly(req: &MountRequest<'_>) -> io::Result<OwnedFd> {
    let dev = cstring(b"/dev/fuse", "path")?;
    // SAFETY: dev is a valid NUL-terminated path.
    let raw = unsafe { libc::open(dev.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("opening /dev/fuse: {e} (is the fuse module loaded?)"),
        ));
    }
    // SAFETY: raw was just opened and is owned only here.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: getuid/getgid have no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let mut data = format!(
        "fd={},rootmode=40000,user_id={uid},group_id={gid},default_permissions",
        fd.as_raw_fd()
    );
    if req.allow_other {
        data.push_str(",allow_other");
    }
    let source = cstring(req.fs_name.as_bytes(), "the source")?;
    let target = cstring(req.mountpoint.as_os_str().as_bytes(), "the mountpoint")?;
    let fstype = cstring(format!("fuse.{}", req.subtype).as_bytes(), "the type")?;
    let data = cstring(data.as_bytes(), "the options")?;
    // SAFETY: all four strings are valid and NUL-terminated; data is the
    // option string the fuse file system parses.
    let r = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            req.flags.ms_flags(),
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Mounts through `fusermount3`, which sends the connection back over a
/// socket pair (the descriptor named by `_FUSE_COMMFD`).
fn mount_with_fusermount(req: &MountRequest<'_>) -> io::Result<OwnedFd> {
    let (ours, theirs) = UnixStream::pair()?;
    // The child must inherit its end: clear close-on-exec on it.
    clear_cloexec(theirs.as_raw_fd())?;
    let mut options = vec![
        format!("fsname={}", escape_option(req.fs_name)),
        format!("subtype={}", escape_option(req.subtype)),
        "default_permissions".to_string(),
    ];
    if req.allow_other {
        options.push("allow_other".to_string());
    }
    options.extend(req.flags.words().iter().map(|w| w.to_string()));
    let status = Command::new("fusermount3")
        .arg("-o")
        .arg(options.join(","))
        .arg("--")
        .arg(req.mountpoint)
        .env("_FUSE_COMMFD", theirs.as_raw_fd().to_string())
        .status()
        .map_err(|e| io::Error::new(e.kind(), format!("running fusermount3: {e}")))?;
    drop(theirs);
    if !status.success() {
        return Err(io::Error::other(format!(
            "fusermount3 could not mount {} ({status})",
            req.mountpoint.display()
        )));
    }
    receive_fd(&ours)
}

fn clear_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Receives one descriptor sent with SCM_RIGHTS.
fn receive_fd(sock: &UnixStream) -> io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // Room for one cmsghdr carrying one int, 8-byte aligned.
    let mut control = [0u64; 8];
    // SAFETY: msghdr is plain data; every pointer set below points into
    // live locals that outlive the recvmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: msg describes valid buffers (above).
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: CMSG_FIRSTHDR reads the msghdr recvmsg filled in.
    let cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    if cmsg.is_null() {
        return Err(io::Error::other("fusermount3 sent no descriptor"));
    }
    // SAFETY: cmsg points into `control`, filled by the kernel.
    let (level, kind) = unsafe { ((*cmsg).cmsg_level, (*cmsg).cmsg_type) };
    if level != libc::SOL_SOCKET || kind != libc::SCM_RIGHTS {
        return Err(io::Error::other("fusermount3 sent something else"));
    }
    // SAFETY: an SCM_RIGHTS message carries at least one int; read it
    // unaligned from the message's data.
    let fd: RawFd = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast()) };
    // SAFETY: the descriptor was just received and is owned only here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Detaches a mount (lazily: it goes once nothing uses it), as root with
/// umount2, otherwise with `fusermount3 -u -z`.
pub fn unmount(mountpoint: &Path) -> io::Result<()> {
    let path = cstring(mountpoint.as_os_str().as_bytes(), "the mountpoint")?;
    // SAFETY: path is a valid NUL-terminated string.
    if unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) } == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EPERM) {
        return Err(err);
    }
    let status = Command::new("fusermount3")
        .args([OsStr::new("-u"), OsStr::new("-z"), mountpoint.as_os_str()])
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "fusermount3 -u {} failed ({status})",
            mountpoint.display()
        )))
    }
}

/// One mount of this process's namespace, from /proc/self/mountinfo.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    /// The device number (for FUSE, the connection's: it names its
    /// directory under fusectl).
    pub dev: u64,
    pub mountpoint: PathBuf,
    /// The type, as `fuse.betreefs`.
    pub fstype: String,
    pub source: String,
}

/// The mounts of this process's namespace, oldest first. Reading them
/// sends no request to any file system.
pub fn mounts() -> Vec<MountEntry> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|line| {
            // id parent major:minor root mountpoint options [optional...] - type source super
            let (left, right) = line.split_once(" - ")?;
            let mut fields = left.split(' ');
            let (major, minor) = fields.nth(2)?.split_once(':')?;
            let mountpoint = fields.nth(1)?;
            let mut rest = right.split(' ');
            let (fstype, source) = (rest.next()?, rest.next()?);
            Some(MountEntry {
                dev: libc::makedev(major.parse().ok()?, minor.parse().ok()?),
                mountpoint: PathBuf::from(OsStr::from_bytes(&unescape_mountinfo(mountpoint))),
                fstype: fstype.to_string(),
                source: String::from_utf8_lossy(&unescape_mountinfo(source)).into_owned(),
            })
        })
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape_mountinfo(field: &str) -> Vec<u8> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| b == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(&[a, b, c]) => {
                out.push((a - b'0') * 64 + (b - b'0') * 8 + (c - b'0'));
                i += 4;
            }
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

/// The FUSE connection mounted on `mountpoint` (the newest mount there).
pub fn connection_id(mountpoint: &Path) -> Option<u64> {
    mounts()
        .into_iter()
        .rfind(|m| m.mountpoint == mountpoint)
        .map(|m| m.dev)
}

/// Aborts FUSE connection `id` (fusectl's `abort`): every request waiting
/// on it ends with an error, and so does every later one. fusectl is
/// mounted first if it is not (root only).
pub fn abort_connection(id: u64) -> io::Result<()> {
    let root = Path::new("/sys/fs/fuse/connections");
    let knob = root.join(id.to_string()).join("abort");
    if !knob.exists() {
        let (source, target) = (c"fusectl", c"/sys/fs/fuse/connections");
        // SAFETY: valid NUL-terminated strings; no data argument.
        let r = unsafe {
            libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                source.as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if r != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EBUSY) {
                return Err(io::Error::other(format!("mounting fusectl: {e}")));
            }
        }
    }
    std::fs::write(&knob, b"1").map_err(|e| io::Error::other(format!("{}: {e}", knob.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo(r"/srv/my\040image"), b"/srv/my image");
        assert_eq!(unescape_mountinfo(r"a\134b"), br"a\b");
        assert_eq!(unescape_mountinfo(r"trailing\04"), br"trailing\04");
        assert_eq!(
            connection_id(Path::new("/proc")).map(|d| libc::major(d)),
            Some(0),
            "procfs is an anonymous device"
        );
    }

    #[test]
    fn flags_map_to_mount_bits_and_words() {
        let f = MountFlags {
            read_only: true,
            nodev: true,
            noatime: true,
            ..MountFlags::default()
        };
        assert_eq!(
            f.ms_flags(),
            libc::MS_RDONLY | libc::MS_NODEV | libc::MS_NOATIME
        );
        assert_eq!(f.words(), ["ro", "nodev", "noatime"]);
        assert_eq!(MountFlags::default().ms_flags(), 0);
        assert_eq!(MountFlags::default().words(), ["rw"]);
        assert_eq!(escape_option(r"/a b,c\d"), r"/a b\,c\\d");
    }
}
