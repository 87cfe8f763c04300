//! Unit tests of loading, overrides, validation, prices and the URL redactor.

use super::*;
use rust_decimal::Decimal;
use std::collections::HashMap;
use std::str::FromStr;

const DEFAULT: &str = include_str!("../../config/default.toml");
const DEMO: &str = include_str!("../../config/demo.toml");
const KEY: &str = "sk-test-SECRET-0123456789";

fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn with_key(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    let mut e = env(pairs);
    e.insert("HOLYSHEEP_API_KEY".into(), KEY.into());
    e
}

/// The key of an `Invalid` error (panics on success or `File`).
fn err_key(r: Result<Config, ConfigError>) -> (String, String) {
    match r {
        Err(ConfigError::Invalid { key, message }) => (key, message),
        Err(other) => panic!("expected Invalid, got {other:?}"),
        Ok(_) => panic!("expected an error, got a valid config"),
    }
}

/// The demo config with `line` appended to the TOML (later keys in a table must be new).
fn demo_plus(extra: &str) -> Result<Config, ConfigError> {
    Config::from_toml_str(&format!("{DEMO}\n{extra}\n"), &env(&[]))
}

/// The demo config with one exact substring replaced.
fn demo_with(from: &str, to: &str) -> Result<Config, ConfigError> {
    assert!(DEMO.contains(from), "demo.toml lacks {from:?}");
    Config::from_toml_str(&DEMO.replacen(from, to, 1), &env(&[]))
}

#[test]
fn config_default_loads_with_api_key() {
    let c = Config::from_toml_str(DEFAULT, &with_key(&[])).expect("default.toml");
    assert_eq!(c.pools["default"].slots.get(), 8);
    let p = &c.providers["holysheep"];
    assert_eq!(p.base_url, "https://api.holysheep.ai/v1");
    assert_eq!(p.api_key.as_ref().map(Secret::expose), Some(KEY));
    assert_eq!(
        c.routes["default"],
        ["deepseek-v3.2", "gemini-2.5-flash", "gpt-4.1"]
    );
    assert_eq!(c.routes["quality"], ["claude-sonnet-4.5", "gpt-4.1"]);
    assert_eq!(c.models.len(), 4);
    assert_eq!(c.server.listen, "0.0.0.0:8080");
}

#[test]
fn config_default_without_api_key_names_the_key() {
    let (key, message) = err_key(Config::from_toml_str(DEFAULT, &env(&[])));
    assert_eq!(key, "providers.holysheep.api_key_env");
    assert!(message.contains("HOLYSHEEP_API_KEY"), "{message}");
    // An empty variable counts as unset.
    let (key, _) = err_key(Config::from_toml_str(
        DEFAULT,
        &env(&[("HOLYSHEEP_API_KEY", "")]),
    ));
    assert_eq!(key, "providers.holysheep.api_key_env");
}

#[test]
fn config_unused_provider_needs_no_key() {
    let c = demo_plus(
        "[providers.other]\nbase_url = \"https://x.example/v1\"\napi_key_env = \"OTHER_KEY_UNSET\"",
    )
    .expect("unused provider");
    assert!(c.providers["other"].api_key.is_none());
}

#[test]
fn config_demo_loads_with_empty_env() {
    let c = Config::from_toml_str(DEMO, &env(&[])).expect("demo.toml");
    assert_eq!(c.pools["default"].slots.get(), 4);
    assert_eq!(c.models["deepseek-v3.2"].provider, "sim");
    assert_eq!(c.models["gpt-4.1"].provider, "sim-b");
    assert!(c.providers.values().all(|p| p.api_key.is_none()));
    assert_eq!(c.server.listen, "");
    assert_eq!(c.worker.concurrency(), 16);
    assert_eq!(c.retry.base_delay_ms.as_millis(), 50);
    assert_eq!(c.slots.acquire_timeout_ms.as_millis(), 2000);
}

#[test]
fn config_prices_are_exact() {
    let c = Config::from_toml_str(DEFAULT, &with_key(&[])).expect("default.toml");
    let d = |s: &str| Decimal::from_str(s).expect("decimal");
    let m = &c.models["deepseek-v3.2"];
    assert_eq!(m.input_per_mtok, d("0.14"));
    assert_eq!(m.output_per_mtok, d("0.42"));
    assert_eq!(m.cached_input_per_mtok, Some(d("0.028")));
    assert_eq!(
        c.models["gemini-2.5-flash"].cached_input_per_mtok,
        Some(d("0.025"))
    );
    assert_eq!(c.models["claude-sonnet-4.5"].output_per_mtok, d("15"));
}

