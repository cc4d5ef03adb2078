//! fsck (to come)
