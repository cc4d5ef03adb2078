//! The read side of the store: visits of a leaf's worth of pairs on the
//! shared lock or with the leaf read holding no lock, range iterators,
//! and the read-ahead threads of sequential scans.

use std::collections::HashSet;
use std::ops::ControlFlow;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::staging::OverlayMerge;
use super::*;
use crate::node::NodeBody;
use crate::validate;

/// Leaves kept read ahead of a sequential scan, the next one included.
const READ_AHEAD_LEAVES: usize = 4;

/// Threads reading them: this many leaves are read from the device at
/// once. One read at a time leaves a scan bound by the device's
/// single-request latency (about half its bandwidth on the machines
/// measured, `docs/benchmarks/readahead-depth.md`).
const READ_AHEAD_READERS: usize = 3;

/// Starts the threads that read leaves ahead of sequential scans
/// (`tree::readahead`): a planner that finds, for each leaf a scan
/// reaches, the leaves after it to read, and [`READ_AHEAD_READERS`]
/// readers that read them, several at once. They hold the store weakly:
/// closing the scans' channel ends the planner, which closes the readers'.
pub(super) fn start_read_ahead(inner: &Arc<Inner>) -> Vec<JoinHandle<()>> {
    let (send, receive) = std::sync::mpsc::channel::<(KeySpace, Vec<u8>)>();
    let (send_leaf, receive_leaf) = std::sync::mpsc::channel::<LeafToRead>();
    let receive_leaf = Arc::new(Mutex::new(receive_leaf));
    let mut threads = Vec::new();
    let weak = Arc::downgrade(inner);
    let planner = std::thread::Builder::new()
        .name("betreefs-readahead".into())
        .spawn(move || {
            while let Ok((ks, key)) = receive.recv() {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                inner.plan_read_ahead(ks, &key, &send_leaf);
            }
        });
    match planner {
        Ok(handle) => threads.push(handle),
        Err(e) => {
            tracing::warn!("could not start the read-ahead thread: {e}; reading on demand");
            return threads;
        }
    }
    for i in 0..READ_AHEAD_READERS {
        let (weak, receive_leaf) = (Arc::downgrade(inner), receive_leaf.clone());
        let reader = std::thread::Builder::new()
            .name(format!("betreefs-readahead-{i}"))
            .spawn(move || loop {
                let next = receive_leaf
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .recv();
                let Ok(leaf) = next else {
                    return;
                };
                match weak.upgrade() {
                    Some(inner) => inner.read_leaf_ahead(&leaf),
                    None => return,
                }
            });
        match reader {
            Ok(handle) => threads.push(handle),
            // The planner's sends then wait for the readers there are;
            // with none, they fail and the scans read on demand.
            Err(e) => tracing::warn!("could not start a read-ahead reader: {e}"),
        }
    }
    *inner.read_ahead.lock().unwrap_or_else(|e| e.into_inner()) = Some(send);
    threads
}

/// A leaf the read-ahead planner hands its readers: where it lies, and
/// the key the planner found it by. A leaf the cache does not hold is read
/// whole; of one it holds in part, the basements from that key on (where
/// the scan goes on).
struct LeafToRead {
    place: LeafOnDisk,
    from: Vec<u8>,
}

/// Iterator over a key range; see [`Store::range`].
pub struct RangeIter<'a> {
    pub(super) store: &'a Store,
    pub(super) ks: KeySpace,
    pub(super) next: Option<Vec<u8>>,
    pub(super) end: Option<Vec<u8>>,
    pub(super) chunk: std::vec::IntoIter<(Vec<u8>, Vec<u8>)>,
}

