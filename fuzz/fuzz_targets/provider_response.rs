//! `provider::classify` (with `parse_usage` and `parse_retry_after`) on an arbitrary
//! HTTP response. Input layout, so seeds can be written by hand:
//!
//! ```text
//! [status: u16 BE, used as 100 + n % 500]
//! [len: u8][Retry-After bytes; absent if len = 0xff]
//! [len: u8][retry-after-ms bytes; absent if len = 0xff]
//! [body: the rest]
//! ```
#![no_main]

mod common;

use common::{CFG, assert_one_line};
use libfuzzer_sys::fuzz_target;
use llm_worker::cost;
use llm_worker::provider::{MAX_REPORTED_TOKENS, classify, parse_retry_after};
use llm_worker::router::ErrorClass;
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, HeaderValue};
use std::time::{Duration, SystemTime};

fn take_header<'a>(data: &mut &'a [u8]) -> Option<&'a [u8]> {
    let (&len, rest) = data.split_first()?;
    if len == 0xff {
        *data = rest;
        return None;
    }
    let n = (len as usize).min(rest.len());
    let (v, rest) = rest.split_at(n);
    *data = rest;
    Some(v)
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let status = 100 + u16::from_be_bytes([data[0], data[1]]) % 500;
    let mut rest = &data[2..];
    let ra = take_header(&mut rest);
    let ra_ms = take_header(&mut rest);
    let body = rest;

    let mut h = HeaderMap::new();
    if let Some(v) = ra.and_then(|b| HeaderValue::from_bytes(b).ok()) {
        h.insert("retry-after", v);
    }
    if let Some(v) = ra_ms.and_then(|b| HeaderValue::from_bytes(b).ok()) {
        h.insert("retry-after-ms", v);
    }
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let _ = parse_retry_after(&h, now);

    let st = StatusCode::from_u16(status).expect("100..=599");
    let out = classify(st, &h, body, now);
    if let Some(u) = out.usage {
        assert!(u.cached_tokens <= u.prompt_tokens);
        assert!(u.prompt_tokens <= MAX_REPORTED_TOKENS);
        assert!(u.completion_tokens <= MAX_REPORTED_TOKENS);
        // Whatever was reported can be billed exactly at every configured price.
        for m in CFG.models.values() {
            let price = cost::Price {
                input_per_mtok: m.input_per_mtok,
                output_per_mtok: m.output_per_mtok,
                cached_input_per_mtok: m.cached_input_per_mtok,
            };
            let c = cost::cost(&u, &price);
            assert!(cost::to_picos(c).is_some(), "{u:?} costs {c}");
        }
    }
    match &out.result {
        Ok(_) => assert!(st.is_success(), "HTTP {status} classified Ok"),
        Err(e) => {
            assert_eq!(e.status, Some(status));
            assert_one_line("classify", &e.message, 310);
            let ok = match status {
                401 | 403 => e.class == ErrorClass::ProviderRejected,
                429 => matches!(
                    e.class,
                    ErrorClass::RateLimited { .. } | ErrorClass::ProviderRejected
                ),
                400 => matches!(e.class, ErrorClass::ContextTooLong | ErrorClass::Fatal),
                200..=299 | 408 | 409 | 500..=599 => e.class == ErrorClass::Transient,
                402..=499 => e.class == ErrorClass::Fatal,
                _ => e.class == ErrorClass::Transient,
            };
            assert!(ok, "HTTP {status} classified {:?}", e.class);
        }
    }
});
