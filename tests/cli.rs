//! The subcommands on the real binary: config errors (exit 2, naming the key),
//! `check-config` redaction, `enqueue`, `results`, `status` and the demo. Every Redis
//! here is a redis-server of the test's own; nothing touches 127.0.0.1:6379.

mod common;

use common::*;
use llm_worker::sim::SimOptions;
use rust_decimal::Decimal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

const T: Duration = Duration::from_secs(20);

/// A Redis URL on a port nobody listens on: a config that passed validation by mistake
/// fails to connect there instead of reaching a real Redis.
fn dead_redis_url() -> String {
    format!("redis://127.0.0.1:{}", free_port())
}

fn unused_sim() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

fn default_toml() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("config/default.toml")
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p
}

/// `enqueue --file <jobs>` with config `cfg`.
async fn enqueue_file(cfg: &Path, jobs: &Path) -> BinOutput {
    let args = [
        "--config",
        cfg.to_str().unwrap(),
        "enqueue",
        "--file",
        jobs.to_str().unwrap(),
    ];
    run_bin_async(&args, &[], T).await
}

/// Both `check-config` and `run` exit 2 with one line on stderr naming `key`.
async fn assert_config_error(cfg: &Path, env: &[(&str, &str)], key: &str) {
    for cmd in ["check-config", "run"] {
        let out = run_bin_async(&["--config", cfg.to_str().unwrap(), cmd], env, T).await;
        assert_eq!(out.code, Some(2), "{cmd}: {}", out.all());
        assert!(
            out.stderr.contains(key),
            "{cmd}: message names {key}: {}",
            out.all()
        );
        assert_eq!(
            out.stderr.trim().lines().count(),
            1,
            "{cmd}: one line: {}",
            out.all()
        );
        assert!(out.stdout.trim().is_empty(), "{cmd}: {}", out.all());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_key_in_file_is_exit_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut tc = TestConfig::with_urls(&dead_redis_url(), unused_sim());
    tc.extra = "bogus_retry_knob = 1\n".into(); // lands in [retry]
    let p = tc.write(dir.path(), "c.toml");
    assert_config_error(&p, &[], "retry.bogus_retry_knob").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_key_from_env_is_exit_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let p = TestConfig::with_urls(&dead_redis_url(), unused_sim()).write(dir.path(), "c.toml");
    assert_config_error(&p, &[("LLM_WORKER__QUEUE__BOGUS", "1")], "queue.bogus").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_naming_an_unknown_model_is_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let text = TestConfig::with_urls(&dead_redis_url(), unused_sim()).toml();
    let route = r#"default = ["m1", "m2", "m3"]"#;
    assert!(text.contains(route));
    let p = write(
        dir.path(),
        "c.toml",
        &text.replace(route, r#"default = ["m1", "no-such-model"]"#),
    );
    assert_config_error(&p, &[], "routes.default").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_naming_an_unknown_provider_or_pool_is_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let text = TestConfig::with_urls(&dead_redis_url(), unused_sim()).toml();
    assert!(text.contains(r#"provider = "p2""#));
    let p = write(
        dir.path(),
        "provider.toml",
        &text.replace(r#"provider = "p2""#, r#"provider = "nowhere""#),
    );
    assert_config_error(&p, &[], "models.m3.provider").await;

    let m1 = "[models.m1]\nprovider = \"p1\"\n";
    assert!(text.contains(m1));
    let p = write(
        dir.path(),
        "pool.toml",
        &text.replace(m1, &format!("{m1}pool = \"no-such-pool\"\n")),
    );
    assert_config_error(&p, &[], "models.m1.pool").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_api_key_variable_is_exit_2_naming_api_key_env() {
    // config/default.toml names HOLYSHEEP_API_KEY, which run_bin never passes on.
    let redis = dead_redis_url();
    let env = [
        ("LLM_WORKER__REDIS__URL", redis.as_str()),
        ("LLM_WORKER__SERVER__LISTEN", ""),
    ];
    assert_config_error(&default_toml(), &env, "providers.holysheep.api_key_env").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_slots_from_env_is_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let p = TestConfig::with_urls(&dead_redis_url(), unused_sim()).write(dir.path(), "c.toml");
    assert_config_error(
        &p,
        &[("LLM_WORKER__POOLS__DEFAULT__SLOTS", "0")],
        "pools.default.slots",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_idle_below_the_floor_is_exit_2_naming_key_and_minimum() {
    let dir = tempfile::tempdir().unwrap();
    let p = TestConfig::with_urls(&dead_redis_url(), unused_sim()).write(dir.path(), "c.toml");
    let env = [("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "100")];
    assert_config_error(&p, &env, "queue.claim_idle_ms").await;
    let out = run_bin_async(&["--config", p.to_str().unwrap(), "check-config"], &env, T).await;
    assert!(out.stderr.contains("at least 200"), "{}", out.all());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_prints_the_config_without_the_api_key() {
    let redis = dead_redis_url();
    let cfg = default_toml();
    let out = run_bin_async(
        &["--config", cfg.to_str().unwrap(), "check-config"],
        &[
            ("HOLYSHEEP_API_KEY", "sk-secret-123"),
            ("LLM_WORKER__REDIS__URL", &redis),
            ("LLM_WORKER__POOLS__DEFAULT__SLOTS", "13"),
        ],
        T,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(!out.stdout.contains("sk-secret-123"), "{}", out.all());
    assert!(!out.stderr.contains("sk-secret-123"), "{}", out.all());
    assert!(
        out.stdout.contains("[providers.holysheep]"),
        "{}",
        out.all()
    );
    assert!(
        out.stdout.contains(r#"api_key_env = "HOLYSHEEP_API_KEY""#),
        "{}",
        out.all()
    );
    assert!(out.stdout.contains("[redacted]"), "{}", out.all());
    // The effective config: env overrides applied, and the output is TOML.
    let parsed: toml::Value = toml::from_str(&out.stdout).expect("check-config prints TOML");
    assert_eq!(parsed["pools"]["default"]["slots"].as_integer(), Some(13));
    assert_eq!(parsed["redis"]["url"].as_str(), Some(redis.as_str()));
}

/// `enqueue --prompt` -> worker -> `results --job --json` -> `status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_results_and_status_round_trip() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "c.toml");
    let cfg_s = cfg.to_str().unwrap();
    let mut conn = redis.conn().await;

    let out = run_bin_async(
        &[
            "--config",
            cfg_s,
            "enqueue",
            "--prompt",
            "hello from the cli",
            "--id",
            "cli-1",
            "--metadata",
            r#"{"from":"cli"}"#,
        ],
        &[],
        T,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    let printed = out.stdout.trim();
    let (ms, seq) = printed
        .split_once('-')
        .unwrap_or_else(|| panic!("an entry id: {}", out.all()));
    assert!(
        ms.parse::<u64>().is_ok() && seq.parse::<u64>().is_ok(),
        "{}",
        out.all()
    );
    let jobs = entries(&mut conn, "{llm}:jobs").await;
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs[0].0, printed);
    let payload: serde_json::Value = serde_json::from_str(&jobs[0].1["payload"]).unwrap();
    assert_eq!(payload["id"], "cli-1");
    assert_eq!(payload["messages"][0]["content"], "hello from the cli");
    assert_eq!(payload["metadata"]["from"], "cli");

    // Not there yet: `results --job` says so and exits non-zero.
    let none = run_bin_async(
        &["--config", cfg_s, "results", "--job", "cli-1", "--json"],
        &[],
        T,
    )
    .await;
    assert_eq!(none.code, Some(1), "{}", none.all());
    assert!(
        none.stderr.contains("no result for job cli-1"),
        "{}",
        none.all()
    );
    assert!(none.stdout.trim().is_empty(), "{}", none.all());

    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(30)).await,
        &[&w],
    )
    .unwrap();

    let out = run_bin_async(
        &["--config", cfg_s, "results", "--job", "cli-1", "--json"],
        &[],
        T,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    let r: serde_json::Value = serde_json::from_str(out.stdout.trim()).expect("one JSON line");
    assert_eq!(r["job_id"], "cli-1", "{r}");
    assert_eq!(r["job_entry"], printed, "{r}");
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["model"], "m1", "{r}");
    assert_eq!(r["metadata"], r#"{"from":"cli"}"#, "{r}");
    let cost = Decimal::from_str(r["cost_usd"].as_str().unwrap()).unwrap();
    assert!(cost > Decimal::ZERO, "{r}");

    let out = run_bin_async(&["--config", cfg_s, "status"], &[], T).await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    let total_line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("cost total"))
        .unwrap_or_else(|| panic!("a cost total line: {}", out.all()));
    let total = total_line.rsplit('$').next().unwrap().trim();
    assert_eq!(Decimal::from_str(total).unwrap(), cost, "{}", out.all());
    assert!(
        out.stdout
            .lines()
            .any(|l| l.trim_start().starts_with("m1 ") && l.contains("calls=1")),
        "per-model totals: {}",
        out.all()
    );
    assert!(out.stdout.contains("results         1"), "{}", out.all());

    let json = run_bin_async(&["--config", cfg_s, "status", "--json"], &[], T).await;
    assert_eq!(json.code, Some(0), "{}", json.all());
    let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("status --json");
    assert_eq!(v["results"], 1);
    assert_eq!(v["dead_letters"], 0);
    assert_eq!(
        Decimal::from_str(v["cost"]["total_usd"].as_str().unwrap()).unwrap(),
        cost
    );

    stop_clean(&mut w, Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_file_with_a_bad_line_enqueues_nothing_and_names_the_line() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = TestConfig::with_urls(&redis.url(), unused_sim()).write(dir.path(), "c.toml");
    let jsonl = write(
        dir.path(),
        "jobs.jsonl",
        concat!(
            r#"{"id":"f-1","messages":[{"role":"user","content":"one"}]}"#,
            "\n\n",
            r#"{"id":"f-2","messages":[]}"#,
            "\n",
            r#"{"id":"f-3","messages":[{"role":"user","content":"three"}]}"#,
            "\n",
        ),
    );
    let out = enqueue_file(&cfg, &jsonl).await;
    assert!(
        out.code.is_some_and(|c| c != 0),
        "exits non-zero: {}",
        out.all()
    );
    assert!(
        out.stderr.contains("line 3"),
        "names the line: {}",
        out.all()
    );
    assert!(out.stderr.contains("messages"), "says why: {}", out.all());
    assert!(out.stdout.trim().is_empty(), "no id printed: {}", out.all());
    let mut conn = redis.conn().await;
    assert_eq!(xlen(&mut conn, "{llm}:jobs").await, 0, "nothing enqueued");

    // The same file without the bad line goes in whole.
    let good = write(
        dir.path(),
        "good.jsonl",
        concat!(
            r#"{"id":"f-1","messages":[{"role":"user","content":"one"}]}"#,
            "\n\n",
            r#"{"id":"f-3","messages":[{"role":"user","content":"three"}]}"#,
            "\n",
        ),
    );
    let out = enqueue_file(&cfg, &good).await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_eq!(out.stdout.trim().lines().count(), 2, "{}", out.all());
    assert_eq!(xlen(&mut conn, "{llm}:jobs").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_to_completion_on_the_tests_redis() {
    let redis = RedisServer::start();
    let url = redis.url();
    let out = run_bin_async(
        &[
            "demo",
            "--jobs",
            "8",
            "--latency-ms",
            "20",
            "--timeout-s",
            "60",
        ],
        &[("LLM_WORKER__REDIS__URL", &url)],
        Duration::from_secs(90),
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(
        out.stdout.contains(&format!("using the Redis at {url}")),
        "{}",
        out.all()
    );
    let summary = out
        .stdout
        .lines()
        .find(|l| l.starts_with("summary:"))
        .unwrap_or_else(|| panic!("a summary line: {}", out.all()));
    assert!(summary.contains("8 jobs (8 ok)"), "{summary}");
    assert!(out.stdout.contains("clean shutdown"), "{}", out.all());
    // The demo removed its own keys from the Redis it borrowed.
    let mut conn = redis.conn().await;
    let keys: Vec<String> = redis::AsyncCommands::keys(&mut conn, "*").await.unwrap();
    assert!(keys.is_empty(), "demo keys left behind: {keys:?}");
}

/// Issue 8 point 13: a `redis.url` that redis-rs will refuse (a port that is not a number,
/// a database that is not a number) is a config error at load, for `check-config` as for
/// `run`, naming `redis.url` (and the variable when an override set it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_redis_url_is_exit_2_naming_redis_url() {
    let dir = tempfile::tempdir().unwrap();
    for (i, url) in [
        "redis://127.0.0.1:notaport",
        "redis://127.0.0.1:6379/abc",
        "rediss://127.0.0.1:6379/#bogus",
        "redis://127.0.0.1:6379/?protocol=resp9",
        "unix:///tmp/x.sock?db=abc",
    ]
    .into_iter()
    .enumerate()
    {
        let p = TestConfig::with_urls(url, unused_sim()).write(dir.path(), &format!("c{i}.toml"));
        assert_config_error(&p, &[], "redis.url").await;
    }
    // From an override: the message names the variable too.
    let p = TestConfig::with_urls(&dead_redis_url(), unused_sim()).write(dir.path(), "env.toml");
    assert_config_error(
        &p,
        &[("LLM_WORKER__REDIS__URL", "redis://127.0.0.1:6379/abc")],
        "LLM_WORKER__REDIS__URL",
    )
    .await;
}

/// A redis-server of this test's own listening only on a unix socket in a temp dir, with
/// `requirepass`: the URL that reaches it must carry the password as `?pass=`.
struct UnixRedis {
    dir: tempfile::TempDir,
    child: std::process::Child,
}

impl UnixRedis {
    fn start(password: &str) -> UnixRedis {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("redis.sock");
        let child = std::process::Command::new("redis-server")
            .args(["--port", "0", "--save", "", "--appendonly", "no"])
            .arg("--unixsocket")
            .arg(&sock)
            .args(["--requirepass", password])
            .arg("--dir")
            .arg(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&sock).is_err() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "redis-server did not start"
            );
            // A plain poll while redis-server starts: this helper is synchronous.
            #[allow(clippy::disallowed_methods)]
            std::thread::sleep(Duration::from_millis(20));
        }
        UnixRedis { dir, child }
    }

    fn url(&self, scheme: &str, password: &str) -> String {
        format!(
            "{scheme}://{}?db=0&pass={password}",
            self.dir.path().join("redis.sock").display()
        )
    }
}

impl Drop for UnixRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Issue 8 point 10: `unix://` and `redis+unix://` URLs carry the password as `?pass=`;
/// neither `check-config` nor `status` (which really connects with it) may print it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_url_password_is_never_printed() {
    const PW: &str = "SECRET-unix-pw-7f3a";
    let redis = UnixRedis::start(PW);
    let dir = tempfile::tempdir().unwrap();
    for scheme in ["unix", "redis+unix"] {
        let url = redis.url(scheme, PW);
        let cfg = TestConfig::with_urls(&url, unused_sim()).write(dir.path(), "c.toml");
        let cfg = cfg.to_str().unwrap();
        let out = run_bin_async(&["--config", cfg, "check-config"], &[], T).await;
        assert_eq!(out.code, Some(0), "{scheme}: {}", out.all());
        assert!(!out.all().contains(PW), "{scheme}: {}", out.all());
        let parsed: toml::Value = toml::from_str(&out.stdout).expect("check-config prints TOML");
        let shown = parsed["redis"]["url"].as_str().unwrap_or_default();
        assert!(shown.contains("redis.sock"), "{scheme}: {shown}");
        let out = run_bin_async(&["--config", cfg, "status"], &[], T).await;
        assert_eq!(out.code, Some(0), "{scheme}: status: {}", out.all());
        assert!(!out.all().contains(PW), "{scheme}: status: {}", out.all());
        // The same URL through the override variable.
        let plain =
            TestConfig::with_urls(&dead_redis_url(), unused_sim()).write(dir.path(), "plain.toml");
        let out = run_bin_async(
            &["--config", plain.to_str().unwrap(), "status"],
            &[("LLM_WORKER__REDIS__URL", &url)],
            T,
        )
        .await;
        assert_eq!(out.code, Some(0), "{scheme}: status via env: {}", out.all());
        assert!(!out.all().contains(PW), "{scheme}: {}", out.all());
    }
}

/// Issue 8 point 10: the start-up error ("cannot reach Redis") names the URL; with a
/// `unix://...?pass=` URL it must not name the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_error_log_hides_the_unix_url_password() {
    const PW: &str = "SECRET-startup-pw-41c2";
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "unix://{}?pass={PW}",
        dir.path().join("nobody-listens.sock").display()
    );
    let cfg = TestConfig::with_urls(&url, unused_sim()).write(dir.path(), "c.toml");
    let mut w = WorkerProc::spawn(&cfg, "w", &[]);
    assert!(
        wait_log(&w, "cannot reach Redis", T).await,
        "no start-up error: {}",
        w.log()
    );
    stop_clean(&mut w, T).await;
    let log = w.log();
    assert!(log.contains("nobody-listens.sock"), "{log}");
    assert!(!log.contains(PW), "{log}");
}

/// `results` and `status` read streams raw: an entry some other program wrote with a field
/// name that is not UTF-8 is shown as unreadable (names read lossily), not fatal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_and_status_survive_a_field_name_that_is_not_utf8() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "c.toml");
    let cfg_s = cfg.to_str().unwrap();
    let mut conn = redis.conn().await;
    for stream in ["{llm}:results", "{llm}:dead"] {
        let _: String = redis::cmd("XADD")
            .arg(stream)
            .arg("*")
            .arg(&b"\xffx"[..])
            .arg("1")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    // The table has a header line; JSON lines do not.
    for (args, lines) in [
        (&["--config", cfg_s, "results"][..], 2),
        (&["--config", cfg_s, "results", "--json"], 1),
    ] {
        let out = run_bin_async(args, &[], T).await;
        assert_eq!(out.code, Some(0), "{}", out.all());
        assert!(out.stdout.contains("status"), "{}", out.all());
        assert_eq!(out.stdout.lines().count(), lines, "{}", out.all());
    }
    let out = run_bin_async(&["--config", cfg_s, "results", "--job", "nope"], &[], T).await;
    assert_eq!(out.code, Some(1), "not found, not an error: {}", out.all());
    let out = run_bin_async(&["--config", cfg_s, "status", "--json"], &[], T).await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("status --json");
    assert_eq!(
        (v["results"].clone(), v["dead_letters"].clone()),
        (1.into(), 1.into())
    );
}

/// The CLI as a new user meets it: negative numbers are named, the demo's help names
/// the config it really uses, sim-provider refuses a --config it would ignore, and status
/// on an empty namespace says so instead of printing nulls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_says_what_is_wrong_in_words() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(llm_worker::sim::SimOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "c.toml");
    let cfg_s = cfg.to_str().unwrap();
    let out = run_bin_async(
        &[
            "--config",
            cfg_s,
            "enqueue",
            "--prompt",
            "x",
            "--max-tokens",
            "-5",
        ],
        &[],
        T,
    )
    .await;
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert!(
        out.stderr.contains("--max-tokens") && out.stderr.contains("-5 is not in 1.."),
        "{}",
        out.all()
    );
    let out = run_bin_async(&["--config", cfg_s, "results", "--count", "0"], &[], T).await;
    assert_eq!(out.code, Some(2), "{}", out.all());
    let out = run_bin_async(&["demo", "--help"], &[], T).await;
    assert!(out.stdout.contains("config/demo.toml"), "{}", out.all());
    let out = run_bin_async(&["--config", cfg_s, "sim-provider"], &[], T).await;
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert!(out.stderr.contains("takes no --config"), "{}", out.all());
    let out = run_bin_async(&["--config", cfg_s, "status"], &[], T).await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(
        out.stdout.contains("no worker has started"),
        "{}",
        out.all()
    );
    assert!(!out.stdout.contains("null"), "{}", out.all());
    let out = run_bin_async(&["--config", cfg_s, "results"], &[], T).await;
    assert!(
        out.stdout.contains("no results in {llm}:results"),
        "{}",
        out.all()
    );
}

/// `status` survives data some other program wrote: a slot holder that is not UTF-8 and a
/// cost total that is not an integer are shown or skipped, never fatal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_survives_odd_values_in_its_keys() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(llm_worker::sim::SimOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "c.toml");
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("SET")
        .arg("{llm}:poolsize:default")
        .arg(4)
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("{llm}:slot:default:0")
        .arg(&b"\xff\xfeholder"[..])
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg("{llm}:cost")
        .arg("m1:cost_picos")
        .arg("abc")
        .query_async(&mut conn)
        .await
        .unwrap();
    let out = run_bin_async(&["--config", cfg.to_str().unwrap(), "status"], &[], T).await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(out.stdout.contains("holder"), "{}", out.all());
}

/// Several prompts with one `--id`: the ids are numbered from 1, as the error messages
/// number the prompts (`--prompt 2: ...`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_prompts_are_numbered_from_one_in_ids_and_messages() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(llm_worker::sim::SimOptions::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "c.toml");
    let cfg_s = cfg.to_str().unwrap();
    let mut conn = redis.conn().await;
    let args = [
        "--config", cfg_s, "enqueue", "--prompt", "a", "--prompt", "b", "--id", "n",
    ];
    let out = run_bin_async(&args, &[], T).await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    let ids: Vec<String> = entries(&mut conn, "{llm}:jobs")
        .await
        .iter()
        .map(|(_, f)| {
            serde_json::from_str::<serde_json::Value>(&f["payload"]).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(ids, ["n-1", "n-2"]);
    let bad = [
        "--config", cfg_s, "enqueue", "--prompt", "a", "--prompt", "b", "--model", "nope",
    ];
    let out = run_bin_async(&bad, &[], T).await;
    assert!(
        out.stderr.contains("--prompt 1") && out.stderr.contains("--prompt 2"),
        "{}",
        out.all()
    );
}
