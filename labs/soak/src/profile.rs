//! Profiles: which fleet, which load and which faults a run has.
//!
//! `default` is the soak as it always was (a seed replays the same plan as
//! before profiles existed). The others put the fleet where users put it:
//!
//! - `busy`: long `sleep` jobs sized to the fleet's slots (every slot busy,
//!   a small queue behind them), one worker with fewer slots than the kinds
//!   it serves, a few poison jobs (`crash`, which aborts its worker; the soak
//!   starts a crashed worker again, as a process supervisor would), and the
//!   usual faults with more worker kills.
//! - `nats-restart`: the single server killed or stopped and started again
//!   after two to three session timeouts, with long jobs in flight.
//! - `rolling`: a rolling restart of the three cluster nodes, one node at a
//!   time (SIGTERM, start, wait until it is current again), under long jobs.
//! - `operators`: the default's faults while operators act on the fleet
//!   with the `leasehold` CLI: reviews resumed and parked jobs cancelled,
//!   dead letters replayed, a kind added to the running fleet and pruned,
//!   ids reused after a short retention (see [`crate::ops`]).
//! - `scale`: a wide fleet on the 3-node cluster: 100 worker processes
//!   with 2 slots each and 3 reapers splitting the sweep, the job mix, and
//!   the kill -9 of nodes (leaders and followers) and of workers.

use std::time::Duration;

use serde::Serialize;

use crate::plan;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// Today's soak: the job mix at --rate, every fault kind of the topology.
    Default,
    /// A fleet kept above 90% slot use with long jobs, poison jobs among them.
    Busy,
    /// Single-node server restarts longer than the session timeout.
    NatsRestart,
    /// Rolling restarts of the 3 cluster nodes.
    Rolling,
    /// The default's faults while operators resume, cancel, replay, add and
    /// prune a kind, and reuse ids after a short retention.
    Operators,
    /// 100 small workers and 3 reapers on the 3-node cluster, with kills
    /// of nodes and workers.
    Scale,
}

/// Long `sleep` jobs that keep slots busy: `lanes` chains of jobs, each
/// submitted `lead_ms` before the previous one of its lane is planned to end.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LongJobs {
    /// Lanes per slot of the fleet, rounded up (above 1: a small queue
    /// behind the slots, so a freed slot finds a job waiting).
    pub per_slot: f64,
    /// Duration of each job, uniform in this range.
    pub ms: (u64, u64),
    /// No job is planned to end later than this after the injection.
    pub tail_ms: u64,
    pub lead_ms: u64,
}

impl LongJobs {
    /// How many lanes a fleet of `slots` gets.
    pub fn lanes(&self, slots: usize) -> usize {
        (self.per_slot * slots as f64).ceil() as usize
    }
}

/// What a profile sets; every field but the profile's nature (long jobs,
/// poison, the fault deck) can be changed on the command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Knobs {
    pub profile: Profile,
    pub cluster: bool,
    pub workers: usize,
    pub reapers: usize,
    pub proxied: usize,
    /// Concurrency of each worker slot; the last value repeats.
    pub concurrency: Vec<usize>,
    /// Submissions per second of the usual job mix.
    pub rate: f64,
    pub session_timeout: Duration,
    pub gap: (Duration, Duration),
    pub quiesce_timeout: Duration,
    pub max_stale_reclaims: u32,
    pub long: Option<LongJobs>,
    /// Planned poison (`crash`) jobs, and crashed workers started again.
    pub poison: bool,
    /// How many poison jobs (default: 3 plus one per two minutes of run).
    pub poison_jobs: Option<usize>,
    /// A `dead` job that is not a planned poison job fails the run.
    pub dead_fails: bool,
    /// Slot use the load is sized for (reported against it).
    pub slot_use_target: Option<f64>,
    /// Operators act during the run ([`crate::ops`]); their kind
    /// ([`crate::ops::LIVE_KIND`]) is not set up at the start.
    pub ops: bool,
    /// The fraction of the mix's `sleep` jobs that are durable timers
    /// (`--durable-sleeps`; 0 keeps recorded plans as they were).
    pub durable_sleeps: f64,
    /// The fraction of the mix's `sleep` jobs that then wait for a signal
    /// the soak sends them (`--signals`; 0 keeps recorded plans).
    pub signals: f64,
    /// Children of one planned `fanout` parent (`--fanout`; 0: none).
    pub fanout: usize,
    /// The fraction of the mix's research jobs whose experts are child
    /// jobs (`--expert-jobs`; 0 keeps recorded plans).
    pub expert_jobs: f64,
}

