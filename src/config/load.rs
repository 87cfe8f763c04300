//! Loading: the TOML file, then `LLM_WORKER__SECTION__KEY` environment overrides, into
//! a [`Config`] that is then validated; config-crate errors become [`ConfigError`]s
//! naming the dotted key (and the variable, when an override set it).

use super::{Config, ConfigError};

/// Where the config file is: `--config PATH`, else `$LLM_WORKER_CONFIG`, else `config/default.toml`.
pub fn resolve_path(
    cli: Option<&std::path::Path>,
    env: &std::collections::HashMap<String, String>,
) -> std::path::PathBuf {
    if let Some(p) = cli {
        return p.to_path_buf();
    }
    match env.get(CONFIG_PATH_ENV) {
        // An empty variable is "unset" (as `LLM_WORKER_CONFIG= llm-worker` usually means).
        Some(p) if !p.is_empty() => std::path::PathBuf::from(p),
        _ => std::path::PathBuf::from(DEFAULT_CONFIG_PATH),
    }
}

/// Environment variable naming the config file (not an override: it has a single `_`).
const CONFIG_PATH_ENV: &str = "LLM_WORKER_CONFIG";
const DEFAULT_CONFIG_PATH: &str = "config/default.toml";
/// Only variables with this prefix are overrides; the separator between levels is `__`.
const ENV_OVERRIDE_PREFIX: &str = "LLM_WORKER__";

/// Builds the layered config (file text, then `LLM_WORKER__` overrides), deserializes it
/// into [`Config`] and validates it. `origin` names the text in file-level errors.
pub(super) fn build(
    text: &str,
    origin: &str,
    env: &std::collections::HashMap<String, String>,
) -> Result<Config, ConfigError> {
    use config::{Environment, File, FileFormat};

    // Only real overrides go to the config crate: `LLM_WORKER_CONFIG` (the file path) and
    // unrelated variables must never become keys.
    let overrides: config::Map<String, String> = env
        .iter()
        .filter(|(k, _)| k.starts_with(ENV_OVERRIDE_PREFIX) && k.len() > ENV_OVERRIDE_PREFIX.len())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();

    let mut environment = Environment::with_prefix("LLM_WORKER")
        .separator("__")
        .try_parsing(true);
    // A route is a list; from the environment it is written comma-separated
    // (`LLM_WORKER__ROUTES__DEFAULT=a,b`). Only those keys are split, so a comma in any
    // other value (a URL, say) stays as written. The config crate lowercases env keys
    // before comparing, hence the lowercase here.
    let route_prefix = format!("{ENV_OVERRIDE_PREFIX}ROUTES__");
    let mut route_keys: Vec<String> = overrides
        .keys()
        .filter_map(|k| k.strip_prefix(&route_prefix))
        .map(|name| format!("routes.{}", name.to_lowercase()))
        .collect();
    // `redis.urls` (Sentinels, cluster seeds) is a list too: `LLM_WORKER__REDIS__URLS=a,b`.
    if overrides.contains_key(&format!("{ENV_OVERRIDE_PREFIX}REDIS__URLS")) {
        route_keys.push("redis.urls".into());
    }
    if !route_keys.is_empty() {
        environment = environment.list_separator(",");
        for key in &route_keys {
            environment = environment.with_list_parse_key(key);
        }
    }
    let environment = environment.source(Some(overrides));

    let layered = config::Config::builder()
        .add_source(File::from_str(text, FileFormat::Toml))
        .add_source(environment)
        .build()
        .map_err(|e| from_config_error(e, origin, env))?;
    let mut cfg: Config = layered
        .try_deserialize()
        .map_err(|e| from_config_error(e, origin, env))?;
    cfg.validate(env).map_err(|e| with_env_source(e, env))?;
    Ok(cfg)
}

/// Turns the config crate's error into ours with the dotted key of the offending value.
///
/// The config crate records where a value error happened (`Type`/`At` with `key`), but
/// serde's "unknown field `x`" is raised while reading the *parent* table, so its key is
/// the parent (`queue`) or absent (top level): the field name is appended here so that
/// the key is the one the operator wrote (`queue.bogus`).
fn from_config_error(
    e: config::ConfigError,
    origin: &str,
    env: &std::collections::HashMap<String, String>,
) -> ConfigError {
    let err = match e {
        config::ConfigError::Type {
            unexpected,
            expected,
            key,
            ..
        } => ConfigError::invalid(
            key.unwrap_or_default(),
            format!("invalid type: {unexpected}, expected {expected}"),
        ),
        config::ConfigError::At { error, key, .. } => {
            let (key, message) = key_and_message(key.unwrap_or_default(), &error.to_string());
            ConfigError::invalid(key, message)
        }
        config::ConfigError::Message(m) => {
            let (key, message) = key_and_message(String::new(), &m);
            ConfigError::invalid(key, message)
        }
        config::ConfigError::NotFound(key) => ConfigError::invalid(key, "missing value"),
        config::ConfigError::FileParse { cause, .. } => ConfigError::File {
            path: origin.to_string(),
            message: format!("not valid TOML: {cause}"),
        },
        other => ConfigError::invalid("", other.to_string()),
    };
    with_env_source(err, env)
}

/// Appends "(set by LLM_WORKER__A__B)" when the offending key came from an override, so
/// an operator who never wrote `a.b` in the file knows where to look.
fn with_env_source(
    err: ConfigError,
    env: &std::collections::HashMap<String, String>,
) -> ConfigError {
    let ConfigError::Invalid { key, message } = err else {
        return err;
    };
    let var = env.keys().find(|k| {
        k.strip_prefix(ENV_OVERRIDE_PREFIX)
            .is_some_and(|rest| rest.to_lowercase().replace("__", ".") == key)
    });
    match var {
        Some(var) => ConfigError::invalid(key, format!("{message} (set by {var})")),
        None => ConfigError::Invalid { key, message },
    }
}

/// Splits serde's "unknown field `x`, expected ..." / "missing field `x`" into the full
/// key (`parent.x`) and a message in config terms; other messages keep `parent` as key.
///
/// Counts that must be >= 1 are `NonZero*` fields, so serde rejects a zero with "invalid
/// value: integer `0`, expected a nonzero u32"; that becomes "must be at least 1, got 0".
fn key_and_message(parent: String, message: &str) -> (String, String) {
    if message.contains("expected a nonzero") {
        return (parent, "must be at least 1, got 0".to_string());
    }
    let join = |field: &str| {
        if parent.is_empty() {
            field.to_string()
        } else {
            format!("{parent}.{field}")
        }
    };
    for (marker, what) in [
        ("unknown field `", "unknown key"),
        ("missing field `", "missing key"),
    ] {
        if let Some(rest) = message.strip_prefix(marker)
            && let Some((field, tail)) = rest.split_once('`')
        {
            // serde: "unknown field `x`, expected one of `a`, `b`" / "..., there are no fields"
            let tail = tail.trim_start_matches(',').trim();
            let message = if tail.is_empty() {
                what.to_string()
            } else {
                format!("{what} ({tail})")
            };
            return (join(field), message);
        }
    }
    (parent, message.to_string())
}
