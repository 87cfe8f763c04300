//! Fleet-wide rate limits: `rpm` / `tpm` on `[providers.<p>]` and `[models.<m>]`,
//! enforced in Redis for every worker together (`lua/quota_admit.lua`, run by `gate`
//! with the budgets: the last 60 s in one-second buckets, a few O(1) commands per limit
//! and call, no entry per call).
//! governor stays the local per-process limiter (`requests_per_second`).
//!
//! Invariants: a call is admitted in every limit that covers it or in none; a window
//! never holds more than its limit (one call larger than a whole tokens limit is
//! admitted alone into an empty window), so any 60 s sees at most the limit plus one
//! second's bucket; tokens are admitted at an estimate before the call and corrected to
//! the real usage after it, in the bucket they were admitted in (`lua/quota_settle.lua`).

use crate::config::{Config, ModelConfig};
use serde_json::{Map, Value};
use std::time::Duration;

/// The window of every limit (whole seconds: one-second buckets).
pub const WINDOW: Duration = Duration::from_secs(60);

/// Prompt tokens estimated for one media part (an image: what providers usually bill).
pub const MEDIA_ESTIMATE: u64 = 1_500;

/// Output tokens counted for a call that sets no `max_tokens` on a model without
/// `max_output_tokens` (the tokens estimate only; the real usage corrects it).
pub const DEFAULT_OUTPUT_ESTIMATE: u64 = 1024;

#[derive(Debug, thiserror::Error)]
pub enum RateError {
    #[error(
        "rate: {what} is at its limit of {limit} per minute fleet-wide; room again in {wait:?} (wait, or use another model)"
    )]
    Limited {
        what: String,
        limit: u64,
        wait: Duration,
    },
    #[error("redis: {0} (retry when Redis answers again)")]
    Redis(redis::RedisError),
    #[error("redis pool: {0} (retry when Redis answers again)")]
    Pool(deadpool_redis::PoolError),
}

from_cause!(RateError, RateError::Redis, redis::RedisError);
from_cause!(RateError, RateError::Pool, deadpool_redis::PoolError);

/// One admitted call: its tokens are corrected by `gate::Gate::settle`.
#[derive(Debug, Clone)]
pub struct Admission {
    /// The window of each tokens limit it was admitted in.
    pub(crate) token_keys: Vec<String>,
    /// The tokens admitted (the estimate).
    pub(crate) tokens: u64,
    /// The window of each requests limit it was admitted in.
    pub(crate) request_keys: Vec<String>,
    /// The calls admitted (1, or a block's size).
    pub(crate) requests: u64,
    /// Its admission record: the tokens correction is made once, in its bucket.
    pub(crate) adm_key: String,
}

/// The fleet-wide limits of this config. Cheap to clone.
#[derive(Clone)]
pub struct RateLimits {
    cfg: std::sync::Arc<Config>,
}

/// One limit covering a call: name for messages, key stem, limit, amount.
struct Limit {
    what: String,
    stem: String,
    limit: u64,
    amount: u64,
    tokens: bool,
}

/// The window of one limit (`<stem>:w`; the key names of the earlier sliding log, a
/// sorted set and a total, are left alone so a mixed fleet never meets a wrong type).
fn window_key(stem: &str) -> String {
    format!("{stem}:w")
}

/// Estimated tokens of one call: a quarter of the request body's bytes (about four bytes
/// per token in English text; the real usage corrects it after the call) plus its output
/// cap.
pub fn token_estimate(body: &Map<String, Value>, model: &ModelConfig) -> u64 {
    // Bytes, not the worst case's media bound: an image is estimated at what a
    // provider usually bills for one (the real usage corrects it after the call).
    let bytes = crate::quota::body_bytes(body);
    let prompt =
        (bytes / 4).saturating_add(crate::quota::media_parts(body).saturating_mul(MEDIA_ESTIMATE));
    let output = crate::quota::requested_output(body)
        .or(model.max_output_tokens)
        .unwrap_or(DEFAULT_OUTPUT_ESTIMATE)
        .saturating_mul(crate::quota::choices(body));
    prompt.saturating_add(output)
}

