//! The HTTP routes: chat completions (with faults), models, stats and options control.

use super::tokens::{content_text, messages};
use super::*;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

pub(super) fn error_json(message: &str, typ: &str, code: &str) -> Value {
    json!({"error": {"message": message, "type": typ, "code": code, "param": null}})
}

pub(super) fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// `type`/`code` pairs close to what OpenAI-compatible providers send for each status.
pub(super) fn status_error(status: u16) -> (&'static str, &'static str) {
    match status {
        400 => ("invalid_request_error", "invalid_request"),
        401 => ("authentication_error", "invalid_api_key"),
        403 => ("permission_error", "permission_denied"),
        404 => ("not_found_error", "model_not_found"),
        408 => ("timeout_error", "request_timeout"),
        429 => ("rate_limit_error", "rate_limit_exceeded"),
        503 => ("service_unavailable_error", "service_unavailable"),
        529 => ("overloaded_error", "overloaded"),
        _ => ("server_error", "server_error"),
    }
}

pub(super) async fn chat_completions(
    State(sim): State<Sim>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(job) = headers.get(JOB_HEADER) {
        let job = String::from_utf8_lossy(job.as_bytes()).into_owned();
        *lock(&sim.inner.state)
            .stats
            .calls_per_job
            .entry(job)
            .or_default() += 1;
    }

    let req: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            sim.record_status(INVALID_MODEL_KEY, 400);
            let msg = format!("invalid JSON body: {e}");
            return json_response(
                StatusCode::BAD_REQUEST,
                &error_json(&msg, "invalid_request_error", "invalid_request"),
            );
        }
    };
    let model = match req.get("model").and_then(Value::as_str) {
        Some(m) if !m.is_empty() => m.to_string(),
        _ => {
            sim.record_status(INVALID_MODEL_KEY, 400);
            return json_response(
                StatusCode::BAD_REQUEST,
                &error_json(
                    "missing or empty 'model'",
                    "invalid_request_error",
                    "invalid_request",
                ),
            );
        }
    };
    if !req.get("messages").is_some_and(Value::is_array) {
        sim.record_status(&model, 400);
        return json_response(
            StatusCode::BAD_REQUEST,
            &error_json(
                "missing 'messages' array",
                "invalid_request_error",
                "invalid_request",
            ),
        );
    }

    // Counted in flight from here; the guard decrements even if this future is dropped.
    let _guard = sim.enter(&model);
    let opts = sim.options();
    let fault = sim.pick_fault(&opts.rules, &model);

    if let Some(Fault::Hang) = fault {
        sim.record_status(&model, 0);
        let release = lock(&sim.inner.hang_release).clone();
        tokio::select! {
            _ = tokio::time::sleep(HANG_MAX) => {}
            _ = release.cancelled() => {}
        }
        return json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &error_json(
                "simulated hang released",
                "service_unavailable_error",
                "service_unavailable",
            ),
        );
    }

    let base = opts
        .model_latency_ms
        .get(&model)
        .copied()
        .unwrap_or(opts.latency_ms);
    let jitter = if opts.jitter_ms > 0 {
        rand::random_range(0..=opts.jitter_ms)
    } else {
        0
    };
    let delay = base.saturating_add(jitter);
    if delay > 0 {
        super::clock::sleep(Duration::from_millis(delay)).await;
    }

    let prompt = estimate_prompt_tokens(&req);
    let (status, resp) = match fault {
        Some(f) => fault_response(&sim, &req, &model, &opts, prompt, f),
        None => match opts.context_windows.get(&model) {
            Some(&window) if prompt > window => {
                (400, context_length_response(&model, window, prompt))
            }
            _ => {
                let (v, _) = success_body(&sim, &req, &model, &opts, prompt, true);
                (200, json_response(StatusCode::OK, &v))
            }
        },
    };
    sim.record_status(&model, status);
    resp
}

pub(super) fn context_length_response(model: &str, window: u64, prompt: u64) -> Response {
    let msg = format!(
        "This model's maximum context length is {window} tokens. However, your messages \
         resulted in {prompt} tokens. Please reduce the length of the messages. (model {model})"
    );
    let mut v = error_json(&msg, "invalid_request_error", "context_length_exceeded");
    v["error"]["param"] = json!("messages");
    json_response(StatusCode::BAD_REQUEST, &v)
}

/// Builds the OpenAI-shaped 200 body and records billing when `usage` is included.
/// Returns the body and the completion tokens it reports.
pub(super) fn success_body(
    sim: &Sim,
    req: &Value,
    model: &str,
    opts: &SimOptions,
    prompt: u64,
    with_usage: bool,
) -> (Value, u64) {
    let completion = completion_tokens_for(req);
    let last_user = messages(req)
        .iter()
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .or_else(|| messages(req).last())
        .map(|m| content_text(m.get("content")))
        .unwrap_or_default();
    let echo: String = last_user.chars().take(40).collect();
    let content = format!("[sim {model}] You said: {echo}");
    let n = sim.inner.seq.fetch_add(1, Ordering::Relaxed) + 1;
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut v = json!({
        "id": format!("chatcmpl-sim-{n}"),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "finish_reason": "stop"
        }],
    });
    if with_usage {
        v["usage"] = usage_json(sim, model, opts, prompt, completion);
    }
    (v, completion)
}

