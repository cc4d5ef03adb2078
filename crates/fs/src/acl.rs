//! POSIX ACLs, as the kernel hands them to a FUSE file system that
//! negotiated `FUSE_POSIX_ACL`: the kernel enforces them (permission
//! checks read `system.posix_acl_access` through GETXATTR and cache it),
//! and the file system keeps them consistent with the mode, as a local
//! file system's `posix_acl_*` helpers do:
//! - setting an access ACL sets the mode's permission bits from it (group
//!   bits from the mask when there is one), and an ACL the mode says
//!   exactly is not stored at all;
//! - chmod rewrites the owner, mask (or owning group) and other entries;
//! - a new file or directory under a directory with a default ACL gets
//!   that ACL masked by the requested mode (the umask is ignored), a new
//!   directory also inherits the default ACL itself; without one, the
//!   umask applies.
//!
//! The stored form is the kernel's xattr form, byte for byte (what
//! getfacl reads back):
//!
//! ```text
//! u32 version = 2                      (little-endian, as every field)
//! entries, sorted by tag then id:
//!   u16 tag    USER_OBJ 0x01, USER 0x02, GROUP_OBJ 0x04, GROUP 0x08,
//!              MASK 0x10, OTHER 0x20
//!   u16 perm   r 4, w 2, x 1
//!   u32 id     uid for USER, gid for GROUP, unused (u32::MAX) otherwise
//! ```

use crate::error::{Errno, FsResult};

/// The access ACL's extended attribute.
pub const ACCESS_XATTR: &[u8] = b"system.posix_acl_access";
/// A directory's default ACL.
pub const DEFAULT_XATTR: &[u8] = b"system.posix_acl_default";

const VERSION: u32 = 2;
const HEADER_BYTES: usize = 4;
const ENTRY_BYTES: usize = 8;
/// Entries at most (what fits in a 64 KiB xattr value).
const MAX_ENTRIES: usize = (crate::fs::XATTR_SIZE_MAX - HEADER_BYTES) / ENTRY_BYTES;

pub const USER_OBJ: u16 = 0x01;
pub const USER: u16 = 0x02;
pub const GROUP_OBJ: u16 = 0x04;
pub const GROUP: u16 = 0x08;
pub const MASK: u16 = 0x10;
pub const OTHER: u16 = 0x20;
const UNDEFINED_ID: u32 = u32::MAX;

const S_IRWXU: u32 = 0o700;
const S_IRWXG: u32 = 0o070;
const S_IRWXO: u32 = 0o007;
const S_IRWXUGO: u32 = 0o777;

/// One entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AclEntry {
    pub tag: u16,
    pub perm: u16,
    pub id: u32,
}

/// A checked ACL: sorted, one USER_OBJ, GROUP_OBJ and OTHER, a MASK
/// exactly when there are named entries, no duplicate names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acl {
    entries: Vec<AclEntry>,
}

impl Acl {
    /// Decodes and checks the xattr form (EINVAL when it is not a valid
    /// ACL, as the kernel's `posix_acl_valid` would say).
    pub fn decode(bytes: &[u8]) -> FsResult<Acl> {
        let (header, body) = bytes.split_at_checked(HEADER_BYTES).ok_or(Errno::EINVAL)?;
        let version = u32::from_le_bytes(header.try_into().map_err(|_| Errno::EINVAL)?);
        if version != VERSION || body.len() % ENTRY_BYTES != 0 {
            return Err(Errno::EINVAL);
        }
        let entries: Vec<AclEntry> = body
            .chunks_exact(ENTRY_BYTES)
            .map(|c| {
                let field = |at: usize, len: usize| {
                    c.get(at..at + len)
                        .into_iter()
                        .flatten()
                        .rev()
                        .fold(0u32, |v, &b| v << 8 | u32::from(b))
                };
                AclEntry {
                    tag: field(0, 2) as u16,
                    perm: field(2, 2) as u16,
                    id: field(4, 4),
                }
            })
            .collect();
        let acl = Acl { entries };
        acl.check()?;
        Ok(acl)
    }