impl RateLimits {
    pub fn new(cfg: std::sync::Arc<Config>) -> RateLimits {
        RateLimits { cfg }
    }

    fn limits(&self, model: &str, tokens: u64) -> Vec<Limit> {
        let ns = &self.cfg.queue.namespace;
        let mut out = vec![];
        let Some(mc) = self.cfg.models.get(model) else {
            return out;
        };
        let scopes = [
            (
                format!("provider {}", mc.provider),
                format!("{{{ns}}}:rate:p:{}", mc.provider),
                self.cfg.providers.get(&mc.provider).map(|p| (p.rpm, p.tpm)),
            ),
            (
                format!("model {model}"),
                format!("{{{ns}}}:rate:m:{model}"),
                Some((mc.rpm, mc.tpm)),
            ),
        ];
        for (what, stem, limits) in scopes {
            let Some((rpm, tpm)) = limits else { continue };
            if let Some(rpm) = rpm {
                out.push(Limit {
                    what: format!("{what} (requests)"),
                    stem: format!("{stem}:rpm"),
                    limit: rpm.get(),
                    amount: 1,
                    tokens: false,
                });
            }
            if let Some(tpm) = tpm {
                out.push(Limit {
                    what: format!("{what} (tokens)"),
                    stem: format!("{stem}:tpm"),
                    limit: tpm.get(),
                    amount: tokens,
                    tokens: true,
                });
            }
        }
        out
    }

    /// The admission of one call of `model` estimated at `tokens` in every limit
    /// covering it (made by `gate::Gate::admit`); `None` when no limit covers it. `id`:
    /// the same for every try of one call.
    pub fn ask(&self, id: &str, model: &str, tokens: u64) -> Option<RateAsk> {
        let limits = self.limits(model, tokens);
        (!limits.is_empty()).then(|| RateAsk {
            id: id.to_string(),
            adm_key: format!("{{{}}}:rate:adm:{id}", self.cfg.queue.namespace),
            limits,
            tokens,
            requests: 1,
        })
    }
}

/// An admission to make: the limits covering one call.
pub struct RateAsk {
    pub(crate) id: String,
    /// The admission record (see `lua/quota_admit.lua`).
    pub(crate) adm_key: String,
    limits: Vec<Limit>,
    tokens: u64,
    /// Calls admitted with it (1, or a block's size).
    requests: u64,
}

impl RateAsk {
    pub(crate) fn keys(&self) -> impl Iterator<Item = String> + '_ {
        self.limits.iter().map(|l| window_key(&l.stem))
    }
    /// Per limit: the limit, the amount this call takes.
    pub(crate) fn args(&self) -> Vec<u64> {
        self.limits
            .iter()
            .flat_map(|l| [l.limit, l.amount])
            .collect()
    }
    /// The error of limit `i` (from 0) having no room for `wait`.
    pub fn limited(&self, i: usize, wait: Duration) -> RateError {
        let l = &self.limits[i.min(self.limits.len() - 1)];
        RateError::Limited {
            what: l.what.clone(),
            limit: l.limit,
            wait,
        }
    }
    /// The largest block (calls admitted at once, see [`Blocks`]) these limits allow: a
    /// block never takes more than 1/[`BLOCK_SHARE`] of any limit, nor more than
    /// [`MAX_BLOCK`] calls.
    pub fn max_block(&self) -> u64 {
        self.limits
            .iter()
            .map(|l| l.limit / (BLOCK_SHARE * l.amount.max(1)))
            .min()
            .unwrap_or(1)
            .clamp(1, MAX_BLOCK)
    }

    /// The same admission for `k` calls of this one's size at once.
    pub fn block(&self, k: u64) -> RateAsk {
        RateAsk {
            id: self.id.clone(),
            adm_key: self.adm_key.clone(),
            limits: self
                .limits
                .iter()
                .map(|l| Limit {
                    what: l.what.clone(),
                    stem: l.stem.clone(),
                    limit: l.limit,
                    amount: l.amount.saturating_mul(k),
                    tokens: l.tokens,
                })
                .collect(),
            tokens: self.tokens.saturating_mul(k),
            requests: self.requests.saturating_mul(k),
        }
    }

    /// The admission once the script made it (its bucket is in its record).
    pub fn admission(self) -> Admission {
        Admission {
            adm_key: self.adm_key,
            token_keys: self
                .limits
                .iter()
                .filter(|l| l.tokens)
                .map(|l| window_key(&l.stem))
                .collect(),
            tokens: self.tokens,
            request_keys: self
                .limits
                .iter()
                .filter(|l| !l.tokens)
                .map(|l| window_key(&l.stem))
                .collect(),
            requests: self.requests,
        }
    }
}

