//! Per-job access and spending rules, applied to a job's route before and between its
//! calls: tiers (`[tiers]`, the job's `tier`) and the per-job cost cap (`max_cost_usd`).
//!
//! Invariant: pure (no IO, no clock), so every rule is checked in unit and property
//! tests. A *worst case* is an upper bound of what one call can cost, never an estimate
//! that a call may exceed:
//! - prompt tokens <= the bytes of the JSON request body: every token of the byte-level
//!   BPE tokenizers these APIs use covers at least one byte of text, and the JSON
//!   syntax around each message (`{"role":"user","content":""}`, 29 bytes) exceeds the
//!   few tokens of chat formatting a provider adds per message; plus, for every media
//!   part (an image is billed by its size, not its URL), [`MEDIA_PART_TOKEN_BOUND`];
//! - output tokens <= the larger of the job's `max_tokens` and `max_completion_tokens`
//!   (providers honour one or the other), else the model's `max_output_tokens`, else its
//!   whole `context_window`, times the completions asked for (`n`, `best_of`);
//! - every prompt token is priced at the dearest of the input, cached-input and
//!   cache-write prices.

use crate::config::{Config, ModelConfig};
use crate::cost::{self, CostError, Price, Usage};
use rust_decimal::Decimal;
use serde_json::{Map, Value};

/// Why a job cannot run on any model of its route. The `Display` starts with the class
/// word of the contract (`tier:`, `budget:`) and says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    #[error(
        "tier: no model of the job's route ({}) is allowed in tier `{tier}` (allowed: {}); send the job with another tier or route",
        .route.join(", "),
        .allowed.join(", ")
    )]
    Tier {
        tier: String,
        route: Vec<String>,
        allowed: Vec<String>,
    },
    #[error(
        "budget: every model left costs more than the job's max_cost_usd {cap} at worst ({spent} spent so far; cheapest worst case {cheapest}); raise max_cost_usd or set a smaller max_tokens"
    )]
    OverCap {
        cap: Decimal,
        spent: Decimal,
        cheapest: String,
    },
}

/// Tokens one media part (an image, an audio clip, a file) can be billed at most when the
/// model sets no `max_media_tokens`, whatever its bytes: providers bill an image by its
/// size, not by its URL or base64 text. The dearest per image in tokens we know of is
/// gpt-4o-mini at high detail: 2,833 + 5,667 per 512-pixel tile, up to 8 tiles = 48,169
/// (Claude bills about 1,600, Gemini up to 16 tiles of 258, Together's vision models up
/// to about 6,400). A file part is billed by its content, which nothing here bounds: set
/// `max_media_tokens` to what your largest file can be billed.
pub const MEDIA_PART_TOKEN_BOUND: u64 = 50_000;

/// Upper bound of the prompt tokens of `body` for `model` (see the module doc): its
/// bytes, plus the model's `max_media_tokens` (else [`MEDIA_PART_TOKEN_BOUND`]) for every
/// media part of its messages.
pub fn prompt_token_bound(body: &Map<String, Value>, model: &ModelConfig) -> u64 {
    let bytes = body_bytes(body);
    let per_part = model
        .max_media_tokens
        .map_or(MEDIA_PART_TOKEN_BOUND, |n| n.get());
    bytes.saturating_add(media_parts(body).saturating_mul(per_part))
}

/// Bytes of `body` as sent (JSON); `u64::MAX` if it cannot be serialized.
pub(crate) fn body_bytes(body: &Map<String, Value>) -> u64 {
    serde_json::to_vec(body).map_or(u64::MAX, |b| b.len() as u64)
}

/// How many content parts of `body`'s messages are not text (images, audio, files).
pub(crate) fn media_parts(body: &Map<String, Value>) -> u64 {
    let Some(Value::Array(messages)) = body.get("messages") else {
        return 0;
    };
    messages
        .iter()
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|p| p.get("text").and_then(Value::as_str).is_none())
        .count() as u64
}

/// Upper bound of the output tokens of one call of `model` for `body`.
pub fn output_token_bound(body: &Map<String, Value>, model: &ModelConfig) -> u64 {
    requested_output(body)
        .or(model.max_output_tokens)
        .unwrap_or(model.context_window)
        .saturating_mul(choices(body))
}

/// How many completions one call asks for: `n` (and the legacy `best_of`), at least 1.
/// Each one can use the whole output cap.
pub fn choices(body: &Map<String, Value>) -> u64 {
    ["n", "best_of"]
        .iter()
        .filter_map(|f| body.get(*f).and_then(Value::as_u64))
        .max()
        .unwrap_or(1)
        .max(1)
}

