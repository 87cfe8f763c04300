//! The operator tools for jobs that did not end `ok`: dead letters (`{ns}:dead`: invalid
//! payloads, poison jobs) and the copies of failed jobs (`{ns}:failed`): list, show,
//! replay, purge by age; `retry ID`; and `purge` of a whole namespace.
//!
//! Invariant: a replay re-enqueues a letter and deletes it in one script that does nothing
//! when the letter is gone (`lua/replay.lua`), so a letter is pushed at most once; a job is
//! never both still a letter and pushed again by the same replay; a replay keeps the job's
//! `id` unless asked (`--new-id`), so an id that meanwhile ended `ok` is answered as a
//! duplicate rather than paid again.

use crate::config::Config;
use crate::connect::{ConnectError, master_connection};
use crate::queue::{DeadLetter, Entries, Keys, QueueError, StreamEntry, WireError};
use serde_json::Value;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum LetterError {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error("redis: {0} (is Redis running at redis.url?)")]
    Redis(redis::RedisError),
    #[error("{0}")]
    Input(String),
}

from_cause!(LetterError, LetterError::Redis, redis::RedisError);

/// Which stream of letters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// `{ns}:dead`: invalid payloads and jobs delivered too many times.
    Dead,
    /// `{ns}:failed`: copies of jobs that ended `failed`, kept for a retry.
    Failed,
}

impl Which {
    fn key(self, keys: &Keys) -> &str {
        match self {
            Which::Dead => &keys.dead,
            Which::Failed => &keys.failed,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Which::Dead => "dead",
            Which::Failed => "failed",
        }
    }
}

/// One letter: where it is and what it holds.
#[derive(Debug, Clone)]
pub struct Letter {
    pub entry: String,
    pub which: Which,
    pub letter: DeadLetter,
}

impl Letter {
    /// The original `payload` field, if the job entry had one.
    pub fn payload(&self) -> Option<&[u8]> {
        self.letter
            .original()
            .iter()
            .find(|(k, _)| k.as_slice() == b"payload")
            .map(|(_, v)| v.as_slice())
    }

    /// When the letter was written (ms, from its entry id).
    pub fn at_ms(&self) -> u64 {
        entry_ms(&self.entry)
    }
}

fn entry_ms(id: &str) -> u64 {
    id.split('-')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0)
}

fn decode(e: StreamEntry, which: Which) -> Result<Letter, WireError> {
    let fields = e.fields.unwrap_or_default();
    Ok(Letter {
        entry: e.id,
        which,
        letter: DeadLetter::from_fields(&fields)?,
    })
}

async fn conn(cfg: &Config) -> Result<redis::aio::MultiplexedConnection, LetterError> {
    Ok(master_connection(cfg, Some(Duration::from_secs(5))).await?)
}

/// The newest `count` letters of `which`, newest first. Entries that do not decode (not
/// written by llm-worker) are skipped and counted in the second value.
pub async fn list(
    cfg: &Config,
    which: Which,
    count: usize,
) -> Result<(Vec<Letter>, usize), LetterError> {
    let keys = Keys::new(&cfg.queue.namespace);
    let mut c = conn(cfg).await?;
    let got: Entries = redis::cmd("XREVRANGE")
        .arg(which.key(&keys))
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(count)
        .query_async(&mut c)
        .await?;
    let mut bad = 0;
    let letters = got
        .0
        .into_iter()
        .filter_map(|e| decode(e, which).map_err(|_| bad += 1).ok())
        .collect();
    Ok((letters, bad))
}

/// The newest letter of each job among `letters` (a failed id pushed again can have
/// several copies; replaying them all would run it several times).
pub fn newest_per_job(letters: Vec<Letter>) -> Vec<Letter> {
    let mut best: std::collections::HashMap<String, Letter> = std::collections::HashMap::new();
    for l in letters {
        let key = l
            .letter
            .job_id
            .clone()
            .unwrap_or_else(|| l.letter.job_entry.clone());
        match best.get(&key) {
            Some(b) if b.entry >= l.entry && b.at_ms() >= l.at_ms() => {}
            _ => {
                best.insert(key, l);
            }
        }
    }
    let mut out: Vec<Letter> = best.into_values().collect();
    out.sort_by_key(|l| std::cmp::Reverse(l.at_ms()));
    out
}