/// A block never takes more than this fraction (1/n) of any limit per minute: with many
/// processes each holding a block, what goes unused at the end of a second stays small.
pub const BLOCK_SHARE: u64 = 1200;

/// The most calls one block admits at once.
pub const MAX_BLOCK: u64 = 32;

/// How long before the end of its server second a block stops being drawn on: the call
/// drawn last still reaches the provider within the second its room was counted in.
pub const BLOCK_MARGIN: Duration = Duration::from_millis(50);

/// Fleet-wide rate room admitted for several calls of one model at once, and drawn on by
/// this process's calls without a round trip (a high-rate model would otherwise cost a
/// script per call and limit: the quotas doubled Redis's work per job).
///
/// Invariants: a block's room is counted in the fleet-wide windows (in the second its
/// script ran) before any call draws on it, and is drawn on only until [`BLOCK_MARGIN`]
/// before that second ends, so every call is counted in the second it is sent in, as an
/// admission of its own would be; a block is at most [`RateAsk::max_block`] calls. A
/// block closes when it is used up or its second ends; once every call drawn on it has
/// ended, one settle corrects its tokens to what its calls used (the room left unused is
/// given back; a killed worker's block keeps its estimate, too much, never too little).
/// One model's block at most is asked for at a time ([`Take::Fetch`]): the calls that find
/// no room meanwhile wait for it ([`Blocks::changed`]) instead of each asking for a block
/// of its own (16 calls at once would otherwise admit 16 blocks and use one).
#[derive(Default)]
pub struct Blocks {
    inner: std::sync::Arc<std::sync::Mutex<BlocksInner>>,
    changed: tokio::sync::Notify,
}

/// What [`Blocks::take`] found.
#[derive(Debug)]
pub enum Take {
    /// Room drawn from the model's block.
    Drawn(Draw),
    /// No room: this caller asks for the next block (then [`Blocks::open`], or
    /// [`Blocks::fetch_failed`] if it did not get one).
    Fetch,
    /// No room, and another call is asking for a block: wait for [`Blocks::changed`].
    Wait,
}

#[derive(Default)]
struct BlocksInner {
    next_id: u64,
    /// The block calls of each model draw on.
    open: std::collections::HashMap<String, Block>,
    /// Closed blocks whose calls have not all ended, by id.
    closing: std::collections::HashMap<u64, Block>,
    /// Models whose next block a call is asking for.
    fetching: std::collections::HashSet<String>,
    /// Settles of blocks whose last call was dropped unsettled (a job's future dropped
    /// between its draw and its call): sent by the next [`Blocks::sweep`].
    ready: Vec<BlockSettle>,
    /// The size to ask for next, per model (grows while blocks are used up).
    size: std::collections::HashMap<String, u64>,
}

struct Block {
    id: u64,
    model: String,
    k: u64,
    usable_until: tokio::time::Instant,
    calls_left: u64,
    tokens_left: u64,
    /// Calls drawn (including the one that opened it).
    drawn: u64,
    /// Calls drawn that have not ended.
    outstanding: u64,
    /// Calls drawn and given back before they were made.
    undone: u64,
    /// Tokens the ended calls used minus their estimates.
    delta: i64,
    /// The block's admission (tokens = every token admitted with it).
    admission: Admission,
}