/// The output cap the job asks for: the larger of `max_tokens` and
/// `max_completion_tokens` (providers honour one or the other).
pub fn requested_output(body: &Map<String, Value>) -> Option<u64> {
    ["max_tokens", "max_completion_tokens"]
        .iter()
        .filter_map(|f| body.get(*f).and_then(Value::as_u64))
        .max()
}

/// The most one call of `model` for `body` can cost.
pub fn worst_case(body: &Map<String, Value>, model: &ModelConfig) -> Result<Decimal, CostError> {
    // Every prompt token at the dearest of the prices a prompt token can have.
    let input = [model.cached_input_per_mtok, model.cache_write_per_mtok]
        .into_iter()
        .flatten()
        .fold(model.input_per_mtok, Decimal::max);
    let price = Price {
        input_per_mtok: input,
        output_per_mtok: model.output_per_mtok,
        cached_input_per_mtok: None,
        cache_write_per_mtok: None,
    };
    cost::checked_cost(
        &Usage {
            prompt_tokens: prompt_token_bound(body, model),
            completion_tokens: output_token_bound(body, model),
            cached_tokens: 0,
            cache_write_tokens: 0,
        },
        &price,
    )
}

/// The models of `order` that tier `tier` allows, in order; `None` tier = all of them.
pub fn tier_filter(
    cfg: &Config,
    tier: Option<&str>,
    order: Vec<String>,
) -> Result<Vec<String>, QuotaError> {
    let Some(tier) = tier else {
        return Ok(order);
    };
    let allowed = cfg.tiers.get(tier).cloned().unwrap_or_default();
    let kept: Vec<String> = order
        .iter()
        .filter(|m| allowed.contains(m))
        .cloned()
        .collect();
    if kept.is_empty() {
        return Err(QuotaError::Tier {
            tier: tier.to_string(),
            route: order,
            allowed,
        });
    }
    Ok(kept)
}

/// Whether one more call of a model whose worst case is `worst` keeps the job within
/// `cap`, having spent `spent` already.
pub fn fits(cap: Decimal, spent: Decimal, worst: &Result<Decimal, CostError>) -> bool {
    match worst {
        Ok(w) => spent.checked_add(*w).is_some_and(|total| total <= cap),
        Err(_) => false, // not computable = not known to fit
    }
}

