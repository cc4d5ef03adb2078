pub mod buffer;
pub mod codec;
pub mod format;
pub mod merge;
pub mod message;
pub mod node;
