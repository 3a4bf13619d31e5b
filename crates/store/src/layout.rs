//! Names of every subject, stream, bucket and consumer, derived from the
//! namespace prefix. Architecture invariant: no other crate spells a NATS name.

use leasehold_core::lane::Lane;

use crate::StoreError;

/// The NATS names of one leasehold namespace (`lh` by default).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub prefix: String,
}

impl Layout {
    /// Validates the prefix: letters, digits, `-` and `_` only (it is used in
    /// subjects, stream names and bucket names alike).
    pub fn new(prefix: &str) -> Result<Self, StoreError> {
        let ok = !prefix.is_empty()
            && prefix.len() <= 32
            && prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !ok {
            return Err(StoreError::Config(format!(
                "invalid LH_PREFIX {prefix:?}: use 1-32 letters, digits, '-' or '_'"
            )));
        }
        Ok(Layout {
            prefix: prefix.to_string(),
        })
    }

    fn upper(&self) -> String {
        self.prefix.to_ascii_uppercase().replace('-', "_")
    }

    /// The server's advisories of a new leader for any stream or consumer
    /// of the account (`$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.<stream>`
    /// and `...CONSUMER.LEADER_ELECTED.<stream>.<consumer>`).
    pub fn leader_advisories(&self) -> String {
        "$JS.EVENT.ADVISORY.*.LEADER_ELECTED.>".into()
    }