#[test]
fn config_price_precision_and_sign() {
    let (key, _) = err_key(demo_with(
        "input_per_mtok = 0.14 ",
        "input_per_mtok = 0.1400001 ",
    ));
    assert_eq!(key, "models.deepseek-v3.2.input_per_mtok");
    let (key, _) = err_key(demo_with(
        "output_per_mtok = 0.42",
        "output_per_mtok = -0.42",
    ));
    assert_eq!(key, "models.deepseek-v3.2.output_per_mtok");
    // Issue 8 point 3: a price above the cap would let a cost overflow.
    let (key, message) = err_key(demo_with(
        "output_per_mtok = 0.42",
        "output_per_mtok = \"100000000000000000000\"",
    ));
    assert_eq!(key, "models.deepseek-v3.2.output_per_mtok");
    assert!(message.contains("1000000"), "{message}");
    demo_with("output_per_mtok = 0.42", "output_per_mtok = 1000000")
        .expect("the cap itself is allowed");
    // Six places are fine, and strings are accepted too.
    demo_with("input_per_mtok = 0.14 ", "input_per_mtok = \"0.140001\" ")
        .expect("six decimal places");
}

#[test]
fn config_unknown_key_in_file() {
    let (key, message) = err_key(demo_with("[queue]\n", "[queue]\nbogus = 1\n"));
    assert_eq!(key, "queue.bogus");
    assert!(message.starts_with("unknown key"), "{message}");
    let (key, _) = err_key(demo_plus("[bogus]\nx = 1"));
    assert_eq!(key, "bogus");
    let (key, _) = err_key(demo_with(
        "context_window = 128000",
        "context_window = 128000\ncontext_windw = 1",
    ));
    assert_eq!(key, "models.deepseek-v3.2.context_windw");
}

#[test]
fn config_unknown_key_via_env() {
    let e = env(&[("LLM_WORKER__QUEUE__BOGUS", "1")]);
    let (key, message) = err_key(Config::from_toml_str(DEMO, &e));
    assert_eq!(key, "queue.bogus");
    assert!(message.starts_with("unknown key"), "{message}");
    assert!(
        message.ends_with("(set by LLM_WORKER__QUEUE__BOGUS)"),
        "{message}"
    );
    let e = env(&[("LLM_WORKER__BOGUS", "1")]);
    assert_eq!(err_key(Config::from_toml_str(DEMO, &e)).0, "bogus");
}

#[test]
fn config_path_variable_is_not_an_override() {
    let e = env(&[
        ("LLM_WORKER_CONFIG", "/elsewhere.toml"),
        ("LLM_WORKER_SOMETHING", "x"),
        ("PATH", "/usr/bin"),
    ]);
    Config::from_toml_str(DEMO, &e).expect("only LLM_WORKER__ vars are overrides");
}

#[test]
fn config_type_error_names_key() {
    let (key, message) = err_key(demo_with("slots = 4", "slots = \"abc\""));
    assert_eq!(key, "pools.default.slots");
    assert!(message.contains("abc"), "{message}");
    let e = env(&[("LLM_WORKER__WORKER__CONCURRENCY", "lots")]);
    assert_eq!(
        err_key(Config::from_toml_str(DEMO, &e)).0,
        "worker.concurrency"
    );
}

#[test]
fn config_missing_required_key_names_it() {
    let (key, message) = err_key(demo_with("context_window = 128000", ""));
    assert_eq!(key, "models.deepseek-v3.2.context_window");
    assert!(message.contains("missing"), "{message}");
}

#[test]
fn config_route_with_unknown_model() {
    let (key, message) = err_key(demo_with(
        "quality = [\"claude-sonnet-4.5\", \"gpt-4.1\"]",
        "quality = [\"claude-sonnet-4.5\", \"gpt-5\"]",
    ));
    assert_eq!(key, "routes.quality");
    assert!(message.contains("gpt-5"), "{message}");
}

#[test]
fn config_route_rules() {
    let (key, _) = err_key(demo_with(
        "default = [\"deepseek-v3.2\", \"gemini-2.5-flash\", \"gpt-4.1\"]",
        "main = [\"gpt-4.1\"]",
    ));
    assert_eq!(key, "routes.default");
    let (key, _) = err_key(demo_with(
        "quality = [\"claude-sonnet-4.5\", \"gpt-4.1\"]",
        "quality = []",
    ));
    assert_eq!(key, "routes.quality");
    let (key, message) = err_key(demo_with(
        "quality = [\"claude-sonnet-4.5\", \"gpt-4.1\"]",
        "quality = [\"gpt-4.1\", \"claude-sonnet-4.5\", \"gpt-4.1\"]",
    ));
    assert_eq!(key, "routes.quality");
    assert!(message.contains("more than once"), "{message}");
}

#[test]
fn config_route_override_from_env() {
    let e = env(&[("LLM_WORKER__ROUTES__DEFAULT", "gpt-4.1, deepseek-v3.2")]);
    let c = Config::from_toml_str(DEMO, &e).expect("route override");
    assert_eq!(c.routes["default"], ["gpt-4.1", "deepseek-v3.2"]);
    // Other values keep their commas.
    let e = env(&[
        ("LLM_WORKER__ROUTES__DEFAULT", "gpt-4.1"),
        ("LLM_WORKER__QUEUE__GROUP", "a,b"),
    ]);
    let c = Config::from_toml_str(DEMO, &e).expect("single-model route");
    assert_eq!(c.routes["default"], ["gpt-4.1"]);
    assert_eq!(c.queue.group, "a,b");
}

