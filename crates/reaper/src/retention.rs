//! Forgetting finished jobs after their retention (see
//! `leasehold_store::retention`): one class per distinct retention, each
//! read from its own cursor over the terminal events, lagging by it.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use leasehold_store::retention::Retention;
use tokio_util::sync::CancellationToken;

use crate::metrics::Stats;
use crate::Options;

/// Terminal events read per class per pass; a full pass runs again at once.
const PER_PASS: usize = 1000;

/// One retention class: a duration and which kinds it covers.
#[derive(Debug, Clone, PartialEq)]
pub struct Class {
    pub retention: Duration,
    /// The kinds with this retention; `None`: every kind not named elsewhere.
    pub kinds: Option<Vec<String>>,
    /// Kinds named by other classes (excluded from the default class).
    pub others: Vec<String>,
}

impl Class {
    pub fn belongs(&self, kind: &str) -> bool {
        match &self.kinds {
            Some(k) => k.iter().any(|x| x == kind),
            None => !self.others.iter().any(|x| x == kind),
        }
    }
}

/// The classes of the options (none when retention is off everywhere).
pub fn classes(o: &Options) -> Vec<Class> {
    let named: Vec<String> = o.retention_kind.iter().map(|(k, _)| k.clone()).collect();
    let mut by_dur: BTreeMap<Duration, Vec<String>> = BTreeMap::new();
    for (k, d) in &o.retention_kind {
        by_dur.entry(*d).or_default().push(k.clone());
    }
    let mut out = Vec::new();
    if !o.retention.is_zero() {
        // Kinds whose own retention equals the default share its class.
        let same = by_dur.remove(&o.retention).unwrap_or_default();
        out.push(Class {
            retention: o.retention,
            kinds: None,
            others: named
                .iter()
                .filter(|k| !same.contains(k))
                .cloned()
                .collect(),
        });
    }
    for (d, kinds) in by_dur {
        if !d.is_zero() {
            out.push(Class {
                retention: d,
                kinds: Some(kinds),
                others: Vec::new(),
            });
        }
    }
    out
}

/// Runs the passes every `every` until `shutdown`: each class, then the
/// transcripts' pass when `transcripts` is set.
pub async fn run(
    retention: Retention,
    classes: Vec<Class>,
    transcripts: Option<Duration>,
    every: Duration,
    stats: Arc<Stats>,
    shutdown: CancellationToken,
) {
    if classes.is_empty() && transcripts.is_none() {
        return;
    }
    loop {
        if let Some(after) = transcripts {
            loop {
                match retention.transcripts_pass(after, PER_PASS).await {
                    Ok(p) => {
                        if p.forgotten > 0 {
                            tracing::info!(after = %leasehold_core::time::human_duration(after), jobs = p.forgotten, "transcripts of finished jobs removed");
                        }
                        if (p.seen as usize) < PER_PASS || shutdown.is_cancelled() {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "transcript pass failed; retrying at the next interval");
                        break;
                    }
                }
            }
        }
        for c in &classes {
            loop {
                match retention
                    .pass(c.retention, |k| c.belongs(k), PER_PASS)
                    .await
                {
                    Ok(p) => {
                        stats.forgotten.fetch_add(p.forgotten, Ordering::Relaxed);
                        if p.forgotten > 0 {
                            tracing::info!(retention = %leasehold_core::time::human_duration(c.retention), forgotten = p.forgotten, seen = p.seen, "finished jobs past their retention removed");
                        }
                        if (p.seen as usize) < PER_PASS || shutdown.is_cancelled() {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "retention pass failed; retrying at the next interval");
                        break;
                    }
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn classes_group_kinds_by_retention() {
        let o = Options::parse_from([
            "leasehold-reaper",
            "--retention",
            "7d",
            "--retention-kind",
            "echo=1h,sleep=1h,research=7d",
        ]);
        let c = classes(&o);
        assert_eq!(c.len(), 2);
        assert!(c[0].belongs("research") && c[0].belongs("deliver") && !c[0].belongs("echo"));
        assert!(c[1].belongs("echo") && c[1].belongs("sleep") && !c[1].belongs("research"));
        assert_eq!(c[1].retention, Duration::from_secs(3600));
        let off = Options::parse_from(["leasehold-reaper", "--retention", "0s"]);
        assert!(classes(&off).is_empty());
    }
}
