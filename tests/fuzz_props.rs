//! Property tests ("fuzzing" on stable) for the two parsers that see untrusted bytes:
//! the job payload parser (`job::parse`) and the provider-response parser
//! (`provider::classify`, `parse_usage`, `parse_retry_after`), plus the cost arithmetic
//! fed by the latter. The cargo-fuzz targets in `fuzz/` check the same invariants with
//! coverage guidance (see fuzz/README.md).
//!
//! Invariants checked for every input: no panic; every rejection is one non-empty line
//! of bounded length; an accepted job is valid against the config; a well-formed 2xx
//! is Ok with exactly its content and usage; a non-2xx is never Ok.

use llm_worker::config::Config;
use llm_worker::cost::{self, Price, Usage};
use llm_worker::job::{self, JobError};
use llm_worker::provider::{self, MAX_REPORTED_TOKENS, classify, parse_retry_after, parse_usage};
use llm_worker::router::ErrorClass;
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, FileFailurePersistence};
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, HeaderValue};
use rust_decimal::Decimal;
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

const CONFIG: &str = r#"
[redis]
url = "redis://127.0.0.1:6379"

[queue]
namespace = "fuzz"

[pools.default]
slots = 4

[providers.p1]
base_url = "http://127.0.0.1:9/v1"
api_key_env = ""

[providers.p2]
base_url = "http://127.0.0.1:9/v1"
api_key_env = ""

[models.m1]
provider = "p1"
input_per_mtok = 0.14
output_per_mtok = 0.42
cached_input_per_mtok = 0.028
context_window = 1000

[models.m2]
provider = "p1"
input_per_mtok = 0.10
output_per_mtok = 2.50
context_window = 100000

[models.m3]
provider = "p2"
input_per_mtok = 2.00
output_per_mtok = 8.00
cached_input_per_mtok = 0.50
context_window = 1000000

[routes]
default = ["m1", "m2", "m3"]
fast = ["m2"]
"#;

/// Limit used by the properties (the real default is 1 MiB; smaller keeps cases fast).
const MAX_BYTES: usize = 64 * 1024;
/// `one_line` keeps 300 characters plus an ellipsis; allow a little slack.
const MAX_REASON_CHARS: usize = 310;
const ENTRY_ID: &str = "1700000000000-0";

fn cfg() -> &'static Config {
    static CFG: OnceLock<Config> = OnceLock::new();
    CFG.get_or_init(|| Config::from_toml_str(CONFIG, &HashMap::new()).expect("test config"))
}

/// `n` cases; failures are saved next to this file so they are replayed first next time.
fn cases(n: u32) -> PtConfig {
    PtConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/fuzz_props.proptest-regressions",
        ))),
        ..PtConfig::with_cases(n)
    }
}

fn now() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
}

// ---------------------------------------------------------------- strategies

/// Strings that matter to the parsers: known names, empty, control characters, line
/// breaks (ASCII and Unicode), long runs, and arbitrary Unicode.
fn arb_string() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => any::<String>(),
        2 => "[a-z0-9_]{0,8}",
        2 => prop::sample::select(vec![
            "", "m1", "m2", "m3", "default", "fast", "user", "assistant", "a\nb", "\r\n",
            "\u{2028}", "\u{85}", "\0", "`", "{}", "insufficient_quota",
            "context_length_exceeded", "maximum context length",
        ])
        .prop_map(String::from),
        1 => (any::<char>(), 0usize..2000).prop_map(|(c, n)| std::iter::repeat_n(c, n).collect()),
    ]
}

fn arb_key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "messages", "model", "route", "id", "max_tokens", "max_completion_tokens",
            "temperature", "metadata", "role", "content", "choices", "message", "usage",
            "prompt_tokens", "completion_tokens", "prompt_tokens_details", "cached_tokens",
            "error", "code", "type", "finish_reason", "stream",
        ])
        .prop_map(String::from),
        1 => arb_string(),
    ]
}

fn arb_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        (0u64..100).prop_map(|n| json!(n)),
        any::<f64>().prop_filter_map("finite", |f| serde_json::Number::from_f64(f)
            .map(Value::Number)),
    ]
}

fn arb_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        arb_number(),
        arb_string().prop_map(Value::String),
    ]
}

