//! Integration tests of the simulated provider over real HTTP on 127.0.0.1:0.

use llm_worker::sim::{
    Fault, Rule, Sim, SimOptions, SimStats, completion_tokens_for, estimate_prompt_tokens,
};
use serde_json::{Value, json};
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Every await of the tests goes through this, so a bug can fail a test but never hang it.
async fn t<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .expect("test step timed out")
}

struct Harness {
    sim: Sim,
    addr: SocketAddr,
    client: reqwest::Client,
    shutdown: CancellationToken,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn start(opts: SimOptions) -> Harness {
    let shutdown = CancellationToken::new();
    let (sim, addr) = t(Sim::spawn(opts, shutdown.clone())).await.expect("spawn");
    Harness {
        sim,
        addr,
        client: reqwest::Client::new(),
        shutdown,
    }
}

fn rule(model: &str, fault: Fault) -> Rule {
    Rule {
        model: model.into(),
        fault,
        probability: 1.0,
        first_n: None,
    }
}

fn request(model: &str, text: &str) -> Value {
    json!({
        "model": model,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": text}
        ]
    })
}

impl Harness {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    async fn chat(&self, body: &Value) -> reqwest::Response {
        t(self
            .client
            .post(self.url("/v1/chat/completions"))
            .json(body)
            .send())
        .await
        .expect("send")
    }

    async fn http_stats(&self) -> SimStats {
        let resp = t(self.client.get(self.url("/stats")).send())
            .await
            .expect("stats");
        t(resp.json()).await.expect("stats json")
    }
}

#[tokio::test]
async fn normal_answer_shape_and_deterministic_usage() {
    let h = start(SimOptions {
        cached_fraction: 0.5,
        ..SimOptions::default()
    })
    .await;
    let body = request(
        "gpt-sim",
        "Summarise the history of the Roman Empire in one line",
    );
    let resp = t(h
        .client
        .post(h.url("/v1/chat/completions"))
        .header("x-llm-worker-job", "job-1")
        .json(&body)
        .send())
    .await
    .expect("send");
    assert_eq!(resp.status(), 200);
    let v: Value = t(resp.json()).await.expect("json");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "gpt-sim");
    assert!(v["id"].as_str().expect("id").starts_with("chatcmpl-sim-"));
    assert!(v["created"].as_u64().expect("created") > 0);
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    assert!(content.contains("gpt-sim"), "{content}");
    assert!(
        content.contains("Summarise the history of the Roman Empir"),
        "{content}"
    );

    let p = estimate_prompt_tokens(&body);
    let c = completion_tokens_for(&body);
    assert_eq!(v["usage"]["prompt_tokens"], p);
    assert_eq!(v["usage"]["completion_tokens"], c);
    assert_eq!(v["usage"]["total_tokens"], p + c);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], p / 2);

    let stats = h.http_stats().await;
    assert_eq!(stats, h.sim.stats());
    assert_eq!(stats.requests["gpt-sim"][&200], 1);
    assert_eq!(stats.calls_per_job["job-1"], 1);
    let billed = &stats.billed["gpt-sim"];
    assert_eq!(
        (
            billed.prompt_tokens,
            billed.completion_tokens,
            billed.cached_tokens,
            billed.responses
        ),
        (p, c, p / 2, 1)
    );
    assert_eq!(stats.in_flight, 0);

    let resp = t(h.client.post(h.url("/stats/reset")).send())
        .await
        .expect("reset");
    assert_eq!(resp.status(), 200);
    assert_eq!(h.sim.stats(), SimStats::default());
}

#[tokio::test]
async fn invalid_requests_get_400() {
    let h = start(SimOptions::default()).await;
    let resp = t(h
        .client
        .post(h.url("/v1/chat/completions"))
        .body("{not json")
        .send())
    .await
    .expect("send");
    assert_eq!(resp.status(), 400);
    let v: Value = t(resp.json()).await.expect("json");
    assert_eq!(v["error"]["code"], "invalid_request");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let resp = h.chat(&json!({"model": "m"})).await;
    assert_eq!(resp.status(), 400);
}