/// The error for a job none of whose remaining models fits its cap.
pub fn over_cap(cap: Decimal, spent: Decimal, worsts: &[Result<Decimal, CostError>]) -> QuotaError {
    let cheapest = worsts
        .iter()
        .filter_map(|w| w.as_ref().ok())
        .min()
        .map_or_else(|| "not computable".to_string(), |d| cost::format_usd(*d));
    QuotaError::OverCap {
        cap,
        spent,
        cheapest,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg() -> Config {
        crate::config::test_config(
            r#"
[models.cheap]
provider = "p"
input_per_mtok = 1
output_per_mtok = 2
context_window = 1000
max_output_tokens = 100
[models.dear]
provider = "p"
input_per_mtok = 10
output_per_mtok = 20
context_window = 5000
[models.mid]
provider = "p"
input_per_mtok = 3
output_per_mtok = 3
context_window = 5000
[routes]
default = ["dear", "mid", "cheap"]
[tiers]
free = ["cheap"]
pro = ["cheap", "mid", "dear"]
none = []
"#,
        )
    }

    fn body(s: &str) -> Map<String, Value> {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn worst_case_bounds_prompt_by_bytes_and_output_by_the_caps() {
        let c = cfg();
        let b = body(r#"{"messages":[{"role":"user","content":"hi"}]}"#);
        let bytes = serde_json::to_vec(&b).unwrap().len() as u64;
        assert_eq!(prompt_token_bound(&b, &c.models["cheap"]), bytes);
        // cheap: no max_tokens -> the model's max_output_tokens (100)
        assert_eq!(output_token_bound(&b, &c.models["cheap"]), 100);
        // dear: neither -> the whole context window
        assert_eq!(output_token_bound(&b, &c.models["dear"]), 5000);
        // n = 3 completions: three times the cap
        let b3 = body(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":7,"n":3}"#);
        assert_eq!(output_token_bound(&b3, &c.models["dear"]), 21);
        let w = worst_case(&b, &c.models["cheap"]).unwrap();
        // bytes x $1/M + 100 x $2/M, by hand
        let want = Decimal::from(bytes) / Decimal::from(1_000_000) + Decimal::new(200, 6);
        assert_eq!(w, want);
        let b = body(
            r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":7,"max_completion_tokens":9}"#,
        );
        assert_eq!(
            output_token_bound(&b, &c.models["dear"]),
            9,
            "the larger cap: providers honour either"
        );
    }

    /// A provider bills an image by its size, not by the bytes of its URL: a short http
    /// URL (or a tiny inline image) costs far more tokens than its bytes. Each media part
    /// adds its own bound, so the worst case still bounds what the call can cost.
    #[test]
    fn worst_case_counts_every_media_part_at_its_bound() {
        let c = cfg();
        let b = body(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},{"type":"image_url","image_url":{"url":"https://example.com/a.png"}},{"type":"input_audio","input_audio":{"data":"UklGR","format":"wav"}}]}],"max_tokens":5}"#,
        );
        let bytes = serde_json::to_vec(&b).unwrap().len() as u64;
        assert_eq!(
            prompt_token_bound(&b, &c.models["cheap"]),
            bytes + 2 * MEDIA_PART_TOKEN_BOUND
        );
        // A model's own bound replaces the default.
        let mut tight = c.models["cheap"].clone();
        tight.max_media_tokens = std::num::NonZeroU64::new(1_600);
        assert_eq!(prompt_token_bound(&b, &tight), bytes + 2 * 1_600);
        // Parts in older messages count too; text parts and plain strings add nothing.
        let b = body(
            r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/gif;base64,R0lGODlhAQABAAAAACw="}}]},{"role":"assistant","content":"a gif"},{"role":"user","content":[{"type":"text","text":"again"}]}]}"#,
        );
        let bytes = serde_json::to_vec(&b).unwrap().len() as u64;
        assert_eq!(
            prompt_token_bound(&b, &c.models["cheap"]),
            bytes + MEDIA_PART_TOKEN_BOUND
        );
        let w = worst_case(&b, &c.models["cheap"]).unwrap();
        let want = Decimal::from(bytes + MEDIA_PART_TOKEN_BOUND) / Decimal::from(1_000_000)
            + Decimal::new(200, 6);
        assert_eq!(w, want);
    }

    #[test]
    fn tiers_keep_order_and_fail_with_the_class_word() {
        let c = cfg();
        let order = || vec!["dear".to_string(), "mid".into(), "cheap".into()];
        assert_eq!(tier_filter(&c, None, order()).unwrap(), order());
        assert_eq!(tier_filter(&c, Some("free"), order()).unwrap(), ["cheap"]);
        assert_eq!(tier_filter(&c, Some("pro"), order()).unwrap(), order());
        let e = tier_filter(&c, Some("none"), order())
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("tier: "), "{e}");
        assert!(
            e.contains("`none`") && e.contains("dear, mid, cheap"),
            "{e}"
        );
    }

    #[test]
    fn cap_fits_exactly_and_over_cap_names_the_cheapest() {
        let one = Decimal::ONE;
        assert!(fits(one, Decimal::ZERO, &Ok(one)), "equal to the cap fits");
        assert!(
            !fits(one, Decimal::new(1, 12), &Ok(one)),
            "one pico over does not"
        );
        assert!(
            !fits(Decimal::MAX, Decimal::MAX, &Ok(one)),
            "overflow does not fit"
        );
        let e = over_cap(one, Decimal::ZERO, &[Ok(Decimal::TWO), Ok(Decimal::TEN)]).to_string();
        assert!(e.starts_with("budget: "), "{e}");
        assert!(e.contains("cheapest worst case 2"), "{e}");
    }

    proptest! {
        /// Whatever the route and the tier, the filtered models are all in the tier, in
        /// route order, and none of the tier's models of the route is dropped.
        #[test]
        fn tiers_are_never_escaped(
            route in proptest::collection::vec(0usize..3, 0..6),
            tier in 0usize..4,
        ) {
            let c = cfg();
            let names = ["dear", "mid", "cheap"];
            let tiers = ["free", "pro", "none", "absent"];
            let order: Vec<String> = route.iter().map(|&i| names[i].to_string()).collect();
            let allowed: Vec<String> = c.tiers.get(tiers[tier]).cloned().unwrap_or_default();
            match tier_filter(&c, Some(tiers[tier]), order.clone()) {
                Ok(kept) => {
                    prop_assert!(kept.iter().all(|m| allowed.contains(m)));
                    let want: Vec<String> = order.iter().filter(|m| allowed.contains(m)).cloned().collect();
                    prop_assert_eq!(kept, want);
                }
                Err(e) => {
                    prop_assert!(order.iter().all(|m| !allowed.contains(m)));
                    prop_assert!(e.to_string().starts_with("tier: "));
                }
            }
        }
    }
}