    /// The stream a leader advisory (see [`Layout::leader_advisories`])
    /// names, when it is one of this namespace's streams, buckets or
    /// object stores.
    pub fn elected_stream<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let stream = subject.split('.').nth(5)?;
        let buckets = self.prefix.replace('-', "_");
        let ours = stream
            .strip_prefix(&self.upper())
            .or_else(|| {
                stream
                    .strip_prefix("KV_")
                    .and_then(|s| s.strip_prefix(&buckets))
            })
            .or_else(|| {
                stream
                    .strip_prefix("OBJ_")
                    .and_then(|s| s.strip_prefix(&buckets))
            })
            .is_some_and(|rest| rest.starts_with('_'));
        ours.then_some(stream)
    }

    /// Work-queue stream holding submission tickets.
    pub fn work_stream(&self) -> String {
        format!("{}_WORK", self.upper())
    }
    /// `lh.submit.<kind>`.
    pub fn submit_subject(&self, kind: &str) -> String {
        format!("{}.submit.{kind}", self.prefix)
    }
    /// Where a job of `kind` waits: `lh.submit.<kind>` for the default lane,
    /// else `lh.submit.<kind>.<tenant>.<priority>`.
    pub fn lane_subject(&self, kind: &str, lane: &Lane) -> String {
        if lane.is_default() {
            self.submit_subject(kind)
        } else {
            format!(
                "{}.submit.{kind}.{}.{}",
                self.prefix, lane.tenant, lane.priority
            )
        }
    }
    /// `lh.submit.<kind>.*.*`: every lane of `kind` but the default one.
    pub fn lanes_filter(&self, kind: &str) -> String {
        format!("{}.submit.{kind}.*.*", self.prefix)
    }
    /// The kind and lane of a ticket's subject (`None`: not a submission
    /// subject, or a malformed lane).
    pub fn lane_of_submit_subject<'a>(&self, subject: &'a str) -> Option<(&'a str, Lane)> {
        let rest = subject
            .strip_prefix(&self.prefix)?
            .strip_prefix(".submit.")?;
        let mut t = rest.split('.');
        let kind = t.next().filter(|k| !k.is_empty())?;
        match (t.next(), t.next(), t.next()) {
            (None, _, _) => Some((kind, Lane::default())),
            (Some(tenant), Some(p), None) => Some((kind, Lane::from_tokens(tenant, p).ok()?)),
            _ => None,
        }
    }
    /// Durable pull consumer of one lane of one kind (not the default
    /// lane's, which is [`Layout::work_consumer`]). Workers create it when
    /// the lane first has a job; it goes away after an idle hour. The kind's
    /// length keeps names apart (kind `a_b` tenant `c`, kind `a` tenant `b_c`).
    pub fn lane_consumer(&self, kind: &str, lane: &Lane) -> String {
        format!(
            "{}{}_p{}",
            self.lane_consumers_prefix(kind),
            lane.tenant,
            lane.priority
        )
    }
    /// What the names of `kind`'s lane consumers start with.
    pub fn lane_consumers_prefix(&self, kind: &str) -> String {
        format!(
            "{}_lane_{}_{}_",
            self.prefix,
            kind.len(),
            kind.replace(['.', '*', '>'], "_")
        )
    }
    /// `lh.submit.>`.
    pub fn submit_wildcard(&self) -> String {
        format!("{}.submit.>", self.prefix)
    }
    /// What the gateway listens on: `lh.submit.*` (default lanes) and
    /// `lh.submit.*.*.*` (tenant and priority lanes), so a submission of
    /// a kind no stream holds is seen on every lane.
    pub fn gateway_submit_wildcards(&self) -> [String; 2] {
        [
            format!("{}.submit.*", self.prefix),
            format!("{}.submit.*.*.*", self.prefix),
        ]
    }
    /// The first token after `lh.submit.` of any subject there, the kind it
    /// names even when its lane is malformed (what a rejection names).
    pub fn kind_token_of_submit_subject<'a>(&self, subject: &'a str) -> Option<&'a str> {
        subject
            .strip_prefix(&self.prefix)?
            .strip_prefix(".submit.")?
            .split('.')
            .next()
            .filter(|k| !k.is_empty())
    }
    /// The kind named by a submission subject (of any lane), if it is one;
    /// `None` for the lanes' wildcard (`lh.submit.<kind>.*.*`).
    pub fn kind_of_submit_subject<'a>(&self, subject: &'a str) -> Option<&'a str> {
        self.lane_of_submit_subject(subject).map(|(k, _)| k)
    }
    /// Durable pull consumer of one kind's tickets.
    pub fn work_consumer(&self, kind: &str) -> String {
        format!(
            "{}_workers_{}",
            self.prefix,
            kind.replace(['.', '*', '>'], "_")
        )
    }
    /// KV bucket of job records.
    pub fn jobs_bucket(&self) -> String {
        format!("{}_jobs", self.prefix.replace('-', "_"))
    }
    /// KV bucket of the effects ledger.
    pub fn effects_bucket(&self) -> String {
        format!("{}_effects", self.prefix.replace('-', "_"))
    }
    /// Object store of artifacts.
    pub fn artifacts_bucket(&self) -> String {
        format!("{}_artifacts", self.prefix.replace('-', "_"))
    }
    /// Event stream.
    pub fn events_stream(&self) -> String {
        format!("{}_EVENTS", self.upper())
    }
    /// `lh.events.<job_id>.<type>`.
    pub fn event_subject(&self, job_id: &str, ty: &str) -> String {
        format!("{}.events.{job_id}.{ty}", self.prefix)
    }
    /// `lh.events.<job_id>.>`: every event of one job (the fence scope).
    pub fn job_events_filter(&self, job_id: &str) -> String {
        format!("{}.events.{job_id}.>", self.prefix)
    }
    /// `lh.events.>`.
    pub fn events_wildcard(&self) -> String {
        format!("{}.events.>", self.prefix)
    }
    /// Dead-letter stream.
    pub fn dlq_stream(&self) -> String {
        format!("{}_DLQ", self.upper())
    }
    /// `lh.dlq.<kind>`.
    pub fn dlq_subject(&self, kind: &str) -> String {
        format!("{}.dlq.{kind}", self.prefix)
    }
    /// `lh.dlq.>`.
    pub fn dlq_wildcard(&self) -> String {
        format!("{}.dlq.>", self.prefix)
    }
    /// `lh.cancel.<job_id>`.
    pub fn cancel_subject(&self, job_id: &str) -> String {
        format!("{}.cancel.{job_id}", self.prefix)
    }
    /// `lh.cancel.*`.
    pub fn cancel_wildcard(&self) -> String {
        format!("{}.cancel.*", self.prefix)
    }
    /// `lh.enqueued.<seq>`: a submitter tells the fleet that ticket `seq`
    /// of the work stream is its job; a worker creates the queued record
    /// (submitters may not write records themselves).
    pub fn enqueued_subject(&self, seq: u64) -> String {
        format!("{}.enqueued.{seq}", self.prefix)
    }
    /// `lh.enqueued.*`.
    pub fn enqueued_wildcard(&self) -> String {
        format!("{}.enqueued.*", self.prefix)
    }
    /// The ticket sequence named by an `lh.enqueued.<seq>` subject.
    pub fn seq_of_enqueued_subject(&self, subject: &str) -> Option<u64> {
        subject
            .strip_prefix(&self.prefix)?
            .strip_prefix(".enqueued.")?
            .parse()
            .ok()
    }
    /// Signal stream: signals sent to jobs, kept until their job takes
    /// them (`store::signals`).
    pub fn signals_stream(&self) -> String {
        format!("{}_SIGNALS", self.upper())
    }
    /// `lh.signal.<job_id>.<name>`: a signal `name` for a job; its payload
    /// is the signal's data (JSON).
    pub fn signal_subject(&self, job_id: &str, name: &str) -> String {
        format!("{}.signal.{job_id}.{name}", self.prefix)
    }
    /// `lh.signal.<job_id>.*`: every signal of one job.
    pub fn job_signals_filter(&self, job_id: &str) -> String {
        format!("{}.signal.{job_id}.*", self.prefix)
    }
    /// `lh.signal.>`.
    pub fn signals_wildcard(&self) -> String {
        format!("{}.signal.>", self.prefix)
    }
    /// The job and the signal's name of an `lh.signal.<job>.<name>` subject.
    pub fn of_signal_subject<'a>(&self, subject: &'a str) -> Option<(&'a str, &'a str)> {
        let rest = subject
            .strip_prefix(&self.prefix)?
            .strip_prefix(".signal.")?;
        let (job, name) = rest.split_once('.')?;
        (!name.contains('.')).then_some((job, name))
    }
    /// Durable consumer of the signal stream shared by every worker and
    /// reaper: each signal looked at once, its job woken if it waits for it.
    pub fn signal_wake_consumer(&self) -> String {
        format!("{}_signal_wakes", self.prefix)
    }
    /// Stream capturing the server's max-deliveries advisories of the work consumers.
    pub fn advisory_stream(&self) -> String {
        format!("{}_ADVISORIES", self.upper())
    }
    /// Advisory subject of max deliveries on the work stream, every consumer.
    pub fn max_deliveries_advisories(&self) -> String {
        format!(
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.*",
            self.work_stream()
        )
    }
}