impl Iterator for RangeIter<'_> {
    type Item = EngineResult<(Vec<u8>, Vec<u8>)>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(kv) = self.chunk.next() {
                return Some(Ok(kv));
            }
            let start = self.next.take()?;
            if self.end.as_ref().is_some_and(|e| *e <= start) {
                return None;
            }
            let mut items = Vec::new();
            let scanned = self.store.inner.visit_one_leaf(
                self.ks,
                &start,
                self.end.as_deref(),
                &mut |k, v| {
                    items.push((k.to_vec(), v.to_vec()));
                    ControlFlow::Continue(())
                },
            );
            match scanned {
                Ok(next) => {
                    self.chunk = items.into_iter();
                    self.next = next;
                }
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

impl Inner {
    /// Visits [from, end) within the leaf holding `from` (see
    /// [`Store::visit_range`]): on the shared tree lock if it and the path
    /// to it are cached, else on the exclusive one, loading what is
    /// missing. What is staged in the range is merged over the trees'
    /// pairs, read in the same hold of the tree lock (`staging.rs`,
    /// [`StagedOverlay`]; on the shared staging lock, but for the first
    /// visit after an application, which orders the staged keys): a visit
    /// does not apply the staged batches, which
    /// stay for the writers to apply in their own time — unless upserts
    /// onto the trees' values are staged in the range. Returns where the
    /// next leaf begins (None once `visit` broke); tells the read-ahead
    /// thread when the visit read on across basements. A leaf to read that
    /// a read-ahead reader is reading is waited for, once, and the visit
    /// tried again.
    pub(super) fn visit_one_leaf(
        &self,
        ks: KeySpace,
        from: &[u8],
        end: Option<&[u8]>,
        visit: &mut PairVisitor<'_>,
    ) -> EngineResult<Option<Vec<u8>>> {
        let mut waited = false;
        let visited = loop {
            match self.visit_leaf_shared(ks, from, end, visit) {
                Shared::Answer(visited) => break visited,
                Shared::ReadLeaf(place) => {
                    if !waited && self.wait_for_read_ahead(place.num) {
                        waited = true;
                        continue;
                    }
                    let want = Want::Range(from, end);
                    let tree = self.read_leaf_unlocked(&place, want, ReadFor::Query);
                    break self.visit_leaf_exclusively(tree, ks, from, end, visit)?;
                }
                Shared::Exclusive => {
                    break self.visit_leaf_exclusively(self.lock_tree(), ks, from, end, visit)?;
                }
            }
        };
        let visited = visited.map_err(|e| self.read_failed(e))?;
        if let Some(read_on) = visited.read_on {
            self.read_ahead_from(ks, read_on);
        }
        Ok(visited.next)
    }

    /// [`Inner::visit_one_leaf`] on the shared tree lock, if the leaf and
    /// the way to it are cached; nothing is visited otherwise.
    fn visit_leaf_shared(
        &self,
        ks: KeySpace,
        from: &[u8],
        end: Option<&[u8]>,
        visit: &mut PairVisitor<'_>,
    ) -> Shared<EngineResult<LeafVisited>> {
        let tree = self.tree.read();
        let Some(overlay) = self.staged_overlay(ks, from, end) else {
            return Shared::Exclusive;
        };
        let mut merge = overlay.merge(visit);
        let mut shared = tree.visit_leaf_cached(ks, from, end, &mut |k, v| merge.tree_pair(k, v));
        if let Shared::Answer(Ok(visited)) = &mut shared {
            finish_overlay(visited, merge);
        }
        shared
    }

    /// [`Inner::visit_one_leaf`] on the exclusive tree lock: what is staged
    /// in the range read in this hold, upserts onto the trees' values
    /// applied first (their settling lets the lock go between steps: read
    /// again). The outer error is the application's, the inner the visit's.
    fn visit_leaf_exclusively(
        &self,
        mut tree: TreeGuard<'_>,
        ks: KeySpace,
        from: &[u8],
        end: Option<&[u8]>,
        visit: &mut PairVisitor<'_>,
    ) -> EngineResult<EngineResult<LeafVisited>> {
        let overlay = loop {
            let overlay = self.staged_overlay(ks, from, end);
            match overlay {
                Some(overlay) => break overlay,
                None => {
                    if self.apply_staged(&mut tree)? {
                        self.want_tree_flush();
                    }
                }
            }
        };
        let mut merge = overlay.merge(visit);
        let mut visited = tree.visit_leaf(ks, from, end, &mut |k, v| merge.tree_pair(k, v));
        if let Ok(visited) = &mut visited {
            finish_overlay(visited, merge);
        }
        tree.evict_clean_if_needed();
        Ok(visited)
    }

    /// What is staged in [from, end) of `ks` ([`Staging::overlay`]), for
    /// a visit holding the tree lock: on the shared staging lock — point
    /// queries and other visits go on — unless the staged keys must be
    /// ordered first.
    fn staged_overlay(
        &self,
        ks: KeySpace,
        from: &[u8],
        end: Option<&[u8]>,
    ) -> Option<StagedOverlay> {
        {
            let staging = self.staging.read();
            if staging.keys_ordered(ks) {
                return staging.overlay(ks, from, end);
            }
        }
        let mut staging = self.staging.write();
        staging.order_keys(ks);
        staging.overlay(ks, from, end)
    }

    /// The tree lock, exclusively — after reading, holding no lock, what
    /// `want` needs of the leaf at `place` (`by` whom: a query or a
    /// read-ahead reader) and caching it if the tree still names it there
    /// ([`Inner::adopt_read`]). Other requests go on while the device
    /// reads. A query's read that goes on where the last one in its tree
    /// ended hands the read-ahead planner what follows
    /// ([`Inner::note_query_read`]).
    pub(super) fn read_leaf_unlocked(
        &self,
        place: &LeafOnDisk,
        want: Want<'_>,
        by: ReadFor,
    ) -> TreeGuard<'_> {
        let read = read_leaf(place, self.device.as_ref(), want, &self.stats);
        let span = match (&read, want, by) {
            (Ok(node), Want::Key(key) | Want::Range(key, _), ReadFor::Query) => {
                basements_read(place, node, key)
            }
            _ => None,
        };
        let mut tree = self.lock_tree();
        self.adopt_read(&mut tree, place, read, by);
        // After the adoption: the planner, which waits for this hold of
        // the lock to end, finds what was read cached.
        if let Some((lo, hi)) = span {
            self.note_query_read(place.ks, lo, hi);
        }
        tree
    }

    /// A query read the basements of tree `ks` spanning [lo, hi) from the
    /// device. When they reach on from where the last ones a query read
    /// in that tree ended — basement after basement, as a find or an `ls
    /// -R` walks the metadata in key order, each listing too short to
    /// read on across basements itself — the read-ahead planner is handed
    /// what follows. Random reads seldom land on the next basement. (The
    /// span may begin before that end: a read of a cached leaf's basements
    /// reads the cached ones inside its span again.)
    fn note_query_read(&self, ks: KeySpace, lo: Vec<u8>, hi: Option<Vec<u8>>) {
        let sequential = {
            let mut ends = self
                .query_read_ends
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let Some(end) = ends.get_mut(ks.index()) else {
                return;
            };
            let sequential = end
                .as_ref()
                .is_some_and(|e| lo <= *e && hi.as_ref().is_none_or(|hi| e < hi));
            end.clone_from(&hi);
            sequential
        };
        if let (true, Some(hi)) = (sequential, hi) {
            add(&self.stats.sequential_query_reads, 1);
            self.read_ahead_from(ks, hi);
        }
    }

    /// Caches what was read of the leaf at `place` holding no lock if the
    /// tree still names it there (`Tree::adopt_leaf_read`). A read that
    /// failed is dropped: whoever needs the leaf reads it again under the
    /// lock, where failures are reported.
    pub(super) fn adopt_read(
        &self,
        tree: &mut Tree,
        place: &LeafOnDisk,
        read: EngineResult<Node>,
        by: ReadFor,
    ) {
        match read {
            Ok(leaf) => {
                tree.adopt_leaf_read(place, leaf, by);
            }
            Err(e) => {
                tracing::debug!("read of node {} outside the lock: {e}", place.num);
                add(&self.stats.unlocked_reads_dropped, 1);
            }
        }
    }

    /// Hands the read-ahead planner the leaf after one a scan just read
    /// sequentially (it begins at `key`), if there is such a thread.
    fn read_ahead_from(&self, ks: KeySpace, key: Vec<u8>) {
        if let Some(send) = &*self.read_ahead.lock().unwrap_or_else(|e| e.into_inner()) {
            let _ = send.send((ks, key));
        }
    }

    /// Hands the read-ahead readers the leaf holding `key` and the ones
    /// after it, [`READ_AHEAD_LEAVES`] in all, that are neither cached nor
    /// being read — of the first, if cached, the basements from `key` on
    /// still on the device: a reader that has just asked for the next
    /// leaf would otherwise often reach it first and read it itself.
    fn plan_read_ahead(&self, ks: KeySpace, key: &[u8], readers: &Sender<LeafToRead>) {
        // One hold of the shared lock for the whole walk: nothing here
        // waits for the device (the readers do).
        let tree = self.tree.read();
        let mut key = key.to_vec();
        for n in 0..READ_AHEAD_LEAVES {
            let Some((place, next)) = tree.leaf_for(ks, &key, n == 0) else {
                return;
            };
            // Marked under the tree lock: a scan that finds the leaf (or
            // the basements) to read after this waits for it.
            if let Some(place) = place {
                if self.lock_reading_ahead().insert(place.num) {
                    // The walk goes on from `next`: the key is the reader's.
                    let from = std::mem::take(&mut key);
                    let leaf = LeafToRead { place, from };
                    if let Err(unsent) = readers.send(leaf) {
                        self.lock_reading_ahead().remove(&unsent.0.place.num);
                        return;
                    }
                }
            }
            match next {
                Some(next) => key = next,
                None => return,
            }
        }
    }

    /// Reads a leaf the planner handed over (whole, or a cached one's
    /// basements from where the scan goes on), caches it if the tree still
    /// names it there, and wakes scans waiting for it.
    fn read_leaf_ahead(&self, leaf: &LeafToRead) {
        let place = &leaf.place;
        let want = if place.is_of_cached_leaf() {
            Want::Range(&leaf.from, None)
        } else {
            Want::Whole
        };
        self.read_leaf_unlocked(place, want, ReadFor::ReadAhead)
            .evict_clean_if_needed();
        self.lock_reading_ahead().remove(&place.num);
        self.read_ahead_landed.notify_all();
    }

    fn lock_reading_ahead(&self) -> MutexGuard<'_, HashSet<u64>> {
        self.reading_ahead.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Before a query reads leaf `num` (or basements of it): if a
    /// read-ahead reader is reading it now, wait (without the tree lock)
    /// until it lands, so it is read once; whether it was being read.
    /// Bounded: a slow device never holds a query up for more than a
    /// moment.
    pub(super) fn wait_for_read_ahead(&self, num: u64) -> bool {
        let mut reading = self.lock_reading_ahead();
        if !reading.contains(&num) {
            return false;
        }
        let deadline = Instant::now() + Duration::from_millis(200);
        while reading.contains(&num) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            reading = match self.read_ahead_landed.wait_timeout(reading, left) {
                Ok((guard, _)) => guard,
                Err(e) => e.into_inner().0,
            };
        }
        true
    }
}