/// Any JSON value, nested up to 4 levels.
fn arb_json() -> impl Strategy<Value = Value> {
    arb_leaf().prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((arb_key(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn valid_payload() -> Value {
    json!({
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}
        ],
        "model": "m1",
        "route": "default",
        "id": "job-1",
        "max_tokens": 16,
        "temperature": 0.5,
        "metadata": {"k": "v"}
    })
}

/// One edit to a valid payload: a field (top-level or inside a message) set to any
/// value, removed, or set to a huge string.
#[derive(Debug, Clone)]
enum Edit {
    Set(String, Value),
    Remove(String),
    MessageSet(usize, String, Value),
    MessageReplace(usize, Value),
}

fn arb_edit() -> impl Strategy<Value = Edit> {
    let field = prop::sample::select(vec![
        "messages",
        "model",
        "route",
        "id",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "metadata",
        "stream",
        "extra",
    ])
    .prop_map(String::from);
    let huge = (any::<char>(), 1usize..40_000)
        .prop_map(|(c, n)| Value::String(std::iter::repeat_n(c, n).collect()));
    let value = prop_oneof![4 => arb_json(), 1 => huge];
    prop_oneof![
        4 => (field.clone(), value.clone()).prop_map(|(f, v)| Edit::Set(f, v)),
        1 => field.prop_map(Edit::Remove),
        2 => (0usize..3, prop::sample::select(vec!["role", "content", "name"]), value.clone())
            .prop_map(|(i, k, v)| Edit::MessageSet(i, k.to_string(), v)),
        1 => (0usize..3, value).prop_map(|(i, v)| Edit::MessageReplace(i, v)),
    ]
}

fn apply(mut v: Value, edits: &[Edit]) -> Value {
    for e in edits {
        let obj = v.as_object_mut().expect("payload stays an object");
        match e {
            Edit::Set(f, x) => {
                obj.insert(f.clone(), x.clone());
            }
            Edit::Remove(f) => {
                obj.remove(f);
            }
            Edit::MessageSet(i, k, x) => {
                if let Some(m) = obj
                    .get_mut("messages")
                    .and_then(Value::as_array_mut)
                    .and_then(|a| a.get_mut(*i))
                    .and_then(Value::as_object_mut)
                {
                    m.insert(k.clone(), x.clone());
                }
            }
            Edit::MessageReplace(i, x) => {
                if let Some(m) = obj
                    .get_mut("messages")
                    .and_then(Value::as_array_mut)
                    .and_then(|a| a.get_mut(*i))
                {
                    *m = x.clone();
                }
            }
        }
    }
    v
}

// ---------------------------------------------------------------- checks

fn assert_one_line(what: &str, msg: &str) -> Result<(), TestCaseError> {
    prop_assert!(!msg.trim().is_empty(), "{what}: empty reason");
    prop_assert!(
        !msg.chars()
            .any(|c| matches!(c, '\n' | '\r' | '\u{85}' | '\u{2028}' | '\u{2029}')),
        "{what}: reason is not one line: {msg:?}"
    );
    prop_assert!(
        msg.chars().count() <= MAX_REASON_CHARS,
        "{what}: reason has {} chars: {:?}",
        msg.chars().count(),
        msg.chars().take(120).collect::<String>()
    );
    Ok(())
}

/// Everything `job::parse` promises, for one input.
fn check_job(bytes: &[u8], max: usize) -> Result<Result<job::Job, JobError>, TestCaseError> {
    let cfg = cfg();
    let res = job::parse(Some(bytes), ENTRY_ID, max, cfg);
    // The dead-letter path must cope with the same bytes.
    let salvaged = job::salvage_id(Some(bytes));
    if let Some(id) = &salvaged {
        prop_assert!(!id.is_empty() && id.chars().count() <= 512);
    }
    if bytes.len() > max {
        prop_assert!(
            matches!(res, Err(JobError::TooLarge { size, limit }) if size == bytes.len() && limit == max),
            "oversized payload not TooLarge: {res:?}"
        );
    } else if std::str::from_utf8(bytes).is_err() {
        prop_assert!(
            matches!(res, Err(JobError::NotUtf8(_))),
            "invalid UTF-8 not NotUtf8"
        );
    }
    match &res {
        Ok(j) => {
            prop_assert!(
                !j.id.is_empty() && j.id.chars().count() <= 512,
                "bad id {:?}",
                j.id
            );
            prop_assert!(
                cfg.routes.contains_key(&j.route),
                "unknown route {:?}",
                j.route
            );
            if let Some(m) = &j.model {
                prop_assert!(cfg.models.contains_key(m), "unknown model {m:?}");
            }
            let msgs = j.body.get("messages").and_then(Value::as_array);
            prop_assert!(
                msgs.is_some_and(|a| !a.is_empty()),
                "messages not a non-empty array"
            );
            for m in msgs.into_iter().flatten() {
                let role = m
                    .as_object()
                    .and_then(|o| o.get("role"))
                    .and_then(Value::as_str);
                prop_assert!(role.is_some_and(|r| !r.is_empty()), "bad message {m}");
            }
            // Accepted means the model order is non-empty and all known.
            let order = job::model_order(j, cfg);
            prop_assert!(!order.is_empty());
            prop_assert!(order.iter().all(|m| cfg.models.contains_key(m)));
        }
        Err(e) => assert_one_line("job::parse", &e.to_string())?,
    }
    Ok(res)
}

fn headers(retry_after: Option<&[u8]>, retry_after_ms: Option<&[u8]>) -> HeaderMap {
    let mut h = HeaderMap::new();
    // Only bytes a real HTTP stack would hand us (HeaderValue rejects the rest).
    if let Some(v) = retry_after.and_then(|b| HeaderValue::from_bytes(b).ok()) {
        h.insert("retry-after", v);
    }
    if let Some(v) = retry_after_ms.and_then(|b| HeaderValue::from_bytes(b).ok()) {
        h.insert("retry-after-ms", v);
    }
    h
}

/// Everything `classify` promises, for one response.
fn check_classify(
    status: u16,
    h: &HeaderMap,
    body: &[u8],
) -> Result<provider::Outcome, TestCaseError> {
    let st = StatusCode::from_u16(status).expect("status 100..=599");
    let out = classify(st, h, body, now());
    let _ = parse_retry_after(h, now());
    if let Some(u) = out.usage {
        prop_assert!(u.cached_tokens <= u.prompt_tokens);
    }
    match &out.result {
        Ok(_) => prop_assert!(st.is_success(), "HTTP {status} classified Ok"),
        Err(e) => {
            prop_assert_eq!(e.status, Some(status));
            assert_one_line("classify", &e.message)?;
            match status {
                401 | 403 => prop_assert_eq!(&e.class, &ErrorClass::AccessDenied),
                429 => prop_assert!(
                    matches!(
                        e.class,
                        ErrorClass::RateLimited { .. } | ErrorClass::ProviderRejected
                    ),
                    "429 -> {:?}",
                    e.class
                ),
                200..=299 | 408 | 409 | 500..=599 => {
                    prop_assert_eq!(&e.class, &ErrorClass::Transient)
                }
                400 => prop_assert!(
                    matches!(e.class, ErrorClass::ContextTooLong | ErrorClass::Fatal),
                    "400 -> {:?}",
                    e.class
                ),
                402..=499 => prop_assert_eq!(&e.class, &ErrorClass::Fatal),
                _ => prop_assert_eq!(&e.class, &ErrorClass::Transient),
            }
        }
    }
    Ok(out)
}

/// Header values worth trying: numbers of every shape, dates, words, raw bytes.
fn arb_header_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        "-?[0-9]{0,22}(\\.[0-9]{0,12})?([eE][+-]?[0-9]{1,4})?".prop_map(String::into_bytes),
        prop::sample::select(vec![
            "NaN",
            "nan",
            "inf",
            "-inf",
            "infinity",
            "-0",
            "0",
            " 1 ",
            "1e400",
            "-1e400",
            "Wed, 21 Oct 2015 07:28:00 GMT",
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Fri, 31 Dec 9999 23:59:59 GMT",
            "soon",
            "",
        ])
        .prop_map(|s| s.as_bytes().to_vec()),
        // httpdate formats years up to 9999 only.
        (0u64..253_402_300_800).prop_map(|t| {
            httpdate::fmt_http_date(SystemTime::UNIX_EPOCH + Duration::from_secs(t)).into_bytes()
        }),
        prop::collection::vec(any::<u8>(), 0..40),
    ]
}

