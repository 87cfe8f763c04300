//! The job wire format: a stream entry's `payload` (JSON chat-completions request) ->
//! a validated [`Job`], or a one-line reason why it cannot be processed.
//!
//! Invariant: parsing never panics and never loses the original bytes (the caller keeps
//! them for the dead letter); every rejection names the offending field.

use crate::config::Config;
use rust_decimal::Decimal;
use serde_json::{Map, Value};

#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// The producer's `id`, or the stream entry id.
    pub id: String,
    /// The producer gave the `id`: it is an idempotency key (result marker, in-progress
    /// marker). A job without one is identified by its stream entry alone, whose
    /// pending-ness already gives one result per entry: it leaves no marker behind.
    pub keyed: bool,
    pub route: String,
    /// First choice of model, if the job named one.
    pub model: Option<String>,
    /// The whole payload object (passed upstream minus the worker's own fields).
    pub body: Map<String, Value>,
    pub metadata: Option<Value>,
    /// A `[tiers]` name: routing stays inside that tier's models.
    pub tier: Option<String>,
    /// Who the job is for (echoed in its result).
    pub tenant: Option<String>,
    /// Most this job may cost, over every call (models whose worst case does not fit
    /// what is left are skipped).
    pub max_cost_usd: Option<Decimal>,
    /// Overrides `[context] policy` for this job.
    pub context_policy: Option<crate::config::ContextPolicy>,
    /// Unix time in ms by which the job must have ended: not started by then = status
    /// `expired` with no call; still running then = its call aborted, `expired`.
    pub deadline_ms: Option<u64>,
}

/// Why a payload is invalid. Each message is one line and says what to fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum JobError {
    #[error("entry has no `payload` field (XADD {jobs} * payload '<json>')")]
    NoPayload { jobs: String },
    #[error("payload is {size} bytes, above the limit of {limit} (queue.max_payload_bytes)")]
    TooLarge { size: usize, limit: usize },
    #[error("payload is not valid UTF-8 (at byte {0})")]
    NotUtf8(usize),
    #[error("payload is not JSON: {0}")]
    NotJson(String),
    #[error("payload must be a JSON object, got {0}")]
    NotObject(&'static str),
    #[error("`messages` is missing")]
    NoMessages,
    #[error("`messages` must be a non-empty array")]
    EmptyMessages,
    #[error("`{field}` {why}")]
    BadField { field: String, why: String },
    #[error("unknown model `{}` (not in [models])", shown(.0))]
    UnknownModel(String),
    #[error("unknown route `{}` (not in [routes])", shown(.0))]
    UnknownRoute(String),
    #[error("unknown tier `{}` (not in [tiers])", shown(.0))]
    UnknownTier(String),
}

