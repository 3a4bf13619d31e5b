//! Child jobs: [`Ctx::spawn`], [`Ctx::spawn_many`], [`Ctx::join`] and
//! [`Ctx::spawn_and_wait`], and the two rules they share with a remote
//! kind's `spawn` and `join` ops ([`spawn_children`], [`join_children`]).

use futures::{StreamExt, TryStreamExt};
use leasehold_core::lane::Lane;
use leasehold_store::children::{self, Outcome, Spawned, CASCADE, DETACH};
use leasehold_store::signals::Signals;
use leasehold_store::work::Work;
use leasehold_store::Jobs;
use leasehold_tools::{Disposition, OwnerGuard};
use leasehold_worker::JobCtx;
use serde_json::{json, Value};

use super::Ctx;
use crate::Error;

/// How deep children may nest: a child of a job without a parent is at
/// depth 1; a spawn that would make depth 9 fails.
pub const MAX_DEPTH: u32 = leasehold_core::spec::MAX_CHILD_DEPTH;
/// How many children one spawn step may start.
pub const MAX_FAN_OUT: usize = leasehold_core::spec::MAX_CHILDREN;
/// Child tickets published side by side.
const PUBLISH_AT_ONCE: usize = 64;
/// Child records read side by side by a join.
const READ_AT_ONCE: usize = 64;

/// A child job this run spawned: what [`Ctx::join`] waits for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Child {
    /// The child's job id (`leasehold status ID` shows it).
    pub id: String,
}

/// How a spawn's children live with their parent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpawnOptions {
    /// A cancel of the parent leaves these children running (by default
    /// it cancels them, and theirs).
    pub detach: bool,
}

/// The one rule of a spawn step `step` (Rust's `ctx.spawn*`, a remote
/// kind's `spawn` op): children of `kind`, one per input, with ids derived
/// from the parent, its incarnation and the step, so a spawn tried again
/// (a crash before its step was recorded, a stale owner) names the same
/// children, and the work stream's dedupe and the records'
/// create-if-absent start each of them once. The owner proves it still
/// owns the job right before the children are published. The result is
/// what the step records: [`Spawned`].
pub(crate) async fn spawn_children(
    job: &JobCtx,
    step: &str,
    kind: &str,
    inputs: &[Value],
    opts: SpawnOptions,
) -> Result<Value, Error> {
    let parent = &job.record;
    let spec = parent.spec.clone().unwrap_or_default();
    let depth = spec.parent.as_ref().map_or(0, |p| p.depth) + 1;
    if depth > MAX_DEPTH {
        return Err(Error::terminal(format!(
            "spawn `{step}`: a child here would be at depth {depth}, past the limit of {MAX_DEPTH} (a child's child's ... child): flatten the tree"
        )));
    }
    if inputs.len() > MAX_FAN_OUT {
        return Err(Error::terminal(format!(
            "spawn `{step}`: {} children asked for, past the limit of {MAX_FAN_OUT} per spawn: spawn them in batches",
            inputs.len()
        )));
    }
    let token = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_');
    if kind.is_empty() || !kind.chars().all(token) {
        return Err(Error::terminal(format!(
            "spawn `{step}`: {kind:?} is not a kind name"
        )));
    }
    let on_cancel = if opts.detach { DETACH } else { CASCADE };
    let ids: Vec<String> = (0..inputs.len())
        .map(|i| children::child_id(parent, step, i))
        .collect();
    let mut specs = Vec::with_capacity(inputs.len());
    for (id, input) in ids.iter().zip(inputs) {
        if !input.is_object() {
            return Err(Error::terminal(format!(
                "spawn `{step}`: a child's input must be a JSON object, not {input}"
            )));
        }
        let mut s = json!({
            "id": id,
            "input": input,
            "parent": {"id": parent.id, "step": step, "depth": depth, "on_cancel": on_cancel},
        });
        // Children share their parent's tenant and priority: a tenant's
        // fan-out is its own share of the fleet.
        if let Some(t) = &spec.tenant {
            s["tenant"] = json!(t);
        }
        if let Some(p) = spec.priority {
            s["priority"] = json!(p);
        }
        specs.push(s);
    }
    // The owner's proof, right before the children exist: a stale owner
    // spawns nothing (and a pause after the proof names the same ids).
    if let Err(e) = OwnerGuard::new(job.gate.clone()).prove_now().await {
        return Err(match e.disposition() {
            Disposition::Stop => Error::stopped(format!("spawn `{step}`: {e}")),
            _ => Error::retryable(format!("spawn `{step}`: {e}")),
        });
    }
    let work = Work::new(&job.conn);
    // The parent's tenant and priority are its children's: one lane.
    let lane = Lane::of(&spec);
    let publishes: Vec<_> = specs
        .into_iter()
        .zip(ids.iter().cloned())
        .map(|(s, id)| {
            let (work, lane) = (work.clone(), lane.clone());
            let (kind, step) = (kind.to_string(), step.to_string());
            async move {
                work.submit_in_lane(&kind, &lane, s.to_string().into(), Some(&id), None, None)
                    .await
                    .map_err(|e| {
                        if leasehold_store::answer::bad_request(&e) {
                            return Error::terminal(format!(
                                "spawn `{step}`: child {id} of kind `{kind}` refused: {e}"
                            ));
                        }
                        Error::retryable(format!(
                            "spawn `{step}`: child {id} of kind `{kind}` not submitted ({e}); the spawn is tried again, naming the same children"
                        ))
                    })
            }
        })
        .collect();
    futures::stream::iter(publishes)
        .buffer_unordered(PUBLISH_AT_ONCE)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(serde_json::to_value(Spawned {
        children: ids,
        on_cancel: on_cancel.into(),
    })
    .expect("serializes"))
}