fn arb_status() -> impl Strategy<Value = u16> {
    prop_oneof![
        100u16..=599,
        prop::sample::select(vec![
            200u16, 201, 204, 400, 401, 403, 404, 408, 409, 429, 500, 502, 503, 529
        ]),
    ]
}

fn arb_body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..600),
        arb_json().prop_map(|v| v.to_string().into_bytes()),
        // A JSON value truncated at a random point (a provider cut off mid-body).
        (arb_json(), any::<prop::sample::Index>()).prop_map(|(v, i)| {
            let b = v.to_string().into_bytes();
            let n = i.index(b.len() + 1);
            b[..n].to_vec()
        }),
    ]
}

fn arb_price() -> impl Strategy<Value = Decimal> {
    // Up to 10,000 USD per million tokens with at most 6 decimal places (config rule).
    (0i64..=10_000_000_000, 0u32..=6).prop_map(|(m, s)| Decimal::new(m, 6).round_dp(s))
}

fn arb_usage(max: u64) -> impl Strategy<Value = Usage> {
    (
        0..=max,
        0..=max,
        any::<prop::sample::Index>(),
        any::<prop::sample::Index>(),
    )
        .prop_map(|(p, c, i, w)| {
            let cached = i.index(p as usize + 1) as u64;
            Usage {
                prompt_tokens: p,
                completion_tokens: c,
                cached_tokens: cached,
                cache_write_tokens: w.index((p - cached) as usize + 1) as u64,
            }
        })
}