/// Names of worker liveness (sessions) and the index of active jobs.
impl Layout {
    /// KV bucket of worker sessions: key = worker id, kept alive by the
    /// worker's renewals, removed by the server when they stop (per-key TTL).
    pub fn sessions_bucket(&self) -> String {
        format!("{}_sessions", self.prefix.replace('-', "_"))
    }
    /// KV bucket of provider limits: key = provider key id (`leasehold
    /// limits set`), watched by every worker.
    pub fn limits_bucket(&self) -> String {
        format!("{}_limits", self.prefix.replace('-', "_"))
    }
    /// KV bucket of flow control's coordination: `lease.<id>` (the leases
    /// of a provider key's limits), `cool.<id>` and `breaker.<id>` (pauses),
    /// `learned.<id>` (a concurrency the key was found to serve at most).
    pub fn flow_bucket(&self) -> String {
        format!("{}_flow", self.prefix.replace('-', "_"))
    }
    /// KV bucket of recurring schedules: key = schedule name (`leasehold
    /// schedule add`), fired by the reapers.
    pub fn schedules_bucket(&self) -> String {
        format!("{}_schedules", self.prefix.replace('-', "_"))
    }
    /// Durable consumer (headers only) of the sessions bucket's stream,
    /// shared by every worker and reaper: each ended session is handled by
    /// one of them.
    pub fn session_watch_consumer(&self) -> String {
        format!("{}_session_ends", self.prefix)
    }
    /// KV bucket indexing the jobs that are not finished: `run.<worker>.<job>`,
    /// `wait.<job>`, `park.<job>`. Nothing ever lists the job records themselves.
    pub fn active_bucket(&self) -> String {
        format!("{}_active", self.prefix.replace('-', "_"))
    }
    /// KV bucket of large job inputs and outputs (`<job>.input`,
    /// `<job>.output`), kept beside the small, often rewritten record.
    pub fn payloads_bucket(&self) -> String {
        format!("{}_payloads", self.prefix.replace('-', "_"))
    }
    /// `lh.workers.<worker>.<what>`: requests to one worker process (`ping`, `cancel`).
    pub fn worker_subject(&self, worker_id: &str, what: &str) -> String {
        format!("{}.workers.{worker_id}.{what}", self.prefix)
    }
    /// `lh.workers.<worker>.*`: everything addressed to one worker.
    pub fn worker_wildcard(&self, worker_id: &str) -> String {
        format!("{}.workers.{worker_id}.*", self.prefix)
    }
}

