//! An admitted request ([`Permit`]): its slot held until dropped, its token
//! reservation reconciled, its first token and its end noted.

use std::sync::Arc;

use tokio::time::Instant;

use super::{sign, Flow, Serving, Sign, LEARN_AFTER};

/// An admitted request: holds its slot until dropped; [`Permit::reconcile`]
/// corrects the token reservation from the response's usage.
pub struct Permit {
    pub(super) flow: Arc<Flow>,
    pub(super) id: String,
    /// Its number among the key's requests, and when it was admitted.
    pub(super) seq: u64,
    pub(super) admitted: Instant,
    pub(super) reserved: u64,
    /// Tokens were reserved against a limit (so they are reconciled).
    pub(super) limited: bool,
    /// The permit of the tenant's model limits, held with this one.
    pub(super) tenant: Option<Box<Permit>>,
}

impl Permit {
    /// The response used `tokens` (input + output): the reservation is
    /// corrected by the difference.
    pub fn reconcile(&mut self, tokens: u64) {
        if let Some(t) = self.tenant.as_mut() {
            t.reconcile(tokens);
        }
        if !self.limited {
            return;
        }
        let diff = tokens as f64 - self.reserved as f64;
        self.reserved = tokens;
        if let Some(s) = self.flow.keys.lock().expect("flow lock").get_mut(&self.id) {
            s.tokens.level -= diff;
            s.asked_tokens = s.asked_tokens.saturating_add_signed(diff as i64);
        }
    }
}

impl Permit {
    /// The response's first token (content or a tool call) arrived: the
    /// provider is generating it.
    pub fn first_token(&self) {
        mark_first_token(&self.flow, &self.id, self.seq);
    }

    /// [`Permit::first_token`] as a callback for the client (it is called
    /// while the response streams).
    pub fn first_token_hook(&self) -> Arc<dyn Fn() + Send + Sync> {
        let (flow, id, seq) = (self.flow.clone(), self.id.clone(), self.seq);
        Arc::new(move || mark_first_token(&flow, &id, seq))
    }

    /// The request ended (`cut`: the server ended its stream, `[DONE]`,
    /// before a finish reason; `completed`: it completed; `last_chunk`: when its last
    /// chunk came, if one did); called before the permit is dropped. What
    /// that says of how the provider serves requests at once ([`sign`]); a
    /// repeated cut learns a concurrency of 1 for the key (module docs).
    pub fn ended(&self, cut: bool, completed: bool, last_chunk: Option<Instant>) -> Serving {
        let flow = &self.flow;
        // Read before the key's lock (the order every caller keeps).
        let concurrency = flow.concurrency(&self.id);
        let mut g = flow.keys.lock().expect("flow lock");
        let Some(s) = g.get_mut(&self.id) else {
            return Serving::Nothing;
        };
        let last = last_chunk.unwrap_or(self.admitted);
        match sign(&s.open, self.seq, cut, completed, last) {
            Sign::Nothing => Serving::Nothing,
            Sign::Parallel => {
                s.cuts = 0;
                Serving::Nothing
            }
            Sign::Cut => match concurrency {
                Some((c, src)) if src.by_hand() && c > 1 => Serving::SetByHand {
                    concurrency: c,
                    setting: src.setting(),
                },
                Some(_) => Serving::Known,
                None => {
                    s.cuts += 1;
                    if s.cuts < LEARN_AFTER {
                        return Serving::Cut { seen: s.cuts };
                    }
                    s.cuts = 0;
                    let key = s.key.clone();
                    drop(g);
                    let reason = format!(
                        "{} ended {LEARN_AFTER} streams before their finish reason while another request waited: it serves one request at a time",
                        key.label()
                    );
                    flow.learn(&key, 1, &reason);
                    Serving::Learned
                }
            },
        }
    }
}

fn mark_first_token(flow: &Flow, id: &str, seq: u64) {
    if let Some(s) = flow.keys.lock().expect("flow lock").get_mut(id) {
        if let Some(first) = s.open.get_mut(&seq) {
            first.get_or_insert_with(Instant::now);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(s) = self.flow.keys.lock().expect("flow lock").get_mut(&self.id) {
            s.in_flight = s.in_flight.saturating_sub(1);
            s.stats.in_flight = s.in_flight;
            s.open.remove(&self.seq);
        }
        self.flow.changed.notify_waiters();
    }
}