// ---------------------------------------------------------------- job::parse

proptest! {
    #![proptest_config(cases(3000))]

    #[test]
    fn job_parse_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = check_job(&bytes, MAX_BYTES)?;
    }

    #[test]
    fn job_parse_arbitrary_json(v in arb_json()) {
        let bytes = v.to_string().into_bytes();
        let res = check_job(&bytes, MAX_BYTES)?;
        if !v.is_object() {
            prop_assert!(matches!(res, Err(JobError::NotObject(_))), "{res:?}");
        }
    }

    #[test]
    fn job_parse_mutated_payload(edits in prop::collection::vec(arb_edit(), 0..4)) {
        let v = apply(valid_payload(), &edits);
        let bytes = v.to_string().into_bytes();
        let _ = check_job(&bytes, MAX_BYTES)?;
        // And the same payload pretty-printed (newlines between fields) parses the same way.
        let pretty = serde_json::to_vec_pretty(&v).expect("serialize");
        if pretty.len() <= MAX_BYTES && bytes.len() <= MAX_BYTES {
            let a = job::parse(Some(&bytes), ENTRY_ID, MAX_BYTES, cfg());
            let b = check_job(&pretty, MAX_BYTES)?;
            prop_assert_eq!(a, b);
        }
    }
}

proptest! {
    #![proptest_config(cases(1000))]

    #[test]
    fn job_parse_unmutated_payload_is_ok(
        id in "[a-zA-Z0-9:-]{1,64}",
        model in prop::option::of(prop::sample::select(vec!["m1", "m2", "m3"])),
        route in prop::option::of(prop::sample::select(vec!["default", "fast"])),
        content in any::<String>(),
    ) {
        let mut v = json!({"messages": [{"role": "user", "content": content}], "id": id});
        if let Some(m) = model { v["model"] = json!(m); }
        if let Some(r) = route { v["route"] = json!(r); }
        let j = check_job(v.to_string().as_bytes(), MAX_BYTES)?.expect("valid payload accepted");
        prop_assert_eq!(j.id, id);
        prop_assert_eq!(j.model.as_deref(), model);
        prop_assert_eq!(j.route, route.unwrap_or("default"));
    }

    #[test]
    fn job_parse_oversized_is_too_large(
        bytes in prop::collection::vec(any::<u8>(), 1..2048),
        cut in any::<prop::sample::Index>(),
    ) {
        let max = cut.index(bytes.len()); // strictly below len
        let res = check_job(&bytes, max)?;
        prop_assert!(matches!(res, Err(JobError::TooLarge { .. })), "{res:?}");
    }

    #[test]
    fn job_parse_invalid_utf8_is_rejected(
        edits in prop::collection::vec(arb_edit(), 0..2),
        at in any::<prop::sample::Index>(),
        bad in prop::sample::select(vec![
            vec![0xffu8], vec![0xc0, 0x80], vec![0xe2, 0x82], vec![0xed, 0xa0, 0x80],
            vec![0xf4, 0x90, 0x80, 0x80], vec![0x80],
        ]),
    ) {
        let mut bytes = apply(valid_payload(), &edits).to_string().into_bytes();
        // Insert at a char boundary so the bad sequence is the only invalid one.
        let text = String::from_utf8(bytes.clone()).expect("serde_json writes UTF-8");
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
        let pos = bounds[at.index(bounds.len())];
        bytes.splice(pos..pos, bad.iter().copied());
        let res = check_job(&bytes, usize::MAX)?;
        prop_assert_eq!(res, Err(JobError::NotUtf8(pos)));
    }
}