#[tokio::test]
async fn status_rule_503() {
    let h = start(SimOptions {
        rules: vec![rule("flaky", Fault::Status { status: 503 })],
        ..SimOptions::default()
    })
    .await;
    let resp = h.chat(&request("flaky", "hi")).await;
    assert_eq!(resp.status(), 503);
    let v: Value = t(resp.json()).await.expect("json");
    assert_eq!(v["error"]["message"], "simulated 503");
    // Other models are unaffected.
    assert_eq!(h.chat(&request("solid", "hi")).await.status(), 200);
    let s = h.sim.stats();
    assert_eq!(s.requests["flaky"][&503], 1);
    assert_eq!(s.requests["solid"][&200], 1);
    assert!(!s.billed.contains_key("flaky"));
}

#[tokio::test]
async fn rate_limit_with_retry_after() {
    let h = start(SimOptions {
        rules: vec![rule(
            "*",
            Fault::RateLimit {
                retry_after: Some("1".into()),
                retry_after_ms: Some(1000),
            },
        )],
        ..SimOptions::default()
    })
    .await;
    let resp = h.chat(&request("any", "hi")).await;
    assert_eq!(resp.status(), 429);
    assert_eq!(
        resp.headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    assert_eq!(
        resp.headers()
            .get("retry-after-ms")
            .and_then(|v| v.to_str().ok()),
        Some("1000")
    );
    let v: Value = t(resp.json()).await.expect("json");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
}

#[tokio::test]
async fn first_n_limits_the_fault() {
    let h = start(SimOptions {
        rules: vec![Rule {
            first_n: Some(2),
            ..rule("m", Fault::Status { status: 500 })
        }],
        ..SimOptions::default()
    })
    .await;
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(h.chat(&request("m", "hi")).await.status().as_u16());
    }
    assert_eq!(statuses, [500, 500, 200, 200]);

    // Replacing the options over HTTP restarts the counters.
    let opts = json!({"latency_ms": 0, "jitter_ms": 0, "rules": [
        {"model": "m", "fault": {"kind": "insufficient_quota"}, "first_n": 1}
    ]});
    let resp = t(h.client.put(h.url("/options")).json(&opts).send())
        .await
        .expect("put");
    assert_eq!(resp.status(), 200);
    let resp = h.chat(&request("m", "hi")).await;
    assert_eq!(resp.status(), 429);
    let v: Value = t(resp.json()).await.expect("json");
    assert_eq!(v["error"]["code"], "insufficient_quota");
    assert_eq!(h.chat(&request("m", "hi")).await.status(), 200);
}

