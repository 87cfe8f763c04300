//! Serde helpers for the duration keys: a whole number of milliseconds (`_ms` keys, this
//! module) or seconds (`_s` keys, [`seconds`]) in TOML and in `LLM_WORKER__...`
//! overrides, a [`Duration`] in [`super::Config`].
//!
//! Why: call sites take a `Duration` directly instead of each converting (and each
//! possibly getting the unit wrong). Serialising writes the same integer back, so
//! `check-config` prints the same keys with the same numbers an operator wrote.
//!
//! Accepted: a non-negative integer, or a string of one (`"1500"`, as an environment
//! override may arrive). Anything else is an error that serde/config attaches the key to.

use serde::Serializer;
use serde::de::{self, Deserializer, Visitor};
use std::time::Duration;

pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    // Config durations come from `from_millis(u64)`, so this never saturates for them.
    s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    d.deserialize_any(Whole {
        unit: "milliseconds",
        make: Duration::from_millis,
    })
}

/// The same for the `_s` keys (`queue.dedupe_ttl_s`): whole seconds.
pub mod seconds {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        // Config durations come from `from_secs(u64)`, so this is exact for them.
        s.serialize_u64(d.as_secs())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        d.deserialize_any(Whole {
            unit: "seconds",
            make: Duration::from_secs,
        })
    }
}

/// A whole number of `unit`s, made into a `Duration` by `make`.
struct Whole {
    unit: &'static str,
    make: fn(u64) -> Duration,
}

impl Visitor<'_> for Whole {
    type Value = Duration;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a whole number of {} (0 or more)", self.unit)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
        Ok((self.make)(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
        u64::try_from(v).map(self.make).map_err(|_| {
            E::custom(format!(
                "must be a whole number of {} (0 or more), got {v}",
                self.unit
            ))
        })
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
        match v.trim().parse::<i64>() {
            Ok(n) => self.visit_i64(n),
            Err(_) => Err(E::custom(format!(
                "must be a whole number of {} (0 or more), got {v:?}",
                self.unit
            ))),
        }
    }
}
