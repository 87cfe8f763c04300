//! Shared by the fuzz targets: the config they validate against and the reason check.
//! Same config and invariants as tests/fuzz_props.rs.
#![allow(dead_code)]

use llm_worker::config::Config;
use std::collections::HashMap;
use std::sync::LazyLock;

pub const CONFIG: &str = r#"
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

pub static CFG: LazyLock<Config> =
    LazyLock::new(|| Config::from_toml_str(CONFIG, &HashMap::new()).expect("fuzz config"));

/// A reason is one non-empty line of at most `max_chars` characters.
pub fn assert_one_line(what: &str, msg: &str, max_chars: usize) {
    assert!(!msg.trim().is_empty(), "{what}: empty reason");
    assert!(
        !msg.chars()
            .any(|c| matches!(c, '\n' | '\r' | '\u{85}' | '\u{2028}' | '\u{2029}')),
        "{what}: reason is not one line: {msg:?}"
    );
    assert!(
        msg.chars().count() <= max_chars,
        "{what}: reason has {} chars",
        msg.chars().count()
    );
}