#[test]
fn config_model_with_unknown_provider_or_pool() {
    let (key, message) = err_key(demo_with("provider = \"sim-b\"", "provider = \"nope\""));
    assert_eq!(key, "models.gpt-4.1.provider");
    assert!(message.contains("nope"), "{message}");
    let (key, message) = err_key(demo_with(
        "provider = \"sim\"\npool = \"default\"",
        "provider = \"sim\"\npool = \"gpu\"",
    ));
    assert_eq!(key, "models.gemini-2.5-flash.pool");
    assert!(message.contains("gpu"), "{message}");
}

#[test]
fn config_pools() {
    let (key, _) = err_key(demo_with("slots = 4", "slots = 0"));
    assert_eq!(key, "pools.default.slots");
    let e = env(&[("LLM_WORKER__POOLS__DEFAULT__SLOTS", "16")]);
    let c = Config::from_toml_str(DEMO, &e).expect("slots override");
    assert_eq!(c.pools["default"].slots.get(), 16);
    let e = env(&[("LLM_WORKER__POOLS__DEFAULT__SLOTS", "0")]);
    let (key, message) = err_key(Config::from_toml_str(DEMO, &e));
    assert_eq!(key, "pools.default.slots");
    assert!(
        message.ends_with("(set by LLM_WORKER__POOLS__DEFAULT__SLOTS)"),
        "{message}"
    );
    let (key, _) = err_key(demo_with("[pools.default]\nslots = 4", ""));
    assert_eq!(key, "pools");
}

#[test]
fn config_env_overrides_scalars() {
    let e = env(&[
        ("LLM_WORKER__REDIS__URL", "redis://10.0.0.5:6379"),
        ("LLM_WORKER__QUEUE__NAMESPACE", "jobs2"),
        ("LLM_WORKER__WORKER__CONCURRENCY", "4"),
    ]);
    let c = Config::from_toml_str(DEMO, &e).expect("overrides");
    assert_eq!(c.redis.url, "redis://10.0.0.5:6379");
    assert_eq!(c.queue.namespace, "jobs2");
    assert_eq!(c.worker.concurrency(), 4);
}

#[test]
fn config_range_checks_name_keys() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "url = \"redis://127.0.0.1:6379\"",
            "url = \"http://x\"",
            "redis.url",
        ),
        (
            "namespace = \"llm\"",
            "namespace = \"l{m}\"",
            "queue.namespace",
        ),
        ("namespace = \"llm\"", "namespace = \"\"", "queue.namespace"),
        ("group = \"workers\"", "group = \"\"", "queue.group"),
        (
            "max_deliveries = 5",
            "max_deliveries = 0",
            "queue.max_deliveries",
        ),
        ("block_ms = 1000", "block_ms = 20000", "queue.block_ms"),
        ("concurrency = 16", "concurrency = 0", "worker.concurrency"),
        ("ttl_ms = 10000", "ttl_ms = 50", "slots.ttl_ms"),
        ("format = \"text\"", "format = \"xml\"", "log.format"),
        ("listen = \"\"", "listen = \"nowhere\"", "server.listen"),
        (
            "base_delay_ms = 50",
            "base_delay_ms = 5000",
            "retry.base_delay_ms",
        ),
        (
            "base_url = \"http://127.0.0.1:8089/v1\"",
            "base_url = \"127.0.0.1:8089\"",
            "providers.sim.base_url",
        ),
        (
            "base_url = \"http://127.0.0.1:8089/v1\"",
            "base_url = \"http://exa mple.com/v1\"",
            "providers.sim.base_url",
        ),
        (
            "base_url = \"http://127.0.0.1:8089/v1\"",
            "base_url = \"http://127.0.0.1:99999/v1\"",
            "providers.sim.base_url",
        ),
        (
            "context_window = 128000",
            "context_window = 0",
            "models.deepseek-v3.2.context_window",
        ),
    ];
    for (from, to, want) in cases {
        assert_eq!(&err_key(demo_with(from, to)).0, want, "{from} -> {to}");
    }
    demo_with("listen = \"\"", "listen = \"127.0.0.1:0\"").expect("socket address");
}

#[test]
fn config_consumer_default_filled() {
    let c = Config::from_toml_str(DEMO, &env(&[("HOSTNAME", "box7")])).expect("demo");
    assert_eq!(c.queue.consumer, format!("box7-{}", std::process::id()));
    let c = demo_with("consumer = \"\"", "consumer = \"me\"").expect("demo");
    assert_eq!(c.queue.consumer, "me");
}

#[test]
fn config_redis_password_from_env() {
    let c = Config::from_toml_str(DEMO, &env(&[("REDIS_PASSWORD", "pw123")])).expect("demo");
    assert_eq!(c.redis.password.as_ref().map(Secret::expose), Some("pw123"));
    let c = Config::from_toml_str(DEMO, &env(&[])).expect("demo");
    assert!(c.redis.password.is_none());
}

