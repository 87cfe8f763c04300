//! Fleet-wide spending budgets (`[budgets.<name>]`): a call's worst case is reserved in
//! Redis in every budget window that covers it before the call, and settled to its real
//! cost after it. This room says which windows cover a call and what they hold
//! ([`Budgets::ask`], [`report`]); `gate` runs the one script that reserves (together
//! with the rate limits, `lua/quota_admit.lua`) and the one that settles
//! (`lua/quota_settle.lua`).
//!
//! Invariants:
//! - a window (`{ns}:budget:<name>:<tenant>:<d:YYYY-MM-DD | m:YYYY-MM>`, UTC) never holds
//!   more than its limit in spent + live reservations: the check and the reservation are
//!   one script, so concurrent calls of the whole fleet overshoot a budget only by what a
//!   provider bills beyond the worst case reserved (see [`crate::quota`] for the bound);
//! - a reservation lives the longest provider timeout plus two slot TTLs (the call, and a
//!   stall between its answer and the settle) plus a block's life ([`blocks`]: a busy
//!   cover reserves for several calls at once, drawn on for up to a second): a
//!   worker killed mid-call frees its reservations when they expire; settling is
//!   idempotent (only a window that still holds the reservation counts the cost);
//! - amounts are whole pico-dollars (i64), as everywhere else in the money path.

pub mod blocks;

use crate::config::{BudgetConfig, Config, OnExhausted};
use crate::cost::{self, civil_from_days, days_from_civil};
use rust_decimal::Decimal;
use std::time::Duration;

/// Why no reservation was made.
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    /// A window has less left than the call's worst case: what `on_exhausted` says.
    #[error(
        "budget: {name} ({window}) has {left} USD left of {limit}, less than this call's worst case {worst}; {what}"
    )]
    Exhausted {
        name: String,
        window: String,
        left: String,
        limit: String,
        worst: String,
        on: OnExhausted,
        what: &'static str,
        /// The call's worst case is above the whole limit: it can never fit.
        never_fits: bool,
        /// The budget covers every model and the whole fleet (no tenant): pausing the
        /// reader stops nothing it does not cover.
        covers_all: bool,
        /// Where a job it pauses is parked when it does not cover all (see [`ParkAt`]).
        park: ParkAt,
    },
    #[error("budget: the call's worst case is not computable: {0} (the model is skipped)")]
    Uncomputable(String),
    #[error("redis: {0} (retry when Redis answers again)")]
    Redis(redis::RedisError),
    #[error("redis pool: {0} (retry when Redis answers again)")]
    Pool(deadpool_redis::PoolError),
}

from_cause!(BudgetError, BudgetError::Redis, redis::RedisError);
from_cause!(BudgetError, BudgetError::Pool, deadpool_redis::PoolError);

/// A budget's parked jobs (those it paused while it covers only some jobs): its name,
/// whose windows (`*` or `t=<tenant>`), and one parked job's worst case (pico-dollars),
/// the room that moves one back.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParkAt {
    pub budget: String,
    pub who: String,
    pub need: i64,
    /// The budget's config when the job was parked (JSON): once it changes (or the
    /// budget is gone), the parked jobs go back to be decided again.
    #[serde(default)]
    pub rule: String,
}

impl ParkAt {
    /// An index value of `lua/budget_park.lua` (`<need>|<next>|<json>`): the JSON, with
    /// the smallest worst case parked as `need`.
    pub fn from_index(v: &str) -> Option<ParkAt> {
        let mut parts = v.splitn(3, '|');
        let need: i64 = parts.next()?.parse().ok()?;
        let _next = parts.next()?;
        let mut at: ParkAt = serde_json::from_str(parts.next()?).ok()?;
        at.need = need;
        Some(at)
    }
}

/// One live reservation: settled by `gate::Gate::settle`.
#[derive(Debug, Clone)]
pub struct Reservation {
    pub(crate) id: String,
    pub(crate) keys: Vec<String>,
}

/// A reservation to make (by `gate::Gate::admit`): the windows covering one call and the
/// amount, in pico-dollars.
#[derive(Debug, Clone)]
pub struct BudgetAsk {
    pub(crate) id: String,
    windows: Vec<Window>,
    amount: i64,
    worst: Decimal,
    /// Calls reserved for (a block, see [`blocks`]): `k` times the amount.
    k: u64,
}

