//! The fleet view, shared: one task reads it from the store at most once
//! per refresh period, and only while a `/fleet/live` stream follows it;
//! every tab gets the same rendered fragment from a `watch` channel. The
//! `/fleet` page takes the latest one when it is recent. What the fleet
//! costs the store is so independent of how many tabs show it.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Mutex, Notify};
use tokio::time::Instant;

use crate::app::App;
use crate::render::esc;

/// Between two reads, at least this long...
pub const PERIOD_MIN: Duration = Duration::from_secs(2);
/// ...and then until a record changes, at most this long in all.
pub const PERIOD_MAX: Duration = Duration::from_secs(5);

/// One rendering of the fleet and when it was read.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub html: Arc<str>,
    pub at: Instant,
}

pub struct FleetView {
    tx: watch::Sender<Option<Snapshot>>,
    /// Told when a stream starts following (the task may be idle).
    wake: Notify,
    /// One read at a time: a page that finds the snapshot old reads it,
    /// others wait for that read.
    reading: Mutex<()>,
}

impl Default for FleetView {
    fn default() -> Self {
        FleetView {
            tx: watch::Sender::new(None),
            wake: Notify::new(),
            reading: Mutex::new(()),
        }
    }
}

impl FleetView {
    /// A follower of the snapshots, the current one marked as seen: it
    /// gets the next read. The task wakes if it was idle.
    pub fn follow(&self) -> watch::Receiver<Option<Snapshot>> {
        let rx = self.tx.subscribe();
        self.wake.notify_one();
        rx
    }

    /// The latest snapshot if it is younger than `PERIOD_MAX`, else one
    /// read now (and given to the followers too).
    pub async fn current(&self, app: &App) -> Arc<str> {
        let fresh = |s: &Option<Snapshot>| {
            s.as_ref()
                .filter(|s| s.at.elapsed() < PERIOD_MAX)
                .map(|s| s.html.clone())
        };
        if let Some(h) = fresh(&self.tx.borrow()) {
            return h;
        }
        let _one = self.reading.lock().await;
        if let Some(h) = fresh(&self.tx.borrow()) {
            return h;
        }
        self.read(app).await
    }

    /// Reads the fleet and gives it to every follower.
    async fn read(&self, app: &App) -> Arc<str> {
        let html: Arc<str> = crate::pages::fleet_fragment(app)
            .await
            .unwrap_or_else(|f| format!("<p class=\"error\">{}</p>", esc(&f.message)))
            .into();
        self.tx.send_replace(Some(Snapshot {
            html: html.clone(),
            at: Instant::now(),
        }));
        html
    }
}

/// The task: while anyone follows, reads the fleet, then waits
/// `PERIOD_MIN`, then until a record changes or `PERIOD_MAX` has passed
/// since the read; with no follower, waits for one.
pub async fn refresh(app: Arc<App>) {
    let fv = &app.fleet;
    let mut records = app.feed.records.subscribe();
    loop {
        while fv.tx.receiver_count() == 0 {
            fv.wake.notified().await;
        }
        let start = Instant::now();
        // Changes until the read are in it; one after it makes the next.
        records = records.resubscribe();
        {
            let _one = fv.reading.lock().await;
            fv.read(&app).await;
        }
        tokio::time::sleep_until(start + PERIOD_MIN).await;
        let _ = tokio::time::timeout_at(start + PERIOD_MAX, records.recv()).await;
    }
}
