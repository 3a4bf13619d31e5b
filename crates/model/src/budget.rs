//! Per-job budgets: steps, tokens, wall time, cost.
//!
//! Exhaustion is an explicit outcome ([`BudgetKind`]), checked before every
//! model call and tool call, never a crash or a hang. Wall time runs on
//! tokio's clock so tests can pause it. Tokens come from the provider's usage
//! or, when it sends none, from an estimate; cost from a price table.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::wire::Usage;

/// Which budget ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetKind {
    Steps,
    Tokens,
    WallTime,
    Cost,
}

impl std::fmt::Display for BudgetKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BudgetKind::Steps => "steps",
            BudgetKind::Tokens => "tokens",
            BudgetKind::WallTime => "wall time",
            BudgetKind::Cost => "cost",
        })
    }
}

/// Limits; `None` means unlimited.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct BudgetLimits {
    pub max_steps: Option<u64>,
    pub max_tokens: Option<u64>,
    pub max_wall: Option<Duration>,
    pub max_cost_usd: Option<f64>,
}

/// What has been used (also the shape journalled as the job's `budget_used`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct BudgetUsed {
    pub steps: u64,
    pub tokens: u64,
    pub wall_s: f64,
    pub cost_usd: f64,
}

/// What is left, as carried in retry reports; `None` means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct BudgetLeft {
    pub steps: Option<u64>,
    pub tokens: Option<u64>,
    pub wall_s: Option<f64>,
    pub cost_usd: Option<f64>,
}

/// USD per million tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Price {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
}

/// Prices by model name; unknown models cost nothing (and say so in logs).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PriceTable(pub HashMap<String, Price>);

impl PriceTable {
    pub fn cost(&self, model: &str, usage: &Usage) -> f64 {
        match self.0.get(model) {
            Some(p) => {
                (usage.prompt_tokens as f64 * p.input_per_mtok
                    + usage.completion_tokens as f64 * p.output_per_mtok)
                    / 1e6
            }
            None => {
                tracing::debug!(model, "no price for model; cost counted as 0");
                0.0
            }
        }
    }
}

/// A job's budget: limits, prices, and what was used, including usage
/// carried over from earlier attempts of the job.
#[derive(Debug, Clone)]
pub struct Budget {
    pub limits: BudgetLimits,
    pub prices: PriceTable,
    carried: BudgetUsed,
    used: BudgetUsed,
    started: Instant,
}

impl Budget {
    pub fn new(limits: BudgetLimits, prices: PriceTable) -> Self {
        Self::resume(limits, prices, BudgetUsed::default())
    }

    /// A budget that continues from usage recorded by earlier attempts.
    pub fn resume(limits: BudgetLimits, prices: PriceTable, carried: BudgetUsed) -> Self {
        Budget {
            limits,
            prices,
            carried,
            used: BudgetUsed::default(),
            started: Instant::now(),
        }
    }

    pub fn unlimited() -> Self {
        Self::new(BudgetLimits::default(), PriceTable::default())
    }

    /// Everything used so far.
    pub fn used(&self) -> BudgetUsed {
        BudgetUsed {
            steps: self.carried.steps + self.used.steps,
            tokens: self.carried.tokens + self.used.tokens,
            wall_s: self.carried.wall_s + self.started.elapsed().as_secs_f64(),
            cost_usd: self.carried.cost_usd + self.used.cost_usd,
        }
    }

    /// Fails with the first exhausted kind.
    pub fn check(&self) -> Result<(), BudgetKind> {
        let u = self.used();
        let l = &self.limits;
        if l.max_steps.is_some_and(|m| u.steps >= m) {
            return Err(BudgetKind::Steps);
        }
        if l.max_tokens.is_some_and(|m| u.tokens >= m) {
            return Err(BudgetKind::Tokens);
        }
        if l.max_wall.is_some_and(|m| u.wall_s >= m.as_secs_f64()) {
            return Err(BudgetKind::WallTime);
        }
        if l.max_cost_usd.is_some_and(|m| u.cost_usd >= m) {
            return Err(BudgetKind::Cost);
        }
        Ok(())
    }

    /// Takes one step (a model call or a tool call) if the budget allows.
    pub fn take_step(&mut self) -> Result<(), BudgetKind> {
        self.check()?;
        self.used.steps += 1;
        Ok(())
    }

    /// Charges a response's tokens and cost.
    pub fn charge(&mut self, model: &str, usage: &Usage) {
        self.used.tokens += usage
            .total_tokens
            .max(usage.prompt_tokens + usage.completion_tokens);
        self.used.cost_usd += self.prices.cost(model, usage);
    }

    /// When the wall-time budget runs out, as a deadline for waits.
    pub fn wall_deadline(&self) -> Option<Instant> {
        let max = self.limits.max_wall?;
        let left = max.as_secs_f64() - self.carried.wall_s;
        Some(self.started + Duration::from_secs_f64(left.max(0.0)))
    }

    pub fn left(&self) -> BudgetLeft {
        let u = self.used();
        let l = &self.limits;
        BudgetLeft {
            steps: l.max_steps.map(|m| m.saturating_sub(u.steps)),
            tokens: l.max_tokens.map(|m| m.saturating_sub(u.tokens)),
            wall_s: l.max_wall.map(|m| (m.as_secs_f64() - u.wall_s).max(0.0)),
            cost_usd: l.max_cost_usd.map(|m| (m - u.cost_usd).max(0.0)),
        }
    }
}
