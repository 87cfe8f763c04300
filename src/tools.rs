//! The operator/producer subcommands: `enqueue`, `results`, `status`. They talk to Redis
//! directly with the same key names as the worker ([`Keys`]).
//!
//! Invariant: nothing printed here contains a secret (URLs are redacted).

use crate::config::Config;
use crate::connect::{ConnectError, blocking_connection, master_connection};
use crate::cost;
use crate::job;
use crate::queue::{
    Entries, Keys, QueueError, ReadReply, ResultEntry, ResultStatus, StreamEntry, WireError,
};
use crate::slots::SlotKeys;
use redis::AsyncCommands;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("redis: {0} (is Redis running at redis.url?)")]
    Redis(redis::RedisError),
    #[error("{0}")]
    Input(String),
    #[error("io: {0}")]
    Io(std::io::Error),
}

from_cause!(ToolError, ToolError::Redis, redis::RedisError);
from_cause!(ToolError, ToolError::Io, std::io::Error);

async fn conn(cfg: &Config) -> Result<redis::aio::MultiplexedConnection, ToolError> {
    master_connection(cfg, Some(Duration::from_secs(5)))
        .await
        .map_err(|e| match e {
            ConnectError::Timeout(_) => ToolError::Input(
                "Redis did not answer within 3 s (is it running at redis.url, or are the Sentinels of redis.urls reachable?)".into(),
            ),
            e => e.into(),
        })
}

/// What `enqueue` pushes: payload objects, validated like the worker validates them.
#[allow(clippy::too_many_arguments)]
pub fn build_payloads(
    cfg: &Config,
    prompts: &[String],
    model: Option<&str>,
    route: Option<&str>,
    id: Option<&str>,
    metadata: Option<&str>,
    max_tokens: Option<u64>,
    file_text: Option<&str>,
) -> Result<Vec<String>, ToolError> {
    let mut out = vec![];
    let metadata: Option<Value> = match metadata {
        Some(m) => Some(
            serde_json::from_str(m)
                .map_err(|e| ToolError::Input(format!("--metadata is not JSON: {e}")))?,
        ),
        None => None,
    };
    for (i, p) in prompts.iter().enumerate() {
        let mut o = Map::new();
        o.insert("messages".into(), json!([{"role": "user", "content": p}]));
        if let Some(m) = model {
            o.insert("model".into(), json!(m));
        }
        if let Some(r) = route {
            o.insert("route".into(), json!(r));
        }
        if let Some(id) = id {
            // Numbered from 1, like `--prompt <n>` in the error messages.
            let id = if prompts.len() > 1 {
                format!("{id}-{}", i + 1)
            } else {
                id.to_string()
            };
            o.insert("id".into(), json!(id));
        }
        if let Some(m) = &metadata {
            o.insert("metadata".into(), m.clone());
        }
        if let Some(t) = max_tokens {
            o.insert("max_tokens".into(), json!(t));
        }
        out.push(Value::Object(o).to_string());
    }
    // Where each payload came from, for error messages: `--prompt <n>` or `line <n>`.
    let mut origins: Vec<String> = (1..=out.len()).map(|n| format!("--prompt {n}")).collect();
    if let Some(text) = file_text {
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            out.push(line.to_string());
            origins.push(format!("line {}", n + 1));
        }
    }
    // Validate everything before pushing anything: a bad line loses nothing.
    let mut errors = vec![];
    for (p, origin) in out.iter().zip(&origins) {
        if let Err(e) = job::parse(Some(p.as_bytes()), "0-0", cfg.queue.max_payload_bytes, cfg) {
            errors.push(format!("{origin}: {e}"));
        }
    }
    if !errors.is_empty() {
        return Err(ToolError::Input(format!(
            "nothing enqueued; fix these first:\n  {}",
            errors.join("\n  ")
        )));
    }
    if out.is_empty() {
        return Err(ToolError::Input(
            "nothing to enqueue: give --prompt or --file".into(),
        ));
    }
    Ok(out)
}

