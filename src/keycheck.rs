//! API key validation at start (`run`, `check-config`): `GET {base_url}/models` with each
//! provider's key, so a rejected key stops the worker with exit 2 instead of failing
//! every job, and models the key cannot see are left out of routing.
//!
//! Invariants: bounded (`CHECK_TIMEOUT` per provider); only a 401/403 answer is fatal (a
//! provider that is down, slow, or has no `/models` endpoint does not stop a worker: it
//! is logged and its models stay in routing); the key never appears in a message.

use crate::config::Config;
use std::collections::BTreeSet;
use std::time::Duration;

/// Longest wait for one provider's `GET /models`.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// What the check found for one provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// The key works; these configured models (table keys) are not in the list.
    Ok { visible: usize, unseen: Vec<String> },
    /// Not checked (`validate_key = false`, or no model uses the provider).
    Skipped,
    /// No usable answer (down, timeout, no endpoint, an empty list): routing unchanged.
    Unknown(String),
}

impl Found {
    /// One line for `status` (never the key).
    pub fn summary(&self) -> String {
        match self {
            Found::Ok { visible, unseen } if unseen.is_empty() => {
                format!("ok: key accepted, {visible} models listed")
            }
            Found::Ok { visible, unseen } => format!(
                "ok: key accepted, {visible} models listed; cannot see {} (left out of routing)",
                unseen.join(", ")
            ),
            Found::Skipped => "not checked (validate_key = false, or no model uses it)".into(),
            Found::Unknown(why) => format!("unknown: {why}; its models stay in routing"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error(
        "providers.{provider}: the API key was rejected ({status} at GET {url}); fix the key in {env} (or set providers.{provider}.validate_key = false to skip this check)"
    )]
    Rejected {
        provider: String,
        status: u16,
        url: String,
        env: String,
    },
}

/// Checks every provider that a model uses and has `validate_key` on. Returns what was
/// found per provider; `Err` on the first rejected key.
pub async fn check(cfg: &Config) -> Result<Vec<(String, Found)>, KeyError> {
    let mut out = vec![];
    for (name, p) in &cfg.providers {
        let models: Vec<(&String, String)> = cfg
            .models
            .iter()
            .filter(|(_, m)| &m.provider == name)
            .map(|(k, _)| (k, cfg.upstream_name(k).to_string()))
            .collect();
        if !p.validate_key || models.is_empty() {
            out.push((name.clone(), Found::Skipped));
            continue;
        }
        let url = format!("{}/models", p.base_url.trim_end_matches('/'));
        let client = match crate::provider::http_client()
            .timeout(CHECK_TIMEOUT)
            .build()
        {
            Ok(c) => c,
            Err(e) => {
                out.push((name.clone(), Found::Unknown(format!("no HTTP client: {e}"))));
                continue;
            }
        };
        let mut req = client.get(&url);
        if let Some(key) = &p.api_key {
            req = req.bearer_auth(key.expose());
        }
        let found = match req.send().await {
            Err(e) => Found::Unknown(format!("GET {url}: {e}")),
            Ok(resp) if matches!(resp.status().as_u16(), 401 | 403) => {
                return Err(KeyError::Rejected {
                    provider: name.clone(),
                    status: resp.status().as_u16(),
                    url,
                    env: if p.api_key_env.is_empty() {
                        "the provider's api_key_env".into()
                    } else {
                        p.api_key_env.clone()
                    },
                });
            }
            Ok(resp) if !resp.status().is_success() => {
                Found::Unknown(format!("GET {url} answered {}", resp.status()))
            }
            Ok(resp) => match resp.json::<serde_json::Value>().await {
                Err(e) => Found::Unknown(format!("GET {url}: not JSON: {e}")),
                Ok(v) => {
                    // Providers spell ids differently (`models/gemini-2.5-flash`,
                    // `openai/gpt-4.1`): compare the last path segment.
                    let ids: BTreeSet<&str> = v["data"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|m| m["id"].as_str())
                        .map(last_segment)
                        .collect();
                    if ids.is_empty() {
                        Found::Unknown(format!("GET {url} listed no model"))
                    } else if v["has_more"].as_bool() == Some(true) {
                        // One page of a longer list: absence from it proves nothing.
                        Found::Unknown(format!("GET {url} answered one page of a longer list"))
                    } else {
                        Found::Ok {
                            visible: ids.len(),
                            unseen: models
                                .iter()
                                .filter(|(_, up)| !ids.contains(last_segment(up)))
                                .map(|(k, _)| (*k).clone())
                                .collect(),
                        }
                    }
                }
            },
        };
        out.push((name.clone(), found));
    }
    Ok(out)
}

fn last_segment(id: &str) -> &str {
    id.rsplit('/').next().unwrap_or(id)
}

/// Logs what [`check`] found and returns the models to leave out of routing.
pub fn unseen_models(found: &[(String, Found)]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (provider, f) in found {
        match f {
            Found::Ok { visible, unseen } => {
                if unseen.is_empty() {
                    tracing::info!(provider = %provider, visible, "API key ok");
                } else {
                    tracing::warn!(provider = %provider, visible, unseen = ?unseen, "API key ok, but it cannot see these models: left out of routing");
                }
                out.extend(unseen.iter().cloned());
            }
            Found::Skipped => {}
            Found::Unknown(why) => {
                tracing::warn!(provider = %provider, reason = %why, "API key not checked; its models stay in routing");
            }
        }
    }
    out
}
