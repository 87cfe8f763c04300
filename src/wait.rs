//! `enqueue --wait`: push jobs, then block until every one has its result.
//!
//! Invariant: no result is missed, however fast the worker: the position in the results
//! stream is taken *before* the first XADD, and results are read from there on. A job
//! is matched by its `id`, or, without one, by its entry id (which is then its job id).

use crate::config::Config;
use crate::connect::{blocking_connection, master_connection, stream_end};
use crate::queue::{Keys, ReadReply, ResultEntry};
use crate::tools::ToolError;
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

/// What became of each pushed job, in input order.
#[derive(Debug)]
pub struct Waited {
    /// (job id, its result if it arrived in time).
    pub jobs: Vec<(String, Option<ResultEntry>)>,
    /// The wait ended by the timeout with results missing.
    pub timed_out: bool,
}

/// Pushes `payloads` and waits (up to `timeout`, if any) for each one's result.
/// `progress(done, total)` is called as results arrive.
pub async fn enqueue_and_wait(
    cfg: &Config,
    payloads: &[String],
    timeout: Option<Duration>,
    mut progress: impl FnMut(usize, usize),
) -> Result<Waited, ToolError> {
    let keys = Keys::new(&cfg.queue.namespace);
    let mut c = master_connection(cfg, Some(Duration::from_secs(5))).await?;
    // Where the results stream ends now (before any push).
    let mut last = stream_end(&mut c, &keys.results).await?;
    let entries = crate::tools::push_payloads(&mut c, &keys, payloads).await?;
    // The job id the worker will write: the payload's own `id` (read as the worker reads
    // it), else the entry id.
    let ids: Vec<String> = payloads
        .iter()
        .zip(entries)
        .map(|(p, entry)| crate::job::salvage_id(Some(p.as_bytes())).unwrap_or(entry))
        .collect();
    let mut wanted: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, id) in ids.iter().enumerate() {
        wanted.entry(id.as_str()).or_default().push(i);
    }
    let mut got: Vec<Option<ResultEntry>> = vec![None; ids.len()];
    let mut done = 0;
    progress(0, ids.len());
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut bc = Some(blocking_connection(cfg).await?);
    let mut warned = false;
    while done < ids.len() {
        let block = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                left.min(Duration::from_secs(1))
            }
            None => Duration::from_secs(1),
        };
        // Each read is bounded (the blocking connection has no reply timeout of its own):
        // a Redis that hangs or is cut off ends this read, the connection is made again
        // (reading on from `last`, so nothing is missed) and the wait still ends by its
        // timeout, not when TCP gives up.
        let read = match bc.as_mut() {
            Some(c) => {
                let mut cmd = redis::cmd("XREAD");
                cmd.arg("COUNT")
                    .arg(500)
                    .arg("BLOCK")
                    .arg(block.as_millis().max(1) as u64)
                    .arg("STREAMS")
                    .arg(&keys.results)
                    .arg(&last);
                let bound = block + Duration::from_secs(2);
                match tokio::time::timeout(bound, cmd.query_async::<ReadReply>(c)).await {
                    Ok(Ok(r)) => Some(r),
                    // What heals by itself (IO, LOADING after a restart, MOVED / ASK /
                    // TRYAGAIN while a cluster slot moves, a failover): read again on a
                    // fresh connection. Anything else (a wrong type) is the user's to fix.
                    Ok(Err(e)) if !crate::queue::redis_error_heals(&e) => {
                        return Err(e.into());
                    }
                    Ok(Err(e)) => {
                        lost(&mut warned, &e.to_string());
                        None
                    }
                    Err(_) => {
                        lost(&mut warned, &format!("no reply within {bound:?}"));
                        None
                    }
                }
            }
            None => {
                // Reconnect (bounded by 3 s), at most once a second.
                match blocking_connection(cfg).await {
                    Ok(c) => {
                        bc = Some(c);
                        warned = false;
                        continue;
                    }
                    Err(e) => {
                        lost(&mut warned, &e.to_string());
                        tokio::time::sleep(Duration::from_secs(1).min(block)).await;
                        continue;
                    }
                }
            }
        };
        let Some(read) = read else {
            bc = None;
            continue;
        };
        for e in read.0 {
            last = e.id.clone();
            let fields = e.fields.unwrap_or_default();
            let Ok(r) = ResultEntry::from_fields(
                fields.iter().map(|(k, v)| (String::from_utf8_lossy(k), v)),
            ) else {
                continue;
            };
            if let Some(slots) = wanted.get(r.job_id.as_str()) {
                for &i in slots {
                    if got[i].is_none() {
                        got[i] = Some(r.clone());
                        done += 1;
                    }
                }
                progress(done, ids.len());
            }
        }
    }
    let timed_out = done < ids.len();
    Ok(Waited {
        jobs: ids.into_iter().zip(got).collect(),
        timed_out,
    })
}

/// Says once per outage that the results cannot be read now (the wait goes on).
fn lost(warned: &mut bool, why: &str) {
    if !std::mem::replace(warned, true) {
        tracing::warn!(error = %why, "results not readable from Redis now; reconnecting (the wait goes on until --timeout)");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_payload_id_is_its_id_field_text_or_number() {
        // The worker's own reading of a payload's id (also what `enqueue --wait` matches).
        let payload_id = |p: &str| crate::job::salvage_id(Some(p.as_bytes()));
        assert_eq!(
            payload_id(r#"{"id":"a","messages":[]}"#).as_deref(),
            Some("a")
        );
        assert_eq!(payload_id(r#"{"id":7}"#).as_deref(), Some("7"));
        assert_eq!(payload_id(r#"{"id":""}"#), None);
        assert_eq!(payload_id(r#"{"messages":[]}"#), None);
        assert_eq!(payload_id("not json"), None);
    }
}
