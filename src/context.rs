//! Context windows: before a call, the prompt is counted (a real tokenizer, tiktoken, for
//! the OpenAI model families it knows; a documented estimate otherwise) and, when the
//! prompt plus the requested output exceed `[context] headroom` of the model's
//! `context_window`, the job's policy applies: `trim` (drop the oldest non-system messages, keeping every
//! system message, the last user turn and what follows it, and each assistant tool call
//! together with its tool results), `fallback` (a later model with a larger window) or
//! `fail`.
//!
//! Invariants: pure (no IO); a prompt whose UTF-8 bytes plus the requested output fit is
//! never tokenized (a token is at least one byte, so it fits); trimming never drops a
//! system message, the last user turn, or half of a tool call / tool result pair.

use crate::config::ContextPolicy;
use serde_json::Value;

/// Tokens a chat format adds per message, and once per request (OpenAI's documented
/// counting for its chat models).
const PER_MESSAGE: u64 = 4;
const PER_REQUEST: u64 = 3;
/// Bytes per token of the estimate for models without a known tokenizer: deliberately
/// low (English text averages about four bytes a token), so the estimate errs long.
const ESTIMATE_BYTES_PER_TOKEN: u64 = 3;

/// What to do with one call's messages.
#[derive(Debug, Clone, PartialEq)]
pub enum Fit {
    /// They fit as they are.
    AsIs,
    /// They fit once `dropped` messages are left out: send `messages`.
    Trimmed {
        messages: Vec<Value>,
        dropped: usize,
    },
    /// They do not fit this model: try a later model of the route (`fallback`, or `trim`
    /// that could not drop enough), else fail with this `context:` reason.
    Skip(String),
    /// Fail the job with this `context:` reason (`fail`).
    Fail(String),
}

/// Prompt tokens of `messages` for `model` (its upstream name): tiktoken when it knows
/// the model, else the estimate. Returns the count and how it was made.
pub fn count(model: &str, messages: &[Value]) -> (u64, &'static str) {
    let name = model.rsplit('/').next().unwrap_or(model);
    let texts: Vec<String> = messages.iter().map(message_text).collect();
    let n = messages.len() as u64 * PER_MESSAGE + PER_REQUEST;
    match tiktoken_rs::tokenizer::get_tokenizer(name)
        .and_then(|t| tiktoken_rs::bpe_for_tokenizer(t).ok())
    {
        Some(bpe) => {
            let toks: u64 = texts
                .iter()
                .map(|t| bpe.encode_ordinary(t).len() as u64)
                .sum();
            (n + toks, "tiktoken")
        }
        None => {
            let bytes: u64 = texts.iter().map(|t| t.len() as u64).sum();
            (n + bytes.div_ceil(ESTIMATE_BYTES_PER_TOKEN), "estimate")
        }
    }
}

/// The text of one message that a model reads: role, name, content (string, or the
/// text of its parts; other parts as their JSON), tool calls as JSON.
fn message_text(m: &Value) -> String {
    let mut out = String::new();
    for k in ["role", "name", "tool_call_id"] {
        if let Some(s) = m.get(k).and_then(Value::as_str) {
            out.push_str(s);
            out.push(' ');
        }
    }
    match m.get("content") {
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(parts)) => {
            for p in parts {
                match p.get("text").and_then(Value::as_str) {
                    Some(t) => out.push_str(t),
                    None => out.push_str(&p.to_string()),
                }
            }
        }
        _ => {}
    }
    if let Some(tc) = m.get("tool_calls") {
        out.push_str(&tc.to_string());
    }
    out
}

fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