impl Knobs {
    /// The concurrency of worker slot `i`.
    pub fn concurrency_of(&self, i: usize) -> usize {
        self.concurrency
            .get(i)
            .or(self.concurrency.last())
            .copied()
            .unwrap_or(1)
    }

    /// Slots of the whole fleet: the sum of every worker's concurrency.
    pub fn slots(&self) -> usize {
        (0..self.workers).map(|i| self.concurrency_of(i)).sum()
    }

    /// Kinds the workers serve (and setup creates).
    pub fn kinds(&self) -> Vec<String> {
        let mut k: Vec<String> = plan::KINDS
            .iter()
            .filter(|k| !(self.ops && **k == crate::ops::LIVE_KIND))
            .map(|k| k.to_string())
            .collect();
        if self.poison {
            k.push("crash".into());
        }
        if self.fanout > 0 {
            k.push("fanout".into());
        }
        if self.expert_jobs > 0.0 {
            k.push("research-expert".into());
        }
        k
    }

    /// The fault kinds dealt, in deck order (a kind listed twice is dealt
    /// twice as often).
    pub fn deck(&self) -> Vec<&'static str> {
        let proxied = self.proxied > 0;
        match self.profile {
            Profile::Default => plan::fault_kinds(self.cluster, proxied),
            Profile::Operators => {
                let mut k = plan::fault_kinds(self.cluster, proxied);
                // Short cuts, inside the session timeout: the default's
                // deck (and so its pinned plans) stays as it was.
                if proxied {
                    k.push("partition_blip");
                }
                k
            }
            Profile::Busy => {
                let mut k = plan::fault_kinds(self.cluster, proxied);
                // Kill -9 of workers especially: what a busy fleet loses most.
                k.extend(["kill9_worker_same_id", "kill9_worker_new_id"]);
                k
            }
            Profile::NatsRestart => vec!["nats_restart_kill9", "nats_restart_sigterm"],
            Profile::Rolling => vec!["rolling_restart"],
            // What a wide fleet on a cluster loses: nodes, and workers
            // among many.
            Profile::Scale => vec![
                "kill9_node_leader",
                "kill9_node_follower",
                "kill9_node_leader",
                "kill9_node_follower",
                "kill9_worker_new_id",
                "kill9_reaper",
            ],
        }
    }
}

