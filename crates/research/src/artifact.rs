//! The job's document: stored once under the job id and never overwritten
//! (another attempt's is adopted), delivered once by the job's publish
//! step, ownership proven right before each; and the partial report of a
//! job cancelled or out of budget.

use std::collections::BTreeMap;

use leasehold::runtime::{step_id, CallCtx, Disposition, ToolError};
use leasehold::{Error, JobResult, NewDocument, Report};
use serde_json::json;

use crate::hooks::CrashPoint;
use crate::report::{self};
use crate::state::{Resume, SectionCk};
use crate::Job;

/// Artifact metadata keys: the version fingerprint it was made under, and the
/// result facts (title, skipped sections) a later attempt needs to finish.
const META_VERSION: &str = "lh-version";
const META_TITLE: &str = "lh-title";
const META_SKIPPED: &str = "lh-skipped";
/// The incarnation of the job that stored the document (its record's
/// `created_at`): an id reused after retention starts a new incarnation,
/// and never adopts an earlier one's document.
const META_INCARNATION: &str = "lh-incarnation";

/// The stored document and the result facts kept with it.
pub(crate) struct Artifact {
    name: String,
    doc: String,
    title: String,
    skipped: Vec<String>,
    version: String,
}

impl Job<'_> {
    /// A cancelled or budget-exhausted job's partial report, stored as
    /// `<id>/partial.md` (overwritten by a later attempt's: it is never
    /// delivered, so no key depends on its digest), when the outline and
    /// the experts are known and at least one section was written. `None`
    /// otherwise, or when it cannot be stored (the job's end matters more).
    pub(crate) async fn partial_report(&self, e: &Error) -> Option<Report> {
        // A stop that is not the job's end (ownership lost, a hand-back at
        // shutdown) keeps nothing: only a cancel someone asked for, of the
        // job as this attempt still holds it, or the budget.
        if matches!(e, Error::Cancelled) && !self.ctx.cancel_requested() {
            return None;
        }
        let outline = self.state.outline.as_ref()?;
        let experts = self.state.experts.as_deref()?;
        let mut sections: BTreeMap<(usize, usize), SectionCk> = self
            .state
            .sections
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        for s in self.fresh.lock().expect("fresh sections").iter() {
            sections.insert((s.expert, s.index), s.clone());
        }
        if !sections.values().any(|s| s.completed()) && self.state.finals.is_empty() {
            return None;
        }
        let why = match e {
            Error::BudgetExhausted(m) => format!("its budget ran out ({m})"),
            _ => "the job was cancelled".to_string(),
        };
        let skipped: Vec<String> = outline
            .sections
            .iter()
            .enumerate()
            .flat_map(|(i, o)| {
                let sections = &sections;
                experts
                    .iter()
                    .enumerate()
                    .filter(move |(x, _)| !sections.get(&(*x, i)).is_some_and(|s| s.completed()))
                    .map(move |(_, ex)| format!("{}. {} ({})", i + 1, o.title, ex.name))
            })
            .collect();
        let recovery = self.recovery().await;
        let doc = report::partial_document(
            &self.report_doc(outline, experts, &sections, &skipped, &recovery),
            &why,
        );
        let name = format!("{}/partial.md", self.ctx.id());
        let store = self.ctx.artifacts().await.ok()?;
        let _ = store.delete(&name).await;
        let new = NewDocument {
            name: name.clone(),
            description: Some(format!("partial research report of job {}", self.ctx.id())),
            metadata: [
                (META_VERSION.to_string(), self.fp.clone()),
                (
                    META_INCARNATION.to_string(),
                    self.ctx.record().created_at.clone(),
                ),
            ]
            .into(),
        };
        match store.create(new, doc.as_bytes()).await {
            Ok(_) => Some(Report {
                artifact: name,
                digest: report::sha256_hex(&doc),
                partial: true,
                skipped_sections: skipped,
            }),
            Err(err) => {
                tracing::warn!(job = %self.ctx.id(), error = %err, "the partial report could not be stored");
                None
            }
        }
    }

    pub(crate) fn artifact_name(&self) -> String {
        format!("{}/report.md", self.ctx.id())
    }

    /// The job's stored artifact, if any. Once it exists it *is* the job's
    /// document, whatever version made it: only the delivery and the
    /// completion remain, and rewriting it would change its digest and so
    /// the delivery's idempotency key.
    /// Whether a stored document's metadata names this job's incarnation
    /// (documents stored before the stamp existed count as this job's).
    pub(crate) fn ours(&self, meta: &std::collections::HashMap<String, String>) -> bool {
        meta.get(META_INCARNATION)
            .is_none_or(|c| *c == self.ctx.record().created_at)
    }

    pub(crate) async fn stored_artifact(&self) -> Result<Option<Artifact>, Error> {
        let artifacts = self.ctx.artifacts().await?;
        let name = self.artifact_name();
        match artifacts.get(&name).await? {
            Some(obj) if !self.ours(&obj.metadata) => {
                // An earlier job of this id left it (its retention did not
                // remove it): not this job's document. It goes, so this
                // job stores its own.
                tracing::warn!(job = %self.ctx.id(), "a stored report of an earlier job with this id is removed, not adopted");
                artifacts.delete(&name).await?;
                Ok(None)
            }
            Some(obj) => {
                let doc = obj.text();
                let meta = &obj.metadata;
                Ok(Some(Artifact {
                    title: meta.get(META_TITLE).cloned().unwrap_or_default(),
                    skipped: meta
                        .get(META_SKIPPED)
                        .and_then(|s| serde_json::from_str(s).ok())
                        .unwrap_or_default(),
                    version: meta.get(META_VERSION).cloned().unwrap_or_default(),
                    name,
                    doc,
                }))
            }
            None => Ok(None),
        }
    }

    /// Assembles the document and stores it under the job id.
    pub(crate) async fn write_artifact(&self) -> Result<Artifact, Error> {
        let outline = self.state.outline.as_ref().expect("outline");
        let experts = self.state.experts.as_deref().expect("experts");
        let skipped = self.skipped_sections();
        // Everything before this point durable, so the appendix can count it.
        self.flusher.barrier().await.map_err(|_| Error::Cancelled)?;
        let recovery = self.recovery().await;
        let sections: BTreeMap<_, _> = self
            .state
            .sections
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        let doc =
            report::document(&self.report_doc(outline, experts, &sections, &skipped, &recovery));
        let art = Artifact {
            name: self.artifact_name(),
            title: outline.title.trim().to_string(),
            skipped,
            version: self.fp.clone(),
            doc,
        };
        // The result's facts travel with the document, so a later attempt
        // can deliver and complete from the artifact alone.
        let new = NewDocument {
            name: art.name.clone(),
            description: Some(format!("research report of job {}", self.ctx.id())),
            metadata: [
                (META_VERSION.to_string(), art.version.clone()),
                (META_TITLE.to_string(), art.title.clone()),
                (META_SKIPPED.to_string(), json!(art.skipped).to_string()),
                (
                    META_INCARNATION.to_string(),
                    self.ctx.record().created_at.clone(),
                ),
            ]
            .into(),
        };
        // Still the owner, proven by a write. The create below is
        // conditional anyway: an owner that pauses after this proof can
        // still never overwrite another attempt's document.
        self.prove_owner().await?;
        let created = self
            .ctx
            .artifacts()
            .await?
            .create(new, art.doc.as_bytes())
            .await?;
        if created {
            self.crash.at(CrashPoint::AfterArtifact);
            return Ok(art);
        }
        // Another attempt stored the job's document first: it is the
        // job's document, and this one is dropped (one of an earlier
        // job with this id is removed instead, and this attempt's
        // retry stores its own).
        tracing::warn!(job = %self.ctx.id(), "artifact already stored by another attempt: not overwritten, adopting the stored one");
        self.stored_artifact().await?.ok_or_else(|| {
            Error::retryable(
                "the stored artifact was an earlier job's (removed) or could not be read back",
            )
        })
    }

    /// Proves ownership with a fenced write of the record, right before a
    /// write effect; lost ownership stops the attempt.
    pub(crate) async fn prove_owner(&self) -> Result<(), Error> {
        self.owner.prove_now().await.map_err(|e| match e {
            ToolError::OwnershipLost(_) => {
                tracing::warn!(job = %self.ctx.id(), error = %e, "ownership lost before a write effect; stopping");
                Error::Cancelled
            }
            e => Error::retryable(e.to_string()),
        })
    }

    /// The delivery (once, by its key) and the result.
    pub(crate) async fn deliver(&self, art: Artifact) -> Result<JobResult, Error> {
        let digest = report::sha256_hex(&art.doc);
        self.flusher.event(
            "phase",
            json!({"v": self.fp, "phase": "artifact", "payload": {"name": art.name, "digest": digest, "version": art.version}}),
        );
        self.progress(Resume::Publish);
        self.cancelled()?;
        // The delivery's identity is the job's publish step: an attempt with
        // another document is refused (and parks), never sent.
        let call = CallCtx::new(self.ctx.id(), step_id("publish", 0), self.ctx.epoch())
            .of_incarnation(&self.ctx.record().created_at)
            .guarded(self.owner.clone());
        let title = clip_title(if art.title.trim().is_empty() {
            &self.input.topic
        } else {
            &art.title
        });
        let args = json!({"title": title, "document": art.doc, "format": "markdown"});
        let out = match self.toolbox.call(&call, "publish", &args).await {
            Ok(o) => o,
            Err(e) => {
                return Err(match e.disposition() {
                    Disposition::Retry => Error::retryable(e.to_string()),
                    Disposition::Stop => {
                        tracing::warn!(job = %self.ctx.id(), error = %e, "delivery refused: ownership lost");
                        Error::Cancelled
                    }
                    Disposition::Park => Error::Park {
                        reason: e.class().into(),
                        message: format!(
                            "delivery of {} (document digest {digest}): {e}",
                            art.name
                        ),
                    },
                    _ => Error::terminal(format!("delivery: {e}")),
                })
            }
        };
        self.crash.at(CrashPoint::AfterDelivery);
        self.flusher.event(
            "phase",
            json!({"v": self.fp, "phase": "delivered", "payload": {"key": out.key, "outcome": out.outcome, "digest": digest}}),
        );
        Ok(JobResult {
            artifact: Some(art.name),
            partial: !art.skipped.is_empty(),
            skipped_sections: art.skipped,
            digest: Some(digest),
            output: json!({
                "title": title,
                "delivery": {"key": out.key, "outcome": out.outcome},
                "sections": self.input.sections,
                "experts": self.input.experts,
            })
            .to_string(),
        })
    }
}

