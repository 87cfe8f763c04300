//! Pure cost arithmetic: usage x price table -> exact decimal USD.
//!
//! Invariant: no floating point anywhere. Prices are `Decimal` per million tokens with at
//! most 6 decimal places (enforced by config validation), so every cost is a whole number
//! of pico-dollars (1e-12 USD) and running totals can be kept in Redis as integers.

use rust_decimal::Decimal;

/// Token counts one provider response reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Part of `prompt_tokens` served from the provider's prompt cache.
    pub cached_tokens: u64,
}

impl Usage {
    pub fn add(&mut self, other: &Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.cached_tokens += other.cached_tokens;
    }
}

/// A model's prices in USD per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Price {
    pub input_per_mtok: Decimal,
    pub output_per_mtok: Decimal,
    /// Cached prompt tokens; `None` = billed as ordinary input.
    pub cached_input_per_mtok: Option<Decimal>,
}

const MILLION: Decimal = Decimal::from_parts(1_000_000, 0, 0, false, 0);
const PICOS_PER_USD: Decimal = Decimal::from_parts(3_567_587_328, 232, 0, false, 0); // 1e12

/// Exact cost of one response. Cached tokens are capped at `prompt_tokens` so a
/// provider reporting nonsense can never make a cost negative.
pub fn cost(usage: &Usage, price: &Price) -> Decimal {
    let cached = usage.cached_tokens.min(usage.prompt_tokens);
    let uncached = usage.prompt_tokens - cached;
    let cached_price = price.cached_input_per_mtok.unwrap_or(price.input_per_mtok);
    let total = Decimal::from(uncached) * price.input_per_mtok
        + Decimal::from(cached) * cached_price
        + Decimal::from(usage.completion_tokens) * price.output_per_mtok;
    (total / MILLION).normalize()
}

/// The cost in whole pico-dollars, for exact integer totals in Redis.
/// `None` if the amount is not a whole number of pico-dollars or overflows i64
/// (cannot happen with validated prices and sane token counts).
pub fn to_picos(usd: Decimal) -> Option<i64> {
    let p = usd * PICOS_PER_USD;
    if p.fract() != Decimal::ZERO {
        return None;
    }
    i64::try_from(p).ok()
}

/// Pico-dollars back to USD, exactly.
pub fn from_picos(picos: i64) -> Decimal {
    (Decimal::from(picos) / PICOS_PER_USD).normalize()
}

/// A decimal USD amount as written into results: plain notation, no exponent,
/// no trailing zeros (`"0"` for zero).
pub fn format_usd(usd: Decimal) -> String {
    usd.normalize().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    fn d(s: &str) -> Decimal {
        Decimal::from_str(s).unwrap()
    }

    fn deepseek() -> Price {
        Price {
            input_per_mtok: d("0.14"),
            output_per_mtok: d("0.42"),
            cached_input_per_mtok: Some(d("0.028")),
        }
    }

    #[test]
    fn constants_are_right() {
        assert_eq!(MILLION, d("1000000"));
        assert_eq!(PICOS_PER_USD, d("1000000000000"));
    }

    #[test]
    fn cost_is_exact() {
        let u = Usage {
            prompt_tokens: 1234,
            completion_tokens: 567,
            cached_tokens: 0,
        };
        // 1234*0.14 + 567*0.42 = 172.76 + 238.14 = 410.90 -> /1e6
        assert_eq!(cost(&u, &deepseek()), d("0.0004109"));
        assert_eq!(format_usd(cost(&u, &deepseek())), "0.0004109");
    }

    #[test]
    fn cached_tokens_use_cached_price_and_are_capped() {
        let u = Usage {
            prompt_tokens: 1000,
            completion_tokens: 0,
            cached_tokens: 400,
        };
        // 600*0.14 + 400*0.028 = 84 + 11.2 = 95.2
        assert_eq!(cost(&u, &deepseek()), d("0.0000952"));
        let silly = Usage {
            prompt_tokens: 10,
            completion_tokens: 0,
            cached_tokens: 99,
        };
        assert_eq!(cost(&silly, &deepseek()), d("0.00000028"));
        let no_cache_price = Price {
            cached_input_per_mtok: None,
            ..deepseek()
        };
        assert_eq!(cost(&u, &no_cache_price), d("0.00014"));
    }

    #[test]
    fn sum_of_many_small_costs_is_exact() {
        let u = Usage {
            prompt_tokens: 1,
            completion_tokens: 1,
            cached_tokens: 0,
        };
        let mut total = Decimal::ZERO;
        let mut picos = 0i64;
        for _ in 0..1_000_000 {
            let c = cost(&u, &deepseek());
            total += c;
            picos += to_picos(c).unwrap();
        }
        assert_eq!(total, d("0.56"));
        assert_eq!(from_picos(picos), d("0.56"));
    }

    #[test]
    fn picos_round_trip() {
        assert_eq!(to_picos(d("0.0004109")), Some(410_900_000));
        assert_eq!(from_picos(410_900_000), d("0.0004109"));
        assert_eq!(to_picos(d("0.0000000000001")), None);
        assert_eq!(format_usd(Decimal::ZERO), "0");
    }
}
