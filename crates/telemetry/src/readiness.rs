//! [`Readiness`]: what `/readyz` answers, flipped by the service.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Whether this process should be sent work: connected to NATS, the
/// JetStream layout verified, and not draining. Cheap to clone (one `Arc`);
/// every clone sees the same state. A new one is not ready.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    connected: AtomicBool,
    layout_ok: AtomicBool,
    draining: AtomicBool,
}

impl Readiness {
    pub fn new() -> Self {
        Self::default()
    }

    /// The NATS connection is up (or, with `false`, lost).
    pub fn set_connected(&self, connected: bool) {
        self.0.connected.store(connected, Ordering::Release);
    }

    /// Streams, buckets and consumers were verified (or are known broken).
    pub fn set_layout_ok(&self, ok: bool) {
        self.0.layout_ok.store(ok, Ordering::Release);
    }

    /// Keeps the connected flag in step with `is_connected` (checked every
    /// 500 ms) until `stop` resolves.
    #[cfg(feature = "http")]
    pub async fn follow_connection(
        &self,
        is_connected: impl Fn() -> bool,
        stop: impl std::future::Future<Output = ()>,
    ) {
        let mut every = tokio::time::interval(std::time::Duration::from_millis(500));
        tokio::pin!(stop);
        loop {
            tokio::select! { _ = every.tick() => {}, _ = &mut stop => return }
            self.set_connected(is_connected());
        }
    }

    /// Shutdown began: not ready again for the rest of this process.
    pub fn set_draining(&self) {
        self.0.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.0.draining.load(Ordering::Acquire)
    }

    pub fn is_ready(&self) -> bool {
        self.reason().is_none()
    }

    /// Why the process is not ready, or `None` when it is. Draining wins
    /// over everything else: a draining process is never ready again.
    pub fn reason(&self) -> Option<&'static str> {
        if self.is_draining() {
            Some("draining: shutting down")
        } else if !self.0.connected.load(Ordering::Acquire) {
            Some("not connected to NATS")
        } else if !self.0.layout_ok.load(Ordering::Acquire) {
            Some("JetStream layout not verified")
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_connected_verified_and_not_draining() {
        let r = Readiness::new();
        assert_eq!(r.reason(), Some("not connected to NATS"));
        let seen_by_server = r.clone();
        r.set_connected(true);
        assert_eq!(
            seen_by_server.reason(),
            Some("JetStream layout not verified")
        );
        r.set_layout_ok(true);
        assert!(seen_by_server.is_ready());
        r.set_connected(false);
        assert!(!seen_by_server.is_ready());
        r.set_connected(true);
        r.set_draining();
        assert_eq!(seen_by_server.reason(), Some("draining: shutting down"));
        assert!(seen_by_server.is_draining());
    }
}
