//! The job wire format: a stream entry's `payload` (JSON chat-completions request) ->
//! a validated [`Job`], or a one-line reason why it cannot be processed.
//!
//! Invariant: parsing never panics and never loses the original bytes (the caller keeps
//! them for the dead letter); every rejection names the offending field.

use crate::config::Config;
use serde_json::{Map, Value};

#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// The producer's `id`, or the stream entry id.
    pub id: String,
    pub route: String,
    /// First choice of model, if the job named one.
    pub model: Option<String>,
    /// The whole payload object (passed upstream minus the worker's own fields).
    pub body: Map<String, Value>,
    pub metadata: Option<Value>,
}

/// Why a payload is invalid. Each message is one line and says what to fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum JobError {
    #[error("entry has no `payload` field (XADD {{ns}}:jobs * payload '<json>')")]
    NoPayload,
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
    #[error("unknown model `{0}` (not in [models])")]
    UnknownModel(String),
    #[error("unknown route `{0}` (not in [routes])")]
    UnknownRoute(String),
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
    let bytes = payload.ok_or(JobError::NoPayload)?;
    if bytes.len() > max_bytes {
        return Err(JobError::TooLarge {
            size: bytes.len(),
            limit: max_bytes,
        });
    }
    let text = std::str::from_utf8(bytes).map_err(|e| JobError::NotUtf8(e.valid_up_to()))?;
    let v: Value = serde_json::from_str(text).map_err(|e| JobError::NotJson(e.to_string()))?;
    let Value::Object(body) = v else {
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
    let id = match body.get("id") {
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => opt_str("id")?,
    }
    .unwrap_or_else(|| entry_id.to_string());
    if id.len() > 512 {
        return Err(bad("id", "must be at most 512 bytes"));
    }
    for f in ["max_tokens", "max_completion_tokens"] {
        match body.get(f) {
            None | Some(Value::Null) => {}
            Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n > 0) => {}
            Some(other) => return Err(bad(f, format!("must be a positive integer, got {other}"))),
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
    let metadata = body.get("metadata").filter(|m| !m.is_null()).cloned();
    Ok(Job {
        id,
        route,
        model,
        body,
        metadata,
    })
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
    out
}
