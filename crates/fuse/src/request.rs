//! Requests as the kernel sends them, parsed into typed operations that
//! borrow names and data from the request buffer. Layouts are those of
//! `include/uapi/linux/fuse.h` (see [`crate::abi`]).

use crate::abi::{opcode, InHeader, Reader, Truncated, GETATTR_FH, IN_HEADER_BYTES};

/// `struct fuse_setattr_in`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SetattrIn {
    pub valid: u32,
    pub fh: u64,
    pub size: u64,
    pub atime: (i64, u32),
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// `struct fuse_init_in`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InitIn {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    /// `flags | flags2 << 32` (flags2 only with `INIT_EXT`).
    pub flags: u64,
}

/// One operation and its arguments.
#[derive(Debug, PartialEq, Eq)]
pub enum Op<'a> {
    Init(InitIn),
    Destroy,
    Lookup {
        name: &'a [u8],
    },
    Forget {
        nlookup: u64,
    },
    BatchForget {
        /// (nodeid, nlookup) pairs.
        forgets: Vec<(u64, u64)>,
    },
    Getattr {
        fh: Option<u64>,
    },
    Setattr(SetattrIn),
    Readlink,
    Symlink {
        name: &'a [u8],
        target: &'a [u8],
    },
    Mknod {
        mode: u32,
        rdev: u32,
        umask: u32,
        name: &'a [u8],
    },
    Mkdir {
        mode: u32,
        umask: u32,
        name: &'a [u8],
    },
    Unlink {
        name: &'a [u8],
    },
    Rmdir {
        name: &'a [u8],
    },
    Rename {
        newdir: u64,
        flags: u32,
        name: &'a [u8],
        newname: &'a [u8],
    },
    Link {
        oldnodeid: u64,
        name: &'a [u8],
    },
    Open {
        flags: u32,
        open_flags: u32,
    },
    Create {
        flags: u32,
        mode: u32,
        umask: u32,
        open_flags: u32,
        name: &'a [u8],
    },
    Read {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Write {
        fh: u64,
        offset: u64,
        write_flags: u32,
        data: &'a [u8],
    },
    Statfs,
    Release {
        fh: u64,
    },
    Flush {
        fh: u64,
    },
    Fsync {
        fh: u64,
        datasync: bool,
    },
    Setxattr {
        flags: u32,
        setxattr_flags: u32,
        name: &'a [u8],
        value: &'a [u8],
    },
    Getxattr {
        size: u32,
        name: &'a [u8],
    },
    Listxattr {
        size: u32,
    },
    Removexattr {
        name: &'a [u8],
    },
    Opendir {
        flags: u32,
    },
    Readdir {
        fh: u64,
        offset: u64,
        size: u32,
        plus: bool,
    },
    Releasedir {
        fh: u64,
    },
    Fsyncdir {
        fh: u64,
        datasync: bool,
    },
    Access {
        mask: u32,
    },
    Interrupt {
        unique: u64,
    },
    Fallocate {
        fh: u64,
        offset: u64,
        length: u64,
        mode: u32,
    },
    Lseek {
        fh: u64,
        offset: u64,
        whence: u32,
    },
    CopyFileRange {
        fh_in: u64,
        off_in: u64,
        nodeid_out: u64,
        fh_out: u64,
        off_out: u64,
        len: u64,
        flags: u64,
    },
    Syncfs,
    /// open(2) with O_TMPFILE in directory `nodeid` (`fuse_create_in`).
    Tmpfile {
        flags: u32,
        mode: u32,
        umask: u32,
    },
    /// `fuse_ioctl_in` and the bytes the caller passes in.
    Ioctl {
        fh: u64,
        flags: u32,
        cmd: u32,
        out_size: u32,
        input: &'a [u8],
    },
    Statx {
        fh: Option<u64>,
        flags: u32,
        mask: u32,
    },
    /// An opcode this front end does not implement: answered ENOSYS.
    Unsupported(u32),
}

/// A parsed request: its header and its operation.
#[derive(Debug)]
pub struct Request<'a> {
    pub header: InHeader,
    pub op: Op<'a>,
}