impl BudgetAsk {
    pub(crate) fn keys(&self) -> impl Iterator<Item = &str> {
        self.windows.iter().map(|w| w.key.as_str())
    }
    /// The windows it covers, as one string: calls with the same cover can share a block.
    pub fn cover(&self) -> String {
        let mut s = String::new();
        for w in &self.windows {
            s.push_str(&w.key);
            s.push('\n');
        }
        s
    }
    /// One call's worst case, pico-dollars.
    pub fn amount(&self) -> i64 {
        self.amount
    }
    /// The most calls a block of this ask may reserve for: [`blocks::MAX_BLOCK`], and
    /// never more than 1/[`blocks::LIMIT_SHARE`] of any window's limit (at least 1).
    pub fn max_block(&self) -> u64 {
        let per = self.amount.max(1).saturating_mul(blocks::LIMIT_SHARE);
        self.windows
            .iter()
            .map(|w| cost::to_picos(w.limit).unwrap_or(i64::MAX) / per)
            .min()
            .unwrap_or(1)
            .clamp(1, blocks::MAX_BLOCK as i64) as u64
    }
    /// The same ask for a block of `k` calls' worst cases (`k` at most
    /// [`BudgetAsk::max_block`]).
    pub fn block(mut self, k: u64) -> BudgetAsk {
        self.k = k.max(1);
        self
    }
    /// Calls reserved for.
    pub fn k(&self) -> u64 {
        self.k
    }
    /// Pico-dollars reserved: `k` worst cases.
    pub fn total(&self) -> i64 {
        self.amount.saturating_mul(self.k as i64)
    }
    /// Per window: limit, amount (pico-dollars), key expiry (unix ms).
    pub(crate) fn args(&self) -> Vec<i64> {
        self.windows
            .iter()
            .flat_map(|w| {
                [
                    cost::to_picos(w.limit).unwrap_or(i64::MAX),
                    self.total(),
                    i64::try_from(w.expire_at_ms).unwrap_or(i64::MAX),
                ]
            })
            .collect()
    }
    pub fn worst(&self) -> Decimal {
        self.worst
    }
    /// The reservation once the script made it.
    pub fn reservation(self) -> Reservation {
        Reservation {
            id: self.id,
            keys: self.windows.into_iter().map(|w| w.key).collect(),
        }
    }
}

/// One window of one budget that covers a call.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Window {
    name: String,
    /// `d:YYYY-MM-DD` or `m:YYYY-MM`.
    period: String,
    key: String,
    /// `*` or `t=<tenant>`.
    who: String,
    limit: Decimal,
    /// Unix ms after which the key may go: the window's end plus a week.
    expire_at_ms: u64,
    on: OnExhausted,
}

/// The budgets of this config. Cheap to clone.
#[derive(Clone)]
pub struct Budgets {
    cfg: std::sync::Arc<Config>,
    ttl: Duration,
}

impl Budgets {
    pub fn new(cfg: std::sync::Arc<Config>) -> Budgets {
        let longest_call = cfg
            .providers
            .values()
            .map(|p| p.timeout_ms)
            .max()
            .unwrap_or(Duration::from_secs(60));
        let ttl = longest_call + cfg.slots.ttl_ms * 2 + blocks::BLOCK_LIFE;
        Budgets { cfg, ttl }
    }

    /// True when no budget is configured (then nothing is reserved: no round trip).
    pub fn is_empty(&self) -> bool {
        self.cfg.budgets.is_empty()
    }

