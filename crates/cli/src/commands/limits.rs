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

use leasehold_core::flow::{provider_key, Limits};
use leasehold_core::time::rfc3339;
use leasehold_store::flow::{now_ms, FlowStore, PauseKind};
use leasehold_store::NatsArgs;
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Which provider key.
#[derive(clap::Args, Debug, Clone)]
struct Key {
    /// The provider key's id (from `leasehold limits list`).
    #[arg(conflicts_with_all = ["base_url", "model"], required_unless_present_all = ["base_url", "model"])]
    id: Option<String>,
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
    /// Every provider key with limits or in use: its limits, the workers' leases and pauses.
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
        #[command(flatten)]
        json: super::AlwaysJson,
    },
    /// Remove a provider key's limits (or only the ones named).
    Clear {
        #[command(flatten)]
        key: Key,
        /// Clear only the requests-per-minute limit.
        #[arg(long)]
        rpm: bool,
        /// Clear only the tokens-per-minute limit.
        #[arg(long)]
        tpm: bool,
        /// Clear only the concurrency limit.
        #[arg(long)]
        concurrency: bool,
        #[command(flatten)]
        json: super::AlwaysJson,
    },
}

fn resolve(k: &Key) -> anyhow::Result<(String, Option<leasehold_core::flow::ProviderInfo>)> {
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
        ..
    } = &args.cmd
    {
        eprintln!("error: nothing to set: give --rpm, --tpm or --concurrency");
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
            ..
        } => {
            let (id, info) = key.expect("resolved");
            let old = store.get_limits(&id).await?;
            let mut e = old.clone().unwrap_or_default();
            e.limits.rpm = rpm.or(e.limits.rpm);
            e.limits.tpm = tpm.or(e.limits.tpm);
            e.limits.concurrency = concurrency.or(e.limits.concurrency);
            e.provider = info.or(e.provider);
            e.updated_at = rfc3339(std::time::SystemTime::now());
            store.set_limits(&id, &e).await?;
            println!(
                "{}",
                json!({"id": id, "limits": e.limits, "provider": e.provider, "set": true})
            );
            Ok(0)
        }
        Cmd::Clear {
            rpm,
            tpm,
            concurrency,
            ..
        } => {
            let (id, _) = key.expect("resolved");
            let Some(mut e) = store.get_limits(&id).await? else {
                eprintln!("error: provider key {id} has no limits (see `leasehold limits list`)");
                return Ok(1);
            };
            if rpm || tpm || concurrency {
                if rpm {
                    e.limits.rpm = None;
                }
                if tpm {
                    e.limits.tpm = None;
                }
                if concurrency {
                    e.limits.concurrency = None;
                }
            } else {
                e.limits = Limits::default();
            }
            if e.limits.is_empty() {
                store.clear_limits(&id).await?;
            } else {
                e.updated_at = rfc3339(std::time::SystemTime::now());
                store.set_limits(&id, &e).await?;
            }
            println!("{}", json!({"id": id, "limits": e.limits, "cleared": true}));
            Ok(0)
        }
    }
}

async fn list(store: &FlowStore, as_json: bool) -> anyhow::Result<i32> {
    use std::collections::BTreeMap;
    let mut rows: BTreeMap<String, serde_json::Value> = BTreeMap::new();
    let now = now_ms();
    for (id, e) in store.list_limits().await? {
        let r = rows.entry(id.clone()).or_insert_with(|| json!({"id": id}));
        r["limits"] = json!(e.limits);
        if let Some(p) = e.provider {
            r["provider"] = json!(p);
        }
    }
    for (id, mut rec) in store.leases().await? {
        rec.expire(now);
        let r = rows.entry(id.clone()).or_insert_with(|| json!({"id": id}));
        if !rec.provider.base_url.is_empty() {
            r["provider"] = json!(rec.provider);
        }
        let held = |f: fn(&leasehold_core::flow::Slice) -> f64| {
            rec.leases.values().map(|l| f(&l.held)).sum::<f64>()
        };
        r["workers"] = json!(rec.leases.len());
        r["leased"] = json!({
            "rpm": (held(|s| s.requests_per_sec) * 60.0).round(),
            "tpm": (held(|s| s.tokens_per_sec) * 60.0).round(),
            "concurrency": rec.leases.values().map(|l| l.held.concurrency).sum::<u64>(),
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
        "{:<17} {:<40} {:>8} {:>10} {:>5} {:>7} PAUSED UNTIL",
        "ID", "PROVIDER", "RPM", "TPM", "CONC", "WORKERS"
    );
    let show = |v: &serde_json::Value| v.as_u64().map_or("-".to_string(), |n| n.to_string());
    for r in rows.values() {
        let provider = r.get("provider").map_or("?".to_string(), |p| {
            format!(
                "{} {}",
                p["base_url"].as_str().unwrap_or(""),
                p["model"].as_str().unwrap_or("")
            )
        });
        let l = r.get("limits").cloned().unwrap_or(json!({}));
        println!(
            "{:<17} {:<40} {:>8} {:>10} {:>5} {:>7} {}",
            r["id"].as_str().unwrap_or(""),
            provider,
            show(&l["rpm"]),
            show(&l["tpm"]),
            show(&l["concurrency"]),
            r.get("workers").map_or("0".into(), |w| w.to_string()),
            r.get("cooldown_until")
                .or(r.get("breaker_open_until"))
                .and_then(|v| v.as_str())
                .unwrap_or("-"),
        );
    }
    Ok(0)
}