/// The publish tool's schema bounds a title (`maxLength` 300 characters);
/// a small model's outline title can be a paragraph (SmolLM2-135M wrote
/// 330 characters), which failed the finished job at its delivery. Longer
/// titles are cut at a word where there is one, marked with an ellipsis.
const PUBLISH_TITLE_MAX: usize = 300;

fn clip_title(title: &str) -> String {
    let title = title.trim();
    if title.chars().count() <= PUBLISH_TITLE_MAX {
        return title.to_string();
    }
    let head: String = title.chars().take(PUBLISH_TITLE_MAX - 1).collect();
    let head = match head.rfind(char::is_whitespace) {
        Some(i) if i > PUBLISH_TITLE_MAX / 2 => head[..i].trim_end(),
        _ => head.as_str(),
    };
    format!("{head}…")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_title_fits_the_publish_schema() {
        assert_eq!(clip_title("  Leases  "), "Leases");
        let long = "What is this assignment? ".repeat(14);
        let t = clip_title(&long);
        assert!(t.chars().count() <= PUBLISH_TITLE_MAX, "{t}");
        assert!(t.ends_with("assignment?…") || t.ends_with('…'), "{t}");
        assert!(!t.contains("  "));
        // No whitespace to cut at: cut anywhere, on a char boundary.
        let t = clip_title(&"é".repeat(400));
        assert_eq!(t.chars().count(), PUBLISH_TITLE_MAX);
    }
}
