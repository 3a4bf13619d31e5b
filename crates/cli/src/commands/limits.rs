//! `leasehold limits list | set | clear`: provider limits (requests and
//! tokens per minute, concurrent requests) per provider key, kept in the
//! KV bucket `lh_limits`. Every worker watches the bucket, so a change
//! applies fleet-wide within a second, without a restart.
//!
//! A provider key is the base URL + model + a hash of the credential; its
//! id is what `list` shows. `set` and `clear` take the id, or
//! `--base-url`/`--model` (and the credential from `--api-key-env`, by
//! default `LH_API_KEY`, hashed here and never stored), which name the key
//! exactly as the workers compute it.
//!
//! A concurrency the workers *learned* (a server that serves one request at
//! a time, seen cutting streams for another request) is listed beside the
//! limits set, with its reason (`learned`); a concurrency set here wins over
//! it, and `clear` (all, or `--concurrency`) removes it too.
//!
//! `--tenant NAME` names a tenant instead: `--jobs` is how many of its
//! jobs the fleet runs at once, `--weight` its share of the fleet under
//! contention (1 by default), and `--rpm`/`--tpm`/`--concurrency` limit the
//! model requests of its jobs (entries `tenant.<name>.jobs` and
//! `tenant.<name>.model`).

use leasehold_core::time::rfc3339;
use leasehold_flow::{provider_key, tenant_jobs_key, tenant_model_key, tenant_of_key, Limits};
use leasehold_store::flow::{now_ms, FlowStore, PauseKind};
use leasehold_store::NatsArgs;
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Which provider key, or which tenant.
#[derive(clap::Args, Debug, Clone)]
struct Key {
    /// The provider key's id (from `leasehold limits list`).
    #[arg(conflicts_with_all = ["base_url", "model", "tenant"], required_unless_present_any = ["base_url", "tenant"])]
    id: Option<String>,
    /// A tenant (as submitted in the spec's `tenant`) instead of a provider key.
    #[arg(long, conflicts_with_all = ["base_url", "model"])]
    tenant: Option<String>,
    /// The provider's base URL, as the workers' LH_MODEL_BASE_URL.
    #[arg(long, requires = "model")]
    base_url: Option<String>,
    /// The model, as the workers' LH_MODEL.
    #[arg(long, requires = "base_url")]
    model: Option<String>,
    /// The variable holding the credential (hashed into the key; never stored or sent).
    #[arg(long, default_value = "LH_API_KEY")]
    api_key_env: String,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Every provider key with limits or in use: its limits (set, or learned by the workers, with why), the workers' leases and pauses.
    List {
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Set a provider key's limits (the ones not given are kept); the fleet applies them within a second.
    Set {
        #[command(flatten)]
        key: Key,
        /// Requests per minute.
        #[arg(long, allow_negative_numbers = true, value_parser = |v: &str| Limits::parse_value("--rpm", v))]
        rpm: Option<u64>,
        /// Tokens per minute (input + output).
        #[arg(long, allow_negative_numbers = true, value_parser = |v: &str| Limits::parse_value("--tpm", v))]
        tpm: Option<u64>,
        /// Concurrent requests.
        #[arg(long, allow_negative_numbers = true, value_parser = |v: &str| Limits::parse_value("--concurrency", v))]
        concurrency: Option<u64>,
        /// With --tenant: how many of the tenant's jobs run at once, fleet-wide.
        #[arg(long, requires = "tenant", allow_negative_numbers = true, value_parser = |v: &str| Limits::parse_value("--jobs", v))]
        jobs: Option<u64>,
        /// With --tenant: its share of the fleet under contention (1-1000; 1 by default).
        #[arg(long, requires = "tenant", allow_negative_numbers = true, value_parser = parse_weight)]
        weight: Option<u32>,
        #[command(flatten)]
        json: super::AlwaysJson,
    },
    /// Remove a provider key's limits (or only the ones named), a learned concurrency included.
    Clear {
        #[command(flatten)]
        key: Key,
        /// Clear only the requests-per-minute limit.
        #[arg(long)]
        rpm: bool,
        /// Clear only the tokens-per-minute limit.
        #[arg(long)]
        tpm: bool,
        /// Clear only the concurrency limit (set or learned).
        #[arg(long)]
        concurrency: bool,
        /// With --tenant: clear only its running-jobs limit.
        #[arg(long, requires = "tenant")]
        jobs: bool,
        /// With --tenant: clear only its weight (back to 1).
        #[arg(long, requires = "tenant")]
        weight: bool,
        #[command(flatten)]
        json: super::AlwaysJson,
    },
}

fn parse_weight(v: &str) -> Result<u32, String> {
    let w: u32 = v
        .trim()
        .parse()
        .map_err(|_| format!("--weight: {v:?} is not a whole number in 1..=1000"))?;
    leasehold_core::lane::check_weight(w).map_err(|e| format!("--weight: {e}"))?;
    Ok(w)
}

/// What `set` and `clear` change.
enum Target {
    Provider(String, Option<leasehold_flow::ProviderInfo>),
    Tenant(String),
}

fn resolve(k: &Key) -> anyhow::Result<Target> {
    if let Some(t) = &k.tenant {
        leasehold_core::lane::check_tenant(t).map_err(|e| anyhow::anyhow!("--tenant: {e}"))?;
        return Ok(Target::Tenant(t.clone()));
    }
    resolve_provider(k).map(|(id, info)| Target::Provider(id, info))
}

fn resolve_provider(k: &Key) -> anyhow::Result<(String, Option<leasehold_flow::ProviderInfo>)> {
    if let Some(id) = &k.id {
        if id.len() != 16 || !id.chars().all(|c| c.is_ascii_hexdigit()) {
            anyhow::bail!(
                "{id:?} is not a provider key id (16 hex digits, from `leasehold limits list`)"
            );
        }
        return Ok((id.to_ascii_lowercase(), None));
    }
    let (base, model) = (
        k.base_url.as_deref().unwrap_or(""),
        k.model.as_deref().unwrap_or(""),
    );
    if !(base.starts_with("http://") || base.starts_with("https://")) {
        anyhow::bail!("--base-url {base:?}: expected an http:// or https:// URL");
    }
    if model.trim().is_empty() {
        anyhow::bail!("--model must not be empty");
    }
    let cred = std::env::var(&k.api_key_env).ok();
    let (id, info) = provider_key(base, model, cred.as_deref());
    Ok((id, Some(info)))
}

pub async fn run(args: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    // Bad input is refused before connecting.
    let key = match &args.cmd {
        Cmd::Set { key, .. } | Cmd::Clear { key, .. } => match resolve(key) {
            Ok(k) => Some(k),
            Err(e) => {
                eprintln!("error: {e}");
                return Ok(2);
            }
        },
        Cmd::List { .. } => None,
    };
    if let Cmd::Set {
        rpm: None,
        tpm: None,
        concurrency: None,
        jobs: None,
        weight: None,
        ..
    } = &args.cmd
    {
        eprintln!("error: nothing to set: give --rpm, --tpm or --concurrency (and with --tenant, --jobs or --weight)");
        return Ok(2);
    }
    let conn = nats.connect("leasehold-cli limits").await?;
    let store = FlowStore::open(&conn).await?;
    match args.cmd {
        Cmd::List { json } => list(&store, json).await,
        Cmd::Set {
            rpm,
            tpm,
            concurrency,
            jobs,
            weight,
            ..
        } => {
            let model = Limits {
                rpm,
                tpm,
                concurrency,
            };
            set(&store, key.expect("resolved"), model, jobs, weight).await
        }
        Cmd::Clear {
            rpm,
            tpm,
            concurrency,
            jobs,
            weight,
            ..
        } => {
            let model = [rpm, tpm, concurrency];
            clear(&store, key.expect("resolved"), model, [jobs, weight]).await
        }
    }
}

/// `limits set`: the limits given replace those kept; a tenant's jobs
/// limit and weight are its own entry.
async fn set(
    store: &FlowStore,
    key: Target,
    model: Limits,
    jobs: Option<u64>,
    weight: Option<u32>,
) -> anyhow::Result<i32> {
    let now = || rfc3339(std::time::SystemTime::now());
    let (model_id, info, tenant) = match key {
        Target::Provider(id, info) => (id, info, None),
        Target::Tenant(t) => (tenant_model_key(&t), None, Some(t)),
    };
    let mut out = json!({"set": true});
    if !model.is_empty() {
        let mut e = store.get_limits(&model_id).await?.unwrap_or_default();
        e.limits.rpm = model.rpm.or(e.limits.rpm);
        e.limits.tpm = model.tpm.or(e.limits.tpm);
        e.limits.concurrency = model.concurrency.or(e.limits.concurrency);
        e.provider = info.or(e.provider);
        e.updated_at = now();
        store.set_limits(&model_id, &e).await?;
        out["id"] = json!(model_id);
        out["limits"] = json!(e.limits);
        if tenant.is_none() {
            out["provider"] = json!(e.provider);
        }
    }
    if let Some(t) = &tenant {
        out["tenant"] = json!(t);
        if jobs.is_some() || weight.is_some() {
            let id = tenant_jobs_key(t);
            let mut e = store.get_limits(&id).await?.unwrap_or_default();
            e.limits.concurrency = jobs.or(e.limits.concurrency);
            e.weight = weight.or(e.weight);
            e.updated_at = now();
            store.set_limits(&id, &e).await?;
            out["jobs"] = json!(e.limits.concurrency);
            out["weight"] = json!(e.weight.unwrap_or(1));
        }
    }
    println!("{out}");
    Ok(0)
}

/// `limits clear`: the limits named (`[rpm, tpm, concurrency]` of the
/// model entry, `[jobs, weight]` of a tenant's), or everything when none is.
async fn clear(
    store: &FlowStore,
    key: Target,
    [rpm, tpm, concurrency]: [bool; 3],
    [jobs, weight]: [bool; 2],
) -> anyhow::Result<i32> {
    let now = || rfc3339(std::time::SystemTime::now());
    let (model_id, tenant) = match key {
        Target::Provider(id, _) => (id, None),
        Target::Tenant(t) => (tenant_model_key(&t), Some(t)),
    };
    let some_model = rpm || tpm || concurrency;
    let some_jobs = jobs || weight;
    let everything = !some_model && !some_jobs;
    let mut found = false;
    let mut out = json!({"cleared": true});
    if tenant.is_none() && (concurrency || everything) {
        if let Some((l, _)) = store.get_learned(&model_id).await? {
            store.forget(&model_id).await?;
            found = true;
            out["id"] = json!(model_id);
            out["learned_cleared"] = json!({"concurrency": l.concurrency, "reason": l.reason});
        }
    }
    if some_model || everything {
        if let Some(mut e) = store.get_limits(&model_id).await? {
            found = true;
            if everything {
                e.limits = Limits::default();
            }
            if rpm {
                e.limits.rpm = None;
            }
            if tpm {
                e.limits.tpm = None;
            }
            if concurrency {
                e.limits.concurrency = None;
            }
            if e.limits.is_empty() {
                store.clear_limits(&model_id).await?;
            } else {
                e.updated_at = now();
                store.set_limits(&model_id, &e).await?;
            }
            out["id"] = json!(model_id);
            out["limits"] = json!(e.limits);
        }
    }
    if let Some(t) = &tenant {
        out["tenant"] = json!(t);
        let id = tenant_jobs_key(t);
        if some_jobs || everything {
            if let Some(mut e) = store.get_limits(&id).await? {
                found = true;
                if jobs || everything {
                    e.limits.concurrency = None;
                }
                if weight || everything {
                    e.weight = None;
                }
                if e.limits.is_empty() && e.weight.is_none() {
                    store.clear_limits(&id).await?;
                } else {
                    e.updated_at = now();
                    store.set_limits(&id, &e).await?;
                }
                out["jobs"] = json!(e.limits.concurrency);
                out["weight"] = json!(e.weight.unwrap_or(1));
            }
        }
    }
    if !found {
        match &tenant {
            Some(t) => {
                eprintln!("error: tenant {t} has no limits or weight (see `leasehold limits list`)")
            }
            None => eprintln!(
                "error: provider key {model_id} has no limits (see `leasehold limits list`)"
            ),
        }
        return Ok(1);
    }
    println!("{out}");
    Ok(0)
}

async fn list(store: &FlowStore, as_json: bool) -> anyhow::Result<i32> {
    use std::collections::BTreeMap;
    let mut rows: BTreeMap<String, serde_json::Value> = BTreeMap::new();
    let now = now_ms();
    let listing = store.list_limits().await?;
    if let Some((id, e)) = listing.unreadable.first() {
        anyhow::bail!(
            "limits {id} are unreadable: {e} (workers take them as no limits; `nats kv del {} {id}` removes them)",
            store.limits_bucket()
        );
    }
    for (id, e) in listing.entries {
        let r = rows.entry(id.clone()).or_insert_with(|| json!({"id": id}));
        r["limits"] = json!(e.limits);
        if let Some(p) = e.provider {
            r["provider"] = json!(p);
        }
        if let Some((t, _)) = tenant_of_key(&id) {
            r["tenant"] = json!(t);
            if let Some(w) = e.weight {
                r["weight"] = json!(w);
            }
        }
    }
    for (id, mut rec) in store.leases().await? {
        rec.expire_by_writers_clocks(now);
        let r = rows.entry(id.clone()).or_insert_with(|| json!({"id": id}));
        if !rec.provider.base_url.is_empty() {
            r["provider"] = json!(rec.provider);
        }
        let held = |f: fn(&leasehold_flow::Slice) -> f64| {
            rec.leases.values().map(|l| f(&l.held)).sum::<f64>()
        };
        r["workers"] = json!(rec.leases.len());
        r["leased"] = json!({
            "rpm": (held(|s| s.requests_per_sec) * 60.0).round(),
            "tpm": (held(|s| s.tokens_per_sec) * 60.0).round(),
            "concurrency": rec.leases.values().map(|l| l.held.concurrency).sum::<u64>(),
        });
    }
    for (id, l) in store.learned().await? {
        let r = rows.entry(id.clone()).or_insert_with(|| json!({"id": id}));
        if r.get("provider").is_none() && !l.provider.base_url.is_empty() {
            r["provider"] = json!(l.provider);
        }
        let set_by_hand = r
            .get("limits")
            .is_some_and(|x| x.get("concurrency").is_some_and(|c| !c.is_null()));
        r["learned"] = json!({
            "concurrency": l.concurrency,
            "reason": l.reason,
            "by": l.by,
            "at": rfc3339(std::time::UNIX_EPOCH + std::time::Duration::from_millis(l.at_ms)),
            // A concurrency set by hand wins over the learned one.
            "applies": !set_by_hand,
        });
    }
    for (kind, id, p) in store.pauses().await? {
        if p.until_ms <= now {
            continue;
        }
        let r = rows.entry(id.clone()).or_insert_with(|| json!({"id": id}));
        if r.get("provider").is_none() && !p.provider.base_url.is_empty() {
            r["provider"] = json!(p.provider);
        }
        let name = if kind == PauseKind::Breaker {
            "breaker_open_until"
        } else {
            "cooldown_until"
        };
        r[name] = json!(rfc3339(
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(p.until_ms)
        ));
        r["pause_reason"] = json!(p.reason);
    }
    if as_json {
        for r in rows.values() {
            println!("{r}");
        }
        return Ok(0);
    }
    if rows.is_empty() {
        println!("no provider limits set (leasehold limits set --base-url URL --model M --rpm N)");
        return Ok(0);
    }
    println!(
        "{:<22} {:<40} {:>8} {:>10} {:>5} {:>7} PAUSED UNTIL",
        "ID", "PROVIDER", "RPM", "TPM", "CONC", "WORKERS"
    );
    let show = |v: &serde_json::Value| v.as_u64().map_or("-".to_string(), |n| n.to_string());
    for r in rows.values() {
        let tenant = r["id"].as_str().and_then(tenant_of_key).map(|(t, what)| {
            let w = r
                .get("weight")
                .map_or(String::new(), |w| format!(", weight {w}"));
            match what {
                "jobs" => format!("tenant {t}: running jobs{w}"),
                _ => format!("tenant {t}: model requests"),
            }
        });
        let provider = tenant.unwrap_or_else(|| {
            r.get("provider").map_or("?".to_string(), |p| {
                format!(
                    "{} {}",
                    p["base_url"].as_str().unwrap_or(""),
                    p["model"].as_str().unwrap_or("")
                )
            })
        });
        let l = r.get("limits").cloned().unwrap_or(json!({}));
        let learned = r.get("learned").filter(|x| x["applies"] == true);
        let conc = match learned {
            Some(x) => format!("{}*", show(&x["concurrency"])),
            None => show(&l["concurrency"]),
        };
        println!(
            "{:<22} {:<40} {:>8} {:>10} {:>5} {:>7} {}",
            r["id"].as_str().unwrap_or(""),
            provider,
            show(&l["rpm"]),
            show(&l["tpm"]),
            conc,
            r.get("workers").map_or("0".into(), |w| w.to_string()),
            r.get("cooldown_until")
                .or(r.get("breaker_open_until"))
                .and_then(|v| v.as_str())
                .unwrap_or("-"),
        );
        if let Some(x) = r.get("learned") {
            println!(
                "  {} concurrency {} learned by {} at {}: {}{}",
                if x["applies"] == true { "*" } else { " " },
                show(&x["concurrency"]),
                x["by"].as_str().unwrap_or("?"),
                x["at"].as_str().unwrap_or("?"),
                x["reason"].as_str().unwrap_or(""),
                if x["applies"] == true {
                    " (`leasehold limits clear ID --concurrency` forgets it)"
                } else {
                    " (the concurrency set above wins)"
                }
            );
        }
    }
    Ok(0)
}