#[tokio::test]
async fn hang_is_in_flight_until_the_client_gives_up() {
    let h = start(SimOptions {
        rules: vec![rule("stuck", Fault::Hang)],
        ..SimOptions::default()
    })
    .await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .expect("client");
    let call = client
        .post(h.url("/v1/chat/completions"))
        .json(&request("stuck", "hello?"))
        .send();
    let waiter = tokio::spawn(async move { t(call).await });

    // While the client waits, the call is counted in flight and under status 0.
    let mut seen = false;
    for _ in 0..50 {
        if h.sim.stats().in_flight == 1 {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(seen, "hang never counted in flight");
    assert_eq!(h.sim.stats().requests["stuck"][&0], 1);

    let res = t(waiter).await.expect("join");
    assert!(res.expect_err("must time out").is_timeout());

    // The client dropped the connection: the server drops the handler and its guard.
    let mut released = false;
    for _ in 0..100 {
        if h.http_stats().await.in_flight == 0 {
            released = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(released, "in_flight never went back to 0");
    assert_eq!(h.sim.stats().max_in_flight, 1);
}

#[tokio::test]
async fn max_in_flight_with_ten_concurrent_calls() {
    let h = start(SimOptions {
        latency_ms: 100,
        ..SimOptions::default()
    })
    .await;
    let mut tasks = Vec::new();
    for i in 0..10 {
        let client = h.client.clone();
        let url = h.url("/v1/chat/completions");
        let body = request("busy", &format!("call {i}"));
        tasks.push(tokio::spawn(async move {
            t(client.post(url).json(&body).send())
                .await
                .map(|r| r.status().as_u16())
        }));
    }
    for task in tasks {
        assert_eq!(t(task).await.expect("join").expect("send"), 200);
    }
    let s = h.sim.stats();
    assert_eq!(s.max_in_flight, 10);
    assert_eq!(s.max_in_flight_per_model["busy"], 10);
    assert_eq!(s.in_flight, 0);
    assert_eq!(s.requests["busy"][&200], 10);
    assert_eq!(s.billed["busy"].responses, 10);
}

#[tokio::test]
async fn context_window_exceeded() {
    let h = start(SimOptions {
        context_windows: [("small".to_string(), 20)].into_iter().collect(),
        ..SimOptions::default()
    })
    .await;
    let long = "x".repeat(200);
    let body = request("small", &long);
    assert!(estimate_prompt_tokens(&body) > 20);
    let resp = h.chat(&body).await;
    assert_eq!(resp.status(), 400);
    let v: Value = t(resp.json()).await.expect("json");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    // A short prompt fits.
    let short = request("small", "hi");
    assert!(estimate_prompt_tokens(&short) <= 20);
    assert_eq!(h.chat(&short).await.status(), 200);
    let s = h.sim.stats();
    assert_eq!(s.requests["small"][&400], 1);
    assert_eq!(s.requests["small"][&200], 1);

    let models: Value = t(t(h.client.get(h.url("/v1/models")).send())
        .await
        .expect("models")
        .json())
    .await
    .expect("json");
    assert_eq!(models["data"][0]["id"], "small");
}

#[tokio::test]
async fn malformed_200_answers() {
    let h = start(SimOptions {
        rules: vec![
            rule("garbage", Fault::Garbage),
            rule("trunc", Fault::Truncated),
            rule("empty", Fault::EmptyChoices),
            rule("errbody", Fault::ErrorBody),
            rule("nousage", Fault::NoUsage),
        ],
        ..SimOptions::default()
    })
    .await;
    for model in ["garbage", "trunc"] {
        let resp = h.chat(&request(model, "hi")).await;
        assert_eq!(resp.status(), 200);
        let text = t(resp.text()).await.expect("text");
        assert!(
            serde_json::from_str::<Value>(&text).is_err(),
            "{model}: {text}"
        );
    }
    let v: Value = t(h.chat(&request("empty", "hi")).await.json())
        .await
        .expect("json");
    assert_eq!(v["choices"], json!([]));
    let v: Value = t(h.chat(&request("errbody", "hi")).await.json())
        .await
        .expect("json");
    assert!(v["error"].is_object());
    let v: Value = t(h.chat(&request("nousage", "hi")).await.json())
        .await
        .expect("json");
    assert!(v.get("usage").is_none());
    assert!(v["choices"][0]["message"]["content"].is_string());
    let s = h.sim.stats();
    assert!(!s.billed.contains_key("nousage"));
    assert!(!s.billed.contains_key("trunc"));
}

#[tokio::test]
async fn shutdown_releases_hangs() {
    let h = start(SimOptions {
        rules: vec![rule("stuck", Fault::Hang)],
        ..SimOptions::default()
    })
    .await;
    let client = h.client.clone();
    let url = h.url("/v1/chat/completions");
    let call =
        tokio::spawn(async move { t(client.post(url).json(&request("stuck", "x")).send()).await });
    for _ in 0..50 {
        if h.sim.stats().in_flight == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    h.shutdown.cancel();
    let resp = t(call).await.expect("join").expect("answered on shutdown");
    assert_eq!(resp.status(), 503);
}
