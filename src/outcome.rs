//! The words that provider, router, cost and worker share: what a call's failure means
//! ([`ErrorClass`], typed by what to do next) and what it consumed ([`Usage`]).
//!
//! Invariant: a leaf: this module imports nothing of the crate, so no arrow runs from a
//! pure module (router, cost) to an IO one (provider) or back.

use std::time::Duration;

/// What a failed provider call tells us to do next, independent of which call it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorClass {
    /// 408, 409, 5xx, 529, connect error, timeout, a 200 whose body is an error or has
    /// no choices: the same model may well answer next time.
    Transient,
    /// 429 rate limit, with the delay the provider asked for (if it said).
    RateLimited { retry_after: Option<Duration> },
    /// 429 `insufficient_quota`: the account is out of credit, so nothing on this
    /// provider will work for now.
    ProviderRejected,
    /// 401 or 403. From an aggregator (HolySheep, LiteLLM, OpenRouter) this often means
    /// only "this key may not use this model" (or one upstream key is bad) while every
    /// other model of the provider works: skip this model. Two different models of one
    /// provider denied is evidence that the key itself is bad: the whole provider is
    /// excluded for this job (see `router::KEY_REJECTED_AFTER`).
    AccessDenied,
    /// 400 `context_length_exceeded`: only a model with a larger window can help.
    ContextTooLong,
    /// Any other 4xx: the request itself is wrong; resending will not help.
    Fatal,
}

/// Token counts one provider response reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Part of `prompt_tokens` served from the provider's prompt cache.
    pub cached_tokens: u64,
    /// Part of `prompt_tokens` written to the provider's prompt cache (Anthropic-style
    /// `cache_creation_input_tokens`), priced at `cache_write_per_mtok`.
    pub cache_write_tokens: u64,
}

impl Usage {
    /// Adds token counts for reporting (result fields, totals). Saturates rather than
    /// panicking: costs are computed per response from that response's own counts
    /// (which fit easily), never from a sum.
    pub fn add(&mut self, other: &Usage) {
        self.prompt_tokens = self.prompt_tokens.saturating_add(other.prompt_tokens);
        self.completion_tokens = self
            .completion_tokens
            .saturating_add(other.completion_tokens);
        self.cached_tokens = self.cached_tokens.saturating_add(other.cached_tokens);
        self.cache_write_tokens = self
            .cache_write_tokens
            .saturating_add(other.cache_write_tokens);
    }
}