/// One call's share of a block: settle it with [`Blocks::settle`] once the call ended,
/// or give it back with [`Blocks::undo`]. Dropped otherwise (its job's future dropped
/// before the call was made), it is given back by itself, and its block's settle goes
/// with the next sweep.
#[derive(Debug)]
pub struct Draw {
    block: u64,
    model: String,
    tokens: u64,
    owner: std::sync::Weak<std::sync::Mutex<BlocksInner>>,
    ended: bool,
    /// The call went on the wire: dropped now, it counts at its estimate.
    sent: bool,
    /// Its block's room was counted in a second that ends (less the margin) here.
    usable_until: tokio::time::Instant,
}

impl Draw {
    /// The call is about to go on the wire: a drop from here on (its future dropped at
    /// the end of the shutdown grace) keeps it counted at its estimate.
    pub fn mark_sent(&mut self) {
        self.sent = true;
    }

    /// Whether a call may still be sent on this room: a draw that waited (a budget
    /// script retried while Redis was away) past its block's second must be taken again.
    pub fn usable(&self) -> bool {
        self.usable_until > tokio::time::Instant::now()
    }
}

impl Drop for Draw {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        if let Some(inner) = self.owner.upgrade() {
            let mut g = crate::sync::lock(&inner);
            let (used, undone) = if self.sent {
                (None, false)
            } else {
                (Some(0), true)
            };
            if let Some(s) = g.end(self.block, &self.model, self.tokens, used, undone) {
                g.ready.push(s);
            }
        }
    }
}

/// A closed block's correction, for `gate::Gate::settle`: its admission (tokens = what
/// was admitted) and the tokens its calls really used.
#[derive(Debug)]
pub struct BlockSettle {
    pub admission: Admission,
    pub used: u64,
    /// Calls drawn on the block and made (the rest of its requests go back).
    pub calls: u64,
}

impl Blocks {
    /// Completes when a block opens or a fetch fails; create it before [`Blocks::take`]
    /// so a change between the two is not missed.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// Like [`Blocks::draw`], and when there is no room says whether this caller should
    /// ask for the model's next block or wait for the one being asked for.
    pub fn take(&self, model: &str, tokens: u64) -> (Take, Vec<BlockSettle>) {
        let (d, closed) = self.draw(model, tokens);
        if let Some(d) = d {
            return (Take::Drawn(d), closed);
        }
        let mut g = crate::sync::lock(&self.inner);
        let t = if g.fetching.insert(model.to_string()) {
            Take::Fetch
        } else {
            Take::Wait
        };
        (t, closed)
    }

    /// The caller of a [`Take::Fetch`] got no block (refused, Redis away, draining).
    pub fn fetch_failed(&self, model: &str) {
        crate::sync::lock(&self.inner).fetching.remove(model);
        self.changed.notify_waiters();
    }

    /// Takes the room of one call of `model` estimated at `tokens` from its open block,
    /// if it has room and its second has not ended. Also returns the settles of blocks
    /// this closed.
    pub fn draw(&self, model: &str, tokens: u64) -> (Option<Draw>, Vec<BlockSettle>) {
        let now = tokio::time::Instant::now();
        let mut g = crate::sync::lock(&self.inner);
        let mut out = vec![];
        let usable = g
            .open
            .get(model)
            .map(|b| b.usable_until > now && b.calls_left > 0 && b.tokens_left >= tokens);
        match usable {
            Some(true) => {
                let b = g.open.get_mut(model).expect("checked above");
                b.calls_left -= 1;
                b.tokens_left -= tokens;
                b.drawn += 1;
                b.outstanding += 1;
                let d = Draw {
                    block: b.id,
                    model: model.to_string(),
                    tokens,
                    owner: std::sync::Arc::downgrade(&self.inner),
                    ended: false,
                    sent: false,
                    usable_until: b.usable_until,
                };
                if b.calls_left == 0 {
                    g.close(model, &mut out);
                }
                (Some(d), out)
            }
            Some(false) => {
                g.close(model, &mut out);
                (None, out)
            }
            None => (None, out),
        }
    }

    /// How many calls the next block of `model` should admit (at most `max`): twice the
    /// calls drawn on its last block, so a busy model soon needs a script every
    /// [`MAX_BLOCK`] calls and an idle one asks for one call at a time.
    pub fn size(&self, model: &str, max: u64) -> u64 {
        crate::sync::lock(&self.inner)
            .size
            .get(model)
            .copied()
            .unwrap_or(1)
            .clamp(1, max.max(1))
    }