/// Up to `count` letters of `which` from the oldest, none newer than `upto` (an entry
/// id): `dead replay --all` takes the letters there were when it started, page by page,
/// never the ones written since (its own replays failing again).
pub async fn oldest_upto(
    cfg: &Config,
    which: Which,
    upto: &str,
    count: usize,
) -> Result<Vec<Letter>, LetterError> {
    let keys = Keys::new(&cfg.queue.namespace);
    let mut c = conn(cfg).await?;
    let got: Entries = redis::cmd("XRANGE")
        .arg(which.key(&keys))
        .arg("-")
        .arg(upto)
        .arg("COUNT")
        .arg(count)
        .query_async(&mut c)
        .await?;
    Ok(got
        .0
        .into_iter()
        .filter_map(|e| decode(e, which).ok())
        .collect())
}

/// Every letter of `which` matching `id` (its own entry id, its job id or its job's entry
/// id), newest first, read in pages of 1000 from the newest.
pub async fn find(cfg: &Config, which: Which, id: &str) -> Result<Vec<Letter>, LetterError> {
    let keys = Keys::new(&cfg.queue.namespace);
    let mut c = conn(cfg).await?;
    let mut found = vec![];
    let mut end = "+".to_string();
    loop {
        let page: Entries = redis::cmd("XREVRANGE")
            .arg(which.key(&keys))
            .arg(&end)
            .arg("-")
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut c)
            .await?;
        let n = page.0.len();
        if let Some(last) = page.0.last() {
            end = format!("({}", last.id);
        }
        for e in page.0 {
            let Ok(l) = decode(e, which) else { continue };
            if l.entry == id || l.letter.job_id.as_deref() == Some(id) || l.letter.job_entry == id {
                found.push(l);
            }
        }
        if n < 1000 {
            break;
        }
    }
    Ok(found)
}

/// How a replayed job is changed.
#[derive(Debug, Clone, Default)]
pub struct Replay {
    /// Run it on this route instead (`route` field set).
    pub route: Option<String>,
    /// Give it a new id (`<old id>.retry-<unix ms>`), so it runs even if its id meanwhile
    /// has an `ok` result.
    pub new_id: bool,
}

/// The payload to push again for `l`, changed as `how` says. Errors name the letter.
fn replay_payload(l: &Letter, how: &Replay) -> Result<Vec<u8>, LetterError> {
    let Some(raw) = l.payload() else {
        return Err(LetterError::Input(format!(
            "letter {} has no payload field: nothing to replay",
            l.entry
        )));
    };
    if how.route.is_none() && !how.new_id {
        return Ok(raw.to_vec());
    }
    let mut v: serde_json::Map<String, Value> = serde_json::from_slice(raw).map_err(|e| {
        LetterError::Input(format!(
            "letter {}: the payload is not a JSON object ({e}), so --route / --new-id cannot change it; replay it without them",
            l.entry
        ))
    })?;
    if let Some(r) = &how.route {
        v.insert("route".into(), Value::String(r.clone()));
    }
    if how.new_id {
        let old = l
            .letter
            .job_id
            .clone()
            .unwrap_or_else(|| l.letter.job_entry.clone());
        let id = format!("{old}.retry-{}", crate::cost::unix_now_ms());
        v.insert("id".into(), Value::String(id));
    }
    Ok(serde_json::to_vec(&v).unwrap_or_else(|_| raw.to_vec()))
}