#[test]
fn config_redacted_toml_hides_secrets_and_round_trips() {
    let e = with_key(&[
        (
            "LLM_WORKER__REDIS__URL",
            "redis://user:hunter2@db.example:6380/0",
        ),
        ("REDIS_PASSWORD", "pw-from-env"),
    ]);
    let c = Config::from_toml_str(DEFAULT, &e).expect("default.toml");
    let text = c.redacted_toml();
    assert!(!text.contains(KEY), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(!text.contains("pw-from-env"), "{text}");
    // The password left the URL at load; `password` shows that there is one.
    assert!(
        text.contains("url = \"redis://user@db.example:6380/0\""),
        "{text}"
    );
    assert!(text.contains("password = \"[redacted]\""), "{text}");
    // Valid TOML, and (secrets aside) it loads back into the same config.
    let value: toml::Table = toml::from_str(&text).expect("valid TOML");
    assert!(value.contains_key("models"));
    let stripped: String = text
        .lines()
        .filter(|l| !l.starts_with("api_key =") && !l.starts_with("password ="))
        .map(|l| format!("{l}\n"))
        .collect();
    let back = Config::from_toml_str(&stripped, &with_key(&[])).expect("round trip");
    assert_eq!(
        back.models["deepseek-v3.2"].input_per_mtok,
        c.models["deepseek-v3.2"].input_per_mtok
    );
    assert_eq!(back.routes, c.routes);
    assert_eq!(back.queue.consumer, c.queue.consumer);
}

/// Every URL form redis-rs accepts (and a few it refuses), with the password each
/// carries (`None`: no password; the URL must still parse).
const URL_FORMS: &[(&str, Option<&str>)] = &[
    ("redis://127.0.0.1:6379", None),
    ("redis://h", None),
    ("redis://user@h:1/3", None),
    ("redis://user:pw1@h:6380/0", Some("pw1")),
    ("redis://:pw2@h:1", Some("pw2")),
    ("redis://u:p%40ss%3Aw0rd@h/2", Some("p@ss:w0rd")),
    ("redis://:pw3@[::1]:6379/1?protocol=resp3", Some("pw3")),
    ("rediss://u:pw4@db.example:6380/0", Some("pw4")),
    ("rediss://:pw5@db.example/#insecure", Some("pw5")),
    ("rediss://db.example:6380/?protocol=3#insecure", None),
    ("unix:///run/redis.sock", None),
    ("unix:///run/redis.sock?db=2&pass=pw6", Some("pw6")),
    ("unix:///run/redis.sock?pass=pw7&db=2&user=bob", Some("pw7")),
    ("redis+unix:///run/redis.sock?pass=pw8", Some("pw8")),
    (
        "redis+unix:///run/redis.sock?protocol=resp3&pass=p%26w9",
        Some("p&w9"),
    ),
];

#[test]
fn config_split_redis_url_every_form() {
    for (raw, pw) in URL_FORMS {
        let split = split_redis_url(raw).unwrap_or_else(|e| panic!("{raw}: {e}"));
        assert_eq!(split.password.as_ref().map(Secret::expose), *pw, "{raw}");
        if let Some(pw) = pw {
            assert!(!split.url.contains(pw), "{raw} -> {}", split.url);
        }
        // The split URL plus the password connects exactly as the original would.
        let want = redis::IntoConnectionInfo::into_connection_info(*raw)
            .unwrap_or_else(|e| panic!("redis-rs refuses {raw}: {e}"));
        let got = redis::IntoConnectionInfo::into_connection_info(split.url.as_str())
            .unwrap_or_else(|e| panic!("redis-rs refuses split {}: {e}", split.url));
        assert_eq!(got.addr(), want.addr(), "{raw}");
        let (w, g) = (want.redis_settings(), got.redis_settings());
        assert_eq!(g.db(), w.db(), "{raw}");
        assert_eq!(g.username(), w.username(), "{raw}");
        assert_eq!(g.protocol(), w.protocol(), "{raw}");
        assert_eq!(g.password(), None, "{raw}");
        assert_eq!(w.password(), *pw, "{raw}");
    }
}

#[test]
fn config_split_redis_url_refuses_what_redis_rs_refuses() {
    for raw in [
        "redis://127.0.0.1:notaport",
        "redis://127.0.0.1:6379/abc",
        "redis://127.0.0.1:99999",
        "redis://0.0.0.0:6379",
        "redis://:6379",
        "rediss://h/#bogus",
        "redis://h/?protocol=resp9",
        "unix:///run/redis.sock?db=x",
        "unix://relative.sock",
        "http://h:6379",
        "not a url",
    ] {
        assert!(split_redis_url(raw).is_err(), "{raw} accepted");
        assert!(
            redis::IntoConnectionInfo::into_connection_info(raw).is_err()
                || raw.starts_with("unix://relative")
                || raw.starts_with("http://"),
            "redis-rs accepts {raw}: the rule here is wrong"
        );
    }
    // Stricter than redis-rs, which would silently connect without the password.
    for raw in ["redis://h?pass=pw", "unix://:pw@localhost/run/redis.sock"] {
        let e = split_redis_url(raw).expect_err(raw);
        assert!(!e.contains("pw@") && !e.contains("=pw"), "{e}");
    }
    // Errors never echo the URL (it may hold a password).
    let e = split_redis_url("redis://:hunter2@h:notaport").expect_err("bad port");
    assert!(!e.contains("hunter2"), "{e}");
}

#[test]
fn config_redact_url_every_form() {
    for (raw, pw) in URL_FORMS {
        let shown = redact_url(raw);
        if let Some(pw) = pw {
            assert!(!shown.contains(pw), "{raw} -> {shown}");
            // percent-encoded forms too
            assert!(
                !shown.contains("p%40ss") && !shown.contains("p%26w9"),
                "{shown}"
            );
            assert!(shown.contains("[redacted]"), "{raw} -> {shown}");
        } else {
            assert!(!shown.contains("[redacted]"), "{raw} -> {shown}");
        }
    }
    assert_eq!(redact_url("redis://:pw@h:1"), "redis://:[redacted]@h:1");
    assert_eq!(
        redact_url("rediss://u:p@w@h/2"),
        "rediss://u:[redacted]@h/2"
    );
    assert_eq!(redact_url("redis://h:6379"), "redis://h:6379");
    assert_eq!(redact_url("redis://user@h"), "redis://user@h");
    assert_eq!(
        redact_url("unix:///run/r.sock?db=2&pass=SECRET&protocol=resp3"),
        "unix:///run/r.sock?db=2&pass=[redacted]&protocol=resp3"
    );
    assert_eq!(
        redact_url("redis://h?PASSWORD=SECRET"),
        "redis://h?PASSWORD=[redacted]"
    );
    let bad = redact_url("redis://:SECRET@h:notaport");
    assert!(!bad.contains("SECRET"), "{bad}");
}

#[test]
fn config_url_password_becomes_a_secret() {
    let e = env(&[(
        "LLM_WORKER__REDIS__URL",
        "unix:///run/r.sock?db=1&pass=SECRET-pw",
    )]);
    let c = Config::from_toml_str(DEMO, &e).expect("unix url");
    assert_eq!(c.redis.url, "unix:///run/r.sock?db=1");
    assert_eq!(
        c.redis.password.as_ref().map(Secret::expose),
        Some("SECRET-pw")
    );
    assert!(!format!("{c:?}").contains("SECRET-pw"));
    assert!(!c.redacted_toml().contains("SECRET-pw"));
    // $REDIS_PASSWORD wins over the URL's.
    let e = env(&[
        ("LLM_WORKER__REDIS__URL", "redis://:from-url@h:1/0"),
        ("REDIS_PASSWORD", "from-env"),
    ]);
    let c = Config::from_toml_str(DEMO, &e).expect("tcp url");
    assert_eq!(c.redis.url, "redis://h:1/0");
    assert_eq!(
        c.redis.password.as_ref().map(Secret::expose),
        Some("from-env")
    );
}

#[test]
fn config_bad_redis_url_names_key_and_variable() {
    let e = env(&[("LLM_WORKER__REDIS__URL", "redis://127.0.0.1:6379/abc")]);
    let (key, message) = err_key(Config::from_toml_str(DEMO, &e));
    assert_eq!(key, "redis.url");
    assert!(message.contains("not a number"), "{message}");
    assert!(
        message.ends_with("(set by LLM_WORKER__REDIS__URL)"),
        "{message}"
    );
    let (key, _) = err_key(demo_with(
        "url = \"redis://127.0.0.1:6379\"",
        "url = \"redis://127.0.0.1:notaport\"",
    ));
    assert_eq!(key, "redis.url");
}

#[test]
fn config_resolve_path_order() {
    use std::path::{Path, PathBuf};
    let e = env(&[("LLM_WORKER_CONFIG", "/etc/w.toml")]);
    assert_eq!(
        resolve_path(Some(Path::new("a.toml")), &e),
        PathBuf::from("a.toml")
    );
    assert_eq!(resolve_path(None, &e), PathBuf::from("/etc/w.toml"));
    assert_eq!(
        resolve_path(None, &env(&[])),
        PathBuf::from("config/default.toml")
    );
}

#[test]
fn config_load_file_and_missing_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("w.toml");
    std::fs::write(&path, DEMO).expect("write");
    Config::load(&path, &env(&[])).expect("load from file");
    match Config::load(&dir.path().join("missing.toml"), &env(&[])) {
        Err(ConfigError::File { path, .. }) => assert!(path.ends_with("missing.toml")),
        other => panic!("expected File error, got {other:?}"),
    }
    std::fs::write(&path, "[queue\n").expect("write");
    assert!(matches!(
        Config::load(&path, &env(&[])),
        Err(ConfigError::File { .. })
    ));
}