/// A producer-supplied value as it appears in a reason: control characters and line
/// separators escaped, at most 80 characters, so the reason stays one short line.
fn shown(s: &str) -> String {
    const MAX_CHARS: usize = 80;
    let mut out = String::new();
    let mut len = 0;
    for c in s.chars() {
        if len >= MAX_CHARS {
            out.push('…');
            break;
        }
        if c.is_control() || matches!(c, '\u{2028}' | '\u{2029}') {
            let esc = c.escape_default();
            len += esc.len();
            out.extend(esc);
        } else {
            len += 1;
            out.push(c);
        }
    }
    out
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn bad(field: impl Into<String>, why: impl Into<String>) -> JobError {
    JobError::BadField {
        field: field.into(),
        why: why.into(),
    }
}

/// Parses and validates one payload against the config's models and routes.
pub fn parse(
    payload: Option<&[u8]>,
    entry_id: &str,
    max_bytes: usize,
    cfg: &Config,
) -> Result<Job, JobError> {
    let bytes = payload.ok_or_else(|| JobError::NoPayload {
        jobs: format!("{{{}}}:jobs", cfg.queue.namespace),
    })?;
    if bytes.len() > max_bytes {
        return Err(JobError::TooLarge {
            size: bytes.len(),
            limit: max_bytes,
        });
    }
    let text = std::str::from_utf8(bytes).map_err(|e| JobError::NotUtf8(e.valid_up_to()))?;
    let v: Value = serde_json::from_str(text).map_err(|e| JobError::NotJson(e.to_string()))?;
    let Value::Object(mut body) = v else {
        return Err(JobError::NotObject(kind(&v)));
    };
    let messages = body.get("messages").ok_or(JobError::NoMessages)?;
    let Value::Array(list) = messages else {
        return Err(bad(
            "messages",
            format!("must be an array, got {}", kind(messages)),
        ));
    };
    if list.is_empty() {
        return Err(JobError::EmptyMessages);
    }
    for (i, m) in list.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(bad(
                format!("messages[{i}]"),
                format!("must be an object, got {}", kind(m)),
            ));
        };
        match m.get("role") {
            Some(Value::String(r)) if !r.is_empty() => {}
            Some(other) => {
                return Err(bad(
                    format!("messages[{i}].role"),
                    format!("must be a non-empty string, got {}", kind(other)),
                ));
            }
            None => return Err(bad(format!("messages[{i}].role"), "is missing")),
        }
        match m.get("content") {
            None | Some(Value::String(_)) | Some(Value::Array(_)) | Some(Value::Null) => {}
            Some(other) => {
                return Err(bad(
                    format!("messages[{i}].content"),
                    format!("must be a string or an array of parts, got {}", kind(other)),
                ));
            }
        }
    }
    let opt_str = |field: &str| -> Result<Option<String>, JobError> {
        match body.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
            Some(Value::String(_)) => Err(bad(field, "must not be empty")),
            Some(other) => Err(bad(field, format!("must be a string, got {}", kind(other)))),
        }
    };
    let model = opt_str("model")?;
    let route = opt_str("route")?.unwrap_or_else(|| "default".to_string());
    let given = match body.get("id") {
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => opt_str("id")?,
    };
    let keyed = given.is_some();
    let id = given.unwrap_or_else(|| entry_id.to_string());
    // Characters, as JSON Schema's maxLength counts (schema/job.schema.json).
    if id.chars().count() > 512 {
        return Err(bad("id", "must be at most 512 characters"));
    }
    let mut whole_tokens: Vec<(&str, u64)> = vec![];
    for f in ["max_tokens", "max_completion_tokens"] {
        match body.get(f) {
            None | Some(Value::Null) => {}
            Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n > 0) => {}
            // 10.0 is an integer to JSON Schema (and to producers computing it): sent on
            // as 10, which every provider takes.
            Some(Value::Number(n))
                if n.as_f64()
                    .is_some_and(|x| x.fract() == 0.0 && (1.0..9.0e15).contains(&x)) =>
            {
                whole_tokens.push((f, n.as_f64().unwrap_or(1.0) as u64));
            }
            Some(other) => {
                return Err(bad(
                    f,
                    format!(
                        "must be a positive integer, got {}",
                        shown(&other.to_string())
                    ),
                ));
            }
        }
    }
    match body.get("temperature") {
        None | Some(Value::Null) | Some(Value::Number(_)) => {}
        Some(other) => {
            return Err(bad(
                "temperature",
                format!("must be a number, got {}", kind(other)),
            ));
        }
    }
    if let Some(m) = &model
        && !cfg.models.contains_key(m)
    {
        return Err(JobError::UnknownModel(m.clone()));
    }
    if !cfg.routes.contains_key(&route) {
        return Err(JobError::UnknownRoute(route));
    }
    let tier = opt_str("tier")?;
    if let Some(t) = &tier
        && !cfg.tiers.contains_key(t)
    {
        return Err(JobError::UnknownTier(t.clone()));
    }
    let tenant = opt_str("tenant")?;
    if tenant.as_ref().is_some_and(|t| t.len() > 256) {
        return Err(bad("tenant", "must be at most 256 bytes"));
    }
    let max_cost_usd = match body.get("max_cost_usd") {
        None | Some(Value::Null) => None,
        Some(v @ (Value::Number(_) | Value::String(_))) => {
            let text = match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            let d = Decimal::from_str_exact(text.trim())
                .or_else(|_| Decimal::from_scientific(text.trim()))
                .map_err(|_| {
                    bad(
                        "max_cost_usd",
                        format!("must be a decimal number of USD, got {}", shown(&text)),
                    )
                })?;
            if d.is_sign_negative() && !d.is_zero() {
                return Err(bad(
                    "max_cost_usd",
                    format!("must not be negative, got {d}"),
                ));
            }
            Some(d)
        }
        Some(other) => {
            return Err(bad(
                "max_cost_usd",
                format!("must be a number or a decimal string, got {}", kind(other)),
            ));
        }
    };
    let context_policy = match opt_str("context_policy")? {
        None => None,
        Some(p) => Some(crate::config::ContextPolicy::parse(&p).ok_or_else(|| {
            bad(
                "context_policy",
                format!("must be trim, fallback or fail, got {}", shown(&p)),
            )
        })?),
    };
    let deadline_ms = match body.get("deadline_ms") {
        None | Some(Value::Null) => None,
        // Any non-negative number (producers often compute ms as floats); a fraction of a
        // ms is dropped.
        Some(Value::Number(n)) => Some(
            n.as_u64()
                .or_else(|| n.as_f64().filter(|x| *x >= 0.0).map(|x| x as u64))
                .ok_or_else(|| {
                    bad(
                        "deadline_ms",
                        format!("must be a Unix time in ms (a non-negative number), got {n}"),
                    )
                })?,
        ),
        Some(other) => {
            return Err(bad(
                "deadline_ms",
                format!(
                    "must be a Unix time in ms (a non-negative number), got {}",
                    kind(other)
                ),
            ));
        }
    };
    let metadata = body.get("metadata").filter(|m| !m.is_null()).cloned();
    for (f, n) in whole_tokens {
        body.insert(f.to_string(), Value::from(n));
    }
    Ok(Job {
        id,
        keyed,
        route,
        model,
        body,
        metadata,
        tier,
        tenant,
        max_cost_usd,
        context_policy,
        deadline_ms,
    })
}

