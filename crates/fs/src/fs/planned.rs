//! Plan, then commit (issue 11): an operation stages its changes to the
//! inode table beside the batch it builds, reads its own staged values
//! back while planning, writes the batch, and only then installs them
//! with [`State::commit`]. A batch the store refuses (a full device, a
//! failed store) leaves the table exactly as it was: there is nothing to
//! undo, so no operation restores fields by hand on an error path.
//!
//! What is staged is what the store also holds: attributes, where an
//! inode lives, the directory and data versions that say its listing or
//! its block count changed, and the inode numbers handed out. Caches of
//! stored facts (whether a file has xattrs or capabilities) are not
//! staged: they are set when learned, or cleared, either way true.

use betreefs_engine::{KeySpace, WriteBatch};

use super::state::{Home, State};
use super::{Ino, INO_BATCH};
use crate::error::FsResult;
use crate::plan::inode_record;
use crate::record::{Attr, FsInfo, Timespec, SPARSE_FL};
use crate::schema;

/// The planned state of one inode of the table.
struct PlannedNode {
    ino: Ino,
    attr: Attr,
    home: Home,
    /// Its entries change (a directory's `dir_version` is bumped).
    listing_changed: bool,
    /// By how many its entries grow (a directory's `entries`, if known).
    entries_delta: i64,
    /// Its data changes (its stored blocks are counted again).
    data_changed: bool,
}

/// Changes to the inode table planned beside one batch.
#[derive(Default)]
pub(super) struct Planned {
    /// A handful per operation (rename touches at most four inodes):
    /// a list is enough.
    nodes: Vec<PlannedNode>,
    /// The inode numbers after the ones handed out: (next, reserved up
    /// to), when any were.
    numbering: Option<(Ino, Ino)>,
}

impl Planned {
    pub(super) fn new() -> Planned {
        Planned::default()
    }

    fn staged(&self, ino: Ino) -> Option<&PlannedNode> {
        self.nodes.iter().find(|n| n.ino == ino)
    }

    /// The planned node of `ino`, staged from the table on first use
    /// (`ESTALE` when the table does not have it).
    fn stage(&mut self, st: &State, ino: Ino) -> FsResult<&mut PlannedNode> {
        let at = match self.nodes.iter().position(|n| n.ino == ino) {
            Some(at) => at,
            None => {
                let node = st.node(ino)?;
                self.nodes.push(PlannedNode {
                    ino,
                    attr: node.attr.clone(),
                    home: node.home,
                    listing_changed: false,
                    entries_delta: 0,
                    data_changed: false,
                });
                self.nodes.len() - 1
            }
        };
        match self.nodes.get_mut(at) {
            Some(n) => Ok(n),
            None => unreachable!("a staged node at {at} was just found or pushed"),
        }
    }

    /// The attributes of `ino` as planned so far.
    pub(super) fn attr<'a>(&'a self, st: &'a State, ino: Ino) -> FsResult<&'a Attr> {
        match self.staged(ino) {
            Some(n) => Ok(&n.attr),
            None => Ok(&st.node(ino)?.attr),
        }
    }

    /// The attributes of `ino` to change.
    pub(super) fn attr_mut(&mut self, st: &State, ino: Ino) -> FsResult<&mut Attr> {
        Ok(&mut self.stage(st, ino)?.attr)
    }

    pub(super) fn set_home(&mut self, st: &State, ino: Ino, home: Home) -> FsResult<()> {
        self.stage(st, ino)?.home = home;
        Ok(())
    }

    /// Directory `dir`'s entries change: its times are marked, its link
    /// count changes by `nlink_delta`, its number of entries by
    /// `entries_delta` (a name replaced in place changes none), its
    /// listing changed.
    pub(super) fn touch_dir(
        &mut self,
        st: &State,
        dir: Ino,
        now: Timespec,
        nlink_delta: i32,
        entries_delta: i32,
    ) -> FsResult<()> {
        let n = self.stage(st, dir)?;
        n.attr.mtime = now;
        n.attr.ctime = now;
        n.attr.nlink = n.attr.nlink.saturating_add_signed(nlink_delta);
        n.entries_delta += i64::from(entries_delta);
        n.listing_changed = true;
        Ok(())
    }

    /// The last name of `ino` goes away: `home` says whether it still
    /// lives under its inode key (open) or is gone. Nothing to plan for an
    /// inode the table does not have.
    pub(super) fn mark_unlinked(&mut self, st: &State, ino: Ino, home: Home, now: Timespec) {
        if let Ok(n) = self.stage(st, ino) {
            n.home = home;
            n.attr.nlink = 0;
            n.attr.ctime = now;
            n.listing_changed = true;
        }
    }

    /// `ino`'s data changes; `leaves_holes` marks the file as one that
    /// may have holes.
    pub(super) fn note_data_change(
        &mut self,
        st: &State,
        ino: Ino,
        leaves_holes: bool,
    ) -> FsResult<()> {
        let n = self.stage(st, ino)?;
        n.data_changed = true;
        if leaves_holes {
            n.attr.flags |= SPARSE_FL;
        }
        Ok(())
    }

    /// Puts the planned record of `ino` (attributes and the table's
    /// symlink target) at `key`.
    pub(super) fn put_record_at(
        &self,
        st: &State,
        batch: &mut WriteBatch,
        key: &[u8],
        ino: Ino,
    ) -> FsResult<()> {
        let target = &st.node(ino)?.target;
        batch.put(
            KeySpace::Meta,
            key,
            &inode_record(self.attr(st, ino)?, target),
        );
        Ok(())
    }

    /// [`Planned::put_record_at`] at the file's own key.
    pub(super) fn put_record(&self, st: &State, batch: &mut WriteBatch, ino: Ino) -> FsResult<()> {
        self.put_record_at(st, batch, &st.file_key(ino)?, ino)
    }

    /// A new inode number. Past the numbers the identity record reserves,
    /// the batch reserves the next `INO_BATCH`: a refused batch must not
    /// leave numbers reserved in memory only (after a crash they would be
    /// handed out again).
    pub(super) fn allocate_ino(&mut self, st: &State, batch: &mut WriteBatch) -> Ino {
        let (ino, mut reserved) = self.numbering.unwrap_or((st.next_ino, st.ino_reserved));
        let next = ino + 1;
        if next > reserved {
            reserved = next + INO_BATCH;
            let info = FsInfo {
                ino_reserved: reserved,
                created: st.created,
            };
            batch.put(KeySpace::Meta, schema::INFO_KEY, &info.encode());
        }
        self.numbering = Some((next, reserved));
        ino
    }
}

impl State {
    /// Installs what `plan` planned: its batch is in the store.
    pub(super) fn commit(&mut self, plan: Planned) {
        for planned in plan.nodes {
            let rehomed = self
                .nodes
                .get(&planned.ino)
                .is_some_and(|node| node.home != planned.home);
            if rehomed {
                self.note_key_move(planned.ino);
            }
            if let Some(node) = self.nodes.get_mut(&planned.ino) {
                node.attr = planned.attr;
                node.home = planned.home;
                node.dir_version += u64::from(planned.listing_changed);
                node.entries = node.entries.and_then(|n| {
                    let counted = n.checked_add_signed(planned.entries_delta);
                    debug_assert!(
                        counted.is_some(),
                        "inode {}: {n} entries {:+}",
                        planned.ino,
                        planned.entries_delta
                    );
                    counted
                });
                node.data_version += u64::from(planned.data_changed);
            }
        }
        if let Some((next, reserved)) = plan.numbering {
            self.next_ino = next;
            self.ino_reserved = reserved;
        }
    }
}