/// The children the run's recorded `spawn` steps started.
pub(crate) fn spawned<'a>(
    steps: impl IntoIterator<Item = &'a crate::journal::Recorded>,
) -> std::collections::HashSet<String> {
    steps
        .into_iter()
        .filter(|r| r.id.starts_with(children::SPAWN_STEP))
        .filter_map(|r| serde_json::from_value::<Spawned>(r.result.clone()).ok())
        .flat_map(|s| s.children)
        .collect()
}

/// The one rule of a join step `step` (Rust's `ctx.join`, a remote kind's
/// `join` op): every child's outcome once all of them ended (the step's
/// result); until then [`Error::Wait`], and the attempt ends, holding no
/// worker, until the announcements of the children's ends (their count and
/// the children they name, read at once) reach their count plus the
/// children not among them: the last child's end wakes it, once. Records
/// are read only when every child was announced (an announcement follows
/// its child's terminal record).
pub(crate) async fn join_children(
    job: &JobCtx,
    step: &str,
    ids: &[String],
    spawned: &std::collections::HashSet<String>,
) -> Result<Value, Error> {
    // Only its own children announce their ends to this job: a wait for
    // another job's would never be woken.
    if let Some(other) = ids.iter().find(|id| !spawned.contains(*id)) {
        return Err(Error::terminal(format!(
            "join `{step}`: {other} is not a child this job spawned (join what its spawns returned)"
        )));
    }
    let signals = Signals::new(&job.conn);
    let (count, ended) = children::announcements(&signals, &job.record.id)
        .await
        .map_err(|e| {
            Error::retryable(format!("join `{step}`: reading its children's ends: {e}"))
        })?;
    let mut pending = ids.iter().filter(|id| !ended.contains_key(*id)).count() as u64;
    if pending == 0 {
        let jobs = Jobs::open(&job.conn)
            .await
            .map_err(|e| Error::retryable(format!("join `{step}`: {e}")))?;
        // An end that carried its outcome is read from its announcement; a
        // child's record only for the others (a large result; a dead one,
        // which may be replayed).
        let reads: Vec<_> = ids
            .iter()
            .cloned()
            .map(|id| {
                let (jobs, step) = (jobs.clone(), step.to_string());
                let carried = ended.get(&id).cloned().flatten();
                async move {
                    if carried.is_some() {
                        return Ok(carried);
                    }
                    children::outcome(&jobs, &id).await.map_err(|e| {
                        Error::retryable(format!("join `{step}`: reading child {id}: {e}"))
                    })
                }
            })
            .collect();
        let outcomes: Vec<Option<Outcome>> = futures::stream::iter(reads)
            .buffered(READ_AT_ONCE)
            .try_collect()
            .await?;
        // Announced, and running again (replayed from the dead letters):
        // its next end is announced too.
        pending = outcomes.iter().filter(|o| o.is_none()).count() as u64;
        if pending == 0 {
            let all: Vec<Outcome> = outcomes.into_iter().flatten().collect();
            return Ok(serde_json::to_value(all).expect("serializes"));
        }
    }
    Err(Error::Wait(crate::Wait::for_children(
        step,
        count + pending,
    )))
}

