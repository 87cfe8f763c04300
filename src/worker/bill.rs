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
    /// Each billed attempt's `usage` object as the provider sent it, in order.
    pub(super) raw_usage: Vec<serde_json::Value>,
}

impl Bill {
    /// Adds one call; returns its cost when it reported usage that could be priced
    /// (`None`: no usage, or usage too implausible to price, which is billed as 0).
    pub(super) fn add(
        &mut self,
        model: &str,
        usage: Option<Usage>,
        price: &Price,
    ) -> Option<Decimal> {
        let entry = self.per_model.entry(model.to_string()).or_default();
        entry.2 += 1;
        let u = usage?;
        // Never a panic: an uncomputable cost (implausible usage) is reported, counted 0.
        let priced = cost::checked_cost(&u, price)
            .map_err(|e| {
                tracing::error!(model = %model, error = %e, "cannot price a call");
                self.warnings.push(format!("{model}: {e}"));
            })
            .ok();
        let c = priced.unwrap_or(Decimal::ZERO);
        self.usage.add(&u);
        self.cost = self.cost.saturating_add(c);
        entry.0.add(&u);
        entry.1 = entry.1.saturating_add(c);
        priced
    }

    pub(super) fn usage_missing(&mut self, model: &str) {
        metrics::counter!("llm_worker_usage_missing_total", "model" => model.to_string())
            .increment(1);
        let w = format!(
            "{model} answered 2xx without usage it could read: that call's cost is unknown (0 here; budgets and caps count its worst case)"
        );
        // Once per model: retries of one model would otherwise crowd out later notes.
        if !self.warnings.contains(&w) {
            self.warnings.push(w);
        }
    }

    /// The `{ns}:cost` increments of this job: five per model it called, less those that
    /// are zero (a field missing from the hash reads as 0, so a zero costs a command and
    /// adds nothing).
    pub(super) fn cost_fields(&self) -> Vec<(String, i64)> {
        let mut out = vec![];
        for (m, (u, c, calls)) in &self.per_model {
            // Validated prices make every cost a whole number of pico-dollars.
            let picos = cost::to_picos(*c).unwrap_or_else(|| {
                tracing::error!(model = %m, cost = %c, "cost is not whole pico-dollars; total rounded");
                cost::to_picos(c.round_dp(12)).unwrap_or(0)
            });
            // `{ns}:cost` field suffixes (the README's cost hash, not result fields).
            let fields = [
                (":cost_picos", picos),
                (":input_tokens", u.prompt_tokens as i64),
                (":output_tokens", u.completion_tokens as i64),
                (":cached_tokens", u.cached_tokens as i64),
                (":calls", *calls as i64),
            ];
            // A zero adds nothing: no command for it (a missing field reads as 0).
            for (suffix, v) in fields.into_iter().filter(|(_, v)| *v != 0) {
                // One allocation of the exact size (`format!` cost ~700 instructions a name).
                out.push(([m.as_str(), suffix].concat(), v));
            }
        }
        out
    }
}

/// What one job has spent on provider calls, over this delivery and those a hand-back
/// carried over ([`Spent::carried`]). Shared by reference between the job's `process`
/// (which adds to it) and `handle` (which reads it after `abort`), so a job stopped by
/// shutdown hands its spending on, and its final result and the cost totals count each
/// paid call exactly once.
#[derive(Debug, Default)]
pub(super) struct Spent {
    pub(super) bill: Bill,
    /// Provider calls made (started) for the job.
    pub(super) attempts: u64,
    /// Models tried, in order (a model repeated only after another one).
    pub(super) tried: Vec<String>,
    /// A provider call was started in this delivery: a hand-back of it counts as a
    /// delivery (`queue.max_deliveries`); one that never called a model does not.
    pub(super) called: bool,
    /// A stop (cancel, deadline) aborted a call of this delivery after it was sent.
    pub(super) aborted_call: bool,
    /// Worst cases of this delivery's calls whose cost is unknown (a success without
    /// usage, a call cut off after it was sent): counted against the job's
    /// `max_cost_usd`, not billed.
    pub(super) unknown_worst: Decimal,
    /// What earlier deliveries of this entry recorded against its `max_cost_usd` and this
    /// one cannot know otherwise (a worker killed mid-call: its call at its worst case).
    pub(super) earlier_deliveries: Decimal,
    /// The entry has a cap record (`{ns}:capspent:<entry>`: this delivery wrote one, or
    /// found one), to drop once the entry has its result.
    pub(super) cap_recorded: bool,
    /// Messages left out of the last call to fit its model's window.
    pub(super) trimmed_messages: Option<u64>,
    /// The entry was parked under its tenant's cap (moved and acknowledged by the
    /// admission script): nothing is left to hand back.
    pub(super) parked: bool,
    /// The entry was parked by a budget that paused it (moved and acknowledged); a place
    /// kept for it under a tenant cap is still given back.
    pub(super) budget_parked: bool,
    /// The place kept for this entry (it was moved back from a parked stream) was taken by
    /// its admission; else the worker gives it back when the job ends.
    pub(super) kept_taken: bool,
    /// The error class of the last failed call (for the log line of a failed job).
    pub(super) last_class: Option<&'static str>,
}

impl Spent {
    /// What the job's cost cap counts: billed plus the worst cases of unknown costs.
    pub(super) fn counted(&self) -> Decimal {
        self.bill
            .cost
            .saturating_add(self.unknown_worst)
            .saturating_add(self.earlier_deliveries)
    }
}