    /// The xattr form.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_BYTES + self.entries.len() * ENTRY_BYTES);
        out.extend_from_slice(&VERSION.to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.tag.to_le_bytes());
            out.extend_from_slice(&e.perm.to_le_bytes());
            out.extend_from_slice(&e.id.to_le_bytes());
        }
        out
    }

    pub fn entries(&self) -> &[AclEntry] {
        &self.entries
    }

    fn check(&self) -> FsResult<()> {
        if self.entries.len() > MAX_ENTRIES {
            return Err(Errno::EINVAL);
        }
        let (mut user_obj, mut group_obj, mut other, mut mask, mut named) = (0, 0, 0, 0, 0);
        let mut previous: Option<(u16, u32)> = None;
        for e in &self.entries {
            if e.perm & !7 != 0 {
                return Err(Errno::EINVAL);
            }
            match e.tag {
                USER_OBJ => user_obj += 1,
                GROUP_OBJ => group_obj += 1,
                OTHER => other += 1,
                MASK => mask += 1,
                USER | GROUP => named += 1,
                _ => return Err(Errno::EINVAL),
            }
            let id = if matches!(e.tag, USER | GROUP) {
                e.id
            } else {
                0
            };
            // Sorted by tag, named entries by id, nothing twice.
            if previous.is_some_and(|p| p >= (e.tag, id)) {
                return Err(Errno::EINVAL);
            }
            previous = Some((e.tag, id));
        }
        let valid = user_obj == 1
            && group_obj == 1
            && other == 1
            && (mask == 1 || (mask == 0 && named == 0));
        if valid {
            Ok(())
        } else {
            Err(Errno::EINVAL)
        }
    }

    fn perm_of(&self, tag: u16) -> Option<u32> {
        self.entries
            .iter()
            .find(|e| e.tag == tag)
            .map(|e| u32::from(e.perm))
    }

    fn set_perm(&mut self, tag: u16, perm: u32) {
        if let Some(e) = self.entries.iter_mut().find(|e| e.tag == tag) {
            e.perm = (perm & 7) as u16;
        }
    }

    /// The permission bits this ACL gives the mode (`posix_acl_equiv_mode`):
    /// owner from USER_OBJ, group from the MASK or else GROUP_OBJ, other
    /// from OTHER; and whether the mode alone says the same (no named
    /// entries, no mask), in which case the ACL need not be stored.
    pub fn mode_bits(&self) -> (u32, bool) {
        let owner = self.perm_of(USER_OBJ).unwrap_or(0);
        let group = self
            .perm_of(MASK)
            .or_else(|| self.perm_of(GROUP_OBJ))
            .unwrap_or(0);
        let other = self.perm_of(OTHER).unwrap_or(0);
        let equivalent = self
            .entries
            .iter()
            .all(|e| matches!(e.tag, USER_OBJ | GROUP_OBJ | OTHER));
        (owner << 6 | group << 3 | other, equivalent)
    }

    /// The ACL after chmod to `mode` (`posix_acl_chmod`): owner and other
    /// from the mode, and the mask (or the owning group, without a mask)
    /// from its group bits; named entries keep their permissions.
    pub fn chmod(&mut self, mode: u32) {
        self.set_perm(USER_OBJ, (mode & S_IRWXU) >> 6);
        self.set_perm(OTHER, mode & S_IRWXO);
        let group_tag = if self.perm_of(MASK).is_some() {
            MASK
        } else {
            GROUP_OBJ
        };
        self.set_perm(group_tag, (mode & S_IRWXG) >> 3);
    }

    /// A minimal ACL saying what `mode` says.
    pub fn from_mode(mode: u32) -> Acl {
        let entry = |tag, perm: u32| AclEntry {
            tag,
            perm: (perm & 7) as u16,
            id: UNDEFINED_ID,
        };
        Acl {
            entries: vec![
                entry(USER_OBJ, (mode & S_IRWXU) >> 6),
                entry(GROUP_OBJ, (mode & S_IRWXG) >> 3),
                entry(OTHER, mode & S_IRWXO),
            ],
        }
    }
}

/// What a new inode gets under a directory: its mode and the ACLs to
/// store with it.
#[derive(Debug, PartialEq, Eq)]
pub struct Inherited {
    pub mode: u32,
    /// The access ACL, when the mode cannot say it alone.
    pub access: Option<Vec<u8>>,
    /// The default ACL (directories under a directory that has one).
    pub default: Option<Vec<u8>>,
}

/// The mode and ACLs of a new inode of `mode` (type and permission bits
/// as requested) created with `umask` under a directory whose default ACL
/// is `parent_default` (`posix_acl_create`). Symlinks take neither.
pub fn inherit(parent_default: Option<&[u8]>, mode: u32, umask: u32) -> FsResult<Inherited> {
    let is_dir = mode & libc::S_IFMT == libc::S_IFDIR;
    let is_symlink = mode & libc::S_IFMT == libc::S_IFLNK;
    let default = match parent_default {
        Some(bytes) if !is_symlink => Acl::decode(bytes)?,
        _ => {
            let mode = if is_symlink {
                mode
            } else {
                mode & !(umask & S_IRWXUGO)
            };
            return Ok(Inherited {
                mode,
                access: None,
                default: None,
            });
        }
    };
    let mut access = default.clone();
    let bits = create_masq(&mut access, mode);
    let (_, equivalent) = access.mode_bits();
    Ok(Inherited {
        mode: (mode & !S_IRWXUGO) | bits,
        access: (!equivalent).then(|| access.encode()),
        default: is_dir.then(|| default.encode()),
    })
}

