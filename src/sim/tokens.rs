//! Deterministic token counts, public so a test can predict exactly what the worker bills.

use serde_json::Value;

/// Text of a message's `content`: a string, or the concatenated `text` of
/// `{"type":"text","text":...}` parts; anything else counts as empty.
pub(super) fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

pub(super) fn messages(body: &Value) -> &[Value] {
    body.get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

/// Deterministic prompt-token estimate: per message, 4 + ceil(chars(content) / 4).
/// Content may be a string or an array of `{"type":"text","text":...}` parts.
pub fn estimate_prompt_tokens(body: &Value) -> u64 {
    messages(body)
        .iter()
        .map(|m| {
            let chars = content_text(m.get("content")).chars().count() as u64;
            4 + chars.div_ceil(4)
        })
        .sum()
}

/// 64-bit FNV-1a: tiny, stable across platforms and Rust versions (unlike `DefaultHasher`),
/// which is what makes completion sizes predictable by tests.
pub(super) fn fnv1a(bytes: impl IntoIterator<Item = u8>, mut h: u64) -> u64 {
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Deterministic completion size: `8 + fnv1a(text of every message, each followed by a
/// 0 byte) % 120`, capped by `max_completion_tokens` (preferred) or `max_tokens`, min 1.
pub fn completion_tokens_for(body: &Value) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325_u64;
    for m in messages(body) {
        h = fnv1a(content_text(m.get("content")).into_bytes(), h);
        h = fnv1a([0u8], h);
    }
    let n = 8 + h % 120;
    let cap = body
        .get("max_completion_tokens")
        .and_then(Value::as_u64)
        .or_else(|| body.get("max_tokens").and_then(Value::as_u64));
    match cap {
        Some(c) => n.min(c).max(1),
        None => n,
    }
}