    /// Opens `model`'s block from a script's admission of `k` calls estimated at `tokens`
    /// each, usable until `usable_until` (`None`: unknown, so for this call alone), and
    /// draws the call that asked for it. Returns its draw and the settles of blocks this
    /// closed (the model's earlier block).
    pub fn open(
        &self,
        model: &str,
        k: u64,
        tokens: u64,
        admission: Admission,
        usable_until: Option<tokio::time::Instant>,
    ) -> (Draw, Vec<BlockSettle>) {
        let mut g = crate::sync::lock(&self.inner);
        let mut out = vec![];
        g.close(model, &mut out);
        g.fetching.remove(model);
        g.next_id += 1;
        let id = g.next_id;
        let calls_left = if usable_until.is_some() {
            k.saturating_sub(1)
        } else {
            0
        };
        let until = usable_until.unwrap_or_else(tokio::time::Instant::now);
        let b = Block {
            id,
            model: model.to_string(),
            k,
            usable_until: until,
            calls_left,
            tokens_left: admission.tokens.saturating_sub(tokens),
            drawn: 1,
            outstanding: 1,
            undone: 0,
            delta: 0,
            admission,
        };
        g.open.insert(model.to_string(), b);
        if calls_left == 0 {
            g.close(model, &mut out);
        }
        drop(g);
        self.changed.notify_waiters();
        (
            Draw {
                block: id,
                model: model.to_string(),
                tokens,
                owner: std::sync::Arc::downgrade(&self.inner),
                ended: false,
                sent: false,
                usable_until: until,
            },
            out,
        )
    }

    /// A drawn call ended: it used `used` tokens (`None`: unknown, its estimate stays
    /// counted). Returns the block's settle if this was its last call and it is closed.
    pub fn settle(&self, d: Draw, used: Option<u64>) -> Option<BlockSettle> {
        self.end(d, used, false)
    }

    /// A drawn call was never made (its budget refused it, draining): its room goes back.
    pub fn undo(&self, d: Draw) -> Option<BlockSettle> {
        self.end(d, Some(0), true)
    }

    fn end(&self, mut d: Draw, used: Option<u64>, undone: bool) -> Option<BlockSettle> {
        d.ended = true;
        crate::sync::lock(&self.inner).end(d.block, &d.model, d.tokens, used, undone)
    }

    /// Closes every block whose second has ended (`all`: every block, at shutdown) and
    /// returns the settles of those whose calls have all ended.
    pub fn sweep(&self, all: bool) -> Vec<BlockSettle> {
        let now = tokio::time::Instant::now();
        let mut g = crate::sync::lock(&self.inner);
        let models: Vec<String> = g
            .open
            .iter()
            .filter(|(_, b)| all || b.usable_until <= now)
            .map(|(m, _)| m.clone())
            .collect();
        let mut out = std::mem::take(&mut g.ready);
        for m in models {
            g.close(&m, &mut out);
        }
        out
    }
}

impl BlocksInner {
    /// One drawn call ended (see [`Blocks::settle`]); the block's settle if it was the
    /// last call of a closed block.
    fn end(
        &mut self,
        block: u64,
        model: &str,
        tokens: u64,
        used: Option<u64>,
        undone: bool,
    ) -> Option<BlockSettle> {
        let delta = used.map_or(0, |u| u as i64 - tokens as i64);
        let undone = u64::from(undone);
        if let Some(b) = self.open.get_mut(model).filter(|b| b.id == block) {
            b.outstanding = b.outstanding.saturating_sub(1);
            b.delta += delta;
            b.undone += undone;
            return None;
        }
        let b = self.closing.get_mut(&block)?;
        b.outstanding = b.outstanding.saturating_sub(1);
        b.delta += delta;
        b.undone += undone;
        if b.outstanding > 0 {
            return None;
        }
        let b = self.closing.remove(&block)?;
        Some(b.settled())
    }

