//! Pure cost arithmetic: usage x price table -> exact decimal USD.
//!
//! Invariant: no floating point anywhere, and no panicking arithmetic: every product and
//! sum is checked, and a cost that cannot be computed exactly is a [`CostError`], never a
//! panic (a panic in a job task would hide its job) and never a rounded figure.
//!
//! How it stays exact: a price is `Decimal` USD per million tokens with at most
//! [`MAX_PRICE_SCALE`] decimal places, i.e. a whole number of micro-dollars per million
//! tokens, which is a whole number of pico-dollars (1e-12 USD) per token. A cost is
//! therefore `tokens x price_in_micros` pico-dollars, computed in `u128` (u64 tokens x
//! prices up to [`MAX_PRICE_PER_MTOK`] cannot overflow it: 3 x 1.8e19 x 1e12 < 3.4e38)
//! and turned into a `Decimal` with scale 12, which fails only above ~7.9e16 USD (beyond
//! 96 bits), far outside any usage a provider can report ([`crate::provider`] rejects
//! more than a billion tokens per response).

pub use crate::outcome::Usage;
use rust_decimal::Decimal;

/// A model's prices in USD per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Price {
    pub input_per_mtok: Decimal,
    pub output_per_mtok: Decimal,
    /// Cached prompt tokens; `None` = billed as ordinary input.
    pub cached_input_per_mtok: Option<Decimal>,
    /// Prompt tokens written to the cache; `None` = billed as ordinary input.
    pub cache_write_per_mtok: Option<Decimal>,
}

/// Largest number of decimal places a price may have: one millionth of a USD per
/// million tokens is one pico-dollar per token, so every cost is an exact integer.
pub const MAX_PRICE_SCALE: u32 = 6;

/// Largest price config accepts, in USD per million tokens (1,000,000: a thousand times
/// the dearest model sold today). With it, pricing any u64 token count cannot overflow.
pub const MAX_PRICE_PER_MTOK: Decimal = Decimal::from_parts(1_000_000, 0, 0, false, 0);

/// Why a cost could not be computed. Each message says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CostError {
    /// A price outside what config validation accepts (negative, above the cap, or with
    /// more than 6 decimal places): only a `Price` built without validation gets here.
    #[error(
        "price {price} USD per million tokens is not a whole number of micro-dollars between 0 and {MAX_PRICE_PER_MTOK}; fix the model's price in config (check-config validates it)"
    )]
    BadPrice { price: Decimal },
    /// The exact cost does not fit the arithmetic (tens of quadrillions of USD): the
    /// reported usage is implausible.
    #[error(
        "the exact cost of {prompt_tokens} input + {completion_tokens} output tokens is too large to compute; the provider's reported usage is implausible: check it (the call is counted with an unknown cost)"
    )]
    Overflow {
        prompt_tokens: u64,
        completion_tokens: u64,
    },
}

const MILLION: Decimal = Decimal::from_parts(1_000_000, 0, 0, false, 0);
const PICOS_PER_USD: Decimal = Decimal::from_parts(3_567_587_328, 232, 0, false, 0); // 1e12
/// Scale of a pico-dollar amount in USD.
const PICO_SCALE: u32 = 12;

/// A validated price as whole micro-dollars per million tokens (= pico-dollars per token).
fn micros_per_mtok(price: Decimal) -> Result<u128, CostError> {
    let bad = || CostError::BadPrice { price };
    if price.is_sign_negative() && !price.is_zero() || price > MAX_PRICE_PER_MTOK {
        return Err(bad());
    }
    let micros = price.checked_mul(MILLION).ok_or_else(bad)?;
    if !micros.fract().is_zero() {
        return Err(bad());
    }
    u128::try_from(micros).map_err(|_| bad())
}

/// Exact cost of one response, or why it cannot be computed (never a panic, never a
/// rounded figure). Cached tokens are capped at `prompt_tokens` so a provider reporting
/// nonsense can never make a cost negative.
pub fn checked_cost(usage: &Usage, price: &Price) -> Result<Decimal, CostError> {
    let overflow = || CostError::Overflow {
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
    };
    // Every prompt token at exactly one price: cache reads, cache writes, the rest.
    let cached = usage.cached_tokens.min(usage.prompt_tokens);
    let written = usage.cache_write_tokens.min(usage.prompt_tokens - cached);
    let uncached = usage.prompt_tokens - cached - written; // cached + written <= prompt
    let input = micros_per_mtok(price.input_per_mtok)?;
    let cached_price = match price.cached_input_per_mtok {
        Some(p) => micros_per_mtok(p)?,
        None => input,
    };
    let write_price = match price.cache_write_per_mtok {
        Some(p) => micros_per_mtok(p)?,
        None => input,
    };
    let output = micros_per_mtok(price.output_per_mtok)?;
    let term = |tokens: u64, micros: u128| u128::from(tokens).checked_mul(micros);
    let picos = term(uncached, input)
        .and_then(|a| a.checked_add(term(cached, cached_price)?))
        .and_then(|a| a.checked_add(term(written, write_price)?))
        .and_then(|a| a.checked_add(term(usage.completion_tokens, output)?))
        .ok_or_else(overflow)?;
    let picos = i128::try_from(picos).map_err(|_| overflow())?;
    Decimal::try_from_i128_with_scale(picos, PICO_SCALE)
        .map(|d| d.normalize())
        .map_err(|_| overflow())
}

/// [`checked_cost`] for callers that know the cost is computable: tests pricing the
/// small usages they make up. Production code (worker, demo) calls [`checked_cost`].
///
/// # Panics
/// With the [`CostError`] message, if the cost cannot be computed exactly.
pub fn cost(usage: &Usage, price: &Price) -> Decimal {
    match checked_cost(usage, price) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    }
}