/// Whether `id` can name a worker: it is a KV key and a subject token
/// (letters, digits, `-`, `_`, `=`; at most 128).
pub fn valid_worker_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '='))
}

/// Names of the history of finished jobs (`store::history`).
impl Layout {
    /// Stream of finished jobs: one message per end, written by the
    /// reapers' historian, searched by `leasehold list --finished` and the
    /// console's jobs page.
    pub fn history_stream(&self) -> String {
        format!("{}_HISTORY", self.upper())
    }
    /// `lh.history.<status>.<kind>.<tenant>.<class>`, each token already
    /// subject-safe (`history::token`) or a wildcard.
    pub fn history_subject(&self, status: &str, kind: &str, tenant: &str, class: &str) -> String {
        format!("{}.history.{status}.{kind}.{tenant}.{class}", self.prefix)
    }
    /// `lh.history.>`.
    pub fn history_wildcard(&self) -> String {
        format!("{}.history.>", self.prefix)
    }
    /// Durable consumer of the reapers' historian on the event stream
    /// (the terminal events), shared by every replica.
    pub fn historian_consumer(&self) -> String {
        format!("{}_historian", self.prefix)
    }
}

/// Names used by the reaper service.
impl Layout {
    /// Durable consumer of the reapers on the advisory stream. Every replica
    /// shares it, so each advisory goes to one reaper at a time.
    pub fn reaper_consumer(&self) -> String {
        format!("{}_reaper", self.prefix)
    }
    /// Request subject answered by every reaper with its metrics as JSON.
    pub fn reaper_metrics_subject(&self) -> String {
        format!("{}.reaper.metrics", self.prefix)
    }
    /// Request subject answered by every live reaper with its id: the roll
    /// call by which reapers split the shards.
    pub fn reaper_roll_subject(&self) -> String {
        format!("{}.reaper.roll", self.prefix)
    }
}