    /// How long a reservation lives (the longest call plus two slot TTLs, plus the life
    /// of a block: its last call may start that late), in ms.
    pub fn ttl_ms(&self) -> u64 {
        u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX)
    }

    /// The reservation of `worst` USD for one call of `model` for `tenant` in every
    /// window that covers it; `Ok(None)` when no budget covers the call. `id` names the
    /// reservation: the same id for every try of one call, so a try whose reply was lost
    /// is not reserved twice. Errors: a worst case above a window's whole limit (no
    /// amount of waiting makes room), or one that is not computable in pico-dollars.
    // The error is large (the message's parts); one per call, and never on a hot loop.
    #[allow(clippy::result_large_err)]
    pub fn ask(
        &self,
        id: &str,
        model: &str,
        tenant: Option<&str>,
        worst: Decimal,
    ) -> Result<Option<BudgetAsk>, BudgetError> {
        let windows = windows(&self.cfg, model, tenant, cost::unix_now_ms());
        if windows.is_empty() {
            return Ok(None);
        }
        let amount = cost::to_picos(worst)
            .ok_or_else(|| BudgetError::Uncomputable(format!("{worst} USD")))?;
        if let Some(w) = windows.iter().find(|w| worst > w.limit) {
            return Err(exhausted(&self.cfg, w, w.limit, worst, true));
        }
        Ok(Some(BudgetAsk {
            id: id.to_string(),
            windows,
            amount,
            worst,
            k: 1,
        }))
    }

    /// The windows of budget `at.budget` for `at.who` now, with their limits in
    /// pico-dollars (for moving its parked jobs back). Empty (move them all back, their
    /// next reader decides again) when the budget is gone, its config changed since the
    /// jobs were parked (limits, models, tenant, `on_exhausted`), or a parked job's worst
    /// case is above a whole limit (it can never fit: it goes to a cheaper model or fails).
    pub fn windows_of(&self, at: &ParkAt) -> Vec<(String, i64)> {
        let Some(b) = self.cfg.budgets.get(&at.budget) else {
            return vec![];
        };
        if rule_of(b) != at.rule {
            return vec![];
        }
        let windows = self.windows_now(&at.budget, &at.who);
        if windows.iter().any(|(_, limit)| at.need > *limit) {
            return vec![];
        }
        windows
    }

    /// The windows of budget `name` for `who` (`*` or `t=<tenant>`) now: key and limit
    /// in pico-dollars; empty if there is no such budget.
    pub fn windows_now(&self, name: &str, who: &str) -> Vec<(String, i64)> {
        let Some(b) = self.cfg.budgets.get(name) else {
            return vec![];
        };
        periods(b, cost::unix_now_ms())
            .into_iter()
            .map(|(period, limit, _)| {
                (
                    format!(
                        "{}{who}:{period}",
                        key_prefix(&self.cfg.queue.namespace, name)
                    ),
                    cost::to_picos(limit).unwrap_or(i64::MAX),
                )
            })
            .collect()
    }

    /// What `on_exhausted` says when window `i` (from 0) of `ask` had only `left_picos`.
    pub fn exhausted(&self, ask: &BudgetAsk, i: usize, left_picos: i64) -> BudgetError {
        let w = ask.windows.get(i).unwrap_or(&ask.windows[0]);
        exhausted(&self.cfg, w, cost::from_picos(left_picos), ask.worst, false)
    }
}

/// One window of one budget now, for `status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowReport {
    pub budget: String,
    /// `*` (the whole fleet) or `t=<tenant>`.
    pub who: String,
    /// `d:YYYY-MM-DD` or `m:YYYY-MM` (UTC).
    pub period: String,
    pub limit: Decimal,
    /// Settled spending.
    pub spent: Decimal,
    /// Live reservations: worst cases of calls running, and budget blocks (room reserved
    /// for a process's next calls, and the real costs of its ended calls until it settles).
    pub reserved: Decimal,
}