#[test]
fn config_duration_ms_round_trip() {
    use std::time::Duration;
    let c = Config::from_toml_str(DEMO, &env(&[])).expect("demo");
    assert_eq!(c.slots.ttl_ms, Duration::from_millis(10_000));
    assert_eq!(c.retry.base_delay_ms, Duration::from_millis(50));
    let text = c.redacted_toml();
    // check-config shows the same key names with plain millisecond numbers.
    assert!(text.contains("ttl_ms = 10000\n"), "{text}");
    assert!(text.contains("base_delay_ms = 50\n"), "{text}");
    assert!(text.contains("claim_idle_ms = "), "{text}");
    let back = Config::from_toml_str(&text, &env(&[])).expect("round trip");
    assert_eq!(back.slots.ttl_ms, c.slots.ttl_ms);
    assert_eq!(back.queue.claim_idle_ms, c.queue.claim_idle_ms);
    assert_eq!(
        back.providers["sim"].timeout_ms,
        c.providers["sim"].timeout_ms
    );
    assert_eq!(back.worker.shutdown_grace_ms, c.worker.shutdown_grace_ms);
}

#[test]
fn config_duration_ms_env_override_as_string() {
    use std::time::Duration;
    let e = env(&[
        ("LLM_WORKER__SLOTS__TTL_MS", "1500"),
        ("LLM_WORKER__PROVIDERS__SIM__TIMEOUT_MS", "2500"),
    ]);
    let c = Config::from_toml_str(DEMO, &e).expect("override");
    assert_eq!(c.slots.ttl_ms, Duration::from_millis(1500));
    assert_eq!(c.providers["sim"].timeout_ms, Duration::from_millis(2500));
    // A quoted number in the file is accepted too.
    let c = demo_with("ttl_ms = 10000", "ttl_ms = \"1500\"").expect("string ms");
    assert_eq!(c.slots.ttl_ms, Duration::from_millis(1500));
}