/// Pushes payloads with XADD (pipelined); prints one entry id per line.
pub async fn enqueue(
    cfg: &Config,
    payloads: &[String],
    out: &mut impl Write,
) -> Result<Vec<String>, ToolError> {
    let keys = Keys::new(&cfg.queue.namespace);
    let mut c = conn(cfg).await?;
    let ids = push_payloads(&mut c, &keys, payloads).await?;
    for id in &ids {
        writeln!(out, "{id}")?;
    }
    Ok(ids)
}

/// XADDs each payload to the jobs stream (field `payload`), pipelined 500 at a time;
/// returns the entry ids in input order.
pub async fn push_payloads(
    c: &mut redis::aio::MultiplexedConnection,
    keys: &Keys,
    payloads: &[String],
) -> Result<Vec<String>, ToolError> {
    let mut ids = Vec::with_capacity(payloads.len());
    for chunk in payloads.chunks(500) {
        let mut pipe = redis::pipe();
        for p in chunk {
            pipe.cmd("XADD")
                .arg(&keys.jobs)
                .arg("*")
                .arg("payload")
                .arg(p);
        }
        let got: Vec<String> = pipe.query_async(c).await?;
        ids.extend(got);
    }
    Ok(ids)
}

/// A result as read back from `{ns}:results`: its entry id, and its fields decoded (or
/// why they do not decode: an entry some other program wrote is shown, not fatal).
pub type ResultRow = (String, Result<ResultEntry, WireError>);

/// Read raw (see `queue::reply`): an entry with a field name that is not UTF-8 is shown
/// (names read lossily), never fatal to the listing.
fn to_row(e: StreamEntry) -> ResultRow {
    let fields = e.fields.unwrap_or_default();
    let r = ResultEntry::from_fields(fields.iter().map(|(k, v)| (String::from_utf8_lossy(k), v)));
    (e.id, r)
}

/// Finds the result of job `job_id`: through its dedupe marker when present, else by
/// scanning the results stream from the newest entry.
async fn find_result(cfg: &Config, job_id: &str) -> Result<Option<ResultRow>, ToolError> {
    let keys = Keys::new(&cfg.queue.namespace);
    let mut c = conn(cfg).await?;
    if let Some(marker) = c.get::<_, Option<String>>(keys.done(job_id)).await? {
        // The marker is `<result entry id>|<status>` (lua/commit.lua).
        let rid = marker.split_once('|').map_or(marker.as_str(), |(r, _)| r);
        let r: Entries = c.xrange(&keys.results, rid, rid).await?;
        if let Some(e) = r.0.into_iter().next() {
            return Ok(Some(to_row(e)));
        }
    }
    let mut end = "+".to_string();
    loop {
        let r: Entries = c.xrevrange_count(&keys.results, &end, "-", 1000).await?;
        let n = r.0.len();
        let last = r.0.last().map(|e| e.id.clone());
        for e in r.0 {
            let row = to_row(e);
            if matches!(&row.1, Ok(r) if r.job_id == job_id) {
                return Ok(Some(row));
            }
        }
        match last {
            Some(l) if n == 1000 => end = format!("({l}"),
            _ => return Ok(None),
        }
    }
}

/// A result as one JSON object: every field as the stream holds it (strings), under its
/// wire name (the shape of `schema/result.schema.json`).
pub fn result_json(r: &ResultEntry) -> Value {
    let mut o = Map::new();
    for (k, v) in r.clone().into_fields() {
        o.insert(k.into(), json!(String::from_utf8_lossy(&v)));
    }
    Value::Object(o)
}

/// The header of the `results` table (see [`print_result`]).
const RESULTS_HEADER: &str = "ENTRY            JOB ID               STATUS    MODEL             TOKENS IN/OUT  COST USD      LATENCY  ANSWER OR ERROR";

