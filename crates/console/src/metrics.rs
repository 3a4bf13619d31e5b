//! The console's own metrics (`GET /metrics`, OpenMetrics text): what its
//! views cost the store and how much memory and how many streams they
//! hold, so a bound can be watched as well as set.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Cheap to clone: every metric is shared.
#[derive(Clone, Debug, Default)]
pub struct ConsoleMetrics {
    /// Fleet views rendered from the store (sessions, queue, DLQ, reapers).
    pub fleet_reads: Counter,
    /// Live streams open (every caller).
    pub live_streams: Gauge,
    /// Live streams refused: the caller had `--streams-per-caller` open.
    pub streams_refused: Counter,
    /// Bytes and records the record cache holds, and records it evicted.
    pub cache_bytes: Gauge,
    pub cache_records: Gauge,
    pub cache_evictions: Counter,
    /// Bulk operations running, and pages of dead letters they read.
    pub bulk_running: Gauge,
    pub bulk_letter_pages: Counter,
    /// The charts' sampler: samples taken, the store requests they made,
    /// and the records read for the submit->start sample.
    pub chart_samples: Counter,
    pub chart_reads: Counter,
    pub chart_record_reads: Counter,
    /// Events the job waterfalls read (only those after a cached model's).
    pub waterfall_events_read: Counter,
}

impl ConsoleMetrics {
    /// A registry holding every metric.
    pub fn registry(&self) -> Registry {
        let mut r = Registry::with_prefix("leasehold_console");
        r.register(
            "fleet_reads",
            "Fleet views read from the store (one read of sessions, queue, dead letters and reapers each), however many tabs follow /fleet/live",
            self.fleet_reads.clone(),
        );
        r.register(
            "live_streams",
            "Server-Sent Events streams open",
            self.live_streams.clone(),
        );
        r.register(
            "live_streams_refused",
            "Live streams refused (429) because their caller had --streams-per-caller open",
            self.streams_refused.clone(),
        );
        r.register(
            "record_cache_bytes",
            "Bytes of job records the record cache holds (at most --record-cache-bytes)",
            self.cache_bytes.clone(),
        );
        r.register(
            "record_cache_records",
            "Job records the record cache holds (at most --record-cache-records)",
            self.cache_records.clone(),
        );
        r.register(
            "record_cache_evictions",
            "Records evicted from the record cache, least recently used first",
            self.cache_evictions.clone(),
        );
        r.register(
            "bulk_operations_running",
            "Bulk actions running (at most --bulk-max)",
            self.bulk_running.clone(),
        );
        r.register(
            "bulk_letter_pages",
            "Pages of dead letters bulk actions read (each at most 100 letters, headers only)",
            self.bulk_letter_pages.clone(),
        );
        r.register(
            "chart_samples",
            "Samples the fleet's charts' sampler took (one per --chart-interval)",
            self.chart_samples.clone(),
        );
        r.register(
            "chart_reads",
            "Store requests the charts' samples made (work stream subjects, sessions): per sample, one per worker plus two, whatever the number of jobs",
            self.chart_reads.clone(),
        );
        r.register(
            "chart_record_reads",
            "Job records the charts read for the submit-to-start sample (at most 20 a second)",
            self.chart_record_reads.clone(),
        );
        r.register(
            "waterfall_events_read",
            "Job events read to draw waterfalls (a cached job's model reads only the events after its last)",
            self.waterfall_events_read.clone(),
        );
        r
    }
}