#[test]
fn config_duration_ms_bad_value_names_key() {
    for bad in ["-5", "soon", "1.5s"] {
        let e = env(&[("LLM_WORKER__SLOTS__TTL_MS", bad)]);
        let (key, message) = err_key(Config::from_toml_str(DEMO, &e));
        assert_eq!(key, "slots.ttl_ms", "{bad}: {message}");
        assert!(
            message.ends_with("(set by LLM_WORKER__SLOTS__TTL_MS)"),
            "{bad}: {message}"
        );
    }
    let (key, message) = err_key(demo_with("ttl_ms = 10000", "ttl_ms = -5"));
    assert_eq!(key, "slots.ttl_ms");
    assert!(message.contains("milliseconds"), "{message}");
    let (key, _) = err_key(demo_with("block_ms = 1000", "block_ms = \"x\""));
    assert_eq!(key, "queue.block_ms");
}

#[test]
fn config_zero_counts_name_key() {
    let cases: &[(&str, &str, &str)] = &[
        ("slots = 4", "slots = 0", "pools.default.slots"),
        ("concurrency = 16", "concurrency = 0", "worker.concurrency"),
        (
            "max_deliveries = 5",
            "max_deliveries = 0",
            "queue.max_deliveries",
        ),
    ];
    for (from, to, want) in cases {
        let (key, message) = err_key(demo_with(from, to));
        assert_eq!(&key, want, "{from} -> {to}");
        assert!(message.contains("at least 1"), "{key}: {message}");
    }
    for (var, want) in [
        (
            "LLM_WORKER__RETRY__MAX_ATTEMPTS_PER_MODEL",
            "retry.max_attempts_per_model",
        ),
        (
            "LLM_WORKER__PROVIDERS__SIM__REQUESTS_PER_SECOND",
            "providers.sim.requests_per_second",
        ),
        ("LLM_WORKER__WORKER__CONCURRENCY", "worker.concurrency"),
    ] {
        let (key, message) = err_key(Config::from_toml_str(DEMO, &env(&[(var, "0")])));
        assert_eq!(key, want, "{message}");
        assert!(message.contains("at least 1"), "{key}: {message}");
        assert!(message.ends_with(&format!("(set by {var})")), "{message}");
    }
}

#[test]
fn command_timeout_defaults_to_a_third_of_the_lease_and_is_bounded_by_it() {
    let c = demo_with("ttl_ms = 10000", "ttl_ms = 10000").expect("default");
    assert_eq!(
        c.redis.command_timeout_ms,
        std::time::Duration::from_millis(1000)
    );
    let c = demo_with("ttl_ms = 10000", "ttl_ms = 300").expect("short lease");
    assert_eq!(
        c.redis.command_timeout_ms,
        std::time::Duration::from_millis(100)
    );
    let text = DEMO
        .replacen("ttl_ms = 10000", "ttl_ms = 3000", 1)
        .replacen("[redis]\n", "[redis]\ncommand_timeout_ms = 1500\n", 1);
    let (key, message) = err_key(Config::from_toml_str(&text, &env(&[])));
    assert_eq!(key, "redis.command_timeout_ms", "{message}");
    assert!(message.contains("a third of slots.ttl_ms"), "{message}");
}