/// The key range of the basements a query's read of the leaf at `place`
/// (`read`, as decoded) loaded from `key` on: the basement holding `key`
/// and those loaded after it in a row. None when that basement was not
/// loaded whole (a point query reads below it, a few chunks).
fn basements_read(
    place: &LeafOnDisk,
    read: &Node,
    key: &[u8],
) -> Option<(Vec<u8>, Option<Vec<u8>>)> {
    let NodeBody::Leaf(leaf) = &read.body else {
        return None;
    };
    let first = leaf.basement_for(key);
    leaf.basements.get(first)?.entries.as_ref()?;
    let loaded = leaf
        .basements
        .get(first..)?
        .iter()
        .take_while(|b| b.entries.is_some())
        .count();
    let last = first + loaded - 1;
    let lo = validate::basement_bounds(leaf, first, &place.bounds).lo;
    let hi = validate::basement_bounds(leaf, last, &place.bounds).hi;
    Some((lo, hi))
}

/// Hands on what is staged after the trees' last pair of a leaf visit;
/// a visit that broke (among the trees' pairs or the staged ones) ends
/// there, naming no next leaf.
fn finish_overlay(visited: &mut LeafVisited, merge: OverlayMerge<'_>) {
    if merge.finish(visited.next.as_deref()).is_break() {
        visited.next = None;
        visited.read_on = None;
    }
}