/// `posix_acl_create_masq`: narrows the inherited ACL by the requested
/// permission bits and returns the permission bits the mode gets.
fn create_masq(acl: &mut Acl, mode: u32) -> u32 {
    let mut bits = mode & S_IRWXUGO;
    let has_mask = acl.perm_of(MASK).is_some();
    for e in acl.entries.iter_mut() {
        let perm = u32::from(e.perm);
        match e.tag {
            USER_OBJ => {
                let p = perm & (bits >> 6);
                e.perm = p as u16;
                bits &= (p << 6) | !S_IRWXU;
            }
            OTHER => {
                let p = perm & bits;
                e.perm = (p & 7) as u16;
                bits &= p | !S_IRWXO;
            }
            MASK | GROUP_OBJ if (e.tag == MASK) == has_mask => {
                let p = perm & (bits >> 3);
                e.perm = (p & 7) as u16;
                bits &= (p << 3) | !S_IRWXG;
            }
            _ => {}
        }
    }
    bits & S_IRWXUGO
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
        Acl {
            entries: entries
                .iter()
                .map(|&(tag, perm, id)| AclEntry { tag, perm, id })
                .collect(),
        }
        .encode()
    }

    #[test]
    fn decode_checks_what_the_kernel_checks() {
        let good = acl(&[
            (USER_OBJ, 6, UNDEFINED_ID),
            (USER, 4, 1000),
            (GROUP_OBJ, 4, UNDEFINED_ID),
            (MASK, 4, UNDEFINED_ID),
            (OTHER, 0, UNDEFINED_ID),
        ]);
        assert_eq!(Acl::decode(&good).unwrap().encode(), good);
        for bad in [
            vec![],
            vec![2, 0, 0],
            // named entry without a mask
            acl(&[
                (USER_OBJ, 6, 0),
                (USER, 4, 1000),
                (GROUP_OBJ, 4, 0),
                (OTHER, 0, 0),
            ]),
            // unsorted
            acl(&[(GROUP_OBJ, 4, 0), (USER_OBJ, 6, 0), (OTHER, 0, 0)]),
            // twice the same user
            acl(&[
                (USER_OBJ, 6, 0),
                (USER, 4, 7),
                (USER, 4, 7),
                (GROUP_OBJ, 4, 0),
                (MASK, 4, 0),
                (OTHER, 0, 0),
            ]),
            // bad permission, bad tag
            acl(&[(USER_OBJ, 8, 0), (GROUP_OBJ, 4, 0), (OTHER, 0, 0)]),
            acl(&[
                (USER_OBJ, 6, 0),
                (0x40, 4, 0),
                (GROUP_OBJ, 4, 0),
                (OTHER, 0, 0),
            ]),
        ] {
            assert_eq!(Acl::decode(&bad), Err(Errno::EINVAL), "{bad:?}");
        }
        let mut wrong_version = good.clone();
        wrong_version[0] = 1;
        assert_eq!(Acl::decode(&wrong_version), Err(Errno::EINVAL));
    }

    #[test]
    fn mode_follows_the_mask_and_chmod_follows_the_mode() {
        let a = Acl::decode(&acl(&[
            (USER_OBJ, 7, 0),
            (USER, 0, 1000),
            (GROUP_OBJ, 5, 0),
            (MASK, 4, 0),
            (OTHER, 1, 0),
        ]))
        .unwrap();
        assert_eq!(a.mode_bits(), (0o741, false));
        let mut b = a.clone();
        b.chmod(0o650);
        assert_eq!(b.mode_bits(), (0o650, false));
        // The owning group keeps its entry; the mask took the group bits.
        assert_eq!(b.perm_of(GROUP_OBJ), Some(5));
        assert_eq!(b.perm_of(USER), Some(0));
        let mut minimal = Acl::from_mode(0o640);
        assert_eq!(minimal.mode_bits(), (0o640, true));
        minimal.chmod(0o705);
        assert_eq!(minimal.mode_bits(), (0o705, true));
    }

    #[test]
    fn inheritance_masks_by_the_requested_mode_and_ignores_the_umask() {
        let default = acl(&[
            (USER_OBJ, 7, 0),
            (USER, 7, 1000),
            (GROUP_OBJ, 5, 0),
            (MASK, 7, 0),
            (OTHER, 5, 0),
        ]);
        let file = inherit(Some(&default), libc::S_IFREG | 0o666, 0o077).unwrap();
        assert_eq!(file.mode, libc::S_IFREG | 0o664);
        let access = Acl::decode(file.access.as_ref().unwrap()).unwrap();
        assert_eq!(access.perm_of(USER_OBJ), Some(6));
        assert_eq!(access.perm_of(MASK), Some(6));
        assert_eq!(access.perm_of(OTHER), Some(4));
        assert_eq!(file.default, None);
        let dir = inherit(Some(&default), libc::S_IFDIR | 0o750, 0o022).unwrap();
        assert_eq!(dir.mode, libc::S_IFDIR | 0o750);
        assert_eq!(dir.default.as_deref(), Some(&default[..]));
        // A minimal default ACL gives a mode and nothing stored.
        let minimal = Acl::from_mode(0o750).encode();
        let f = inherit(Some(&minimal), libc::S_IFREG | 0o666, 0o022).unwrap();
        assert_eq!((f.mode, f.access), (libc::S_IFREG | 0o640, None));
        // No default ACL: the umask.
        let plain = inherit(None, libc::S_IFREG | 0o666, 0o027).unwrap();
        assert_eq!(plain.mode, libc::S_IFREG | 0o640);
        let link = inherit(Some(&default), libc::S_IFLNK | 0o777, 0o077).unwrap();
        assert_eq!((link.mode, link.access), (libc::S_IFLNK | 0o777, None));
    }
}
