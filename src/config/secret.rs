//! `Secret` and the one Redis URL parser/redactor: the only places a password can be
//! read from or masked in a URL.

use serde::Serialize;

/// A secret value (API key, password). Never printed.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    /// The only way to read the secret: call sites are easy to audit.
    pub fn expose(&self) -> &str {
        &self.0
    }
}
impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}
impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}
impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("[redacted]")
    }
}

/// A `redis.url` split in two: the URL without its password (safe to print, and what
/// [`Config`] keeps in `redis.url`) and the password, percent-decoded, as a [`Secret`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitRedisUrl {
    /// The URL as written, minus the password (`redis://user@host:6379/0`,
    /// `unix:///run/redis.sock?db=2`). Connecting with it plus `password` is the same as
    /// connecting with the original URL.
    pub url: String,
    /// From `redis://user:PASSWORD@host` or `unix:///path?pass=PASSWORD`.
    pub password: Option<Secret>,
}

/// The URL forms accepted in `redis.url`, for error messages (no values echoed: a URL that
/// does not parse cannot be redacted reliably).
const REDIS_URL_FORMS: &str = "redis://[user[:password]@]host[:port][/db], \
     rediss://...[#insecure], unix:///path/to/redis.sock[?db=N&user=U&pass=P]";

/// Parses a Redis URL with the rules redis-rs applies (`redis::IntoConnectionInfo` for
/// `&str`), so that a URL accepted here fails at connect time only for network reasons,
/// never for its syntax; and splits off the password.
///
/// Rules mirrored: scheme `redis`, `rediss`, `unix` or `redis+unix`; TCP: a host that is
/// not a wildcard address, a numeric port, a numeric database as the path, a UTF-8
/// user and password after percent-decoding, `#insecure` as the only fragment of
/// `rediss://`; unix: a socket path, `db` numeric; both: `protocol` one of 2, resp2, 3,
/// resp3. Stricter than redis-rs where it ignores a password silently (a `?pass=` on a
/// TCP URL, a `user:pass@` on a unix URL): those are errors rather than a connection
/// without the password the operator meant to send.
pub fn split_redis_url(raw: &str) -> Result<SplitRedisUrl, String> {
    let mut u = url::Url::parse(raw)
        .map_err(|e| format!("not a valid Redis URL ({e}); expected {REDIS_URL_FORMS}"))?;
    let query: Vec<(String, String)> = u
        .query_pairs()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    // redis-rs collects the query into a map: the last value of a name wins.
    let param = |name: &str| {
        query
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    if let Some(p) = param("protocol")
        && !matches!(p, "2" | "resp2" | "3" | "resp3")
    {
        return Err(format!(
            "query parameter protocol={p:?} is not one of 2, resp2, 3, resp3"
        ));
    }
    let decode = |what: &str, s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|c| c.into_owned())
            .map_err(|_| format!("the {what} is not valid UTF-8 after percent-decoding"))
    };
    match u.scheme() {
        "redis" | "rediss" => {
            let host = match u.host() {
                Some(url::Host::Domain(d)) => d.to_string(),
                Some(url::Host::Ipv4(a)) => a.to_string(),
                Some(url::Host::Ipv6(a)) => a.to_string(),
                None => return Err(format!("has no host; expected {REDIS_URL_FORMS}")),
            };
            if host == "0.0.0.0" || host == "::" {
                return Err(format!(
                    "host {host} is a wildcard address; name the server to connect to"
                ));
            }
            let db = u.path().trim_matches('/');
            if !db.is_empty() && db.parse::<i64>().is_err() {
                return Err(format!(
                    "database {db:?} (the path) is not a number; write redis://host:port/<db>, e.g. /0"
                ));
            }
            if u.scheme() == "rediss" && !matches!(u.fragment(), None | Some("insecure")) {
                return Err("the only fragment rediss:// accepts is #insecure".into());
            }
            if param("pass").is_some() || param("password").is_some() {
                return Err(
                    "a password in the query is ignored by redis://; write redis://:PASSWORD@host or use redis.password_env"
                        .into(),
                );
            }
            decode("user name", u.username())?;
            let password = match u.password() {
                Some(p) => Some(Secret::new(decode("password", p)?)),
                None => None,
            };
            if password.is_some() && u.set_password(None).is_err() {
                return Err("cannot remove the password from the URL".into());
            }
            Ok(SplitRedisUrl {
                url: u.to_string(),
                password,
            })
        }
        "unix" | "redis+unix" => {
            if u.to_file_path().is_err() {
                return Err(format!(
                    "has no absolute socket path; expected {REDIS_URL_FORMS}"
                ));
            }
            if u.password().is_some() || !u.username().is_empty() {
                return Err(
                    "a unix:// URL takes its user and password as ?user=U&pass=P, not before an @"
                        .into(),
                );
            }
            if let Some(db) = param("db")
                && db.parse::<i64>().is_err()
            {
                return Err(format!(
                    "query parameter db={db:?} is not a number; write ?db=0"
                ));
            }
            let password = param("pass").map(Secret::new);
            let kept: Vec<&(String, String)> = query.iter().filter(|(k, _)| k != "pass").collect();
            if kept.len() != query.len() {
                if kept.is_empty() {
                    u.set_query(None);
                } else {
                    u.query_pairs_mut().clear().extend_pairs(kept);
                }
            }
            Ok(SplitRedisUrl {
                url: u.to_string(),
                password,
            })
        }
        other => Err(format!(
            "scheme {other}:// is not one of redis://, rediss://, unix://, redis+unix://"
        )),
    }
}

/// The one URL redactor: any URL -> the same URL with every password replaced by
/// `[redacted]` (the userinfo password, and `pass`/`password` query parameters as
/// `unix://` URLs carry them). For logs and output (`check-config`, `status`, the
/// start-up error, the demo).
///
/// Invariant: the result never contains a password of `url`. A text that does not parse
/// as a URL is not echoed at all (its password could sit anywhere in it).
pub fn redact_url(url: &str) -> String {
    // A marker that survives URL serialisation unescaped, swapped for `[redacted]` at the
    // end (brackets would be percent-encoded in userinfo and query).
    const MARK: &str = "REDACTEDx9q7MARK";
    let Ok(mut u) = url::Url::parse(url) else {
        return "[a URL that does not parse; not shown]".to_string();
    };
    if u.password().is_some() && u.set_password(Some(MARK)).is_err() {
        return "[a URL whose password cannot be masked; not shown]".to_string();
    }
    let secret_param = |k: &str| {
        let k = k.to_ascii_lowercase();
        k == "pass" || k == "password"
    };
    if u.query_pairs().any(|(k, _)| secret_param(&k)) {
        let pairs: Vec<(String, String)> = u
            .query_pairs()
            .map(|(k, v)| {
                let v = if secret_param(&k) {
                    MARK.to_string()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        u.query_pairs_mut().clear().extend_pairs(pairs);
    }
    u.to_string().replace(MARK, "[redacted]")
}
