//! The bill of one job: usage and exact cost per model over every billed attempt.
//!
//! Invariant: costs come from `cost::checked_cost` per response; nothing here panics.

use crate::cost::{self, Price, Usage};
use rust_decimal::Decimal;
use std::collections::BTreeMap;

/// Costs and tokens of one job, per model, for the result and the exact Redis totals.
#[derive(Debug, Default)]
pub(super) struct Bill {
    pub(super) usage: Usage,
    pub(super) cost: Decimal,
    pub(super) per_model: BTreeMap<String, (Usage, Decimal, u64)>,
    /// One-line notes for the result's `warning` field (e.g. a provider gave no usage).
    pub(super) warnings: Vec<String>,
}

impl Bill {
    pub(super) fn add(&mut self, model: &str, usage: Option<Usage>, price: &Price) {
        let entry = self.per_model.entry(model.to_string()).or_default();
        entry.2 += 1;
        if let Some(u) = usage {
            // Never a panic: an uncomputable cost (implausible usage) is reported, counted 0.
            let c = cost::checked_cost(&u, price).unwrap_or_else(|e| {
                tracing::error!(model = %model, error = %e, "cannot price a call");
                self.warnings.push(format!("{model}: {e}"));
                Decimal::ZERO
            });
            self.usage.add(&u);
            self.cost += c;
            entry.0.add(&u);
            entry.1 += c;
        }
    }

    pub(super) fn usage_missing(&mut self, model: &str) {
        metrics::counter!("llm_worker_usage_missing_total", "model" => model.to_string())
            .increment(1);
        self.warnings.push(format!(
            "{model} answered without usage: that call's cost is unknown and counted as 0"
        ));
    }

    pub(super) fn cost_fields(&self) -> Vec<(String, i64)> {
        let mut out = vec![];
        for (m, (u, c, calls)) in &self.per_model {
            // Validated prices make every cost a whole number of pico-dollars.
            let picos = cost::to_picos(*c).unwrap_or_else(|| {
                tracing::error!(model = %m, cost = %c, "cost is not whole pico-dollars; total rounded");
                cost::to_picos(c.round_dp(12)).unwrap_or(0)
            });
            out.push((format!("{m}:cost_picos"), picos));
            out.push((format!("{m}:input_tokens"), u.prompt_tokens as i64));
            out.push((format!("{m}:output_tokens"), u.completion_tokens as i64));
            out.push((format!("{m}:cached_tokens"), u.cached_tokens as i64));
            out.push((format!("{m}:calls"), *calls as i64));
        }
        out
    }
}