    /// Moves `model`'s open block to the closing ones (or settles it now when none of its
    /// calls is still running), and sizes the next block by how much of this one was used.
    fn close(&mut self, model: &str, out: &mut Vec<BlockSettle>) {
        let Some(mut b) = self.open.remove(model) else {
            return;
        };
        // Used up before its second ended: twice as large next time; else twice what it served.
        let next = if b.calls_left == 0 && b.drawn == b.k {
            b.k.saturating_mul(2)
        } else {
            b.drawn.saturating_mul(2)
        };
        self.size.insert(b.model.clone(), next.clamp(1, MAX_BLOCK));
        // The room nobody drew on goes back with the correction.
        b.delta -= b.tokens_left as i64;
        b.tokens_left = 0;
        b.calls_left = 0;
        if b.outstanding == 0 {
            out.push(b.settled());
        } else {
            self.closing.insert(b.id, b);
        }
    }
}

impl Block {
    fn settled(self) -> BlockSettle {
        let used = (self.admission.tokens as i64 + self.delta).max(0) as u64;
        BlockSettle {
            calls: self.drawn - self.undone,
            admission: self.admission,
            used,
        }
    }
}

#[cfg(test)]
mod block_tests {
    use super::*;

    fn adm(tokens: u64) -> Admission {
        Admission {
            token_keys: vec!["{llm}:rate:m:m:tpm:w".into()],
            tokens,
            request_keys: vec!["{llm}:rate:m:m:rpm:w".into()],
            requests: tokens / 10,
            adm_key: "{llm}:rate:adm:x".into(),
        }
    }

    fn later(ms: u64) -> Option<tokio::time::Instant> {
        Some(tokio::time::Instant::now() + Duration::from_millis(ms))
    }

    /// Four calls of 10 tokens admitted at once: three more draws, then none; once every
    /// call ended, one settle says what they used in all (the estimates corrected).
    #[test]
    fn a_block_is_drawn_on_until_used_up_and_settles_once_with_what_was_used() {
        let b = Blocks::default();
        let (first, closed) = b.open("m", 4, 10, adm(40), later(10_000));
        assert!(closed.is_empty());
        let mut draws = vec![first];
        for _ in 0..3 {
            let (d, closed) = b.draw("m", 10);
            draws.push(d.expect("room left"));
            assert!(closed.is_empty());
        }
        assert!(b.draw("m", 10).0.is_none(), "used up");
        let used = [4, 10, 12, 0];
        let mut settles = vec![];
        for (d, u) in draws.into_iter().zip(used) {
            settles.extend(b.settle(d, Some(u)));
        }
        assert_eq!(settles.len(), 1, "one settle, after the last call");
        assert_eq!(settles[0].admission.tokens, 40);
        assert_eq!(settles[0].used, 26);
        assert_eq!(settles[0].calls, 4);
        assert_eq!(b.size("m", 32), 8, "used up: twice as large next time");
        assert_eq!(b.size("m", 3), 3, "never above the limits' own bound");
    }

    /// A draw dropped unsettled (its job's future dropped before the call) gives its room
    /// back, and its block's settle goes with the next sweep, not never.
    #[test]
    fn a_draw_dropped_unsettled_is_given_back_at_the_next_sweep() {
        let b = Blocks::default();
        let (first, _) = b.open("m", 4, 10, adm(40), later(10_000));
        let (second, _) = b.draw("m", 10);
        assert!(b.settle(first, Some(7)).is_none());
        drop(second);
        let s = b.sweep(true);
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!(
            (s[0].used, s[0].calls),
            (7, 1),
            "the dropped call made nothing"
        );
        assert!(b.sweep(true).is_empty(), "sent once");
        // A draw dropped once its call went on the wire stays counted, at its estimate.
        let (first, _) = b.open("m", 4, 10, adm(40), later(10_000));
        let (mut second, _) = b.draw("m", 10);
        second.as_mut().unwrap().mark_sent();
        assert!(b.settle(first, Some(10)).is_none());
        drop(second);
        let s = b.sweep(true);
        assert_eq!((s[0].used, s[0].calls), (20, 2), "{s:?}");
        // The same on a block already closed (used up), waiting for its calls.
        let (first, _) = b.open("m", 2, 10, adm(20), later(10_000));
        let (second, closed) = b.draw("m", 10);
        assert!(closed.is_empty(), "closed, but its calls run");
        assert!(b.settle(first, Some(12)).is_none());
        drop(second);
        let s = b.sweep(false);
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!((s[0].used, s[0].calls), (12, 1));
    }

