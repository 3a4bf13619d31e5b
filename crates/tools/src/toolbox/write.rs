//! The write path: a call with side effects run through the effects ledger
//! (its key created or taken over, reconciled, its business key claimed) and
//! its effect only after the caller proved it owns the job.

use serde_json::Value;

use crate::error::ToolError;
use crate::events::ToolEventKind;
use crate::key::{arg_digest, business_key_id, check_job_id};
use crate::ledger::{now_rfc3339, BusinessKeyEntry, EffectState, LedgerEntry};
use crate::tool::{Reconcile, Tool};

use super::{CallCtx, Outcome, Reporter, Step, ToolOutput, Toolbox};

impl Toolbox {
    pub(super) async fn call_write(
        &self,
        ctx: &CallCtx,
        tool: &dyn Tool,
        args: &Value,
        key: &str,
        rep: &Reporter<'_>,
    ) -> Result<ToolOutput, ToolError> {
        let Some(ledger) = self.ledger.as_ref() else {
            let e = ToolError::Config(format!(
                "`{}` has side effects and needs the effects ledger; none is configured",
                tool.spec().name
            ));
            rep.refused(&e);
            return Err(e);
        };
        if let Err(message) = check_job_id(&ctx.job_id) {
            let e = ToolError::InvalidArgs {
                tool: tool.spec().name.clone(),
                message,
            };
            rep.refused(&e);
            return Err(e);
        }
        let job = ctx.job_id.as_str();
        let digest = arg_digest(args);
        let bk = tool.business_key(&ctx.job_id, args);
        // Each turn reads the key and acts on its state; a lost conditional
        // write means someone else moved it, so read again. The bound only
        // stops a livelock.
        for _ in 0..16 {
            let step = match ledger.get(job, key).await? {
                Some((e, _)) if e.state == EffectState::Void => {
                    let err = ToolError::Superseded {
                        key: key.to_string(),
                        reason: format!("the key was retired by epoch {} at {}", e.epoch, e.at),
                    };
                    rep.refused(&err);
                    Step::Return(Err(err))
                }
                Some((e, _)) if e.arg_digest != digest => {
                    let err = ToolError::KeyReuse {
                        key: key.to_string(),
                        stored: e.arg_digest,
                        given: digest.clone(),
                    };
                    rep.refused(&err);
                    Step::Return(Err(err))
                }
                Some((e, _)) if e.state == EffectState::Done => {
                    rep.emit(
                        ToolEventKind::Replayed,
                        Some(true),
                        None,
                        Some(format!("done by epoch {} at {}", e.epoch, e.at)),
                    );
                    Step::Return(Ok(self.output(
                        tool,
                        key,
                        e.result.unwrap_or(Value::Null),
                        Outcome::Replayed,
                        0,
                    )))
                }
                Some((e, rev)) => self.reconcile(ctx, tool, args, key, e, rev, rep).await?,
                None => {
                    let bk_step = match &bk {
                        Some(bk) => {
                            self.claim_business_key(ctx, tool, args, key, bk, &digest, rep)
                                .await?
                        }
                        None => None,
                    };
                    match bk_step {
                        Some(step) => step,
                        None => {
                            self.prove_owner(ctx, rep).await?;
                            let entry =
                                self.entry(ctx, tool, EffectState::InFlight, &digest, bk.as_ref());
                            match ledger.create(job, key, &entry).await? {
                                // Another executor created it first: read its state.
                                None => Step::Again,
                                Some(rev) => Step::Return(
                                    self.execute_write(
                                        ctx,
                                        tool,
                                        args,
                                        key,
                                        entry,
                                        rev,
                                        Outcome::Executed,
                                        rep,
                                    )
                                    .await,
                                ),
                            }
                        }
                    }
                }
            };
            if let Step::Return(r) = step {
                return r;
            }
        }
        Err(ToolError::Ledger(format!(
            "effect key {key} kept changing under us"
        )))
    }