fn print_result(e: &ResultRow, as_json: bool, out: &mut impl Write) -> std::io::Result<()> {
    let r = match &e.1 {
        Ok(r) => r,
        Err(err) => {
            if as_json {
                return writeln!(
                    out,
                    "{}",
                    json!({"entry": e.0, "unreadable": err.to_string()})
                );
            }
            return writeln!(out, "{}  (not a readable result: {err})", e.0);
        }
    };
    if as_json {
        let mut o = result_json(r);
        o["entry"] = json!(e.0);
        return writeln!(out, "{o}");
    }
    let detail = if r.status == ResultStatus::Ok {
        r.content.as_deref()
    } else {
        r.error.as_deref()
    };
    let detail: String = detail
        .unwrap_or_default()
        .chars()
        .take(80)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    // A copy of an id that already had a result repeats it, marked.
    let dup = r
        .duplicate_of
        .as_ref()
        .map(|d| format!("[duplicate of {d}] "))
        .unwrap_or_default();
    writeln!(
        out,
        "{:<16} {:<20} {:<9} {:<17} {:>6}/{:<6}  {:<13} {:>5}ms  {dup}{}",
        e.0,
        r.job_id,
        r.status.as_str(),
        r.model.as_deref().unwrap_or("-"),
        r.input_tokens,
        r.output_tokens,
        cost::format_usd(r.cost_usd),
        r.latency_ms,
        detail
    )
}

/// What `cancel` found.
#[derive(Debug, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The cancel marker is set: a queued copy ends `cancelled` with no call when a
    /// worker takes it; a running one has its call aborted within about a second.
    Requested,
    /// The id already has an `ok` result: nothing to cancel.
    AlreadyOk,
}

/// Sets the cancel marker of `job_id` (`{ns}:cancel:<id>`, for `queue.dedupe_ttl_s`),
/// unless the id already has an `ok` result. The marker stands for the id until it
/// expires: a copy pushed later is cancelled too (delete the key to push it again).
pub async fn cancel(cfg: &Config, job_id: &str) -> Result<CancelOutcome, ToolError> {
    if job_id.is_empty() {
        return Err(ToolError::Input("cancel: the job id is empty".into()));
    }
    let keys = Keys::new(&cfg.queue.namespace);
    let mut c = conn(cfg).await?;
    if let Some(marker) = c.get::<_, Option<String>>(keys.done(job_id)).await? {
        if crate::queue::marker_status(&marker) == "ok" {
            return Ok(CancelOutcome::AlreadyOk);
        }
    }
    let _: () = c
        .set_ex(
            keys.cancel(job_id),
            cost::unix_now_ms(),
            cfg.queue.dedupe_ttl_s.as_secs().max(1),
        )
        .await?;
    Ok(CancelOutcome::Requested)
}

/// What `results` found.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    /// A listing (no --job).
    Listed,
    /// The result of the job asked for, with its status (None: not readable).
    Job(Option<ResultStatus>),
    /// No result for the job asked for.
    NoJob,
}