/// Every budget window of the current day and month that has a key (per-tenant windows
/// found with SCAN), for `status`.
pub async fn report(
    cfg: &Config,
    c: &mut redis::aio::MultiplexedConnection,
) -> Result<Vec<WindowReport>, redis::RedisError> {
    let now = cost::unix_now_ms();
    let mut out = vec![];
    for (name, b) in &cfg.budgets {
        for (period, limit, _) in periods(b, now) {
            let prefix = key_prefix(&cfg.queue.namespace, name);
            let pattern = format!("{prefix}*:{period}");
            let keys = crate::connect::scan_match(c, &pattern).await?;
            for key in keys {
                let fields: std::collections::HashMap<String, String> =
                    redis::cmd("HGETALL").arg(&key).query_async(c).await?;
                let mut spent = 0i64;
                let mut reserved = 0i64;
                for (f, v) in &fields {
                    if f == "spent" {
                        spent = v.parse().unwrap_or(0);
                    } else if f.starts_with("r:") {
                        let mut parts = v.split('|');
                        let amount: i64 = parts.next().and_then(|a| a.parse().ok()).unwrap_or(0);
                        let expiry: u64 = parts.next().and_then(|e| e.parse().ok()).unwrap_or(0);
                        if expiry > now {
                            reserved = reserved.saturating_add(amount);
                        }
                    }
                }
                let who = key
                    .strip_prefix(&prefix)
                    .and_then(|r| r.strip_suffix(&format!(":{period}")))
                    .unwrap_or("*")
                    .to_string();
                out.push(WindowReport {
                    budget: name.clone(),
                    who,
                    period: period.clone(),
                    limit,
                    spent: cost::from_picos(spent),
                    reserved: cost::from_picos(reserved),
                });
            }
        }
    }
    Ok(out)
}

fn exhausted(
    cfg: &Config,
    w: &Window,
    left: Decimal,
    worst: Decimal,
    never_fits: bool,
) -> BudgetError {
    let b = cfg.budgets.get(&w.name);
    let covers_all = b.is_some_and(|b| b.models.is_empty() && b.tenant.is_empty());
    let (on, what) = match (w.on, never_fits) {
        (OnExhausted::Fail, true) => (
            OnExhausted::Fail,
            "the call can never fit it: the job fails (lower max_tokens, or raise the budget)",
        ),
        (OnExhausted::Pause, true) => (
            OnExhausted::Cheaper,
            "the call can never fit it, so waiting cannot help: another model of the route is tried, else the job fails (lower max_tokens, or raise the budget)",
        ),
        (OnExhausted::Fail, false) => {
            (OnExhausted::Fail, "the job fails (on_exhausted = \"fail\")")
        }
        (OnExhausted::Cheaper, _) => (
            OnExhausted::Cheaper,
            "a cheaper model of the route is tried (on_exhausted = \"cheaper\")",
        ),
        (OnExhausted::Pause, false) => (
            OnExhausted::Pause,
            "jobs it covers wait until it has room or its window ends (on_exhausted = \"pause\")",
        ),
    };
    metrics::counter!("llm_worker_budget_exhausted_total", "budget" => w.name.clone()).increment(1);
    BudgetError::Exhausted {
        park: ParkAt {
            budget: w.name.clone(),
            who: w.who.clone(),
            need: cost::to_picos(worst).unwrap_or(i64::MAX),
            rule: b.map(rule_of).unwrap_or_default(),
        },
        name: w.name.clone(),
        window: w.period.clone(),
        left: cost::format_usd(left),
        limit: cost::format_usd(w.limit),
        worst: cost::format_usd(worst),
        on,
        what,
        never_fits,
        covers_all,
    }
}

/// A budget's config as one string, to see whether it changed (its models in order, so
/// their order in the TOML does not count).
fn rule_of(b: &BudgetConfig) -> String {
    let mut b = b.clone();
    b.models.sort();
    b.models.dedup();
    serde_json::to_string(&b).unwrap_or_default()
}

fn key_prefix(ns: &str, name: &str) -> String {
    format!("{{{ns}}}:budget:{name}:")
}

/// Whether budget `b` covers a call of `model` for `tenant`.
fn covers(b: &BudgetConfig, model: &str, tenant: Option<&str>) -> bool {
    let model_ok = b.models.is_empty() || b.models.iter().any(|m| m == model);
    let tenant_ok = match b.tenant.as_str() {
        "" | "*" => true,
        name => tenant == Some(name),
    };
    model_ok && tenant_ok
}

/// The budget's windows at `now_ms`: (period, limit, end of the window in unix ms).
fn periods(b: &BudgetConfig, now_ms: u64) -> Vec<(String, Decimal, u64)> {
    let day = now_ms / 86_400_000;
    let (y, m, d) = civil_from_days(day as i64);
    let mut out = vec![];
    if let Some(limit) = b.usd_per_day {
        out.push((
            format!("d:{y:04}-{m:02}-{d:02}"),
            limit,
            (day + 1) * 86_400_000,
        ));
    }
    if let Some(limit) = b.usd_per_month {
        let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
        let end = days_from_civil(ny, nm, 1) as u64 * 86_400_000;
        out.push((format!("m:{y:04}-{m:02}"), limit, end));
    }
    out
}

