//! What happens when serving a request panics.
//!
//! A panic is a bug, and the file system's in-memory state may be half
//! changed, so going on could hand out wrong data. It must not look like
//! success either (a dead mount answering "Transport endpoint is not
//! connected" while the daemon exits 0). So the request that panicked gets
//! EIO and the panic is logged with the request; every later request gets
//! EIO; the owner is told once (the daemon unmounts, flushes the log —
//! which holds every acknowledged write and is not touched by the bug — and
//! exits non-zero without a final checkpoint of the suspect state; the next
//! mount replays the log).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use betreefs_fs::{Errno, FsResult};

type OnFatal = Box<dyn Fn(&str) + Send + Sync>;

/// Runs requests, catching panics at the request boundary.
pub struct RequestGuard {
    failed: AtomicBool,
    failure: Mutex<Option<String>>,
    on_fatal: OnFatal,
}

impl RequestGuard {
    /// `on_fatal` is called once, with the panic's description, from the
    /// thread that caught it (it must not block on the mount).
    pub fn new(on_fatal: impl Fn(&str) + Send + Sync + 'static) -> RequestGuard {
        RequestGuard {
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            on_fatal: Box::new(on_fatal),
        }
    }

    /// A guard whose failure only logs (tests, embedders without a daemon).
    pub fn logging() -> RequestGuard {
        RequestGuard::new(|_| {})
    }

    /// Whether serving has stopped (every request gets EIO).
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// The panic that stopped serving, if one did.
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Runs one request; `describe` names it for the log.
    pub fn run<T>(
        &self,
        describe: impl FnOnce() -> String,
        request: impl FnOnce() -> FsResult<T>,
    ) -> FsResult<T> {
        if self.failed.load(Ordering::Acquire) {
            return Err(Errno::EIO);
        }
        match std::panic::catch_unwind(AssertUnwindSafe(request)) {
            Ok(result) => result,
            Err(payload) => {
                let message = panic_message(&*payload);
                self.fail(&format!("{} panicked: {message}", describe()));
                Err(Errno::EIO)
            }
        }
    }

    /// Stops serving for a reason other than a panic (a transport that
    /// broke): every later request gets EIO, the owner is told once.
    pub fn fail(&self, what: &str) {
        tracing::error!("{what}; refusing every further request");
        self.failed.store(true, Ordering::Release);
        let first = {
            let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
            let first = failure.is_none();
            failure.get_or_insert_with(|| what.to_string());
            first
        };
        if first {
            (self.on_fatal)(what);
        }
    }
}

/// The message a panic was raised with.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// A fault to inject in debug builds (the FUSE tests): a lookup of this
/// name panics, so the path above can be tested end to end.
pub(crate) fn injected_panic(name: &[u8]) {
    if cfg!(debug_assertions)
        && std::env::var_os("BETREEFS_TEST_PANIC_LOOKUP")
            .is_some_and(|n| std::os::unix::ffi::OsStrExt::as_bytes(n.as_os_str()) == name)
    {
        panic!("injected fault: lookup of {}", name.escape_ascii());
    }
}

/// Test hook (debug builds): `BETREEFS_TEST_DELAY=<opcode>:<ms>` holds
/// every request of that opcode for that long before serving it, so that
/// tests can interrupt a request in flight.
pub(crate) fn injected_delay(opcode: u32) {
    if !cfg!(debug_assertions) {
        return;
    }
    static DELAY: std::sync::OnceLock<Option<(String, u64)>> = std::sync::OnceLock::new();
    let delay = DELAY.get_or_init(|| {
        let spec = std::env::var("BETREEFS_TEST_DELAY").ok()?;
        let (op, ms) = spec.split_once(':')?;
        Some((op.to_string(), ms.parse().ok()?))
    });
    if let Some((op, ms)) = delay {
        if op == crate::abi::opcode::name(opcode) {
            std::thread::sleep(std::time::Duration::from_millis(*ms));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    #[test]
    fn a_panic_fails_this_and_every_later_request() {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let guard = RequestGuard::new(move |what| {
            assert!(what.contains("boom"), "{what}");
            seen.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(guard.run(|| "ok".into(), || Ok(3)), Ok(3));
        let r: FsResult<()> = guard.run(|| "lookup of x".into(), || panic!("boom"));
        assert_eq!(r, Err(Errno::EIO));
        assert_eq!(guard.run(|| "later".into(), || Ok(4)), Err(Errno::EIO));
        let r: FsResult<()> = guard.run(|| "again".into(), || panic!("boom"));
        assert_eq!(r, Err(Errno::EIO));
        assert_eq!(calls.load(Ordering::SeqCst), 1, "told once");
        assert!(guard
            .failure()
            .unwrap()
            .contains("lookup of x panicked: boom"));
    }
}
