//! Verification for fsck and tests: every node of both trees against
//! checksums, order, bounds and heights, and the nodes no tree reaches.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::*;

/// What a verifying walk has seen so far.
#[derive(Default)]
pub(super) struct Walk {
    /// Nodes reached: the key space of their first parent, and how many
    /// parents named them (shared nodes, more than one).
    visited: HashMap<u64, (KeySpace, u32)>,
    /// Leaves reached (a shared one once), and the bytes they hold.
    leaves: u64,
    leaf_bytes: u64,
}

impl Tree {
    /// Walks every node of every tree, reading all of them, and checks
    /// ordering, bounds, heights, buffer placement and fanout; also finds
    /// nodes the block table holds but no tree reaches (leaked space).
    /// Shared nodes (range clones) are checked under every parent that
    /// names them, walked below once, and their reference counts in the
    /// block table must equal the references the trees hold.
    pub fn verify(&mut self) -> EngineResult<VerifyReport> {
        let mut walk = Walk::default();
        for ks in KeySpace::ALL {
            let root = self.roots[ks.index()];
            self.load(ks, root, &Bounds::full(), Want::Whole, None)?;
            let height = self.node(root).height();
            self.verify_subtree(ks, root, &Bounds::full(), height, &mut walk)?;
        }
        let Walk {
            visited,
            leaves,
            leaf_bytes,
        } = walk;
        for (&num, &(ks, found)) in &visited {
            let counted = self.btt.refs(num);
            if counted != found {
                return Err(Self::corrupt(
                    ks,
                    num,
                    format!("the block table counts {counted} references, the trees hold {found}"),
                ));
            }
        }
        let unreachable = self
            .btt
            .live_numbers()
            .filter(|n| !visited.contains_key(n))
            .collect();
        Ok(VerifyReport {
            nodes: visited.len() as u64,
            leaves,
            leaf_bytes,
            unreachable,
        })
    }

    /// Frees nodes no tree reaches (found by [`Tree::verify`]).
    pub fn free_unreachable(&mut self, nums: &[u64]) {
        for &num in nums {
            if !self.roots.contains(&num) {
                // Unreachable: whatever references the table counts are
                // gone with the parents that held them.
                let refs = self.btt.refs(num);
                if refs > 1 {
                    self.btt.drop_refs(num, refs - 1);
                }
                self.free_node(num);
            }
        }
    }

    /// Checks the chunk directories of a clean leaf and the chunks they
    /// name, in its image: a whole read does not use them, so only a
    /// point query would find them damaged.
    fn verify_chunk_dirs(&self, ks: KeySpace, num: u64, bounds: &Bounds) -> EngineResult<()> {
        let node = self.node(num);
        let NodeBody::Leaf(leaf) = &node.body else {
            return Ok(());
        };
        if node.dirty || leaf.basements.iter().all(|b| b.dir.is_none()) {
            return Ok(());
        }
        let Slot::OnDisk { extent, .. } = self.btt.get(num) else {
            return Ok(());
        };
        let image = self.read_extent_bytes(extent, 0, extent.len as usize, 0)?;
        let prefix = bounds.lifted_prefix();
        for (i, b) in leaf.basements.iter().enumerate() {
            if let (Some(loc), Some(dir)) = (b.loc, b.dir) {
                let range = validate::basement_bounds(leaf, i, bounds);
                crate::format::check_chunks(&image, &loc, &dir, b.count, &prefix, &range)
                    .map_err(|e| Self::corrupt(ks, num, e.0))?;
            }
        }
        Ok(())
    }

    pub(super) fn verify_subtree(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
        height: u32,
        walk: &mut Walk,
    ) -> EngineResult<()> {
        let seen = walk.visited.entry(num).or_insert((ks, 0));
        seen.1 += 1;
        if seen.1 > 1 {
            if seen.1 > self.btt.refs(num) {
                return Err(Self::corrupt(
                    ks,
                    num,
                    format!("reached {} times, shared by {}", seen.1, self.btt.refs(num)),
                ));
            }
            // Shared: its place here must agree with its image too.
            return self.load(ks, num, bounds, Want::Whole, Some(height));
        }
        self.load(ks, num, bounds, Want::Whole, Some(height))?;
        let bad = |reason: String| Self::corrupt(ks, num, reason);
        let kids: Vec<(u64, Bounds)> = match &self.node(num).body {
            NodeBody::Leaf(leaf) => {
                let mut prev: Option<&[u8]> = None;
                for (bi, b) in leaf.basements.iter().enumerate() {
                    let Some(entries) = &b.entries else {
                        unreachable!("loaded whole")
                    };
                    for (k, _) in entries.iter() {
                        if !bounds.contains(k) || prev.is_some_and(|p| p >= k) {
                            return Err(bad(format!(
                                "key {k:?} out of order or outside {bounds:?}"
                            )));
                        }
                        if bi > 0 && k < &leaf.pivots[bi - 1][..]
                            || bi < leaf.pivots.len() && k >= &leaf.pivots[bi][..]
                        {
                            return Err(bad(format!("key {k:?} in the wrong basement")));
                        }
                        prev = Some(k);
                    }
                }
                self.verify_chunk_dirs(ks, num, bounds)?;
                walk.leaves += 1;
                walk.leaf_bytes += leaf.bytes() as u64;
                Vec::new()
            }
            NodeBody::Interior(int) => {
                if int.children.len() != int.pivots.len() + 1
                    || int.buffers.len() != int.children.len()
                {
                    return Err(bad("pivot, child and buffer counts disagree".into()));
                }
                if int.children.len() > self.opts.fanout.max(2) * 2 {
                    return Err(bad(format!(
                        "fanout {} far over the limit",
                        int.children.len()
                    )));
                }
                for (i, p) in int.pivots.iter().enumerate() {
                    if !bounds.contains(p) || (i > 0 && int.pivots[i - 1] >= *p) {
                        return Err(bad(format!(
                            "pivot {p:?} out of order or outside {bounds:?}"
                        )));
                    }
                }
                for i in 0..int.children.len() {
                    let cb = int.child_bounds(i, bounds);
                    let buf = &int.buffers[i];
                    let keys_ok = buf.points().keys().all(|k| cb.contains(k));
                    let ranges_ok = buf.ranges().iter().all(|(s, r)| {
                        cb.contains(s) && s < &r.end && cb.hi.as_ref().is_none_or(|hi| r.end <= *hi)
                    });
                    if !keys_ok || !ranges_ok {
                        return Err(bad(format!(
                            "buffer of child {i} holds messages outside {cb:?}"
                        )));
                    }
                }
                (0..int.children.len())
                    .map(|i| (int.children[i], int.child_bounds(i, bounds)))
                    .collect()
            }
        };
        for (child, child_bounds) in kids {
            self.verify_subtree(ks, child, &child_bounds, height - 1, walk)?;
            // A whole-tree walk must not hold the whole tree in memory.
            self.evict_clean_if_needed();
        }
        Ok(())
    }
}