/// Decides how `messages` go to `model` (upstream name) with a `window`, `headroom` and
/// `output` tokens asked for, under `policy`.
pub fn fit(
    model: &str,
    window: u64,
    headroom: f64,
    output: u64,
    messages: &[Value],
    policy: ContextPolicy,
) -> Fit {
    let limit = (window as f64 * headroom).floor() as u64;
    let bytes: u64 = messages.iter().map(|m| message_text(m).len() as u64).sum();
    let overhead = messages.len() as u64 * PER_MESSAGE + PER_REQUEST;
    if bytes + overhead + output <= limit {
        return Fit::AsIs; // a token is at least a byte
    }
    let (tokens, how) = count(model, messages);
    if tokens + output <= limit {
        return Fit::AsIs;
    }
    let why = format!(
        "context: the prompt ({tokens} tokens, {how}) plus {output} output tokens is more than {headroom} of {model}'s window of {window}"
    );
    match policy {
        ContextPolicy::Fail => Fit::Fail(why),
        ContextPolicy::Fallback => Fit::Skip(why),
        ContextPolicy::Trim => match trim(model, limit.saturating_sub(output), messages) {
            Some((kept, dropped)) => Fit::Trimmed {
                messages: kept,
                dropped,
            },
            None => Fit::Skip(format!(
                "{why}, even trimmed to the system prompt and the last user turn"
            )),
        },
    }
}

/// Droppable groups (oldest first) of `messages`: every message before the last user
/// message that is not a system message; an assistant message with `tool_calls` and the
/// `tool` messages that follow it form one group.
fn groups(messages: &[Value]) -> Vec<Vec<usize>> {
    let last_user = messages
        .iter()
        .rposition(|m| role(m) == "user")
        .unwrap_or(0);
    let mut out: Vec<Vec<usize>> = vec![];
    let mut i = 0;
    while i < last_user {
        let m = &messages[i];
        if role(m) == "system" {
            i += 1;
            continue;
        }
        let mut g = vec![i];
        if role(m) == "assistant" && m.get("tool_calls").is_some() {
            while i + 1 < messages.len() && role(&messages[i + 1]) == "tool" {
                i += 1;
                g.push(i);
            }
        } else if role(m) == "tool" {
            // a tool result whose call is gone: it goes with the group before it
            if let Some(prev) = out.last_mut() {
                prev.push(i);
                i += 1;
                continue;
            }
        }
        out.push(g);
        i += 1;
    }
    out
}

