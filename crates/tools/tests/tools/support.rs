//! Shared setup: a JetStream server with the effects bucket, the simulator on
//! a loopback port, and toolboxes pointed at both.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use leasehold_harness::{wait_for_jetstream, NatsServer};
use leasehold_tools::{
    AllowList, CallCtx, CollectEvents, EffectsLedger, RetryPolicy, Toolbox, ToolboxConfig,
};
use serde_json::Value;

/// The simulator's web and effects routes on `127.0.0.1:<free port>`.
pub struct Sim {
    pub addr: SocketAddr,
    pub base: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Sim {
    pub async fn start() -> Sim {
        let args = crate::Args {
            listen: "127.0.0.1:0".into(),
            seed: 7,
            faults: None,
        };
        let app = crate::web::router(&args)
            .unwrap()
            .merge(crate::effects::router(&args).unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Sim {
            addr,
            base: format!("http://{addr}"),
            task,
        }
    }

    /// Number of effects recorded by the sink.
    pub async fn count(&self) -> u64 {
        let v: Value = reqwest::get(format!("{}/effects/count", self.base))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["count"].as_u64().unwrap()
    }

    /// The sink's stored result of one key (None when unknown).
    pub async fn effect(&self, key: &str) -> Option<Value> {
        let r = reqwest::get(format!("{}/effects/{key}", self.base))
            .await
            .unwrap();
        if r.status() == reqwest::StatusCode::NOT_FOUND {
            return None;
        }
        Some(r.json().await.unwrap())
    }

    /// Arms a sink-side fault for the next `times` POSTs.
    pub async fn arm(&self, mode: &str, times: u32) {
        let r = reqwest::Client::new()
            .post(format!("{}/effects/faults", self.base))
            .json(&serde_json::json!({"mode": mode, "times": times}))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "arming {mode}: {}", r.status());
    }
}

/// Everything a ledger test needs.
pub struct Env {
    pub sim: Sim,
    pub ledger: EffectsLedger,
    pub events: Arc<CollectEvents>,
    pub js: async_nats::jetstream::Context,
    _nats: NatsServer,
}

impl Env {
    pub async fn start() -> Env {
        let nats = NatsServer::start();
        wait_for_jetstream(&nats.url(), Duration::from_secs(10)).await;
        let client = async_nats::connect(nats.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        js.create_key_value(leasehold_store::setup::effects_config(
            "lh_effects".into(),
            Duration::from_secs(7 * 86_400),
            1,
        ))
        .await
        .unwrap();
        let ledger = EffectsLedger::open(&js, "lh_effects").await.unwrap();
        Env {
            sim: Sim::start().await,
            ledger,
            events: Arc::new(CollectEvents::new()),
            js,
            _nats: nats,
        }
    }

    /// The built-in tools against the simulator, with fast read retries.
    pub fn config(&self) -> ToolboxConfig {
        let mut c = ToolboxConfig::with_base_url(&self.sim.base);
        c.fetch.allow = AllowList::parse("127.0.0.1").unwrap();
        c.publish.timeout = Duration::from_millis(800);
        c.read_retry = RetryPolicy {
            max_attempts: 3,
            base: Duration::from_millis(5),
            cap: Duration::from_millis(20),
            deadline: Duration::from_secs(5),
        };
        c
    }

    pub fn toolbox(&self) -> Toolbox {
        self.toolbox_with(self.config())
    }

    pub fn toolbox_with(&self, config: ToolboxConfig) -> Toolbox {
        Toolbox::builtin(&config, Some(self.ledger.clone()), self.events.clone()).unwrap()
    }
}

pub fn ctx(step: &str) -> CallCtx {
    CallCtx::new("job-1", step, 1)
}
