//! Context windows: before a call, the prompt is counted (a real tokenizer, tiktoken, for
//! the OpenAI model families it knows; a documented estimate otherwise) and, when the
//! prompt plus the requested output exceed `[context] headroom` of the model's
//! `context_window`, the job's policy applies: `trim` (drop the oldest non-system messages, keeping every
//! system message, the last user turn and the latest step of an agent loop after it, and
//! each assistant tool call together with its tool results), `fallback` (a later model with a larger window) or
//! `fail`.
//!
//! Invariants: pure (no IO); a prompt whose UTF-8 bytes plus the requested output fit is
//! never tokenized (a token is at least one byte, so it fits); trimming never drops a
//! system message, the last user turn, the latest step after it, or half of a tool call /
//! tool result pair.

use crate::config::ContextPolicy;
use serde_json::Value;

/// Tokens a chat format adds per message, and once per request (OpenAI's documented
/// counting for its chat models).
const PER_MESSAGE: u64 = 4;
const PER_REQUEST: u64 = 3;
/// Bytes per token of the estimate for models without a known tokenizer: the average of
/// English text. It may err short: a prompt it lets through that is still too long is
/// answered `context_length_exceeded` by the provider (not billed), which moves the job
/// to a model with a larger window. Erring long would instead send prompts that fit
/// to another model.
const ESTIMATE_BYTES_PER_TOKEN: u64 = 4;

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

/// Tokens counted for one image or audio part, whatever its bytes (a provider bills an
/// image by its size in tiles, at most about 1,500 tokens, not by its base64 text).
const PER_MEDIA_PART: u64 = 1_500;

/// Tokens of `text` for `model` (its upstream name): tiktoken when it knows the model,
/// else the estimate; and how they were counted.
fn text_tokens(model: &str, text: &str) -> (u64, &'static str) {
    let name = model.rsplit('/').next().unwrap_or(model);
    match tiktoken_rs::tokenizer::get_tokenizer(name)
        .and_then(|t| tiktoken_rs::bpe_for_tokenizer(t).ok())
    {
        Some(bpe) => (bpe.encode_ordinary(text).len() as u64, "tiktoken"),
        None => (
            (text.len() as u64).div_ceil(ESTIMATE_BYTES_PER_TOKEN),
            "estimate",
        ),
    }
}

/// Tokens of one message (text, media parts at [`PER_MEDIA_PART`], the format's own).
fn message_tokens(model: &str, m: &Value) -> (u64, &'static str) {
    let (text, media) = message_text(m);
    let (t, how) = text_tokens(model, &text);
    (t + media * PER_MEDIA_PART + PER_MESSAGE, how)
}

/// Prompt tokens of `messages` for `model`: tiktoken when it knows the model, else the
/// estimate. Returns the count and how it was made.
pub fn count(model: &str, messages: &[Value]) -> (u64, &'static str) {
    let mut how = text_tokens(model, "").1;
    let mut n = PER_REQUEST;
    for m in messages {
        let (t, h) = message_tokens(model, m);
        n += t;
        how = h;
    }
    (n, how)
}

/// The text of one message that a model reads (role, name, content: a string or its
/// text parts, tool calls as JSON) and how many media parts (images, audio) it has.
fn message_text(m: &Value) -> (String, u64) {
    let mut media = 0;
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
                    None => media += 1,
                }
            }
        }
        _ => {}
    }
    if let Some(tc) = m.get("tool_calls") {
        out.push_str(&tc.to_string());
    }
    (out, media)
}

/// Bytes of [`message_text`] and its media parts, without building the text (the check
/// every call makes; most prompts end here).
fn message_bytes(m: &Value) -> (u64, u64) {
    let mut bytes = 0u64;
    let mut media = 0u64;
    for k in ["role", "name", "tool_call_id"] {
        if let Some(s) = m.get(k).and_then(Value::as_str) {
            bytes += s.len() as u64 + 1;
        }
    }
    match m.get("content") {
        Some(Value::String(s)) => bytes += s.len() as u64,
        Some(Value::Array(parts)) => {
            for p in parts {
                match p.get("text").and_then(Value::as_str) {
                    Some(t) => bytes += t.len() as u64,
                    None => media += 1,
                }
            }
        }
        _ => {}
    }
    if let Some(tc) = m.get("tool_calls") {
        bytes += tc.to_string().len() as u64;
    }
    (bytes, media)
}

fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

/// Decides how `messages` go to `model` (upstream name) with a `window`, `headroom` and
/// `output` tokens asked for, under `policy`.
/// `extra` is the request's other prompt text (`tools`, `response_format`), counted
/// once and never trimmed.
pub fn fit(
    model: &str,
    window: u64,
    headroom: f64,
    output: u64,
    messages: &[Value],
    extra: &str,
    policy: ContextPolicy,
) -> Fit {
    let limit = (window as f64 * headroom).floor() as u64;
    let mut bytes = extra.len() as u64;
    let mut overhead = messages.len() as u64 * PER_MESSAGE + PER_REQUEST;
    for m in messages {
        let (b, media) = message_bytes(m);
        bytes += b;
        overhead += media * PER_MEDIA_PART;
    }
    if bytes + overhead + output <= limit {
        return Fit::AsIs; // a token is at least a byte
    }
    let extra_tokens = text_tokens(model, extra).0;
    let (tokens, how) = count(model, messages);
    let tokens = tokens + extra_tokens;
    if tokens + output <= limit {
        return Fit::AsIs;
    }
    let why = format!(
        "context: the prompt ({tokens} tokens, {how}) plus {output} output tokens is more than {headroom} of {model}'s window of {window}"
    );
    match policy {
        ContextPolicy::Fail => Fit::Fail(why),
        ContextPolicy::Fallback => Fit::Skip(why),
        ContextPolicy::Trim => match trim(
            model,
            limit.saturating_sub(output).saturating_sub(extra_tokens),
            messages,
        ) {
            Some((kept, dropped)) => Fit::Trimmed {
                messages: kept,
                dropped,
            },
            None => Fit::Skip(format!(
                "{why}, even trimmed to the system prompt, the last user turn and its latest step"
            )),
        },
    }
}

/// Droppable groups (oldest first) of `messages`: every message before the last user
/// message that is not a system message, then those after it (an agent loop's earlier
/// steps) but the last group; an assistant message with `tool_calls` and the `tool`
/// messages that follow it form one group. The last user turn and the latest step (the
/// last group, and anything after it) are never dropped.
fn groups(messages: &[Value]) -> Vec<Vec<usize>> {
    let Some(last_user) = messages.iter().rposition(|m| role(m) == "user") else {
        return vec![];
    };
    let mut out = group_range(messages, 0, last_user);
    let mut steps = group_range(messages, last_user + 1, messages.len());
    // The latest step: from the last tool-calling message on (its results and what the
    // assistant said after them), else the last group.
    let latest = steps
        .iter()
        .rposition(|g| messages[g[0]].get("tool_calls").is_some())
        .unwrap_or(steps.len().saturating_sub(1));
    steps.truncate(latest);
    out.extend(steps);
    out
}

/// Messages trimming never drops: system prompts (`developer` is the o-series name).
fn is_system(m: &Value) -> bool {
    matches!(role(m), "system" | "developer")
}

