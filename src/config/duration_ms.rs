//! Serde helper for the `_ms` keys: a whole number of milliseconds in TOML and in
//! `LLM_WORKER__..._MS` overrides, a [`Duration`] in [`super::Config`].
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
    d.deserialize_any(MsVisitor)
}

struct MsVisitor;

impl Visitor<'_> for MsVisitor {
    type Value = Duration;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a whole number of milliseconds (0 or more)")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
        Ok(Duration::from_millis(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
        u64::try_from(v).map(Duration::from_millis).map_err(|_| {
            E::custom(format!(
                "must be a whole number of milliseconds (0 or more), got {v}"
            ))
        })
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
        match v.trim().parse::<i64>() {
            Ok(n) => self.visit_i64(n),
            Err(_) => Err(E::custom(format!(
                "must be a whole number of milliseconds (0 or more), got {v:?}"
            ))),
        }
    }
}