/// Every window covering a call of `model` for `tenant` at `now_ms`, in budget order.
fn windows(cfg: &Config, model: &str, tenant: Option<&str>, now_ms: u64) -> Vec<Window> {
    let mut out = vec![];
    for (name, b) in &cfg.budgets {
        if !covers(b, model, tenant) {
            continue;
        }
        // "*" = each tenant its own window (a job without a tenant shares the "-" one).
        let who = match b.tenant.as_str() {
            "" => "*".to_string(),
            "*" => format!("t={}", tenant.unwrap_or("-")),
            name => format!("t={name}"),
        };
        for (period, limit, end) in periods(b, now_ms) {
            out.push(Window {
                name: name.clone(),
                key: format!("{}{who}:{period}", key_prefix(&cfg.queue.namespace, name)),
                who: who.clone(),
                period,
                limit,
                expire_at_ms: end + 7 * 86_400_000,
                on: b.on_exhausted,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review finding: the order of a budget's `models` is not a change of its rule (a
    /// rollout with the list reordered would move its parked jobs back and forth).
    #[test]
    fn a_budgets_rule_ignores_the_order_of_its_models() {
        let c = cfg();
        let mut b = c.budgets["only-b"].clone();
        b.models = vec!["b".into(), "a".into()];
        let mut r = b.clone();
        r.models = vec!["a".into(), "b".into()];
        assert_eq!(rule_of(&b), rule_of(&r));
        r.on_exhausted = OnExhausted::Pause;
        assert_ne!(rule_of(&b), rule_of(&r), "a real change is one");
    }

    #[test]
    fn civil_dates_round_trip_and_known_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_425), (2025, 12, 3));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        for z in -800_000..800_000i64 {
            if z % 997 != 0 {
                continue;
            }
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
        }
    }

    fn cfg() -> Config {
        crate::config::test_config(&format!(
            "{}{}",
            crate::config::TEST_MODELS_AB,
            r#"
[budgets.all]
usd_per_day = "25.00"
usd_per_month = 500
[budgets.only-b]
usd_per_day = 1
models = ["b"]
on_exhausted = "fail"
[budgets.each]
usd_per_month = 2
tenant = "*"
on_exhausted = "cheaper"
[budgets.acme]
usd_per_day = 3
tenant = "acme"
"#
        ))
    }

    #[test]
    fn windows_cover_by_model_and_tenant_and_name_the_utc_period() {
        let c = cfg();
        // 2026-12-31T23:59:59Z
        let t = days_from_civil(2026, 12, 31) as u64 * 86_400_000 + 86_399_000;
        let keys = |model, tenant| -> Vec<String> {
            windows(&c, model, tenant, t)
                .into_iter()
                .map(|w| w.key)
                .collect()
        };
        assert_eq!(
            keys("a", None),
            [
                "{llm}:budget:all:*:d:2026-12-31",
                "{llm}:budget:all:*:m:2026-12",
                "{llm}:budget:each:t=-:m:2026-12",
            ]
        );
        assert_eq!(
            keys("b", Some("acme")),
            [
                "{llm}:budget:acme:t=acme:d:2026-12-31",
                "{llm}:budget:all:*:d:2026-12-31",
                "{llm}:budget:all:*:m:2026-12",
                "{llm}:budget:each:t=acme:m:2026-12",
                "{llm}:budget:only-b:*:d:2026-12-31",
            ]
        );
        let w = windows(&c, "a", None, t);
        // the month window ends at 2027-01-01, kept a week more
        let jan1 = days_from_civil(2027, 1, 1) as u64 * 86_400_000;
        assert_eq!(w[1].expire_at_ms, jan1 + 7 * 86_400_000);
        assert_eq!(w[0].expire_at_ms, jan1 + 7 * 86_400_000);
        // one second later: the next day and month
        assert!(
            windows(&c, "a", None, t + 1000)[0]
                .key
                .ends_with("d:2027-01-01")
        );
    }
}