    /// A draw held past its block's second (its budget script retried while Redis was
    /// away) says so, and the worker takes its room again instead of sending the call
    /// in a later second than it was counted in.
    #[tokio::test(start_paused = true)]
    async fn a_draw_held_past_its_second_is_no_longer_usable() {
        let b = Blocks::default();
        let (first, _) = b.open("m", 4, 10, adm(40), later(100));
        let (second, _) = b.draw("m", 10);
        let second = second.expect("room");
        assert!(first.usable() && second.usable());
        tokio::time::advance(Duration::from_millis(150)).await;
        assert!(!first.usable() && !second.usable());
        assert!(b.draw("m", 10).0.is_none(), "nor drawn on");
    }

    /// One call asks for a model's block at a time; the others wait for it and then draw.
    #[test]
    fn one_call_fetches_a_block_while_the_others_wait_for_it() {
        let b = Blocks::default();
        assert!(matches!(b.take("m", 10).0, Take::Fetch));
        assert!(matches!(b.take("m", 10).0, Take::Wait));
        assert!(matches!(b.take("other", 10).0, Take::Fetch), "per model");
        b.fetch_failed("m");
        assert!(
            matches!(b.take("m", 10).0, Take::Fetch),
            "a failed fetch lets the next one try"
        );
        let (_first, _) = b.open("m", 4, 10, adm(40), later(10_000));
        assert!(matches!(b.take("m", 10).0, Take::Drawn(_)));
    }

    /// A block whose second ended is not drawn on; what it did not serve goes back with
    /// its settle, and a call of unknown usage keeps its estimate.
    #[test]
    fn a_block_past_its_second_gives_back_the_room_nobody_used() {
        let b = Blocks::default();
        let (first, _) = b.open("m", 8, 10, adm(80), later(0));
        let (d, closed) = b.draw("m", 10);
        assert!(d.is_none(), "its second has ended");
        assert!(closed.is_empty(), "its call is still running");
        let s = b.settle(first, None).expect("closed and its call ended");
        assert_eq!(
            s.used, 10,
            "the one call at its estimate; 70 unused given back"
        );
        assert_eq!(s.calls, 1, "7 of its 8 calls go back");
        assert_eq!(b.size("m", 32), 2);
    }

    /// A block whose call ended before its second did settles at the sweep (or the next
    /// draw), a block without a known second serves only its own call, and a call too
    /// large for what is left opens a new block.
    #[test]
    fn blocks_close_at_the_sweep_and_for_calls_they_cannot_hold() {
        let b = Blocks::default();
        let (first, _) = b.open("m", 4, 10, adm(40), later(10_000));
        assert!(b.settle(first, Some(10)).is_none(), "still open");
        assert!(b.sweep(false).is_empty(), "its second has not ended");
        let (d, closed) = b.draw("m", 35);
        assert!(d.is_none(), "30 left: a call of 35 does not fit");
        assert_eq!(closed.len(), 1, "the block closes; its only call has ended");
        assert_eq!(closed[0].used, 10, "the 30 unused go back");
        let (x, _) = b.open("m", 4, 10, adm(40), later(10_000));
        assert!(b.settle(x, Some(10)).is_none());
        assert_eq!(b.sweep(true).len(), 1, "shutdown closes every block");
        let (lone, closed) = b.open("m", 4, 10, adm(40), None);
        assert!(closed.is_empty());
        assert!(
            b.draw("m", 1).0.is_none(),
            "no known second: its own call only"
        );
        let s = b.undo(lone).expect("closed");
        assert_eq!(
            (s.used, s.calls),
            (0, 0),
            "a call never made gives back its room"
        );
    }
}