#[test]
fn job_parse_missing_payload() {
    let e = job::parse(None, ENTRY_ID, MAX_BYTES, cfg()).unwrap_err();
    assert!(matches!(e, JobError::NoPayload { .. }), "{e:?}");
    assert!(!e.to_string().contains('\n'));
}

// ---------------------------------------------------------------- provider

proptest! {
    #![proptest_config(cases(3000))]

    #[test]
    fn classify_never_panics(
        status in arb_status(),
        ra in prop::option::of(arb_header_value()),
        ra_ms in prop::option::of(arb_header_value()),
        body in arb_body(),
    ) {
        let h = headers(ra.as_deref(), ra_ms.as_deref());
        check_classify(status, &h, &body)?;
    }

    #[test]
    fn classify_error_bodies(
        status in arb_status(),
        code in arb_string(),
        ty in arb_string(),
        message in arb_string(),
        as_string in any::<bool>(),
        usage in prop::option::of(arb_json()),
    ) {
        let mut body = if as_string {
            json!({"error": message})
        } else {
            json!({"error": {"code": code, "type": ty, "message": message}})
        };
        if let Some(u) = usage { body["usage"] = u; }
        let out = check_classify(status, &HeaderMap::new(), body.to_string().as_bytes())?;
        // An error body is never a success, whatever the status.
        prop_assert!(out.result.is_err());
    }
}