impl Profile {
    pub fn name(self) -> &'static str {
        match self {
            Profile::Default => "default",
            Profile::Busy => "busy",
            Profile::NatsRestart => "nats-restart",
            Profile::Rolling => "rolling",
            Profile::Operators => "operators",
            Profile::Scale => "scale",
        }
    }

    /// The profile's settings before the command line's overrides.
    /// `cluster` is the `--cluster` flag (`rolling` is always a cluster,
    /// `nats-restart` never).
    pub fn knobs(self, cluster: bool) -> anyhow::Result<Knobs> {
        let s = Duration::from_secs;
        let base = Knobs {
            profile: self,
            cluster,
            workers: 4,
            reapers: 2,
            proxied: 2,
            concurrency: vec![8],
            rate: 1.5,
            session_timeout: s(3),
            gap: (s(3), s(12)),
            quiesce_timeout: s(300),
            max_stale_reclaims: 6,
            long: None,
            poison: false,
            poison_jobs: None,
            dead_fails: false,
            slot_use_target: None,
            ops: false,
            durable_sleeps: 0.0,
            signals: 0.0,
            fanout: 0,
            expert_jobs: 0.0,
        };
        let long = |per_slot| LongJobs {
            per_slot,
            ms: (20_000, 60_000),
            tail_ms: 30_000,
            lead_ms: 2_000,
        };
        Ok(match self {
            Profile::Default => base,
            Profile::Operators => Knobs {
                rate: 0.8,
                ops: true,
                ..base
            },
            Profile::Busy => Knobs {
                // Worker 1 serves 6 kinds with 2 slots; the others have 4.
                concurrency: vec![2, 4],
                rate: 0.25,
                // Fewer faults than the default's 3-12 s, and some room for
                // interruptions before a job counts as poison: the soak's own
                // kills must not be what dead-letters a 60 s job (at this
                // rate a job loses a worker about once a minute), while each
                // poison job's crashes (limit + 1 of them) take its
                // bystanders along, so the limit stays close to the
                // product's default (3).
                gap: (s(5), s(15)),
                max_stale_reclaims: 5,
                quiesce_timeout: s(180),
                long: Some(long(1.1)),
                poison: true,
                dead_fails: true,
                slot_use_target: Some(0.9),
                ..base
            },
            Profile::NatsRestart => {
                anyhow::ensure!(
                    !cluster,
                    "--profile nats-restart restarts the single server; drop --cluster"
                );
                Knobs {
                    concurrency: vec![4],
                    rate: 0.5,
                    gap: (s(8), s(20)),
                    quiesce_timeout: s(180),
                    long: Some(long(0.75)),
                    dead_fails: true,
                    ..base
                }
            }
            Profile::Scale => Knobs {
                cluster: true,
                workers: 100,
                reapers: 3,
                // No fault proxies: the faults are the nodes' and the
                // workers' kills.
                proxied: 0,
                concurrency: vec![2],
                rate: 1.5,
                // The product's default session, as for `rolling`: a
                // killed node's elections stall writes for 4-9 s.
                session_timeout: s(10),
                gap: (s(10), s(25)),
                quiesce_timeout: s(300),
                ..base
            },
            Profile::Rolling => Knobs {
                cluster: true,
                // The product's default session: a restarted node's leader
                // elections can stall writes for several seconds, which the
                // default timeout rides out and the soak's short one
                // (3 s, for quick recoveries elsewhere) does not.
                session_timeout: s(10),
                concurrency: vec![4],
                rate: 0.5,
                gap: (s(5), s(15)),
                quiesce_timeout: s(180),
                long: Some(long(0.75)),
                dead_fails: true,
                ..base
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_profile_is_the_soak_as_it_was() {
        let k = Profile::Default.knobs(false).unwrap();
        assert_eq!(k.workers, 4);
        assert_eq!(k.slots(), 32);
        assert_eq!(k.kinds(), plan::KINDS.map(String::from).to_vec());
        assert_eq!(k.deck(), plan::fault_kinds(false, true));
        assert!(k.long.is_none() && !k.poison && !k.dead_fails);
    }

    #[test]
    fn busy_has_a_worker_with_more_kinds_than_slots() {
        let k = Profile::Busy.knobs(false).unwrap();
        assert_eq!(k.concurrency_of(0), 2);
        assert_eq!(k.concurrency_of(3), 4);
        assert_eq!(k.slots(), 14);
        assert!(k.kinds().len() > k.concurrency_of(0));
        assert!(k.kinds().contains(&"crash".to_string()));
        let deck = k.deck();
        let kills = deck
            .iter()
            .filter(|d| d.starts_with("kill9_worker"))
            .count();
        assert_eq!(kills, 4);
    }

    #[test]
    fn operators_add_their_kind_live() {
        let k = Profile::Operators.knobs(false).unwrap();
        assert!(k.ops);
        assert!(!k.kinds().contains(&crate::ops::LIVE_KIND.to_string()));
        let mut deck = plan::fault_kinds(false, true);
        deck.push("partition_blip");
        assert_eq!(k.deck(), deck);
    }

    #[test]
    fn scale_is_a_hundred_small_workers_and_three_reapers_on_the_cluster() {
        let k = Profile::Scale.knobs(false).unwrap();
        assert!(k.cluster);
        assert_eq!((k.workers, k.reapers, k.proxied), (100, 3, 0));
        assert_eq!(k.slots(), 200);
        assert!(
            k.deck()
                .iter()
                .filter(|d| d.starts_with("kill9_node"))
                .count()
                >= 4
        );
    }

    #[test]
    fn topologies_are_fixed_where_the_profile_needs_one() {
        assert!(Profile::Rolling.knobs(false).unwrap().cluster);
        assert!(Profile::NatsRestart.knobs(true).is_err());
        assert!(!Profile::NatsRestart.knobs(false).unwrap().cluster);
    }
}