/// `usage` object; records the figures as billed, since the client receives them.
pub(super) fn usage_json(
    sim: &Sim,
    model: &str,
    opts: &SimOptions,
    prompt: u64,
    completion: u64,
) -> Value {
    let fraction = if opts.cached_fraction.is_nan() {
        0.0
    } else {
        opts.cached_fraction.clamp(0.0, 1.0)
    };
    let cached = ((prompt as f64) * fraction).floor() as u64;
    sim.record_billed(model, prompt, completion, cached);
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached}
    })
}

pub(super) fn fault_response(
    sim: &Sim,
    req: &Value,
    model: &str,
    opts: &SimOptions,
    prompt: u64,
    fault: Fault,
) -> (u16, Response) {
    match fault {
        Fault::RateLimit {
            retry_after,
            retry_after_ms,
        } => {
            let body = error_json(
                "Rate limit reached (simulated)",
                "rate_limit_error",
                "rate_limit_exceeded",
            );
            let mut resp = json_response(StatusCode::TOO_MANY_REQUESTS, &body);
            if let Some(ra) = retry_after
                && let Ok(v) = HeaderValue::from_str(&ra)
            {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
            if let Some(ms) = retry_after_ms {
                resp.headers_mut()
                    .insert("retry-after-ms", HeaderValue::from(ms));
            }
            (429, resp)
        }
        Fault::InsufficientQuota => (
            429,
            json_response(
                StatusCode::TOO_MANY_REQUESTS,
                &error_json(
                    "You exceeded your current quota (simulated)",
                    "insufficient_quota",
                    "insufficient_quota",
                ),
            ),
        ),
        Fault::Status { status } => {
            // An out-of-range status in the options must not crash the sim: answer 500.
            let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let (typ, c) = status_error(code.as_u16());
            let msg = format!("simulated {}", code.as_u16());
            (
                code.as_u16(),
                json_response(code, &error_json(&msg, typ, c)),
            )
        }
        Fault::ContextLength => {
            let window = opts.context_windows.get(model).copied().unwrap_or(0);
            (400, context_length_response(model, window, prompt))
        }
        // Handled before the latency; kept here so the match is exhaustive.
        Fault::Hang => (
            503,
            json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &error_json(
                    "simulated hang",
                    "service_unavailable_error",
                    "service_unavailable",
                ),
            ),
        ),
        Fault::EmptyChoices => {
            // Providers still bill the prompt of such answers; report it so the worker's
            // cost accounting can be checked on this path too.
            let (mut v, _) = success_body(sim, req, model, opts, prompt, false);
            v["choices"] = json!([]);
            v["usage"] = usage_json(sim, model, opts, prompt, 0);
            (200, json_response(StatusCode::OK, &v))
        }
        Fault::ErrorBody => (
            200,
            json_response(
                StatusCode::OK,
                &error_json(
                    "simulated error inside a 200 response",
                    "server_error",
                    "internal_error",
                ),
            ),
        ),
        Fault::Garbage => (
            200,
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "text/html")],
                "<html><body>502 Bad Gateway (simulated garbage)</body></html>",
            )
                .into_response(),
        ),
        Fault::Truncated => {
            // No usage is billed: the client cannot read it.
            let (v, _) = success_body(sim, req, model, opts, prompt, false);
            let mut s = v.to_string();
            let mut cut = s.len() / 2;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            s.truncate(cut);
            (
                200,
                (
                    StatusCode::OK,
                    [(header::CONTENT_TYPE, "application/json")],
                    s,
                )
                    .into_response(),
            )
        }
        Fault::NoUsage => {
            let (v, _) = success_body(sim, req, model, opts, prompt, false);
            (200, json_response(StatusCode::OK, &v))
        }
    }
}

pub(super) async fn list_models(
    State(sim): State<Sim>,
    headers: axum::http::HeaderMap,
) -> Response {
    let opts = sim.options();
    if let Some(key) = &opts.api_key {
        let given = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            return json_response(
                StatusCode::UNAUTHORIZED,
                &json!({"error": {"message": "invalid api key", "type": "authentication_error", "code": "invalid_api_key"}}),
            );
        }
    }
    if let Some(list) = &opts.models {
        let data: Vec<Value> = list
            .iter()
            .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "sim"}))
            .collect();
        return json_response(StatusCode::OK, &json!({"object": "list", "data": data}));
    }
    let mut models: BTreeSet<String> = opts
        .rules
        .iter()
        .map(|r| r.model.clone())
        .filter(|m| m != "*")
        .collect();
    models.extend(opts.context_windows.keys().cloned());
    models.extend(opts.model_latency_ms.keys().cloned());
    models.extend(
        sim.stats()
            .requests
            .into_keys()
            .filter(|m| m != INVALID_MODEL_KEY),
    );
    let data: Vec<Value> = models
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "sim"}))
        .collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

pub(super) async fn get_stats(State(sim): State<Sim>) -> Response {
    json_response(StatusCode::OK, &json!(sim.stats()))
}

pub(super) async fn reset_stats(State(sim): State<Sim>) -> Response {
    sim.reset_stats();
    json_response(StatusCode::OK, &json!(sim.stats()))
}

pub(super) async fn get_options(State(sim): State<Sim>) -> Response {
    json_response(StatusCode::OK, &json!(sim.options()))
}

pub(super) async fn put_options(State(sim): State<Sim>, body: Bytes) -> Response {
    match serde_json::from_slice::<SimOptions>(&body) {
        Ok(opts) => {
            sim.set_options(opts);
            json_response(StatusCode::OK, &json!(sim.options()))
        }
        Err(e) => json_response(
            StatusCode::BAD_REQUEST,
            &error_json(
                &format!("invalid SimOptions JSON: {e}"),
                "invalid_request_error",
                "invalid_request",
            ),
        ),
    }
}