proptest! {
    #![proptest_config(cases(1500))]

    #[test]
    fn classify_well_formed_2xx_is_ok(
        status in 200u16..=299,
        content in arb_string(),
        finish in prop::option::of("[a-z_]{0,12}"),
        prompt in prop_oneof![4 => 0..=MAX_REPORTED_TOKENS, 1 => any::<u64>()],
        completion in prop_oneof![4 => 0..=MAX_REPORTED_TOKENS, 1 => any::<u64>()],
        cached in prop_oneof![4 => 0..=MAX_REPORTED_TOKENS, 1 => any::<u64>()],
        extra in prop::collection::vec((arb_key(), arb_json()), 0..3),
    ) {
        let mut v = json!({
            "id": "chatcmpl-1",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "prompt_tokens_details": {"cached_tokens": cached}
            }
        });
        if let Some(f) = &finish { v["choices"][0]["finish_reason"] = json!(f); }
        for (k, x) in extra {
            if !matches!(k.as_str(), "choices" | "usage" | "error") {
                v[k] = x;
            }
        }
        let out = check_classify(status, &HeaderMap::new(), v.to_string().as_bytes())?;
        let done = out.result.expect("well-formed 2xx is Ok");
        prop_assert_eq!(done.content, content);
        prop_assert_eq!(done.finish_reason, finish.unwrap_or_default());
        // Absurd counts are garbage: reported as no usage (the worker warns).
        let want = (prompt <= MAX_REPORTED_TOKENS && completion <= MAX_REPORTED_TOKENS)
            .then_some(Usage {
                prompt_tokens: prompt,
                completion_tokens: completion,
                cached_tokens: cached.min(prompt),
                cache_write_tokens: 0,
            });
        prop_assert_eq!(out.usage, want);
    }

    #[test]
    fn classify_2xx_without_usage_is_ok_without_usage(
        content in arb_string(),
        usage in prop_oneof![Just(None), Just(Some(Value::Null)), arb_leaf().prop_map(Some)],
    ) {
        let mut v = json!({"choices": [{"message": {"role": "assistant", "content": content}}]});
        if let Some(u) = usage { v["usage"] = u; }
        let out = check_classify(200, &HeaderMap::new(), v.to_string().as_bytes())?;
        prop_assert_eq!(out.result.expect("ok").content, content);
        prop_assert_eq!(out.usage, None);
    }

    #[test]
    fn parse_usage_caps_cached(v in arb_json(), prompt in arb_number(), cached in arb_number()) {
        if let Some(u) = parse_usage(&v) {
            prop_assert!(u.cached_tokens <= u.prompt_tokens);
            prop_assert!(u.prompt_tokens <= MAX_REPORTED_TOKENS);
            prop_assert!(u.completion_tokens <= MAX_REPORTED_TOKENS);
        }
        let w = json!({"usage": {"prompt_tokens": prompt, "completion_tokens": 1,
                                 "prompt_tokens_details": {"cached_tokens": cached}}});
        if let Some(u) = parse_usage(&w) {
            prop_assert!(u.cached_tokens <= u.prompt_tokens);
            prop_assert_eq!(Some(u.prompt_tokens), prompt.as_u64());
        } else {
            // No usage: the prompt count is unreadable or too large, or the cached count
            // is present but unreadable (read as 0 it would bill cache reads at full
            // price; the cost is unknown instead).
            prop_assert!(
                prompt.as_u64().is_none_or(|p| p > MAX_REPORTED_TOKENS)
                    || (!cached.is_null() && cached.as_u64().is_none())
            );
        }
    }

    #[test]
    fn retry_after_never_panics(ra in arb_header_value(), ms in any::<bool>()) {
        let h = if ms { headers(None, Some(&ra)) } else { headers(Some(&ra), None) };
        let got = parse_retry_after(&h, now());
        let text = std::str::from_utf8(&ra).map(str::trim).unwrap_or("");
        match text.parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 && h.len() == 1 => {
                let scale = if ms { 1e-3 } else { 1.0 };
                let want = x * scale;
                let d = got.expect("non-negative number accepted");
                if want < 1e9 {
                    prop_assert!((d.as_secs_f64() - want).abs() <= 1e-5 + want * 1e-9,
                        "{text:?} -> {d:?}");
                }
            }
            Ok(_) => prop_assert_eq!(got, None, "{:?}", text),
            Err(_) if ms || httpdate::parse_http_date(text).is_err() => {
                prop_assert_eq!(got, None, "{:?}", text)
            }
            Err(_) => {}
        }
    }

    #[test]
    fn retry_after_rejects_negative_nan_garbage(
        v in prop_oneof![
            "-[1-9][0-9]{0,10}(\\.[0-9]{0,6})?",
            "-0\\.0*[1-9][0-9]{0,3}",
            prop::sample::select(vec!["NaN", "nan", "-NaN", "inf", "-inf", "infinity", "1e400"])
                .prop_map(String::from),
            "[a-zA-Z ,:]{1,30}".prop_filter("not a date or number", |s| {
                s.trim().parse::<f64>().is_err() && httpdate::parse_http_date(s.trim()).is_err()
            }),
        ],
        ms in any::<bool>(),
    ) {
        let h = if ms { headers(None, Some(v.as_bytes())) } else { headers(Some(v.as_bytes()), None) };
        prop_assert_eq!(parse_retry_after(&h, now()), None, "{:?}", v);
    }
}

// ---------------------------------------------------------------- cost

