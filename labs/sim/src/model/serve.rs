//! How many requests the sim generates at once (`--serve`, env
//! `LH_SIM_SERVE`), as real servers differ:
//!
//! - `parallel` (default): every request at once, as OpenAI or vLLM.
//! - `serialized`: one generation at a time; the others wait for it
//!   (llama.cpp's `llama-server` with one slot, Ollama with
//!   `OLLAMA_NUM_PARALLEL=1`, llama-cpp-python with
//!   `--interrupt_requests false`).
//! - `interrupts`: one at a time, and a request that arrives while a
//!   stream is generating ends that stream after its next chunk with
//!   `data: [DONE]` and no finish reason, then is served: llama-cpp-python's
//!   server by default (`interrupt_requests=True`). A non-streaming request
//!   is never cut (it holds the model until answered), but cuts a stream.
//!
//! A streamed response's headers go out at once, before its turn (as
//! llama-cpp-python's `EventSourceResponse`); a waiting request gets its
//! first chunk when the model is its, a token's time later (its prompt's
//! evaluation), in these two modes. `GET /stats` counts `interrupted`
//! (streams cut for a newcomer before their finish reason), `waited`
//! (requests that waited for the model) and `generating_peak` (the most
//! generations at once).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Serve {
    /// Every request at once.
    #[default]
    Parallel,
    /// One generation at a time; the others wait.
    Serialized,
    /// One at a time; a newcomer cuts the stream in flight (llama-cpp-python).
    Interrupts,
}

impl Serve {
    pub fn name(self) -> &'static str {
        match self {
            Serve::Parallel => "parallel",
            Serve::Serialized => "serialized",
            Serve::Interrupts => "interrupts",
        }
    }
}

/// The model, as a server that serves one request at a time has it.
pub struct Model {
    pub mode: Serve,
    slot: Arc<Semaphore>,
    /// Requests waiting for the model.
    waiting: Arc<AtomicU64>,
    generating: AtomicU64,
    pub generating_peak: AtomicU64,
    pub interrupted: AtomicU64,
    pub waited: AtomicU64,
}

/// A generation's hold on the model (the slot, when one at a time).
pub struct Turn {
    model: Arc<Model>,
    _slot: Option<OwnedSemaphorePermit>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.model.generating.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Counts a waiter until dropped (a client that goes away while it waits
/// stops counting).
struct Waiting(Arc<AtomicU64>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Model {
    pub fn new(mode: Serve) -> Arc<Model> {
        Arc::new(Model {
            mode,
            slot: Arc::new(Semaphore::new(1)),
            waiting: Arc::new(AtomicU64::new(0)),
            generating: AtomicU64::new(0),
            generating_peak: AtomicU64::new(0),
            interrupted: AtomicU64::new(0),
            waited: AtomicU64::new(0),
        })
    }

    /// Waits for the model's turn (at once when parallel).
    pub async fn turn(self: &Arc<Self>) -> Turn {
        let slot = if self.mode == Serve::Parallel {
            None
        } else {
            let _w = {
                self.waiting.fetch_add(1, Ordering::SeqCst);
                Waiting(self.waiting.clone())
            };
            if self.slot.available_permits() == 0 {
                self.waited.fetch_add(1, Ordering::Relaxed);
            }
            Some(
                self.slot
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("the slot is never closed"),
            )
        };
        let now = self.generating.fetch_add(1, Ordering::SeqCst) + 1;
        self.generating_peak.fetch_max(now, Ordering::SeqCst);
        Turn {
            model: self.clone(),
            _slot: slot,
        }
    }

    /// Whether the stream holding the model ends here for a newcomer;
    /// counted as `interrupted` when it had not sent its finish reason yet
    /// (`before_finish`: after it, the client has its answer).
    pub fn cut_for_newcomer(&self, before_finish: bool) -> bool {
        if self.mode == Serve::Interrupts && self.waiting.load(Ordering::SeqCst) > 0 {
            if before_finish {
                self.interrupted.fetch_add(1, Ordering::Relaxed);
            }
            return true;
        }
        false
    }
}