/// The producer's `id` from a payload that failed validation, if it has a usable one
/// (a JSON object whose `id` is a non-empty string of at most 512 characters, or a number).
pub fn salvage_id(payload: Option<&[u8]>) -> Option<String> {
    let v: Value = serde_json::from_slice(payload?).ok()?;
    match v.get("id")? {
        Value::String(s) if !s.is_empty() && s.chars().count() <= 512 => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The ordered models for a job: its own `model` first (if any), then its route's.
pub fn model_order(job: &Job, cfg: &Config) -> Vec<String> {
    let mut out: Vec<String> = job.model.iter().cloned().collect();
    if let Some(route) = cfg.routes.get(&job.route) {
        for m in route {
            if !out.contains(m) {
                out.push(m.clone());
            }
        }
    }
    // Models the provider's key cannot see (checked at start) are never tried.
    out.retain(|m| !cfg.unavailable_models.contains(m));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        crate::config::test_config(&format!(
            "{}{}",
            crate::config::TEST_MODELS_AB,
            r#"
alt = ["b"]
"#
        ))
    }

    fn p(s: &str) -> Result<Job, JobError> {
        parse(Some(s.as_bytes()), "1-0", 1000, &cfg())
    }

    #[test]
    fn valid_job() {
        let j = p(r#"{"messages":[{"role":"user","content":"hi"}],"id":"x","metadata":{"k":1},"top_p":1}"#).unwrap();
        assert_eq!(j.id, "x");
        assert_eq!(j.route, "default");
        assert_eq!(j.metadata, Some(serde_json::json!({"k":1})));
        assert!(j.body.contains_key("top_p"));
        let j = p(r#"{"messages":[{"role":"user","content":"hi"}],"model":"b","route":"default"}"#)
            .unwrap();
        assert_eq!(j.id, "1-0", "entry id when no id");
        assert_eq!(model_order(&j, &cfg()), vec!["b", "a"]);
    }

    #[test]
    fn each_error_names_the_problem() {
        let cases = [
            ("not json", "not JSON"),
            ("[1]", "must be a JSON object, got an array"),
            (r#"{}"#, "`messages` is missing"),
            (r#"{"messages":[]}"#, "non-empty array"),
            (
                r#"{"messages":"hi"}"#,
                "`messages` must be an array, got a string",
            ),
            (r#"{"messages":[1]}"#, "`messages[0]` must be an object"),
            (
                r#"{"messages":[{"content":"x"}]}"#,
                "`messages[0].role` is missing",
            ),
            (
                r#"{"messages":[{"role":"user","content":5}]}"#,
                "`messages[0].content`",
            ),
            (
                r#"{"messages":[{"role":"user"}],"model":5}"#,
                "`model` must be a string",
            ),
            (
                r#"{"messages":[{"role":"user"}],"model":"zzz"}"#,
                "unknown model `zzz`",
            ),
            (
                r#"{"messages":[{"role":"user"}],"route":"zzz"}"#,
                "unknown route `zzz`",
            ),
            (
                r#"{"messages":[{"role":"user"}],"max_tokens":-1}"#,
                "`max_tokens` must be a positive integer",
            ),
            (
                r#"{"messages":[{"role":"user"}],"temperature":"hot"}"#,
                "`temperature` must be a number",
            ),
            (
                r#"{"messages":[{"role":"user"}],"id":""}"#,
                "`id` must not be empty",
            ),
        ];
        for (input, want) in cases {
            let e = p(input).unwrap_err().to_string();
            assert!(e.contains(want), "{input}: {e}");
            assert!(!e.contains('\n'));
        }
        let big = "x".repeat(2000);
        assert!(matches!(
            p(&big),
            Err(JobError::TooLarge {
                size: 2000,
                limit: 1000
            })
        ));
        assert_eq!(
            parse(Some(b"\xff\xfe"), "1-0", 1000, &cfg()),
            Err(JobError::NotUtf8(0))
        );
        assert_eq!(
            parse(None, "1-0", 1000, &cfg()),
            Err(JobError::NoPayload {
                jobs: "{llm}:jobs".into()
            })
        );
    }

    #[test]
    fn salvages_the_id_of_an_invalid_job() {
        assert_eq!(
            salvage_id(Some(br#"{"id":"j-1","messages":[]}"#)),
            Some("j-1".into())
        );
        assert_eq!(salvage_id(Some(br#"{"id":7}"#)), Some("7".into()));
        assert_eq!(salvage_id(Some(br#"{"id":""}"#)), None);
        assert_eq!(salvage_id(Some(b"garbage")), None);
        assert_eq!(salvage_id(None), None);
    }
}