#[test]
fn config_claim_idle_ms_has_a_floor() {
    // The keepalive (every claim_idle_ms / 3) must come round, with its round trip,
    // before the stall gate's gap (claim_idle_ms / 2): below the floor it cannot.
    for bad in ["1", "100", "199"] {
        let (key, message) = err_key(demo_with(
            "claim_idle_ms = 120000",
            &format!("claim_idle_ms = {bad}"),
        ));
        assert_eq!(key, "queue.claim_idle_ms", "{bad}: {message}");
        assert!(message.contains("at least 200"), "{bad}: {message}");
        assert!(message.contains(&format!("got {bad}")), "{bad}: {message}");
    }
    let c = demo_with("claim_idle_ms = 120000", "claim_idle_ms = 200").expect("the floor");
    assert_eq!(c.queue.claim_idle_ms, std::time::Duration::from_millis(200));
    let var = "LLM_WORKER__QUEUE__CLAIM_IDLE_MS";
    let (key, message) = err_key(Config::from_toml_str(DEMO, &env(&[(var, "50")])));
    assert_eq!(key, "queue.claim_idle_ms", "{message}");
    assert!(message.contains("at least 200"), "{message}");
}

#[test]
fn config_dedupe_ttl_s_is_a_duration_in_seconds() {
    use std::time::Duration;
    let c = Config::from_toml_str(DEMO, &env(&[])).expect("demo");
    assert_eq!(c.queue.dedupe_ttl_s, Duration::from_secs(86_400));
    // check-config shows the contract's key with whole seconds, and reads back.
    let text = c.redacted_toml();
    assert!(text.contains("dedupe_ttl_s = 86400\n"), "{text}");
    let back = Config::from_toml_str(&text, &env(&[])).expect("round trip");
    assert_eq!(back.queue.dedupe_ttl_s, c.queue.dedupe_ttl_s);
    let var = "LLM_WORKER__QUEUE__DEDUPE_TTL_S";
    let c = Config::from_toml_str(DEMO, &env(&[(var, "60")])).expect("override");
    assert_eq!(c.queue.dedupe_ttl_s, Duration::from_secs(60));
    for bad in ["0", "-5", "\"x\""] {
        let (key, message) = err_key(demo_with(
            "dedupe_ttl_s = 86400",
            &format!("dedupe_ttl_s = {bad}"),
        ));
        assert_eq!(key, "queue.dedupe_ttl_s", "{bad}: {message}");
        assert!(message.contains("second"), "{bad}: {message}");
    }
}

#[test]
fn numbers_the_commit_script_passes_as_lua_numbers_are_bounded() {
    // Lua formats a number >= 1e14 as "1e+14": SET ... EX and XADD MAXLEN ~ then refuse
    // it after the script's first writes (a second result, costs counted twice).
    let var = "LLM_WORKER__QUEUE__DEDUPE_TTL_S";
    let (key, message) = err_key(Config::from_toml_str(
        DEMO,
        &env(&[(var, "9300000000000000")]),
    ));
    assert_eq!(key, "queue.dedupe_ttl_s", "{message}");
    assert!(message.contains("at most"), "{message}");
    let c = Config::from_toml_str(DEMO, &env(&[(var, "315360000")])).expect("ten years");
    assert_eq!(c.queue.dedupe_ttl_s.as_secs(), 315_360_000);
    let var = "LLM_WORKER__QUEUE__RESULTS_MAXLEN";
    let (key, message) = err_key(Config::from_toml_str(
        DEMO,
        &env(&[(var, "100000000000000")]),
    ));
    assert_eq!(key, "queue.results_maxlen", "{message}");
    assert!(message.contains("at most"), "{message}");
    let c = Config::from_toml_str(DEMO, &env(&[(var, "1000000000000")])).expect("10^12");
    assert_eq!(c.queue.results_maxlen, 1_000_000_000_000);
}

#[test]
fn concurrency_absent_is_every_pools_n_and_read_ahead_a_quarter_of_it() {
    let without = DEMO.replacen("concurrency = 16", "", 1);
    let c = Config::from_toml_str(&without, &env(&[])).expect("no concurrency");
    // demo.toml: one pool of 4 slots -> 4, and max(1, 4 / 4) read ahead
    assert_eq!(c.worker.concurrency(), 4);
    assert_eq!(c.worker.read_ahead(), 1);
    let big = without.replacen("slots = 4 ", "slots = 64 ", 1);
    let c = Config::from_toml_str(&big, &env(&[])).expect("N = 64");
    assert_eq!(c.worker.concurrency(), 64);
    assert_eq!(c.worker.read_ahead(), 16);
    // An explicit value wins, and reads none ahead unless told; check-config shows what
    // is used.
    let c = Config::from_toml_str(DEMO, &env(&[])).expect("demo");
    assert_eq!(c.worker.concurrency(), 16);
    assert_eq!(c.worker.read_ahead(), 0);
    assert!(c.redacted_toml().contains("concurrency = 16\n"));
    assert!(c.redacted_toml().contains("read_ahead = 0\n"));
    let c = Config::from_toml_str(DEMO, &env(&[("LLM_WORKER__WORKER__READ_AHEAD", "5")]))
        .expect("both set");
    assert_eq!((c.worker.concurrency(), c.worker.read_ahead()), (16, 5));
    // A large explicit concurrency is no error about a key nobody wrote.
    let c = Config::from_toml_str(DEMO, &env(&[("LLM_WORKER__WORKER__CONCURRENCY", "40004")]))
        .expect("a large concurrency");
    assert_eq!(c.worker.read_ahead(), 0);
    let var = "LLM_WORKER__WORKER__READ_AHEAD";
    let c = Config::from_toml_str(DEMO, &env(&[(var, "0")])).expect("no read-ahead");
    assert_eq!(c.worker.read_ahead(), 0);
    let (key, message) = err_key(Config::from_toml_str(DEMO, &env(&[(var, "10001")])));
    assert_eq!(key, "worker.read_ahead", "{message}");
    assert!(message.contains("10001"), "{message}");
}