impl<'a> Request<'a> {
    /// Parses a request read from `/dev/fuse`: the header, then the
    /// opcode's argument struct, then its names and data. Extensions after
    /// them (`total_extlen`) are cut off first.
    pub fn parse(buf: &'a [u8]) -> Result<Request<'a>, Truncated> {
        let mut r = Reader::new(buf);
        let header = InHeader::parse(&mut r)?;
        let len = (header.len as usize)
            .min(buf.len())
            .saturating_sub(header.total_extlen as usize * 8);
        let body = buf.get(IN_HEADER_BYTES..len).ok_or(Truncated)?;
        let split = match header.opcode {
            // INIT grew over the versions: all of it is the argument.
            opcode::INIT => body.len(),
            op => arg_size(op),
        };
        let args = body.get(..split).ok_or(Truncated)?;
        let payload = body.get(split..).ok_or(Truncated)?;
        let op = parse_op(header.opcode, args, payload)?;
        Ok(Request { header, op })
    }

    /// Parses a request delivered through an io_uring entry: the header,
    /// the argument struct (the first [`arg_size`] bytes of the entry's
    /// `op_in`), and the payload (names, data; extensions last).
    pub fn parse_parts(
        header: &'a [u8],
        op_in: &'a [u8],
        payload: &'a [u8],
    ) -> Result<Request<'a>, Truncated> {
        let header = InHeader::parse(&mut Reader::new(header))?;
        let ext = header.total_extlen as usize * 8;
        let payload = payload
            .get(..payload.len().saturating_sub(ext))
            .ok_or(Truncated)?;
        let args = op_in.get(..arg_size(header.opcode)).ok_or(Truncated)?;
        let op = parse_op(header.opcode, args, payload)?;
        Ok(Request { header, op })
    }
}

/// The size of an opcode's fixed argument struct (`fuse_*_in`), which
/// precedes its names and data; 0 for opcodes that have none (and for
/// opcodes this front end does not know). SETXATTR is the extended layout
/// that `SETXATTR_EXT` asks for.
pub fn arg_size(op: u32) -> usize {
    match op {
        opcode::FORGET
        | opcode::MKDIR
        | opcode::RENAME
        | opcode::LINK
        | opcode::OPEN
        | opcode::OPENDIR
        | opcode::GETXATTR
        | opcode::LISTXATTR
        | opcode::ACCESS
        | opcode::INTERRUPT
        | opcode::BATCH_FORGET
        | opcode::SYNCFS => 8,
        opcode::GETATTR
        | opcode::MKNOD
        | opcode::FSYNC
        | opcode::FSYNCDIR
        | opcode::SETXATTR
        | opcode::CREATE
        | opcode::TMPFILE
        | opcode::BMAP
        | opcode::RENAME2 => 16,
        opcode::RELEASE
        | opcode::RELEASEDIR
        | opcode::FLUSH
        | opcode::POLL
        | opcode::LSEEK
        | opcode::STATX => 24,
        opcode::FALLOCATE | opcode::IOCTL => 32,
        opcode::READ | opcode::WRITE | opcode::READDIR | opcode::READDIRPLUS => 40,
        opcode::GETLK | opcode::SETLK | opcode::SETLKW => 48,
        opcode::COPY_FILE_RANGE => 56,
        opcode::INIT => 64,
        opcode::SETATTR => 88,
        _ => 0,
    }
}

fn timespec(r: &mut Reader<'_>) -> Result<i64, Truncated> {
    r.u64().map(|v| v as i64)
}