/// Re-enqueues each letter (as changed by `how`) and deletes it, each in one script
/// (`lua/replay.lua`) that does nothing if the letter is gone (another replay took it);
/// also clears the cancel marker of its id (a replay is a new request to run it).
/// Returns (letter entry, new job entry) per letter pushed. Stops at the first that cannot
/// be replayed (the ones before it are done).
pub async fn replay(
    cfg: &Config,
    letters: &[Letter],
    how: &Replay,
) -> Result<Vec<(String, String)>, LetterError> {
    if let Some(r) = &how.route
        && !cfg.routes.contains_key(r)
    {
        return Err(LetterError::Input(format!(
            "--route {r:?} is not a route of [routes] ({})",
            cfg.routes.keys().cloned().collect::<Vec<_>>().join(", ")
        )));
    }
    let keys = Keys::new(&cfg.queue.namespace);
    let mut c = conn(cfg).await?;
    let mut done = vec![];
    for l in letters {
        let payload = replay_payload(l, how)?;
        // A job without an id has no cancel marker to clear: a key under the letter's
        // own entry id, which no cancel ever sets, stands in.
        let cancel = match &l.letter.job_id {
            Some(id) => keys.cancel(id),
            None => format!("{}:replay-none:{}", keys.prefix, l.entry),
        };
        let new: Option<String> = crate::scripts::Call::new(&crate::scripts::REPLAY)
            .key(l.which.key(&keys))
            .key(&keys.jobs)
            .key(cancel)
            .arg(&l.entry)
            .arg(payload)
            .invoke(&mut c)
            .await?;
        if let Some(new) = new {
            done.push((l.entry.clone(), new));
        }
    }
    Ok(done)
}

/// `dead replay --all`: the letters of `which` there are now, oldest first, page by page
/// (replayed letters are deleted, so each page is the next), never those written while
/// this runs (its own replays, failing again). A letter seen already (left by a replay
/// that did nothing) ends the loop. Returns what [`replay`] returns, for all of them.
pub async fn replay_all(
    cfg: &Config,
    which: Which,
    how: &Replay,
) -> Result<Vec<(String, String)>, LetterError> {
    let (newest, _) = list(cfg, which, 1).await?;
    let Some(upto) = newest.first().map(|l| l.entry.clone()) else {
        return Ok(vec![]);
    };
    let mut seen = std::collections::HashSet::new();
    let mut every = vec![];
    loop {
        let page: Vec<Letter> = oldest_upto(cfg, which, &upto, 500)
            .await?
            .into_iter()
            .filter(|l| seen.insert(l.entry.clone()))
            .collect();
        if page.is_empty() {
            return Ok(every);
        }
        every.extend(replay(cfg, &page, how).await?);
    }
}

/// Deletes the letters of `which` older than `older` (XTRIM MINID). Returns how many.
pub async fn purge_older(cfg: &Config, which: Which, older: Duration) -> Result<u64, LetterError> {
    let keys = Keys::new(&cfg.queue.namespace);
    let mut c = conn(cfg).await?;
    let cutoff = crate::cost::unix_now_ms().saturating_sub(older.as_millis() as u64);
    let n: u64 = redis::cmd("XTRIM")
        .arg(which.key(&keys))
        .arg("MINID")
        .arg(cutoff)
        .query_async(&mut c)
        .await?;
    Ok(n)
}

/// What `retry ID` did.
#[derive(Debug)]
pub enum Retried {
    /// Pushed again from this letter, as this new job entry.
    Pushed { letter: Letter, new_entry: String },
    /// The id already has an `ok` result: nothing to retry.
    AlreadyOk,
    /// A copy of the id is running now (its in-progress marker): retrying would run it
    /// twice if that one fails.
    Running,
}

