//! Prices: TOML floats (or strings) -> exact `Decimal`, and the bounds that keep every
//! cost exact (see [`crate::cost`]).

use super::ConfigError;
use crate::cost::{MAX_PRICE_PER_MTOK, MAX_PRICE_SCALE};
use rust_decimal::Decimal;

/// Prices: TOML floats (or strings) -> exact `Decimal`, via the float's shortest
/// round-trip text, so `0.14` becomes exactly `0.14`.
pub(super) mod price {
    use rust_decimal::Decimal;
    use serde::{Deserialize, Deserializer, Serializer};
    use std::str::FromStr;

    #[derive(Deserialize)]
    #[serde(untagged)]
    pub(super) enum Raw {
        F(f64),
        I(i64),
        S(String),
    }
    pub(super) fn to_decimal(r: Raw) -> Result<Decimal, String> {
        let text = match r {
            Raw::F(f) => format!("{f}"),
            Raw::I(i) => i.to_string(),
            Raw::S(s) => s,
        };
        Decimal::from_str(text.trim()).map_err(|e| format!("not a decimal price {text:?}: {e}"))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Decimal, D::Error> {
        to_decimal(Raw::deserialize(d)?).map_err(serde::de::Error::custom)
    }
    pub fn serialize<S: Serializer>(v: &Decimal, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.normalize().to_string())
    }
}

pub(super) mod opt_price {
    use rust_decimal::Decimal;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Decimal>, D::Error> {
        match Option::<super::price::Raw>::deserialize(d)? {
            None => Ok(None),
            Some(r) => super::price::to_decimal(r)
                .map(Some)
                .map_err(serde::de::Error::custom),
        }
    }
    pub fn serialize<S: Serializer>(v: &Option<Decimal>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_str(&v.normalize().to_string()),
            None => s.serialize_none(),
        }
    }
}

pub(super) fn check_price(key: String, value: Decimal) -> Result<(), ConfigError> {
    if value.is_sign_negative() && !value.is_zero() {
        return Err(ConfigError::invalid(
            key,
            format!("price must not be negative, got {value}"),
        ));
    }
    // The cap keeps every cost computable exactly (see `cost`): no overflow for any
    // token count a provider can report.
    if value > MAX_PRICE_PER_MTOK {
        return Err(ConfigError::invalid(
            key,
            format!(
                "price {value} USD per million tokens is above the maximum {MAX_PRICE_PER_MTOK}; check the unit (USD per million tokens, not per token)"
            ),
        ));
    }
    if value.normalize().scale() > MAX_PRICE_SCALE {
        return Err(ConfigError::invalid(
            key,
            format!(
                "price {value} has more than {MAX_PRICE_SCALE} decimal places (USD per million tokens)"
            ),
        ));
    }
    Ok(())
}