/// `results`: the last `count` results, or one job's, optionally following new ones.
pub async fn results(
    cfg: &Config,
    job_id: Option<&str>,
    follow: bool,
    count: usize,
    as_json: bool,
    out: &mut impl Write,
) -> Result<Found, ToolError> {
    let keys = Keys::new(&cfg.queue.namespace);
    if let Some(id) = job_id {
        loop {
            if let Some(e) = find_result(cfg, id).await? {
                if !as_json {
                    writeln!(out, "{RESULTS_HEADER}")?;
                }
                print_result(&e, as_json, out)?;
                return Ok(Found::Job(e.1.as_ref().ok().map(|r| r.status)));
            }
            if !follow {
                return Ok(Found::NoJob);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    let mut c = conn(cfg).await?;
    let r: Entries = c.xrevrange_count(&keys.results, "+", "-", count).await?;
    if !as_json {
        if r.0.is_empty() && !follow {
            writeln!(out, "no results in {}", keys.results)?;
            return Ok(Found::Listed);
        }
        writeln!(out, "{RESULTS_HEADER}")?;
    }
    let mut last = "$".to_string();
    for e in r.0.into_iter().rev() {
        last = e.id.clone();
        print_result(&to_row(e), as_json, out)?;
    }
    out.flush()?;
    if !follow {
        return Ok(Found::Listed);
    }
    let mut bc = blocking_connection(cfg).await?;
    loop {
        let opts = redis::streams::StreamReadOptions::default()
            .block(1000)
            .count(100);
        let r: ReadReply = bc.xread_options(&[&keys.results], &[&last], &opts).await?;
        for e in r.0 {
            last = e.id.clone();
            print_result(&to_row(e), as_json, out)?;
        }
        out.flush()?;
    }
}

/// `status`: queue length, pending, consumers, slots and holders, dead letters, costs.
pub async fn status(cfg: &Config) -> Result<Value, ToolError> {
    let keys = Keys::new(&cfg.queue.namespace);
    let mut c = conn(cfg).await?;
    let jobs_len: u64 = c.xlen(&keys.jobs).await.unwrap_or(0);
    let results_len: u64 = c.xlen(&keys.results).await.unwrap_or(0);
    let dead_len: u64 = c.xlen(&keys.dead).await.unwrap_or(0);
    let failed_len: u64 = c.xlen(&keys.failed).await.unwrap_or(0);
    // Entries ever added to the jobs and results streams (Redis >= 7): the watch view's
    // rates in and out.
    let mut added = [json!(null), json!(null)];
    for (slot, stream) in added.iter_mut().zip([&keys.jobs, &keys.results]) {
        let info: redis::RedisResult<redis::Value> = redis::cmd("XINFO")
            .arg("STREAM")
            .arg(stream)
            .query_async(&mut c)
            .await;
        if let Ok(v) = info {
            let m = crate::queue::reply::flat_map(v);
            if let Some(n) = m.get("entries-added").and_then(|s| s.parse::<u64>().ok()) {
                *slot = json!(n);
            }
        }
    }
    let [jobs_added, results_added] = added;
    let mut group = json!(null);
    let mut consumers = vec![];
    let groups: redis::RedisResult<redis::Value> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(&keys.jobs)
        .query_async(&mut c)
        .await;
    if let Ok(redis::Value::Array(gs)) = groups {
        for g in gs {
            let m = crate::queue::reply::flat_map(g);
            if m.get("name").map(String::as_str) == Some(cfg.queue.group.as_str()) {
                group = json!({
                    "name": m.get("name"),
                    "pending": m.get("pending").and_then(|s| s.parse::<u64>().ok()),
                    "lag": m.get("lag").and_then(|s| s.parse::<u64>().ok()),
                    "last_delivered": m.get("last-delivered-id"),
                });
            }
        }
        let cs: redis::RedisResult<redis::Value> = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(&keys.jobs)
            .arg(&cfg.queue.group)
            .query_async(&mut c)
            .await;
        if let Ok(redis::Value::Array(cs)) = cs {
            for x in cs {
                let m = crate::queue::reply::flat_map(x);
                consumers.push(json!({
                    "name": m.get("name"),
                    "pending": m.get("pending").and_then(|s| s.parse::<u64>().ok()),
                    "idle_ms": m.get("idle").and_then(|s| s.parse::<u64>().ok()),
                }));
            }
        }
    }
    let mut pools = serde_json::Map::new();
    let slot_keys = SlotKeys::new(&cfg.queue.namespace);
    for (name, pc) in &cfg.pools {
        let recorded: Option<u32> = c.get(slot_keys.pool_size(name)).await?;
        let n = recorded.unwrap_or(pc.slots.get());
        let mut held = vec![];
        for i in 0..n {
            let k = slot_keys.slot(name, i);
            // Read as bytes: a value some other program wrote is shown, never fatal.
            let holder: Option<Vec<u8>> = c.get(&k).await?;
            let holder = holder.map(|h| String::from_utf8_lossy(&h).into_owned());
            if let Some(h) = holder {
                let ttl: i64 = c.pttl(&k).await?;
                // The value is `<process token>#<lease nonce>`: show the process.
                let process = h.split('#').next().unwrap_or(&h).to_string();
                // `<token>#<unix ms>n<nonce>`: held since that time (a bare token: a
                // hand-off not yet picked up, age unknown).
                let since: Option<u64> = h
                    .split_once('#')
                    .and_then(|(_, rest)| rest.split('n').next())
                    .and_then(|ms| ms.parse().ok());
                let age_ms = since.map(|s| cost::unix_now_ms().saturating_sub(s));
                held.push(json!({"slot": i, "holder": process, "ttl_ms": ttl, "age_ms": age_ms}));
            }
        }
        let waiting: u64 = c.zcard(slot_keys.slot_queue(name)).await.unwrap_or(0);
        pools.insert(
            name.clone(),
            json!({"slots": n, "configured": pc.slots, "held": held, "waiting_processes": waiting}),
        );
    }
    // Read as text: a field that is not an integer (written by something else) is
    // skipped, not fatal to the whole status.
    let totals: BTreeMap<String, String> = c.hgetall(&keys.costs).await?;
    let totals: BTreeMap<String, i64> = totals
        .into_iter()
        .filter_map(|(k, v)| v.parse().ok().map(|v| (k, v)))
        .collect();
    let mut per_model: BTreeMap<String, serde_json::Map<String, Value>> = BTreeMap::new();
    let mut total_picos: i64 = 0;
    for (k, v) in &totals {
        let Some((model, field)) = k.rsplit_once(':') else {
            continue;
        };
        let e = per_model.entry(model.to_string()).or_default();
        if field == "cost_picos" {
            total_picos += v;
            e.insert(
                "cost_usd".into(),
                json!(cost::format_usd(cost::from_picos(*v))),
            );
        } else {
            e.insert(field.to_string(), json!(v));
        }
    }
    let budgets: Vec<Value> = crate::budget::report(cfg, &mut c)
        .await?
        .into_iter()
        .map(|w| {
            json!({
                "budget": w.budget,
                "who": w.who,
                "window": w.period,
                "limit_usd": cost::format_usd(w.limit),
                "spent_usd": cost::format_usd(w.spent),
                "reserved_usd": cost::format_usd(w.reserved),
            })
        })
        .collect();
    let cooldowns: Vec<Value> = crate::cooldown::list_with(&cfg.queue.namespace, &mut c)
        .await?
        .into_iter()
        .map(|(what, ms, why)| json!({"what": what, "ms_left": ms, "reason": why}))
        .collect();
    // Spend per model in the UTC day and month (written with each commit).
    let [day, month] = cost::spend_periods(cost::unix_now_ms());
    let mut spend = serde_json::Map::new();
    for (label, period) in [("today", &day), ("this_month", &month)] {
        let by_model: BTreeMap<String, i64> =
            c.hgetall(keys.spend(period)).await.unwrap_or_default();
        let total: i64 = by_model.values().fold(0i64, |a, v| a.saturating_add(*v));
        spend.insert(
            label.into(),
            json!({
                "window": period,
                "total_usd": cost::format_usd(cost::from_picos(total)),
                "models": by_model
                    .iter()
                    .map(|(m, p)| (m.clone(), json!(cost::format_usd(cost::from_picos(*p)))))
                    .collect::<serde_json::Map<_, _>>(),
            }),
        );
    }
    let key_check: BTreeMap<String, String> = c.hgetall(keys.key_check()).await.unwrap_or_default();
    let key_check: serde_json::Map<String, Value> = key_check
        .into_iter()
        .map(|(p, v)| (p, serde_json::from_str(&v).unwrap_or(json!({"found": v}))))
        .collect();
    // Tenants under a cap: places held and jobs parked, per pool and tenant.
    let parked_index: Vec<String> = c.hkeys(keys.parked_index()).await.unwrap_or_default();
    let mut tenants = vec![];
    for f in parked_index {
        let Some((pool, tenant)) = f.split_once(':') else {
            continue;
        };
        let parked: u64 = c.xlen(keys.parked(pool, tenant)).await.unwrap_or(0);
        let places: u64 = c
            .zcard(keys.tenant_holders(pool, tenant))
            .await
            .unwrap_or(0);
        tenants.push(json!({
            "pool": pool,
            "tenant": tenant,
            "cap": cfg.pools.get(pool).map(|p| p.max_per_tenant),
            "places_held": places,
            "parked": parked,
        }));
    }
    // Jobs parked by budgets that pause only some jobs, per budget and whose windows.
    let bparked: BTreeMap<String, String> = c
        .hgetall(keys.budget_parked_index())
        .await
        .unwrap_or_default();
    let mut budget_parked = vec![];
    for (stream, v) in bparked {
        let at = crate::budget::ParkAt::from_index(&v);
        let n: u64 = c.xlen(&stream).await.unwrap_or(0);
        budget_parked.push(json!({
            "budget": at.as_ref().map(|a| a.budget.clone()),
            "who": at.as_ref().map(|a| a.who.clone()),
            "parked": n,
        }));
    }
    // Anything but noeviction lets a full Redis evict slot keys, pending jobs, markers.
    let policy: Result<Vec<String>, _> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut c)
        .await;
    let maxmemory_policy = match policy {
        Ok(v) => v.get(1).cloned().unwrap_or_else(|| "unknown".into()),
        Err(_) => "unknown (CONFIG GET not allowed)".into(),
    };
    Ok(json!({
        "redis": crate::config::redact_url(&cfg.redis.url),
        "maxmemory_policy": maxmemory_policy,
        "stream": keys.jobs,
        "jobs_in_stream": jobs_len,
        "group": group,
        "consumers": consumers,
        "results": results_len,
        "dead_letters": dead_len,
        "failed_kept": failed_len,
        "jobs_added": jobs_added,
        "results_added": results_added,
        "pools": pools,
        "cost": {"total_usd": cost::format_usd(cost::from_picos(total_picos)), "models": per_model},
        "budgets": budgets,
        "spend": spend,
        "cooldowns": cooldowns,
        "key_check": key_check,
        "tenants": tenants,
        "budget_parked": budget_parked,
    }))
}

/// Human-readable rendering of [`status`].
pub fn print_status(v: &Value, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "redis           {}", v["redis"].as_str().unwrap_or(""))?;
    let policy = v["maxmemory_policy"].as_str().unwrap_or("unknown");
    if policy != "noeviction" {
        writeln!(
            out,
            "WARNING         maxmemory-policy is {policy}: a full Redis may evict slot keys, pending jobs and idempotency markers (set noeviction)"
        )?;
    }
    writeln!(
        out,
        "stream          {}  ({} entries)",
        v["stream"].as_str().unwrap_or(""),
        v["jobs_in_stream"]
    )?;
    match v["group"]["name"].as_str() {
        // No group yet: no worker has started on this namespace (or it was purged).
        None => writeln!(
            out,
            "group           none yet: no worker has started on this namespace"
        )?,
        Some(name) => {
            let num = |x: &Value| x.as_u64().map_or("unknown".to_string(), |n| n.to_string());
            writeln!(
                out,
                "group           {name}  pending={} lag={}",
                num(&v["group"]["pending"]),
                // XINFO GROUPS has no lag before Redis 7 (or after some deletions).
                num(&v["group"]["lag"])
            )?
        }
    }
    for c in v["consumers"].as_array().into_iter().flatten() {
        writeln!(
            out,
            "  consumer      {}  pending={} idle_ms={}",
            c["name"].as_str().unwrap_or(""),
            c["pending"],
            c["idle_ms"]
        )?;
    }
    writeln!(out, "results         {}", v["results"])?;
    writeln!(out, "dead letters    {}", v["dead_letters"])?;
    writeln!(out, "failed (kept)   {}", v["failed_kept"])?;
    if let Some(pools) = v["pools"].as_object() {
        for (name, p) in pools {
            let held = p["held"].as_array().map(|h| h.len()).unwrap_or(0);
            writeln!(
                out,
                "pool {name:<10} {held}/{} slots held, {} processes waiting",
                p["slots"], p["waiting_processes"]
            )?;
            for h in p["held"].as_array().into_iter().flatten() {
                writeln!(
                    out,
                    "  slot {:<3} {}  ttl {} ms",
                    h["slot"],
                    h["holder"].as_str().unwrap_or(""),
                    h["ttl_ms"]
                )?;
            }
        }
    }
    writeln!(
        out,
        "cost total      ${}",
        v["cost"]["total_usd"].as_str().unwrap_or("0")
    )?;
    for label in ["today", "this_month"] {
        let w = &v["spend"][label];
        if w.is_null() {
            continue;
        }
        writeln!(
            out,
            "spend {:<10} ${}  ({})",
            label.replace('_', " "),
            w["total_usd"].as_str().unwrap_or("0"),
            w["window"].as_str().unwrap_or("")
        )?;
        for (m, usd) in w["models"].as_object().into_iter().flatten() {
            writeln!(out, "  {m:<18} ${}", usd.as_str().unwrap_or("0"))?;
        }
    }
    for (p, k) in v["key_check"].as_object().into_iter().flatten() {
        writeln!(
            out,
            "key {:<14} {}  (worker {})",
            p,
            k["found"].as_str().unwrap_or(""),
            k["worker"].as_str().unwrap_or("?")
        )?;
    }
    for t in v["tenants"].as_array().into_iter().flatten() {
        writeln!(
            out,
            "tenant {:<13} pool {}: {} of {} places, {} jobs parked",
            t["tenant"].as_str().unwrap_or(""),
            t["pool"].as_str().unwrap_or(""),
            t["places_held"],
            t["cap"],
            t["parked"]
        )?;
    }
    for b in v["budget_parked"].as_array().into_iter().flatten() {
        writeln!(
            out,
            "budget {:<13} {}: {} jobs parked until it has room",
            b["budget"].as_str().unwrap_or(""),
            b["who"].as_str().unwrap_or(""),
            b["parked"]
        )?;
    }
    for c in v["cooldowns"].as_array().into_iter().flatten() {
        writeln!(
            out,
            "cooldown {:<20} {} ms left  ({})",
            c["what"].as_str().unwrap_or(""),
            c["ms_left"],
            c["reason"].as_str().unwrap_or("")
        )?;
    }
    for b in v["budgets"].as_array().into_iter().flatten() {
        writeln!(
            out,
            "budget {:<14} {} {}  spent ${} + reserved ${} of ${}",
            b["budget"].as_str().unwrap_or(""),
            b["who"].as_str().unwrap_or(""),
            b["window"].as_str().unwrap_or(""),
            b["spent_usd"].as_str().unwrap_or("0"),
            b["reserved_usd"].as_str().unwrap_or("0"),
            b["limit_usd"].as_str().unwrap_or("0"),
        )?;
    }
    if let Some(models) = v["cost"]["models"].as_object() {
        for (m, t) in models {
            writeln!(
                out,
                "  {m:<18} ${:<14} calls={} in={} out={} cached={}",
                t["cost_usd"].as_str().unwrap_or("0"),
                t["calls"],
                t["input_tokens"],
                t["output_tokens"],
                t["cached_tokens"]
            )?;
        }
    }
    Ok(())
}