/// Drops the oldest groups until the prompt fits `budget` tokens. `None` when even
/// dropping all of them is not enough.
fn trim(model: &str, budget: u64, messages: &[Value]) -> Option<(Vec<Value>, usize)> {
    let gs = groups(messages);
    let mut dropped: Vec<bool> = vec![false; messages.len()];
    for g in &gs {
        for &i in g {
            dropped[i] = true;
        }
        let kept: Vec<Value> = messages
            .iter()
            .zip(&dropped)
            .filter(|(_, d)| !**d)
            .map(|(m, _)| m.clone())
            .collect();
        if count(model, &kept).0 <= budget {
            let n = dropped.iter().filter(|d| **d).count();
            return Some((kept, n));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn msg(role: &str, text: &str) -> Value {
        json!({"role": role, "content": text})
    }

    #[test]
    fn tiktoken_counts_openai_models_and_the_estimate_others() {
        let m = [msg("user", "hello world, how are you today?")];
        let (n, how) = count("gpt-4o", &m);
        assert_eq!(how, "tiktoken");
        assert!(n > 5 && n < 20, "{n}");
        let (_, how) = count("openai/gpt-4.1", &m);
        assert_eq!(how, "tiktoken", "an aggregator's prefix is ignored");
        let (n, how) = count("deepseek-v3.2", &m);
        assert_eq!(how, "estimate");
        // 4 + "user " (5) + 31 bytes = 36 bytes -> 12, plus 4 + 3
        assert_eq!(n, 19);
    }

    #[test]
    fn short_prompts_fit_and_long_ones_follow_the_policy() {
        let long = "word ".repeat(400);
        let m = vec![
            msg("system", "be brief"),
            msg("user", &long),
            msg("assistant", "ok"),
            msg("user", "and now?"),
        ];
        assert_eq!(
            fit("gpt-4o", 100_000, 0.9, 100, &m, ContextPolicy::Trim),
            Fit::AsIs
        );
        match fit("gpt-4o", 300, 0.9, 16, &m, ContextPolicy::Fail) {
            Fit::Fail(why) => assert!(why.starts_with("context: "), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            fit("gpt-4o", 300, 0.9, 16, &m, ContextPolicy::Fallback),
            Fit::Skip(_)
        ));
        match fit("gpt-4o", 300, 0.9, 16, &m, ContextPolicy::Trim) {
            Fit::Trimmed { messages, dropped } => {
                assert_eq!(dropped, 1, "the oldest turn only: the rest fits");
                assert_eq!(
                    messages,
                    vec![
                        msg("system", "be brief"),
                        msg("assistant", "ok"),
                        msg("user", "and now?")
                    ]
                );
            }
            other => panic!("{other:?}"),
        }
        // The last user turn alone is too long: trimming cannot help.
        let m = vec![msg("system", "s"), msg("user", &long)];
        assert!(matches!(
            fit("gpt-4o", 100, 0.9, 16, &m, ContextPolicy::Trim),
            Fit::Skip(_)
        ));
    }

    fn arb_messages() -> impl Strategy<Value = Vec<Value>> {
        let one = prop_oneof![
            (1usize..200).prop_map(|n| msg("system", &"s ".repeat(n))),
            (1usize..200).prop_map(|n| msg("user", &"u ".repeat(n))),
            (1usize..200).prop_map(|n| msg("assistant", &"a ".repeat(n))),
            (1usize..3).prop_map(|k| {
                let calls: Vec<Value> = (0..k)
                    .map(|j| json!({"id": format!("c{j}"), "type": "function", "function": {"name": "f", "arguments": "{}"}}))
                    .collect();
                json!({"role": "assistant", "content": null, "tool_calls": calls, "k": k})
            }),
        ];
        proptest::collection::vec(one, 1..12).prop_map(|ms| {
            // after each tool-calling assistant message, its tool results
            let mut out = vec![];
            for m in ms {
                let k = m.get("k").and_then(Value::as_u64);
                out.push(m);
                if let Some(k) = k {
                    for j in 0..k {
                        out.push(json!({"role": "tool", "tool_call_id": format!("c{j}"), "content": "r"}));
                    }
                }
            }
            out.push(msg("user", "last question"));
            out
        })
    }

    proptest! {
        /// Trimming keeps every system message and the last user turn, keeps order, and
        /// never keeps a tool result without its call or a call without its results.
        #[test]
        fn trimming_keeps_the_system_prompt_and_tool_pairs(
            messages in arb_messages(),
            budget in 20u64..400,
        ) {
            if let Some((kept, dropped)) = trim("gpt-4o", budget, &messages) {
                prop_assert_eq!(kept.len() + dropped, messages.len());
                let systems = |ms: &[Value]| ms.iter().filter(|m| role(m) == "system").count();
                prop_assert_eq!(systems(&kept), systems(&messages));
                prop_assert_eq!(kept.last(), messages.last());
                prop_assert!(count("gpt-4o", &kept).0 <= budget);
                // order kept: `kept` is a subsequence of `messages`
                let mut it = messages.iter();
                prop_assert!(kept.iter().all(|k| it.any(|m| m == k)));
                for (i, m) in kept.iter().enumerate() {
                    if role(m) == "tool" {
                        let before = kept[..i].iter().rev().find(|p| role(p) != "tool");
                        prop_assert!(
                            before.is_some_and(|p| p.get("tool_calls").is_some()),
                            "a tool result without its call: {:?}", kept
                        );
                    }
                    if let Some(k) = m.get("k").and_then(Value::as_u64) {
                        let results = kept[i + 1..].iter().take_while(|p| role(p) == "tool").count();
                        prop_assert_eq!(results as u64, k, "a call without its results: {:?}", kept);
                    }
                }
            }
        }
    }
}