    /// Runs a write whose `in_flight` entry (at `rev`) this call holds, and
    /// records `done`.
    #[allow(clippy::too_many_arguments)]
    async fn execute_write(
        &self,
        ctx: &CallCtx,
        tool: &dyn Tool,
        args: &Value,
        key: &str,
        entry: LedgerEntry,
        rev: u64,
        outcome: Outcome,
        rep: &Reporter<'_>,
    ) -> Result<ToolOutput, ToolError> {
        let ledger = self.ledger.as_ref().expect("checked by call_write");
        let exec = self.exec_ctx(ctx, tool, key);
        rep.emit(ToolEventKind::Started, None, None, None);
        match self.run_once(tool, args, &exec).await {
            Ok(value) => {
                let done = LedgerEntry {
                    state: EffectState::Done,
                    result: Some(value.clone()),
                    via: Some(
                        if outcome == Outcome::Executed {
                            "executed"
                        } else {
                            "reconciled"
                        }
                        .into(),
                    ),
                    at: now_rfc3339(),
                    ..entry
                };
                match ledger.update(&ctx.job_id, key, &done, rev).await {
                    Ok(Some(_)) => {}
                    // The effect happened, so the result is returned either
                    // way; whoever holds the key now reconciles it at the
                    // destination, which knows this effect by its key.
                    Ok(None) => {
                        tracing::warn!(%key, "effect done but another executor took the key over")
                    }
                    Err(e) => {
                        tracing::warn!(%key, error = %e, "effect done but `done` could not be recorded")
                    }
                }
                rep.emit(ToolEventKind::Finished, Some(true), None, None);
                Ok(self.output(tool, key, value, outcome, 1))
            }
            Err(e) => {
                // Only an entry this call created fresh may be withdrawn: a
                // taken-over one still stands for the earlier attempt.
                if outcome == Outcome::Executed && e.certainly_not_committed() {
                    // Nothing left this process: free the key for a clean retry.
                    if let Err(we) = ledger.withdraw(&ctx.job_id, key, rev).await {
                        tracing::warn!(%key, error = %we, "could not withdraw in_flight");
                    }
                }
                rep.emit(
                    ToolEventKind::Finished,
                    Some(false),
                    Some(e.class()),
                    Some(e.to_string()),
                );
                Err(e)
            }
        }
    }

    /// Proves, with the call's guard, that the caller still owns the job:
    /// the last step before a write's effect (only the `in_flight` record or
    /// its takeover comes between them). Done before anything is recorded,
    /// so a refusal, or a caller dropped while it waits for its proof,
    /// leaves nothing to reconcile.
    async fn prove_owner(&self, ctx: &CallCtx, rep: &Reporter<'_>) -> Result<(), ToolError> {
        let Some(guard) = &ctx.guard else {
            return Ok(());
        };
        guard.prove().await.inspect_err(|e| rep.refused(e))
    }