/// The `_billed` field of a handed-back entry (JSON; tokens and calls per model, cost as
/// a decimal string, exact).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Carried {
    attempts: u64,
    tried: Vec<String>,
    models: BTreeMap<String, CarriedModel>,
    /// The raw usage objects of the billed attempts so far.
    #[serde(default)]
    usage: Vec<serde_json::Value>,
    /// What the job's cost cap counts beyond the bill: worst cases of calls whose cost is
    /// unknown, and what earlier deliveries recorded (absent in older workers' values).
    #[serde(default)]
    unknown_usd: Decimal,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct CarriedModel {
    input_tokens: u64,
    output_tokens: u64,
    cached_tokens: u64,
    cost_usd: Decimal,
    calls: u64,
}

impl Spent {
    /// Starts from what a hand-back carried (`_billed`); an unreadable value is logged
    /// and counted as nothing (it is our own encoding, so only a hand edit breaks it).
    pub(super) fn carried(billed: Option<&[u8]>, entry: &str) -> Spent {
        let mut s = Spent::default();
        let Some(raw) = billed else { return s };
        let c: Carried = match serde_json::from_slice(raw) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(entry = %entry, error = %e, "unreadable _billed field of a handed-back job; its earlier spending is not counted");
                return s;
            }
        };
        // A hand-edited value could be absurd; a cost outside [0, 1e9] USD is not ours.
        let plausible = |d: &Decimal| *d >= Decimal::ZERO && *d <= Decimal::from(1_000_000_000u64);
        if !c.models.values().all(|m| plausible(&m.cost_usd)) || !plausible(&c.unknown_usd) {
            tracing::warn!(entry = %entry, "implausible cost in the _billed field of a handed-back job; its earlier spending is not counted");
            return s;
        }
        s.attempts = c.attempts;
        s.tried = c.tried;
        s.bill.raw_usage = c.usage;
        s.unknown_worst = c.unknown_usd;
        for (model, m) in c.models {
            let usage = Usage {
                prompt_tokens: m.input_tokens,
                completion_tokens: m.output_tokens,
                cached_tokens: m.cached_tokens,
                cache_write_tokens: 0,
            };
            s.bill.usage.add(&usage);
            s.bill.cost = s.bill.cost.saturating_add(m.cost_usd);
            s.bill.per_model.insert(model, (usage, m.cost_usd, m.calls));
        }
        s
    }

    /// The `_billed` value to hand on; `None` when nothing was called yet.
    pub(super) fn carry(&self) -> Option<Vec<u8>> {
        // Nothing called and nothing counted: nothing to carry. A delivery that took a
        // killed worker's entry over counts that worker's calls before its own first one.
        if self.attempts == 0 && self.counted() == Decimal::ZERO {
            return None;
        }
        let c = Carried {
            attempts: self.attempts,
            tried: self.tried.clone(),
            models: self
                .bill
                .per_model
                .iter()
                .map(|(m, (u, cost, calls))| {
                    let cm = CarriedModel {
                        input_tokens: u.prompt_tokens,
                        output_tokens: u.completion_tokens,
                        cached_tokens: u.cached_tokens,
                        cost_usd: *cost,
                        calls: *calls,
                    };
                    (m.clone(), cm)
                })
                .collect(),
            usage: self.bill.raw_usage.clone(),
            unknown_usd: self.unknown_worst.saturating_add(self.earlier_deliveries),
        };
        serde_json::to_vec(&c).ok()
    }

    /// Records the start of a call to `model`.
    pub(super) fn start_call(&mut self, model: &str) {
        self.called = true;
        self.attempts += 1;
        if self.tried.last().map(String::as_str) != Some(model) {
            self.tried.push(model.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carried_spending_round_trips_exactly() {
        let price = Price {
            input_per_mtok: Decimal::new(14, 2),
            output_per_mtok: Decimal::new(42, 2),
            cached_input_per_mtok: Some(Decimal::new(28, 3)),
            cache_write_per_mtok: None,
        };
        let mut s = Spent::default();
        s.start_call("m1");
        s.bill.add(
            "m1",
            Some(Usage {
                prompt_tokens: 7,
                completion_tokens: 3,
                cached_tokens: 2,
                cache_write_tokens: 0,
            }),
            &price,
        );
        s.bill
            .raw_usage
            .push(serde_json::json!({"prompt_tokens": 7, "x": [1]}));
        s.start_call("m1");
        s.start_call("m2");
        // A call of unknown cost, and what an earlier (killed) delivery recorded: the cap of
        // the next delivery counts both.
        s.unknown_worst = Decimal::new(21_140, 9);
        s.earlier_deliveries = Decimal::new(5, 6);
        let back = Spent::carried(s.carry().as_deref(), "1-0");
        assert_eq!(
            back.counted(),
            s.counted(),
            "the cap counts the same after a hand-back"
        );
        assert_eq!(
            back.bill.raw_usage, s.bill.raw_usage,
            "raw usage travels too"
        );
        assert_eq!(back.attempts, 3);
        assert_eq!(back.tried, ["m1", "m2"]);
        assert!(!back.called, "a new delivery has not called yet");
        assert_eq!(back.bill.cost, s.bill.cost);
        assert_eq!(back.bill.usage, s.bill.usage);
        assert_eq!(back.bill.cost_fields(), s.bill.cost_fields());
        assert!(Spent::default().carry().is_none());
        assert_eq!(Spent::carried(Some(b"nope"), "1-0").attempts, 0);
        // A value written by an older worker has no `unknown_usd`: nothing more counted.
        let mut old: serde_json::Value = serde_json::from_slice(&s.carry().unwrap()).unwrap();
        old.as_object_mut().unwrap().remove("unknown_usd");
        let old = serde_json::to_vec(&old).unwrap();
        assert_eq!(
            Spent::carried(Some(&old), "1-0").counted(),
            back.bill.cost,
            "an older value counts its bill alone"
        );
    }
}
