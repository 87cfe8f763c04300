//! The fleet-wide quotas of one call, in at most one round trip before it and one after
//! it (room drawn from a rate block, `ratelimit::Blocks`, or a budget block,
//! `budget::blocks`, needs none): its
//! budget reservation ([`crate::budget`]) and its rpm / tpm admission
//! ([`crate::ratelimit`]) are one script (`lua/quota_admit.lua`), all or nothing; its
//! settlement (real cost, real tokens) is another (`lua/quota_settle.lua`).
//!
//! Invariants: a call held back by a rate limit reserves no budget, and one refused by a
//! budget takes no rate; budget windows are checked first (a budget's verdict, not a
//! rate limit's wait, decides `on_exhausted`); a retry of a try whose reply was lost
//! neither reserves nor admits twice (the reservation id, or the last admitted id).

use crate::budget::{BudgetAsk, Reservation};
use crate::connect::Commands;
use crate::ratelimit::{Admission, RateAsk, WINDOW};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum GateError {
    #[error("redis: {0} (retry when Redis answers again)")]
    Redis(redis::RedisError),
    #[error("redis pool: {0} (retry when Redis answers again)")]
    Pool(deadpool_redis::PoolError),
}

from_cause!(GateError, GateError::Redis, redis::RedisError);
from_cause!(GateError, GateError::Pool, deadpool_redis::PoolError);

/// What [`Gate::admit`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Reserved and admitted; the rate bucket is the server's unix `second`, `ms` the
    /// server's milliseconds into it when it was admitted (`None`: a retry found the
    /// admission made already, at an unknown time of that second).
    Admitted { second: i64, ms: Option<i64> },
    /// Budget window `i` (from 0) has only `left` pico-dollars: nothing done.
    Budget { i: usize, left: i64 },
    /// Rate limit `i` (from 0) has no room for `wait`: nothing done.
    Rate { i: usize, wait: Duration },
}

/// The quota scripts on this worker's connections. Cheap to clone.
#[derive(Clone)]
pub struct Gate {
    conn: Commands,
}

impl Gate {
    pub fn new(conn: Commands) -> Gate {
        Gate { conn }
    }

    /// Reserves `budget` (for `ttl_ms`) and admits `rate`, all or nothing.
    pub async fn admit(
        &self,
        budget: Option<&BudgetAsk>,
        ttl_ms: u64,
        rate: Option<&RateAsk>,
    ) -> Result<Answer, GateError> {
        let mut inv = crate::scripts::Call::new(&crate::scripts::QUOTA_ADMIT);
        let nb = budget.map_or(0, |b| b.keys().count());
        inv.arg(nb)
            .arg(budget.map_or("", |b| b.id.as_str()))
            .arg(ttl_ms)
            .arg(rate.map_or("", |r| r.id.as_str()))
            .arg(WINDOW.as_millis() as u64);
        if let Some(b) = budget {
            for k in b.keys() {
                inv.key(k);
            }
            for a in b.args() {
                inv.arg(a);
            }
        }
        if let Some(r) = rate {
            for k in r.keys() {
                inv.key(k);
            }
            inv.key(&r.adm_key);
            for a in r.args() {
                inv.arg(a);
            }
        }
        let mut conn = self.conn.get().await?;
        let reply: Vec<i64> = inv.invoke(&mut conn).await?;
        let at = |n: usize| reply.get(n).copied().unwrap_or(0);
        Ok(match (at(0), at(1)) {
            (1, second) => Answer::Admitted {
                second,
                ms: reply.get(2).copied(),
            },
            (_, 1) => Answer::Budget {
                i: (at(2).max(1) - 1) as usize,
                left: at(3),
            },
            _ => Answer::Rate {
                i: (at(2).max(1) - 1) as usize,
                wait: Duration::from_millis(at(3).max(1) as u64),
            },
        })
    }

    /// Settles `reservation` to `cost_picos` and corrects `admission` to `used` tokens
    /// and, when given, to `used_calls` calls made (a block's calls not made go back to
    /// its requests windows). `first` = no earlier try of this settle can have reached
    /// Redis (see `lua/quota_settle.lua`). Returns how many budget windows counted the
    /// cost.
    pub async fn settle(
        &self,
        reservation: Option<&Reservation>,
        cost_picos: i64,
        first: bool,
        admission: Option<&Admission>,
        used: Option<u64>,
        used_calls: Option<u64>,
    ) -> Result<usize, GateError> {
        let mut inv = crate::scripts::Call::new(&crate::scripts::QUOTA_SETTLE);
        let nb = reservation.map_or(0, |r| r.keys.len());
        // Only an admission with something to correct is sent (its record goes with it):
        // tokens, or requests admitted and not all made (a block's).
        let unmade = |a: &Admission| used_calls.map_or(0, |c| a.requests.saturating_sub(c));
        let admission = admission
            .filter(|a| !a.token_keys.is_empty() || (!a.request_keys.is_empty() && unmade(a) > 0));
        let tokens = admission.map_or(0, |a| a.tokens);
        let unmade = admission.map_or(0, unmade);
        let requests: &[String] = match admission {
            Some(a) if unmade > 0 => &a.request_keys,
            _ => &[],
        };
        inv.arg(nb)
            .arg(reservation.map_or("", |r| r.id.as_str()))
            .arg(cost_picos)
            .arg(if first { "1" } else { "0" })
            .arg(tokens)
            .arg(used.unwrap_or(tokens))
            .arg(if admission.is_some() { "1" } else { "0" })
            .arg(requests.len())
            .arg(-(unmade.min(i64::MAX as u64) as i64));
        for k in reservation.iter().flat_map(|r| r.keys.iter()) {
            inv.key(k);
        }
        if let Some(a) = admission {
            for k in a.token_keys.iter().chain(requests) {
                inv.key(k);
            }
            inv.key(&a.adm_key);
        }
        let mut conn = self.conn.get().await?;
        let settled: i64 = inv.invoke(&mut conn).await?;
        Ok(settled.max(0) as usize)
    }
}