    /// An `in_flight` key: an earlier attempt may or may not have had its
    /// effect. Ask the destination; never guess.
    #[allow(clippy::too_many_arguments)]
    async fn reconcile(
        &self,
        ctx: &CallCtx,
        tool: &dyn Tool,
        args: &Value,
        key: &str,
        entry: LedgerEntry,
        rev: u64,
        rep: &Reporter<'_>,
    ) -> Result<Step, ToolError> {
        let ledger = self.ledger.as_ref().expect("checked by call_write");
        if ctx.epoch < entry.epoch {
            // A newer owner of the job holds this key: a stale executor (its
            // lease reclaimed) must not reconcile or run it.
            let err = ToolError::Superseded {
                key: key.to_string(),
                reason: format!(
                    "the key is in flight for epoch {}, newer than this executor's epoch {}",
                    entry.epoch, ctx.epoch
                ),
            };
            rep.refused(&err);
            return Ok(Step::Return(Err(err)));
        }
        let earlier = format!(
            "an earlier attempt (epoch {}, {}) left the effect in flight",
            entry.epoch, entry.at
        );
        match tool.find_existing(key, args).await {
            Reconcile::Found(value) => {
                let done = LedgerEntry {
                    state: EffectState::Done,
                    result: Some(value.clone()),
                    via: Some("reconciled".into()),
                    epoch: ctx.epoch,
                    at: now_rfc3339(),
                    ..entry
                };
                if ledger.update(&ctx.job_id, key, &done, rev).await?.is_none() {
                    return Ok(Step::Again);
                }
                rep.emit(
                    ToolEventKind::Reconciled,
                    Some(true),
                    None,
                    Some(format!("{earlier}; found at the destination")),
                );
                Ok(Step::Return(Ok(self.output(
                    tool,
                    key,
                    value,
                    Outcome::Reconciled,
                    0,
                ))))
            }
            Reconcile::NotFound if tool.dedupes_by_key() => {
                // Take the key over (conditioned on the revision we read, so
                // of two reconcilers only one runs), then run again with the
                // same key: the destination drops it if the first one lands.
                self.prove_owner(ctx, rep).await?;
                let mine = LedgerEntry {
                    epoch: ctx.epoch,
                    at: now_rfc3339(),
                    ..entry
                };
                let Some(new_rev) = ledger.update(&ctx.job_id, key, &mine, rev).await? else {
                    return Ok(Step::Again);
                };
                rep.emit(
                    ToolEventKind::Reconciled,
                    None,
                    None,
                    Some(format!("{earlier}; not found at the destination, which deduplicates by key: running again with the same key")),
                );
                Ok(Step::Return(
                    self.execute_write(
                        ctx,
                        tool,
                        args,
                        key,
                        mine,
                        new_rev,
                        Outcome::Reconciled,
                        rep,
                    )
                    .await,
                ))
            }
            Reconcile::NotFound => {
                let err = ToolError::UncertainEffect {
                    key: key.to_string(),
                    reason: format!(
                        "{earlier}; the destination has no record of it yet but does not deduplicate by key, so it may still land"
                    ),
                };
                rep.refused(&err);
                Ok(Step::Return(Err(err)))
            }
            Reconcile::Unknowable(why) => {
                let err = ToolError::UncertainEffect {
                    key: key.to_string(),
                    reason: format!("{earlier}; {why}"),
                };
                rep.refused(&err);
                Ok(Step::Return(Err(err)))
            }
            Reconcile::Unavailable(why) => {
                // Not knowable *now*: keep `in_flight` and let the step retry.
                let err = ToolError::Unreachable(format!("{earlier}; cannot reconcile yet: {why}"));
                rep.refused(&err);
                Ok(Step::Return(Err(err)))
            }
        }
    }