#[test]
fn worker_threads_defaults_to_one_and_is_bounded() {
    let c = Config::from_toml_str(DEMO, &env(&[])).expect("demo");
    assert_eq!(c.worker.threads, 1);
    let var = "LLM_WORKER__WORKER__THREADS";
    let c = Config::from_toml_str(DEMO, &env(&[(var, "0")])).expect("one per core");
    assert_eq!(c.worker.threads, 0);
    let (key, message) = err_key(Config::from_toml_str(DEMO, &env(&[(var, "5000")])));
    assert_eq!(key, "worker.threads", "{message}");
    assert!(message.contains("is 5000"), "{message}");
}

/// The demo config with `lines` added to `[redis]`.
fn demo_redis(lines: &str) -> Result<Config, ConfigError> {
    demo_with(
        "password_env = \"REDIS_PASSWORD\"     # used when set and non-empty",
        &format!("password_env = \"REDIS_PASSWORD\"\n{lines}"),
    )
}

#[test]
fn config_redis_topology_keys_name_what_is_wrong() {
    let c = demo_redis("sentinel_master = \"mymaster\"\nurls = [\"redis://127.0.0.1:26379\"]")
        .expect("sentinel");
    assert_eq!(c.redis.urls.len(), 1);
    let c = demo_redis("cluster = true\nurls = [\"redis://127.0.0.1:7001\"]").expect("cluster");
    assert!(c.redis.cluster);
    // Seeds share redis.url's scheme: a plain seed next to a TLS url would get the
    // password in clear.
    let e = demo_with(
        "url = \"redis://127.0.0.1:6379\"",
        "url = \"rediss://127.0.0.1:6379\"\ncluster = true\nurls = [\"redis://127.0.0.1:7001\"]",
    );
    let (key, message) = err_key(e);
    assert_eq!(key, "redis.urls[0]", "{message}");
    for url in ["unix:///tmp/r.sock", "redis://127.0.0.1:7000/3"] {
        let e = demo_with(
            "url = \"redis://127.0.0.1:6379\"",
            &format!("url = \"{url}\"\ncluster = true"),
        );
        let (key, message) = err_key(e);
        assert_eq!(key, "redis.url", "{url}: {message}");
    }
    for (lines, want_key) in [
        ("sentinel_master = \"m\"", "redis.urls"),
        ("urls = [\"redis://127.0.0.1:26379\"]", "redis.urls"),
        (
            "sentinel_master = \"m\"\nurls = [\"redis://:pw@127.0.0.1:26379\"]",
            "redis.urls[0]",
        ),
        (
            "sentinel_master = \"m\"\nurls = [\"unix:///tmp/s.sock\"]",
            "redis.urls[0]",
        ),
        (
            "cluster = true\nsentinel_master = \"m\"\nurls = [\"redis://127.0.0.1:26379\"]",
            "redis.cluster",
        ),
        ("username = \"a b\"", "redis.username"),
        (
            "password_file = \"/nonexistent/llm-worker-pw\"",
            "redis.password_file",
        ),
    ] {
        let (key, message) = err_key(demo_redis(lines));
        assert_eq!(key, want_key, "{lines}: {message}");
    }
}

#[test]
fn config_redis_password_file_is_read_once_and_never_printed() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("pw");
    std::fs::write(&f, "file-secret-93a1\n").unwrap();
    let c = demo_redis(&format!("password_file = \"{}\"", f.display())).expect("file");
    assert_eq!(
        c.redis.password.as_ref().map(Secret::expose),
        Some("file-secret-93a1")
    );
    assert!(!c.redacted_toml().contains("file-secret-93a1"));
    // The environment variable wins over the file.
    let text = DEMO.replacen(
        "password_env = \"REDIS_PASSWORD\"     # used when set and non-empty",
        &format!(
            "password_env = \"REDIS_PASSWORD\"\npassword_file = \"{}\"",
            f.display()
        ),
        1,
    );
    let c = Config::from_toml_str(&text, &env(&[("REDIS_PASSWORD", "env-pw")])).unwrap();
    assert_eq!(
        c.redis.password.as_ref().map(Secret::expose),
        Some("env-pw")
    );
    // A file of two lines is not a password.
    std::fs::write(&f, "a\nb\n").unwrap();
    let (key, _) = err_key(demo_redis(&format!("password_file = \"{}\"", f.display())));
    assert_eq!(key, "redis.password_file");
}