/// The groups of `messages[from..to]` (see [`groups`]), system messages left out.
fn group_range(messages: &[Value], from: usize, to: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = vec![];
    let mut i = from;
    while i < to {
        let m = &messages[i];
        if is_system(m) {
            i += 1;
            continue;
        }
        let mut g = vec![i];
        if role(m) == "assistant" && m.get("tool_calls").is_some() {
            while i + 1 < to && role(&messages[i + 1]) == "tool" {
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
/// dropping all of them is not enough. Each message is counted once (linear in the
/// conversation); the first message kept after the system messages is a user turn
/// (providers reject a conversation that opens with an assistant or tool turn).
fn trim(model: &str, budget: u64, messages: &[Value]) -> Option<(Vec<Value>, usize)> {
    let gs = groups(messages);
    let tokens: Vec<u64> = messages
        .iter()
        .map(|m| message_tokens(model, m).0)
        .collect();
    let mut total: u64 = PER_REQUEST + tokens.iter().sum::<u64>();
    let mut dropped: Vec<bool> = vec![false; messages.len()];
    for g in &gs {
        for &i in g {
            dropped[i] = true;
            total -= tokens[i];
        }
        let opens_with_user = messages
            .iter()
            .zip(&dropped)
            .find(|(m, d)| !**d && !is_system(m))
            .is_none_or(|(m, _)| role(m) == "user");
        if total <= budget && opens_with_user {
            let kept: Vec<Value> = messages
                .iter()
                .zip(&dropped)
                .filter(|(_, d)| !**d)
                .map(|(m, _)| m.clone())
                .collect();
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
    fn message_bytes_agree_with_message_text() {
        let ms = [
            msg("user", "héllo"),
            json!({"role": "assistant", "name": "x", "content": null, "tool_calls": [{"id": "c"}]}),
            json!({"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "r"}, {"type": "image_url"}]}),
        ];
        for m in &ms {
            let (text, media) = message_text(m);
            assert_eq!(message_bytes(m), (text.len() as u64, media), "{m}");
        }
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
        // "user " (5) + 31 bytes = 36 bytes -> 9, plus 4 + 3
        assert_eq!(n, 16);
    }

    /// Review findings: the latest step ending in the assistant's text keeps the tool
    /// exchange that text answers (only the text was kept); a `developer` message (the
    /// o-series system prompt) is kept like a system message (it was dropped first).
    #[test]
    fn the_latest_step_keeps_its_tool_exchange_and_developer_prompts_stay() {
        let m = vec![
            json!({"role": "system", "content": "agent"}),
            json!({"role": "user", "content": "fix the bug"}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "read", "arguments": "{}"}}]}),
            json!({"role": "tool", "tool_call_id": "c9", "content": "old ".repeat(800)}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "read", "arguments": "{}"}}]}),
            json!({"role": "tool", "tool_call_id": "c0", "content": "line ".repeat(300)}),
            json!({"role": "assistant", "content": "per the file above, the bug is on line 3"}),
        ];
        match fit("gpt-4o", 1_000, 0.9, 16, &m, "", ContextPolicy::Trim) {
            Fit::Trimmed { messages, dropped } => {
                assert_eq!(dropped, 2, "the older step: {messages:?}");
                assert_eq!(messages[..2], m[..2]);
                assert_eq!(messages[2..], m[4..], "the latest step whole");
            }
            other => panic!("{other:?}"),
        }
        let m = vec![
            json!({"role": "developer", "content": "you are an agent"}),
            json!({"role": "user", "content": "old ".repeat(1500)}),
            json!({"role": "assistant", "content": "ok"}),
            json!({"role": "user", "content": "now"}),
        ];
        match fit("gpt-4o", 1_000, 0.9, 16, &m, "", ContextPolicy::Trim) {
            Fit::Trimmed { messages, .. } => {
                assert_eq!(messages, vec![m[0].clone(), m[3].clone()]);
            }
            other => panic!("{other:?}"),
        }
    }

    /// An agent loop: one user turn, then many tool-calling steps whose results are
    /// long. Trimming drops the oldest steps (each call with its results), never the user
    /// turn nor the latest step; before, everything after the last user turn was kept and
    /// such a conversation could not be trimmed at all.
    #[test]
    fn an_agent_loop_is_trimmed_by_its_oldest_steps() {
        let step = |n: usize| {
            vec![
                json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{n}"), "type": "function", "function": {"name": "read", "arguments": "{}"}}]}),
                json!({"role": "tool", "tool_call_id": format!("c{n}"), "content": "line ".repeat(200)}),
            ]
        };
        let mut m = vec![
            msg("system", "you are an agent"),
            msg("user", "fix the bug"),
        ];
        for n in 0..10 {
            m.extend(step(n));
        }
        match fit("gpt-4o", 1_000, 0.9, 16, &m, "", ContextPolicy::Trim) {
            Fit::Trimmed { messages, dropped } => {
                assert_eq!(dropped % 2, 0, "whole steps: {dropped}");
                assert!((12..20).contains(&dropped), "{dropped}");
                assert_eq!(messages[..2], m[..2], "the system prompt and the user turn");
                assert_eq!(
                    messages[messages.len() - 2..],
                    m[m.len() - 2..],
                    "the latest step"
                );
                assert!(count("gpt-4o", &messages).0 + 16 <= 900);
            }
            other => panic!("{other:?}"),
        }
        // The latest step alone is too long: nothing else can go.
        let mut big = vec![msg("user", "fix it")];
        big.extend(step(0));
        big[2]["content"] = json!("line ".repeat(2000));
        assert!(matches!(
            fit("gpt-4o", 1_000, 0.9, 16, &big, "", ContextPolicy::Trim),
            Fit::Skip(why) if why.contains("its latest step")
        ));
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
            fit("gpt-4o", 100_000, 0.9, 100, &m, "", ContextPolicy::Trim),
            Fit::AsIs
        );
        match fit("gpt-4o", 300, 0.9, 16, &m, "", ContextPolicy::Fail) {
            Fit::Fail(why) => assert!(why.starts_with("context: "), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            fit("gpt-4o", 300, 0.9, 16, &m, "", ContextPolicy::Fallback),
            Fit::Skip(_)
        ));
        match fit("gpt-4o", 300, 0.9, 16, &m, "", ContextPolicy::Trim) {
            Fit::Trimmed { messages, dropped } => {
                assert_eq!(
                    dropped, 2,
                    "the oldest turn, and the answer that would open the rest"
                );
                assert_eq!(
                    messages,
                    vec![msg("system", "be brief"), msg("user", "and now?")]
                );
            }
            other => panic!("{other:?}"),
        }
        // The last user turn alone is too long: trimming cannot help.
        let m = vec![msg("system", "s"), msg("user", &long)];
        assert!(matches!(
            fit("gpt-4o", 100, 0.9, 16, &m, "", ContextPolicy::Trim),
            Fit::Skip(_)
        ));
        // Tools count too: a short prompt with a long tool schema does not fit.
        let short = vec![msg("user", "hi")];
        let tools = "schema ".repeat(400);
        assert!(matches!(
            fit("gpt-4o", 300, 0.9, 16, &short, &tools, ContextPolicy::Fail),
            Fit::Fail(_)
        ));
    }

    /// An inline image is counted as an image (about 1,500 tokens), not as its base64.
    #[test]
    fn an_inline_image_counts_as_an_image_not_as_its_base64() {
        let b64 = "A".repeat(1_000_000);
        let m = vec![json!({"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}}
        ]})];
        let (n, _) = count("gpt-4o", &m);
        assert!(n > PER_MEDIA_PART && n < PER_MEDIA_PART + 50, "{n}");
        assert_eq!(
            fit("gpt-4o", 128_000, 0.9, 1000, &m, "", ContextPolicy::Fail),
            Fit::AsIs
        );
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
        let call = |k: u64| {
            let calls: Vec<Value> = (0..k)
                .map(|j| json!({"id": format!("c{j}"), "type": "function", "function": {"name": "f", "arguments": "{}"}}))
                .collect();
            json!({"role": "assistant", "content": null, "tool_calls": calls, "k": k})
        };
        // after each tool-calling assistant message, its tool results
        let with_results = |ms: Vec<Value>, out: &mut Vec<Value>| {
            for m in ms {
                let k = m.get("k").and_then(Value::as_u64);
                out.push(m);
                if let Some(k) = k {
                    for j in 0..k {
                        out.push(json!({"role": "tool", "tool_call_id": format!("c{j}"), "content": "r ".repeat(20)}));
                    }
                }
            }
        };
        (
            proptest::collection::vec(one, 1..12),
            // an agent loop after the last user turn: its steps
            proptest::collection::vec((1u64..3).prop_map(call), 0..5),
            // and the assistant's text after its last step
            proptest::bool::ANY,
        )
            .prop_map(move |(ms, steps, said)| {
                let mut out = vec![];
                with_results(ms, &mut out);
                out.push(msg("user", "last question"));
                let any = !steps.is_empty();
                with_results(steps, &mut out);
                if any && said {
                    out.push(msg("assistant", "as the results show"));
                }
                out
            })
    }

    proptest! {
        /// Trimming keeps every system message, the last user turn and the latest step of
        /// an agent loop after it, keeps order, and never keeps a tool result without its
        /// call or a call without its results.
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
                let last_user = |ms: &[Value]| ms.iter().rfind(|m| role(m) == "user").cloned();
                prop_assert_eq!(last_user(&kept), last_user(&messages));
                // the latest step whole: from the last tool-calling message on
                let step = |ms: &[Value]| {
                    let at = ms.iter().rposition(|m| m.get("tool_calls").is_some());
                    at.filter(|&i| i > ms.iter().rposition(|m| role(m) == "user").unwrap_or(0))
                        .map(|i| ms[i..].to_vec())
                };
                prop_assert_eq!(step(&kept), step(&messages));
                let first = kept.iter().find(|m| role(m) != "system");
                prop_assert!(first.is_none_or(|m| role(m) == "user"), "opens with a user turn: {:?}", kept);
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