    /// Checks the business key before `key` is created. `None`: this call
    /// owns the business key and may go on; `Some(step)`: the answer (a
    /// replay of the effect another step already had, an uncertainty, or
    /// "read again").
    #[allow(clippy::too_many_arguments)]
    async fn claim_business_key(
        &self,
        ctx: &CallCtx,
        tool: &dyn Tool,
        args: &Value,
        key: &str,
        bk: &str,
        digest: &str,
        rep: &Reporter<'_>,
    ) -> Result<Option<Step>, ToolError> {
        let ledger = self.ledger.as_ref().expect("checked by call_write");
        let name = &tool.spec().name;
        let bk_id = business_key_id(name, bk);
        let mine = BusinessKeyEntry {
            effect_key: key.to_string(),
            tool: name.clone(),
            job_id: ctx.job_id.clone(),
            at: now_rfc3339(),
        };
        let Some((owner, bk_rev)) = ledger.get_bk(&bk_id).await? else {
            return Ok(match ledger.create_bk(&bk_id, &mine).await? {
                Some(_) => None,
                None => Some(Step::Again),
            });
        };
        if owner.effect_key == key && owner.job_id == ctx.job_id {
            return Ok(None);
        }
        // The owning effect's key lives under its own job.
        let (other_job, other) = (owner.job_id, owner.effect_key);
        match ledger.get(&other_job, &other).await? {
            Some((e, _)) if e.state == EffectState::Done => {
                // Record this step's key as done too, so its retries replay
                // directly; losing that race to a copy of ourselves is fine.
                let value = e.result.clone().unwrap_or(Value::Null);
                let done = LedgerEntry {
                    result: Some(value.clone()),
                    via: Some("business_key".into()),
                    ..self.entry(ctx, tool, EffectState::Done, digest, Some(&bk.to_string()))
                };
                ledger.create(&ctx.job_id, key, &done).await?;
                rep.emit(
                    ToolEventKind::Replayed,
                    Some(true),
                    None,
                    Some(format!(
                        "business key already delivered by step {} (key {other})",
                        e.step_id
                    )),
                );
                Ok(Some(Step::Return(Ok(self.output(
                    tool,
                    key,
                    value,
                    Outcome::Replayed,
                    0,
                )))))
            }
            Some((e, rev)) if e.state == EffectState::InFlight => {
                // Another step's effect with this business key is unresolved:
                // only the destination can say whether it happened.
                match tool.find_existing(&other, args).await {
                    Reconcile::Found(value) => {
                        let other_done = LedgerEntry {
                            state: EffectState::Done,
                            result: Some(value.clone()),
                            via: Some("reconciled".into()),
                            at: now_rfc3339(),
                            ..e
                        };
                        if ledger
                            .update(&other_job, &other, &other_done, rev)
                            .await?
                            .is_none()
                        {
                            return Ok(Some(Step::Again));
                        }
                        rep.emit(
                            ToolEventKind::Reconciled,
                            Some(true),
                            None,
                            Some(format!("business key held by in-flight key {other}, found at the destination")),
                        );
                        // Next turn replays it through the Done branch above.
                        Ok(Some(Step::Again))
                    }
                    Reconcile::Unavailable(why) => {
                        let err = ToolError::Unreachable(format!(
                            "the same business key is held by in-flight key {other}; cannot reconcile yet: {why}"
                        ));
                        rep.refused(&err);
                        Ok(Some(Step::Return(Err(err))))
                    }
                    Reconcile::NotFound | Reconcile::Unknowable(_) => {
                        let err = ToolError::UncertainEffect {
                            key: key.to_string(),
                            reason: format!(
                                "the same business key is held by step {} (key {other}, epoch {}), whose effect is still in flight with unknown outcome",
                                e.step_id, e.epoch
                            ),
                        };
                        rep.refused(&err);
                        Ok(Some(Step::Return(Err(err))))
                    }
                }
            }
            Some(_) | None => {
                // The owning key never ran (it has no entry, or was retired):
                // its executor stopped between claiming the business key and
                // recording `in_flight`, or is about to record it. Retire the
                // key so it can never run, then take the business key over.
                let void = LedgerEntry {
                    state: EffectState::Void,
                    tool: name.clone(),
                    arg_digest: String::new(),
                    job_id: other_job.clone(),
                    step_id: String::new(),
                    epoch: ctx.epoch,
                    at: now_rfc3339(),
                    result: None,
                    business_key: Some(bk.to_string()),
                    via: Some(format!(
                        "business key taken over by key {key} of job {}",
                        ctx.job_id
                    )),
                };
                if let Some((cur, _)) = ledger.get(&other_job, &other).await? {
                    if cur.state != EffectState::Void {
                        return Ok(Some(Step::Again));
                    }
                } else if ledger.create(&other_job, &other, &void).await?.is_none() {
                    return Ok(Some(Step::Again));
                }
                Ok(match ledger.update_bk(&bk_id, &mine, bk_rev).await? {
                    Some(_) => None,
                    None => Some(Step::Again),
                })
            }
        }
    }
}