proptest! {
    #![proptest_config(cases(2000))]

    #[test]
    fn cost_is_whole_picos_and_additive(
        input in arb_price(),
        output in arb_price(),
        cached_price in prop::option::of(arb_price()),
        // i64 pico-dollars hold 9.2 million USD: 2e8 tokens at 10,000 USD/Mtok fit.
        a in arb_usage(100_000_000),
        b in arb_usage(100_000_000),
    ) {
        let price = Price { input_per_mtok: input, output_per_mtok: output, cached_input_per_mtok: cached_price, cache_write_per_mtok: None };
        let (ca, cb) = (cost::cost(&a, &price), cost::cost(&b, &price));
        let mut sum = a;
        sum.add(&b);
        let cs = cost::cost(&sum, &price);
        prop_assert!(ca >= Decimal::ZERO && cb >= Decimal::ZERO);
        let (pa, pb, ps) = (cost::to_picos(ca), cost::to_picos(cb), cost::to_picos(cs));
        prop_assert!(pa.is_some() && pb.is_some() && ps.is_some(), "{ca} {cb} {cs}");
        prop_assert_eq!(ca + cb, cs);
        prop_assert_eq!(pa.unwrap() + pb.unwrap(), ps.unwrap());
        prop_assert_eq!(cost::from_picos(ps.unwrap()), cs);
    }

    /// Whatever token counts a provider reports, what `parse_usage` accepts can be
    /// priced without panicking and, at up to 1,000 USD/Mtok, in whole i64 pico-dollars.
    #[test]
    fn cost_of_any_reported_usage_does_not_panic(
        input in arb_price(),
        output in arb_price(),
        cached_price in prop::option::of(arb_price()),
        p in prop_oneof![0..=MAX_REPORTED_TOKENS, any::<u64>()],
        c in prop_oneof![0..=MAX_REPORTED_TOKENS, any::<u64>()],
        k in any::<u64>(),
    ) {
        let body = json!({"usage": {"prompt_tokens": p, "completion_tokens": c,
                                    "prompt_tokens_details": {"cached_tokens": k}}});
        let Some(u) = parse_usage(&body) else {
            prop_assert!(p > MAX_REPORTED_TOKENS || c > MAX_REPORTED_TOKENS);
            return Ok(());
        };
        let price = Price { input_per_mtok: input, output_per_mtok: output, cached_input_per_mtok: cached_price, cache_write_per_mtok: None };
        let total = cost::cost(&u, &price);
        prop_assert!(total >= Decimal::ZERO);
        let cap = Decimal::new(1_000_000_000, 6);
        if input <= cap && output <= cap && cached_price.is_none_or(|c| c <= cap) {
            prop_assert!(cost::to_picos(total).is_some(), "{total}");
        }
    }
}

// ---------------------------------------------------------------- regressions
// Inputs the properties above found; each failed before the fix named in its comment.

/// U+2028 (LINE SEPARATOR) in a provider's error message passed `one_line` untouched.
#[test]
fn regression_line_separator_in_provider_error() {
    for body in [
        r#"{"error":{"message":"\u2028"}}"#,
        r#"{"messages":"\u2029"}"#,
    ] {
        for status in [100u16, 300, 400, 500] {
            let out = classify(
                StatusCode::from_u16(status).unwrap(),
                &HeaderMap::new(),
                body.as_bytes(),
                now(),
            );
            let msg = out.result.unwrap_err().message;
            assert!(!msg.contains(['\u{2028}', '\u{2029}']), "{msg:?}");
        }
    }
}

/// `prompt_tokens` = 2^64-1 in a 200 made `cost::cost` panic ("Addition overflowed").
#[test]
fn regression_absurd_usage_is_no_usage() {
    let body = format!(
        r#"{{"choices":[{{"message":{{"content":"x"}}}}],"usage":{{"prompt_tokens":{m},"completion_tokens":{m}}}}}"#,
        m = u64::MAX
    );
    let out = classify(StatusCode::OK, &HeaderMap::new(), body.as_bytes(), now());
    assert_eq!(out.result.unwrap().content, "x");
    assert_eq!(out.usage, None);
}

/// A 311-character (or multi-line) unknown model name made a long / multi-line reason.
#[test]
fn regression_unknown_model_reason_is_short_and_one_line() {
    for model in [
        "¡".repeat(300),
        "a\nb".to_string(),
        "x\u{2028}y".to_string(),
    ] {
        let p = json!({"messages": [{"role": "user", "content": "hi"}], "model": model});
        let e = job::parse(Some(p.to_string().as_bytes()), ENTRY_ID, MAX_BYTES, cfg()).unwrap_err();
        assert!(matches!(e, JobError::UnknownModel(ref m) if *m == model));
        let msg = e.to_string();
        assert!(
            msg.chars().count() <= 120 && !msg.contains(['\n', '\u{2028}']),
            "{msg:?}"
        );
    }
    let p = json!({"messages": [{"role": "user"}], "route": "r\n".repeat(500)});
    let msg = job::parse(Some(p.to_string().as_bytes()), ENTRY_ID, MAX_BYTES, cfg())
        .unwrap_err()
        .to_string();
    assert!(
        msg.starts_with("unknown route `r\\nr\\n") && msg.chars().count() <= 120,
        "{msg}"
    );
    let p = json!({"messages": [{"role": "user"}], "max_tokens": "9".repeat(5000)});
    let msg = job::parse(Some(p.to_string().as_bytes()), ENTRY_ID, MAX_BYTES, cfg())
        .unwrap_err()
        .to_string();
    assert!(msg.chars().count() <= 150, "{msg}");
}