/// The cost in whole pico-dollars, for exact integer totals in Redis.
/// `None` if the amount is not a whole number of pico-dollars or overflows i64
/// (9.2 million USD; cannot happen with validated prices and sane token counts).
pub fn to_picos(usd: Decimal) -> Option<i64> {
    let p = usd.checked_mul(PICOS_PER_USD)?;
    if !p.fract().is_zero() {
        return None;
    }
    i64::try_from(p).ok()
}

/// Pico-dollars back to USD, exactly (division by a constant: cannot overflow).
pub fn from_picos(picos: i64) -> Decimal {
    (Decimal::from(picos) / PICOS_PER_USD).normalize()
}

/// A decimal USD amount as written into results: plain notation, no exponent,
/// no trailing zeros (`"0"` for zero).
pub fn format_usd(usd: Decimal) -> String {
    usd.normalize().to_string()
}

/// (year, month, day) of a day count since 1970-01-01 (proleptic Gregorian; Howard
/// Hinnant's `civil_from_days`).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Days since 1970-01-01 of a civil date (inverse of [`civil_from_days`]).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Wall-clock unix ms (the clock the UTC spend and budget windows are named by).
pub fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The UTC day and month of `now_ms` as the spend windows name them: `d:YYYY-MM-DD`,
/// `m:YYYY-MM` (the budgets' window names too).
pub fn spend_periods(now_ms: u64) -> [String; 2] {
    let (y, m, d) = civil_from_days((now_ms / 86_400_000) as i64);
    [
        format!("d:{y:04}-{m:02}-{d:02}"),
        format!("m:{y:04}-{m:02}"),
    ]
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
            cache_write_per_mtok: None,
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
            cache_write_tokens: 0,
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
            cache_write_tokens: 0,
        };
        // 600*0.14 + 400*0.028 = 84 + 11.2 = 95.2
        assert_eq!(cost(&u, &deepseek()), d("0.0000952"));
        let silly = Usage {
            prompt_tokens: 10,
            completion_tokens: 0,
            cached_tokens: 99,
            cache_write_tokens: 0,
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
            cache_write_tokens: 0,
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

    /// Issue 8 point 3: the largest token counts (u64) at the largest prices must give an
    /// exact figure or an error, never a panic (a panic in a job task hides its job).
    #[test]
    fn huge_token_counts_do_not_panic() {
        let max = Usage {
            prompt_tokens: u64::MAX,
            completion_tokens: u64::MAX,
            cached_tokens: u64::MAX / 2,
            cache_write_tokens: 0,
        };
        let dearest = Price {
            input_per_mtok: MAX_PRICE_PER_MTOK,
            output_per_mtok: d("999999.999999"),
            cached_input_per_mtok: Some(d("0.000001")),
            cache_write_per_mtok: None,
        };
        // ~5.5e31 picos: exact in u128, beyond a Decimal's 96 bits -> reported.
        let e = checked_cost(&max, &dearest).expect_err("too large for a Decimal");
        assert!(matches!(e, CostError::Overflow { .. }), "{e}");
        assert!(e.to_string().contains("implausible"), "{e}");
        // Prices beyond validation (as config accepted before the cap) are reported too.
        for absurd in ["100000000000000000000", "1000000.000001", "0.0000001", "-1"] {
            let p = Price {
                input_per_mtok: d(absurd),
                output_per_mtok: d("1"),
                cached_input_per_mtok: None,
                cache_write_per_mtok: None,
            };
            let r = std::panic::catch_unwind(|| checked_cost(&max, &p));
            let e = r.expect("no panic").expect_err(absurd);
            assert!(matches!(e, CostError::BadPrice { .. }), "{absurd}: {e}");
        }
        // u64::MAX tokens at the cheapest price: exact (1 pico-dollar per token).
        let cheapest = Price {
            input_per_mtok: d("0.000001"),
            output_per_mtok: d("0"),
            cached_input_per_mtok: None,
            cache_write_per_mtok: None,
        };
        let one = Usage {
            prompt_tokens: u64::MAX,
            ..Usage::default()
        };
        assert_eq!(
            checked_cost(&one, &cheapest),
            Ok(d("18446744.073709551615"))
        );
        // A billion tokens (the most a response may report) at the cap: exact.
        let billion = Usage {
            prompt_tokens: 1_000_000_000,
            completion_tokens: 1_000_000_000,
            cached_tokens: 999_999_999,
            cache_write_tokens: 0,
        };
        let cap = Price {
            input_per_mtok: MAX_PRICE_PER_MTOK,
            output_per_mtok: MAX_PRICE_PER_MTOK,
            cached_input_per_mtok: Some(d("0.000001")),
            cache_write_per_mtok: None,
        };
        // 1 x 1e6 / 1e6 + 999,999,999 x 1e-6 / 1e6 + 1e9 x 1e6 / 1e6 USD
        assert_eq!(
            checked_cost(&billion, &cap),
            Ok(d("1000000001.000999999999"))
        );
        // to_picos reports (None) rather than panicking on the largest Decimal.
        assert_eq!(to_picos(Decimal::MAX), None);
        let mut u = max;
        u.add(&max);
        assert_eq!(u.prompt_tokens, u64::MAX);
    }

    #[test]
    fn picos_round_trip() {
        assert_eq!(to_picos(d("0.0004109")), Some(410_900_000));
        assert_eq!(from_picos(410_900_000), d("0.0004109"));
        assert_eq!(to_picos(d("0.0000000000001")), None);
        assert_eq!(format_usd(Decimal::ZERO), "0");
    }
}