/// Re-runs job `id` from its newest letter (dead or failed copy), keeping its id.
pub async fn retry(cfg: &Config, id: &str) -> Result<Retried, LetterError> {
    let keys = Keys::new(&cfg.queue.namespace);
    let mut c = conn(cfg).await?;
    let marker: Option<String> = redis::cmd("GET")
        .arg(keys.done(id))
        .query_async(&mut c)
        .await?;
    if marker.is_some_and(|m| crate::queue::marker_status(&m) == "ok") {
        return Ok(Retried::AlreadyOk);
    }
    let running: bool = redis::cmd("EXISTS")
        .arg(keys.inflight(id))
        .query_async(&mut c)
        .await?;
    if running {
        return Ok(Retried::Running);
    }
    let mut all = find(cfg, Which::Failed, id).await?;
    all.extend(find(cfg, Which::Dead, id).await?);
    let Some(newest) = all.into_iter().max_by_key(|l| l.at_ms()) else {
        return Err(LetterError::Input(format!(
            "no copy of job {id:?} in {} or {} (trimmed, purged, or it never failed): push it again (an id whose last result was not ok runs again)",
            keys.failed, keys.dead
        )));
    };
    let new = replay(cfg, std::slice::from_ref(&newest), &Replay::default()).await?;
    Ok(Retried::Pushed {
        letter: newest,
        new_entry: new.into_iter().next().map(|(_, n)| n).unwrap_or_default(),
    })
}

/// Consumers of the group seen within this long count as running workers for `purge`.
pub const LIVE_CONSUMER: Duration = Duration::from_secs(60);

/// Every key of the namespace (`{ns}:*`, SCAN), and the consumers of the group active
/// within [`LIVE_CONSUMER`] (by name).
pub async fn namespace_keys(cfg: &Config) -> Result<(Vec<String>, Vec<String>), LetterError> {
    let keys = Keys::new(&cfg.queue.namespace);
    let mut c = conn(cfg).await?;
    let pattern = format!("{}:*", glob_escape(&keys.prefix));
    let found = crate::connect::scan_match(&mut c, &pattern).await?;
    let consumers: redis::RedisResult<Vec<std::collections::HashMap<String, redis::Value>>> =
        redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(&keys.jobs)
            .arg(&cfg.queue.group)
            .query_async(&mut c)
            .await;
    let live = consumers
        .unwrap_or_default()
        .into_iter()
        .filter(|m| {
            let idle = m
                .get("idle")
                .and_then(|v| redis::from_redis_value::<u64>(v.clone()).ok());
            idle.is_some_and(|i| i < LIVE_CONSUMER.as_millis() as u64)
        })
        .filter_map(|m| {
            m.get("name")
                .and_then(|v| redis::from_redis_value::<String>(v.clone()).ok())
        })
        .collect();
    Ok((found, live))
}

/// Deletes `keys` (UNLINK, 500 at a time). Returns how many existed.
pub async fn delete_keys(cfg: &Config, keys: &[String]) -> Result<u64, LetterError> {
    let mut c = conn(cfg).await?;
    let mut n = 0;
    for chunk in keys.chunks(500) {
        let got: u64 = redis::cmd("UNLINK").arg(chunk).query_async(&mut c).await?;
        n += got;
    }
    Ok(n)
}

/// `s` with Redis glob's special characters escaped.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        if matches!(ch, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_specials_are_escaped() {
        assert_eq!(glob_escape("{a*b?[c]\\}"), "{a\\*b\\?\\[c\\]\\\\}");
    }

    #[test]
    fn replay_changes_only_what_it_is_asked_to() {
        let letter = DeadLetter::new(
            "1-0",
            Some("j1"),
            "failed: 503",
            1,
            vec![(
                b"payload".to_vec(),
                br#"{"id":"j1","messages":[]}"#.to_vec(),
            )],
        );
        let l = Letter {
            entry: "5-0".into(),
            which: Which::Failed,
            letter,
        };
        assert_eq!(
            replay_payload(&l, &Replay::default()).unwrap(),
            br#"{"id":"j1","messages":[]}"#.to_vec()
        );
        let changed = replay_payload(
            &l,
            &Replay {
                route: Some("quality".into()),
                new_id: true,
            },
        )
        .unwrap();
        let v: Value = serde_json::from_slice(&changed).unwrap();
        assert_eq!(v["route"], "quality");
        assert!(v["id"].as_str().unwrap().starts_with("j1.retry-"));
    }
}