/// Whether `subject` is one that the stream subject `filter` captures
/// (`*` one token, a last `>` one or more).
pub fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return f.next().is_none(),
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leader_advisories_name_the_namespaces_streams_only() {
        let l = Layout::new("lh").unwrap();
        let adv = "$JS.EVENT.ADVISORY";
        for (subject, stream) in [
            (
                format!("{adv}.STREAM.LEADER_ELECTED.LH_WORK"),
                Some("LH_WORK"),
            ),
            (
                format!("{adv}.CONSUMER.LEADER_ELECTED.LH_WORK.lh_workers_echo"),
                Some("LH_WORK"),
            ),
            (
                format!("{adv}.STREAM.LEADER_ELECTED.KV_lh_jobs"),
                Some("KV_lh_jobs"),
            ),
            (
                format!("{adv}.STREAM.LEADER_ELECTED.OBJ_lh_artifacts"),
                Some("OBJ_lh_artifacts"),
            ),
            (format!("{adv}.STREAM.LEADER_ELECTED.KV_lhx_jobs"), None),
            (format!("{adv}.STREAM.LEADER_ELECTED.LHX_WORK"), None),
            (format!("{adv}.STREAM.LEADER_ELECTED.ORDERS"), None),
            ("$JS.EVENT.ADVISORY.STREAM".to_string(), None),
        ] {
            assert_eq!(l.elected_stream(&subject), stream, "{subject}");
        }
        let other = Layout::new("team-a").unwrap();
        assert_eq!(
            other.elected_stream(&format!("{adv}.STREAM.LEADER_ELECTED.KV_team_a_jobs")),
            Some("KV_team_a_jobs")
        );
        assert_eq!(
            other.elected_stream(&format!("{adv}.STREAM.LEADER_ELECTED.TEAM_A_EVENTS")),
            Some("TEAM_A_EVENTS")
        );
    }

    #[test]
    fn default_names_match_the_contract() {
        let l = Layout::new("lh").unwrap();
        assert_eq!(l.work_stream(), "LH_WORK");
        assert_eq!(l.submit_subject("research"), "lh.submit.research");
        assert_eq!(l.jobs_bucket(), "lh_jobs");
        assert_eq!(l.effects_bucket(), "lh_effects");
        assert_eq!(l.artifacts_bucket(), "lh_artifacts");
        assert_eq!(l.events_stream(), "LH_EVENTS");
        assert_eq!(l.event_subject("j", "claimed"), "lh.events.j.claimed");
        assert_eq!(l.dlq_subject("echo"), "lh.dlq.echo");
        assert_eq!(l.dlq_stream(), "LH_DLQ");
        assert_eq!(l.cancel_subject("j"), "lh.cancel.j");
        assert_eq!(l.enqueued_subject(7), "lh.enqueued.7");
        assert_eq!(l.seq_of_enqueued_subject("lh.enqueued.7"), Some(7));
        assert_eq!(l.seq_of_enqueued_subject("lh.enqueued.x"), None);
        assert_eq!(l.kind_of_submit_subject("lh.submit.echo"), Some("echo"));
        let acme = Lane::from_tokens("acme", "2").unwrap();
        assert_eq!(l.lane_subject("echo", &acme), "lh.submit.echo.acme.2");
        assert_eq!(l.lane_subject("echo", &Lane::default()), "lh.submit.echo");
        assert_eq!(
            l.lane_of_submit_subject("lh.submit.echo.acme.2"),
            Some(("echo", acme.clone()))
        );
        assert_eq!(l.kind_of_submit_subject("lh.submit.echo.*.*"), None);
        assert_eq!(l.kind_of_submit_subject("lh.submit.echo.acme.9"), None);
        assert_eq!(l.kind_of_submit_subject("lh.submit.echo.acme"), None);
        assert_eq!(l.lanes_filter("echo"), "lh.submit.echo.*.*");
        assert_eq!(l.lane_consumer("echo", &acme), "lh_lane_4_echo_acme_p2");
        assert_ne!(
            l.lane_consumer("a_b", &Lane::from_tokens("c", "3").unwrap()),
            l.lane_consumer("a", &Lane::from_tokens("b_c", "3").unwrap())
        );
        assert_eq!(Layout::new("acme").unwrap().jobs_bucket(), "acme_jobs");
        assert!(Layout::new("a.b").is_err());
        assert_eq!(l.sessions_bucket(), "lh_sessions");
        assert_eq!(l.active_bucket(), "lh_active");
        assert_eq!(l.history_stream(), "LH_HISTORY");
        assert_eq!(
            l.history_subject("failed", "echo", "acme", "none"),
            "lh.history.failed.echo.acme.none"
        );
        assert_eq!(l.historian_consumer(), "lh_historian");
        assert_eq!(l.worker_subject("w-1", "ping"), "lh.workers.w-1.ping");
        assert!(valid_worker_id("pod-7_a"));
        assert!(!valid_worker_id("a.b") && !valid_worker_id("a b") && !valid_worker_id(""));
    }

    #[test]
    fn stream_filters_capture_their_subjects_only() {
        assert!(subject_matches("lh.submit.echo", "lh.submit.echo"));
        assert!(subject_matches(
            "lh.submit.echo.*.*",
            "lh.submit.echo.acme.2"
        ));
        assert!(!subject_matches("lh.submit.echo.*.*", "lh.submit.echo"));
        assert!(!subject_matches(
            "lh.submit.echo.*.*",
            "lh.submit.echo.acme"
        ));
        assert!(!subject_matches(
            "lh.submit.echo.*.*",
            "lh.submit.echox.a.1"
        ));
        assert!(!subject_matches("lh.submit.echo", "lh.submit.echo.acme.2"));
        assert!(subject_matches("lh.submit.>", "lh.submit.echo.acme.2"));
        assert!(!subject_matches("lh.submit.>", "lh.submit"));
        let l = Layout::new("lh").unwrap();
        assert_eq!(
            l.kind_token_of_submit_subject("lh.submit.nope.acme.x"),
            Some("nope")
        );
        assert_eq!(
            l.kind_token_of_submit_subject("lh.submit.nope"),
            Some("nope")
        );
        assert_eq!(l.kind_token_of_submit_subject("lh.events.j.x"), None);
    }
}