impl Ctx {
    /// Starts one child job of `kind` with `input`, as a durable step
    /// (`spawn:<kind>#n`): see [`Ctx::spawn_many`].
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// let child = ctx.spawn("echo", serde_json::json!({"text": "hi"})).await?;
    /// let outcome = &ctx.join(&[child]).await?[0];
    /// # Ok(()) }
    /// ```
    pub async fn spawn(&self, kind: &str, input: Value) -> Result<Child, Error> {
        let mut c = self.spawn_many(kind, vec![input]).await?;
        Ok(c.remove(0))
    }

    /// Starts one child job of `kind` per input, as one durable step
    /// (`spawn:<kind>#n`). Each child is a job of its own (its own
    /// retries, budget, events, `leasehold status`), of the parent's
    /// tenant and priority. Its id is derived from the parent, its
    /// incarnation and the step, so a parent resumed after a crash, or a
    /// stale owner, never starts a second set. A cancel of the parent
    /// cancels them ([`Ctx::spawn_many_with`] to detach them). At most
    /// [`MAX_FAN_OUT`] per step and [`MAX_DEPTH`] deep.
    pub async fn spawn_many(&self, kind: &str, inputs: Vec<Value>) -> Result<Vec<Child>, Error> {
        self.spawn_many_with(kind, inputs, SpawnOptions::default())
            .await
    }

    /// [`Ctx::spawn_many`] with options (`detach`).
    pub async fn spawn_many_with(
        &self,
        kind: &str,
        inputs: Vec<Value>,
        opts: SpawnOptions,
    ) -> Result<Vec<Child>, Error> {
        let job = &self.job;
        let inputs = &inputs;
        let v: Value = self
            .step_with_id(
                &format!("{}{kind}", children::SPAWN_STEP),
                |step| async move { spawn_children(job, &step, kind, inputs, opts).await },
            )
            .await?;
        let s: Spawned = serde_json::from_value(v).map_err(|e| {
            Error::park(
                "journal_mismatch",
                format!("the recorded spawn of `{kind}` no longer decodes: {e}"),
            )
        })?;
        Ok(s.children.into_iter().map(|id| Child { id }).collect())
    }

    /// Waits for `children` to end, holding no worker, as a durable step
    /// (`join#n`), and returns each one's outcome in their order: its
    /// result, or how it failed (a child's failure is an outcome, not an
    /// error of the parent). The first time, unless all have ended, the
    /// attempt ends (this returns [`Error::Wait`]: propagate it with `?`),
    /// the job is `waiting` for its children and its slot is free; the
    /// end of the last one wakes it once, on any worker.
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// let inputs = (0..20).map(|i| serde_json::json!({"question": i})).collect();
    /// let children = ctx.spawn_many("research", inputs).await?;
    /// for o in ctx.join(&children).await? {
    ///     match o.result {
    ///         Some(r) => println!("{}: {r}", o.id),
    ///         None => println!("{} {}: {:?}", o.id, o.status, o.error),
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn join(&self, children: &[Child]) -> Result<Vec<Outcome>, Error> {
        let ids: Vec<String> = children.iter().map(|c| c.id.clone()).collect();
        let mine = {
            let g = self.journal().await?;
            spawned(g.as_ref().expect("journal loaded").steps())
        };
        let job = &self.job;
        let (ids, mine) = (&ids, &mine);
        let v: Value = self
            .step_with_id("join", |step| async move {
                join_children(job, &step, ids, mine).await
            })
            .await?;
        serde_json::from_value(v).map_err(|e| {
            Error::park(
                "journal_mismatch",
                format!("the recorded join no longer decodes: {e}"),
            )
        })
    }

    /// Starts one child and waits for its end: [`Ctx::spawn`] then
    /// [`Ctx::join`].
    pub async fn spawn_and_wait(&self, kind: &str, input: Value) -> Result<Outcome, Error> {
        let child = self.spawn(kind, input).await?;
        Ok(self.join(&[child]).await?.remove(0))
    }
}