/// Builds the operation from its argument struct (`a`) and its names and
/// data (`p`).
fn parse_op<'a>(opcode: u32, args: &'a [u8], payload: &'a [u8]) -> Result<Op<'a>, Truncated> {
    let (mut a, mut p) = (Reader::new(args), Reader::new(payload));
    let (r, p) = (&mut a, &mut p);
    Ok(match opcode {
        opcode::INIT => {
            let (major, minor, max_readahead, flags) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
            // flags2 exists from 7.36 (FUSE_INIT_EXT); older kernels send less.
            let flags2 = r.u32().unwrap_or(0);
            let ext = u64::from(flags) & crate::abi::init::INIT_EXT != 0;
            Op::Init(InitIn {
                major,
                minor,
                max_readahead,
                flags: u64::from(flags) | if ext { u64::from(flags2) << 32 } else { 0 },
            })
        }
        opcode::DESTROY => Op::Destroy,
        opcode::LOOKUP => Op::Lookup { name: p.name()? },
        opcode::FORGET => Op::Forget { nlookup: r.u64()? },
        opcode::BATCH_FORGET => {
            let count = r.u32()?;
            let mut forgets = Vec::with_capacity((count as usize).min(payload.len() / 16));
            for _ in 0..count {
                forgets.push((p.u64()?, p.u64()?));
            }
            Op::BatchForget { forgets }
        }
        opcode::GETATTR => {
            let flags = r.u32()?;
            r.skip(4)?;
            let fh = r.u64()?;
            Op::Getattr {
                fh: (flags & GETATTR_FH != 0).then_some(fh),
            }
        }
        opcode::SETATTR => {
            let valid = r.u32()?;
            r.skip(4)?;
            let fh = r.u64()?;
            let size = r.u64()?;
            let _lock_owner = r.u64()?;
            let (atime, mtime, ctime) = (timespec(r)?, timespec(r)?, timespec(r)?);
            let (atimensec, mtimensec, ctimensec) = (r.u32()?, r.u32()?, r.u32()?);
            let mode = r.u32()?;
            r.skip(4)?;
            let (uid, gid) = (r.u32()?, r.u32()?);
            Op::Setattr(SetattrIn {
                valid,
                fh,
                size,
                atime: (atime, atimensec),
                mtime: (mtime, mtimensec),
                ctime: (ctime, ctimensec),
                mode,
                uid,
                gid,
            })
        }
        opcode::READLINK => Op::Readlink,
        opcode::SYMLINK => Op::Symlink {
            name: p.name()?,
            target: p.name()?,
        },
        opcode::MKNOD => {
            let (mode, rdev, umask) = (r.u32()?, r.u32()?, r.u32()?);
            Op::Mknod {
                mode,
                rdev,
                umask,
                name: p.name()?,
            }
        }
        opcode::MKDIR => Op::Mkdir {
            mode: r.u32()?,
            umask: r.u32()?,
            name: p.name()?,
        },
        opcode::UNLINK => Op::Unlink { name: p.name()? },
        opcode::RMDIR => Op::Rmdir { name: p.name()? },
        opcode::RENAME | opcode::RENAME2 => {
            let newdir = r.u64()?;
            let flags = if opcode == opcode::RENAME2 {
                r.u32()?
            } else {
                0
            };
            Op::Rename {
                newdir,
                flags,
                name: p.name()?,
                newname: p.name()?,
            }
        }
        opcode::LINK => Op::Link {
            oldnodeid: r.u64()?,
            name: p.name()?,
        },
        opcode::OPEN => Op::Open {
            flags: r.u32()?,
            open_flags: r.u32()?,
        },
        opcode::OPENDIR => Op::Opendir { flags: r.u32()? },
        opcode::CREATE => Op::Create {
            flags: r.u32()?,
            mode: r.u32()?,
            umask: r.u32()?,
            open_flags: r.u32()?,
            name: p.name()?,
        },
        opcode::READ | opcode::READDIR | opcode::READDIRPLUS => {
            let (fh, offset, size) = (r.u64()?, r.u64()?, r.u32()?);
            match opcode {
                opcode::READ => Op::Read { fh, offset, size },
                _ => Op::Readdir {
                    fh,
                    offset,
                    size,
                    plus: opcode == opcode::READDIRPLUS,
                },
            }
        }
        opcode::WRITE => {
            let (fh, offset, size, write_flags) = (r.u64()?, r.u64()?, r.u32()?, r.u32()?);
            Op::Write {
                fh,
                offset,
                write_flags,
                data: p.bytes(size as usize)?,
            }
        }
        opcode::STATFS => Op::Statfs,
        opcode::RELEASE => Op::Release { fh: r.u64()? },
        opcode::RELEASEDIR => Op::Releasedir { fh: r.u64()? },
        opcode::FLUSH => Op::Flush { fh: r.u64()? },
        opcode::FSYNC | opcode::FSYNCDIR => {
            let (fh, flags) = (r.u64()?, r.u32()?);
            let datasync = flags & crate::abi::FSYNC_FDATASYNC != 0;
            if opcode == opcode::FSYNC {
                Op::Fsync { fh, datasync }
            } else {
                Op::Fsyncdir { fh, datasync }
            }
        }
        opcode::SETXATTR => {
            let (size, flags, setxattr_flags) = (r.u32()?, r.u32()?, r.u32()?);
            Op::Setxattr {
                flags,
                setxattr_flags,
                name: p.name()?,
                value: p.bytes(size as usize)?,
            }
        }
        opcode::GETXATTR => Op::Getxattr {
            size: r.u32()?,
            name: p.name()?,
        },
        opcode::LISTXATTR => Op::Listxattr { size: r.u32()? },
        opcode::REMOVEXATTR => Op::Removexattr { name: p.name()? },
        opcode::ACCESS => Op::Access { mask: r.u32()? },
        opcode::INTERRUPT => Op::Interrupt { unique: r.u64()? },
        opcode::FALLOCATE => Op::Fallocate {
            fh: r.u64()?,
            offset: r.u64()?,
            length: r.u64()?,
            mode: r.u32()?,
        },
        opcode::LSEEK => Op::Lseek {
            fh: r.u64()?,
            offset: r.u64()?,
            whence: r.u32()?,
        },
        opcode::COPY_FILE_RANGE => Op::CopyFileRange {
            fh_in: r.u64()?,
            off_in: r.u64()?,
            nodeid_out: r.u64()?,
            fh_out: r.u64()?,
            off_out: r.u64()?,
            len: r.u64()?,
            flags: r.u64()?,
        },
        opcode::SYNCFS => Op::Syncfs,
        opcode::TMPFILE => {
            let (flags, mode, umask) = (r.u32()?, r.u32()?, r.u32()?);
            Op::Tmpfile { flags, mode, umask }
        }
        opcode::IOCTL => {
            let (fh, flags, cmd) = (r.u64()?, r.u32()?, r.u32()?);
            let (_arg, in_size, out_size) = (r.u64()?, r.u32()?, r.u32()?);
            Op::Ioctl {
                fh,
                flags,
                cmd,
                out_size,
                input: p.bytes(in_size as usize)?,
            }
        }
        opcode::STATX => {
            let getattr_flags = r.u32()?;
            r.skip(4)?;
            let fh = r.u64()?;
            Op::Statx {
                fh: (getattr_flags & GETATTR_FH != 0).then_some(fh),
                flags: r.u32()?,
                mask: r.u32()?,
            }
        }
        other => Op::Unsupported(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::Writer;

    fn request(opcode: u32, body: &[u8]) -> Vec<u8> {
        let mut w = Writer::default();
        let len = (IN_HEADER_BYTES + body.len()) as u32;
        w.u32(len)
            .u32(opcode)
            .u64(7)
            .u64(1)
            .u32(0)
            .u32(0)
            .u32(0)
            .u16(0)
            .u16(0);
        w.bytes(body);
        w.buf
    }

    #[test]
    fn parses_names_and_data() {
        let buf = request(opcode::LOOKUP, b"name\0");
        let r = Request::parse(&buf).unwrap();
        assert_eq!(r.header.unique, 7);
        assert_eq!(r.op, Op::Lookup { name: b"name" });
        let mut body = Writer::default();
        body.u64(3)
            .u64(4096)
            .u32(5)
            .u32(0)
            .u64(0)
            .u32(0)
            .u32(0)
            .bytes(b"hello");
        let buf = request(opcode::WRITE, &body.buf);
        assert_eq!(
            Request::parse(&buf).unwrap().op,
            Op::Write {
                fh: 3,
                offset: 4096,
                write_flags: 0,
                data: b"hello"
            }
        );
        let mut body = Writer::default();
        body.u64(9).u32(1).u32(0).bytes(b"a\0b\0");
        let buf = request(opcode::RENAME2, &body.buf);
        assert_eq!(
            Request::parse(&buf).unwrap().op,
            Op::Rename {
                newdir: 9,
                flags: 1,
                name: b"a",
                newname: b"b"
            }
        );
    }

    #[test]
    fn short_or_odd_requests_are_errors_not_panics() {
        for op in 0..60 {
            for len in 0..80 {
                let mut buf = request(op, &vec![0xffu8; len]);
                let _ = Request::parse(&buf);
                buf.truncate(buf.len() / 2);
                let _ = Request::parse(&buf);
            }
        }
        assert!(Request::parse(&request(opcode::LOOKUP, b"no nul")).is_err());
        assert!(Request::parse(&[0; 10]).is_err());
    }
}
