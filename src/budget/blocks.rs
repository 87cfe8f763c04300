//! Budget room reserved in blocks: one reservation (one `quota_admit.lua` run) holds the
//! worst cases of up to [`MAX_BLOCK`] calls of one *cover* (the budget windows covering
//! a call: the same for every call of a model and tenant within a UTC day), and the
//! process's next calls of that cover draw on it without a round trip; one settle
//! (`quota_settle.lua`) counts the real costs of all its calls and frees the rest.
//!
//! Invariants:
//! - a block's calls never draw more than its reservation: the worst cases of its calls
//!   running plus the real costs of its calls ended stay within the amount reserved, so
//!   the fleet-wide bound of [`crate::budget`] holds (spent + live reservations <= limit;
//!   concurrent calls overshoot only by what a provider bills beyond a worst case);
//! - a block is drawn on for [`BLOCK_LIFE`] at most, and never holds more than
//!   1/[`LIMIT_SHARE`] of any of its windows' limits, so near a budget's end the calls
//!   reserve one at a time again (a refused block is asked again for one call) and what
//!   is left stays usable by every worker;
//! - the settle goes once every call drawn has ended (settled, given back, or dropped:
//!   a draw dropped after its call went on the wire counts at its worst case), so a
//!   window's `spent` lags its calls by at most a block's life plus its longest call;
//! - a worker killed with a block open leaves its reservation to expire (like a single
//!   call's): what its ended calls cost is then not counted, at most the block's amount.

use super::Reservation;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// Most calls one block reserves for.
pub const MAX_BLOCK: u64 = 32;

/// A block never reserves more than 1/`LIMIT_SHARE` of a window's limit.
pub const LIMIT_SHARE: i64 = 1000;

/// How long a block is drawn on after it was reserved. Its reservation lives this much
/// longer than a single call's (see [`super::Budgets::ttl_ms`]).
pub const BLOCK_LIFE: Duration = Duration::from_secs(1);

/// Block sizes remembered at most (one per cover: a model and tenant, per UTC day).
const MAX_COVERS: usize = 4096;

/// What [`Blocks::take`] found.
pub enum Take {
    /// Room drawn from the cover's block.
    Drawn(Draw),
    /// No room: this caller reserves the next block ([`Blocks::open`] with this token; a
    /// token dropped unused lets the next caller try).
    Fetch(Fetching),
    /// No room, and another call is reserving a block: wait for [`Blocks::changed`].
    Wait,
}

#[derive(Default)]
struct Shared {
    m: Mutex<Inner>,
    changed: tokio::sync::Notify,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    /// The block calls of each cover draw on.
    open: HashMap<String, Block>,
    /// Closed blocks whose calls have not all ended, by id.
    closing: HashMap<u64, Block>,
    /// Covers whose next block a call is reserving.
    fetching: HashSet<String>,
    /// Settles of blocks whose last call was dropped (sent by the next sweep).
    ready: Vec<BlockSettle>,
    /// The size to ask for next, per cover (grows while blocks are used up).
    size: HashMap<String, u64>,
}

struct Block {
    id: u64,
    cover: String,
    k: u64,
    reservation: Reservation,
    /// Pico-dollars reserved.
    amount: i64,
    /// Worst cases of its calls running.
    running: i64,
    /// Real costs of its calls ended.
    spent: i64,
    /// Calls drawn (including the one that opened it).
    drawn: u64,
    /// Calls drawn that have not ended.
    outstanding: u64,
    /// Drawn on until then.
    until: tokio::time::Instant,
    /// A call did not fit what was left.
    used_up: bool,
}

impl Block {
    fn room(&self) -> i64 {
        self.amount
            .saturating_sub(self.running)
            .saturating_sub(self.spent)
    }
}

/// One call's share of a block: end it with [`Blocks::settle`] or [`Blocks::undo`].
/// Dropped otherwise, it ends by itself: given back if its call was never sent, counted
/// at its worst case if it was ([`Draw::mark_sent`]).
#[derive(Debug)]
pub struct Draw {
    block: u64,
    cover: String,
    worst: i64,
    owner: Weak<Shared>,
    ended: bool,
    sent: bool,
    /// Its block's life ends here: a call not sent by then is not sent on this room
    /// (its reservation's ttl counts from the block's reservation, not from the send).
    until: tokio::time::Instant,
}

impl Draw {
    /// The call is about to go on the wire: from here on a drop counts its worst case.
    pub fn mark_sent(&mut self) {
        self.sent = true;
    }

    /// The call's worst case, pico-dollars.
    pub fn worst(&self) -> i64 {
        self.worst
    }

    /// Whether the call may still be sent on this room: a draw held past its block's
    /// life (the rate limits' script retried while Redis was away) must be taken again.
    pub fn usable(&self) -> bool {
        self.until > tokio::time::Instant::now()
    }
}

impl Drop for Draw {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        if let Some(s) = self.owner.upgrade() {
            let cost = if self.sent { self.worst } else { 0 };
            let mut g = crate::sync::lock(&s.m);
            if let Some(b) = g.end(self.block, &self.cover, self.worst, cost) {
                g.ready.push(b);
            }
        }
    }
}

/// The right to reserve a cover's next block (see [`Take::Fetch`]).
pub struct Fetching {
    cover: String,
    owner: Weak<Shared>,
    done: bool,
}

impl Drop for Fetching {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Some(s) = self.owner.upgrade() {
            crate::sync::lock(&s.m).fetching.remove(&self.cover);
            s.changed.notify_waiters();
        }
    }
}

/// A closed block's settle, for `gate::Gate::settle`: its reservation and what its calls
/// cost in all.
#[derive(Debug)]
pub struct BlockSettle {
    pub reservation: Reservation,
    pub cost_picos: i64,
}

/// The budget blocks of this process. Cheap to clone.
#[derive(Clone, Default)]
pub struct Blocks {
    s: Arc<Shared>,
}

impl Blocks {
    /// Completes when a block opens or a reservation fails; create it before
    /// [`Blocks::take`] so a change between the two is not missed.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.s.changed.notified()
    }

    /// Draws a call of `worst` pico-dollars from `cover`'s block, else says whether this
    /// caller reserves the next block or waits for the one being reserved. Also returns
    /// the settles of blocks this closed.
    pub fn take(&self, cover: &str, worst: i64) -> (Take, Vec<BlockSettle>) {
        let now = tokio::time::Instant::now();
        let mut g = crate::sync::lock(&self.s.m);
        let mut out = vec![];
        let fits = g
            .open
            .get(cover)
            .map(|b| b.until > now && b.room() >= worst);
        match fits {
            Some(true) => {
                let b = g.open.get_mut(cover).expect("checked above");
                b.running = b.running.saturating_add(worst);
                b.drawn += 1;
                b.outstanding += 1;
                let d = Draw {
                    block: b.id,
                    cover: cover.to_string(),
                    worst,
                    owner: Arc::downgrade(&self.s),
                    ended: false,
                    sent: false,
                    until: b.until,
                };
                return (Take::Drawn(d), out);
            }
            Some(false) => {
                if let Some(b) = g.open.get_mut(cover) {
                    b.used_up = b.until > now;
                }
                g.close(cover, &mut out);
            }
            None => {}
        }
        let t = if g.fetching.insert(cover.to_string()) {
            Take::Fetch(Fetching {
                cover: cover.to_string(),
                owner: Arc::downgrade(&self.s),
                done: false,
            })
        } else {
            Take::Wait
        };
        (t, out)
    }

    /// How many calls the next block of `cover` should reserve for (at most `max`): twice
    /// the calls its last block served (so an idle cover reserves for one or two calls at
    /// a time), twice its size if it was used up.
    pub fn size(&self, cover: &str, max: u64) -> u64 {
        crate::sync::lock(&self.s.m)
            .size
            .get(cover)
            .copied()
            .unwrap_or(1)
            .clamp(1, max.max(1))
    }

    /// Opens the block a script reserved (`amount` pico-dollars for `k` calls, under
    /// `reservation`) and draws the call of `worst` that reserved it. A block of one call
    /// serves that call alone. Returns its draw and the settles of blocks this closed.
    pub fn open(
        &self,
        mut fetching: Fetching,
        reservation: Reservation,
        k: u64,
        amount: i64,
        worst: i64,
    ) -> (Draw, Vec<BlockSettle>) {
        fetching.done = true;
        let cover = std::mem::take(&mut fetching.cover);
        let mut g = crate::sync::lock(&self.s.m);
        let mut out = vec![];
        g.close(&cover, &mut out);
        g.fetching.remove(&cover);
        g.next_id += 1;
        let id = g.next_id;
        let until = tokio::time::Instant::now() + BLOCK_LIFE;
        let b = Block {
            id,
            cover: cover.clone(),
            k,
            reservation,
            amount,
            running: worst,
            spent: 0,
            drawn: 1,
            outstanding: 1,
            until,
            used_up: false,
        };
        let alone = k <= 1;
        g.open.insert(cover.clone(), b);
        if alone {
            g.close(&cover, &mut out);
        }
        drop(g);
        self.s.changed.notify_waiters();
        (
            Draw {
                block: id,
                cover,
                worst,
                owner: Arc::downgrade(&self.s),
                ended: false,
                sent: false,
                until,
            },
            out,
        )
    }

    /// Room this process holds in `cover`'s blocks and does not use (reserved, neither
    /// running nor spent), pico-dollars; the open block closes, so that room goes back
    /// once its calls end. A call refused by the budget while this is positive may fit
    /// once it does: it waits instead of taking `on_exhausted`.
    pub fn release_unused(&self, cover: &str) -> (i64, Vec<BlockSettle>) {
        let mut g = crate::sync::lock(&self.s.m);
        let mut out = vec![];
        g.close(cover, &mut out);
        let unused = g
            .closing
            .values()
            .filter(|b| b.cover == cover)
            .map(|b| b.room().max(0))
            .sum();
        (unused, out)
    }

    /// A drawn call ended and cost `cost` pico-dollars (`None`: unknown, its worst case
    /// counts). Returns its block's settle if this was the last call of a closed block.
    pub fn settle(&self, d: Draw, cost: Option<i64>) -> Option<BlockSettle> {
        let c = cost.unwrap_or(d.worst);
        self.end(d, c)
    }

    /// A drawn call was never made: its room goes back.
    pub fn undo(&self, d: Draw) -> Option<BlockSettle> {
        self.end(d, 0)
    }

    fn end(&self, mut d: Draw, cost: i64) -> Option<BlockSettle> {
        d.ended = true;
        crate::sync::lock(&self.s.m).end(d.block, &d.cover, d.worst, cost)
    }

    /// Closes every block past its life (`all`: every block, at shutdown) and returns
    /// the settles of those whose calls have all ended.
    pub fn sweep(&self, all: bool) -> Vec<BlockSettle> {
        let now = tokio::time::Instant::now();
        let mut g = crate::sync::lock(&self.s.m);
        let covers: Vec<String> = g
            .open
            .iter()
            .filter(|(_, b)| all || b.until <= now)
            .map(|(c, _)| c.clone())
            .collect();
        let mut out = std::mem::take(&mut g.ready);
        for c in covers {
            g.close(&c, &mut out);
        }
        out
    }
}

impl Inner {
    /// One drawn call ended; its block's settle if it was the last call of a closed one.
    fn end(&mut self, block: u64, cover: &str, worst: i64, cost: i64) -> Option<BlockSettle> {
        let ended = |b: &mut Block| {
            b.outstanding = b.outstanding.saturating_sub(1);
            b.running = b.running.saturating_sub(worst).max(0);
            b.spent = b.spent.saturating_add(cost.max(0));
        };
        if let Some(b) = self.open.get_mut(cover).filter(|b| b.id == block) {
            ended(b);
            return None;
        }
        let b = self.closing.get_mut(&block)?;
        ended(b);
        if b.outstanding > 0 {
            return None;
        }
        self.closing.remove(&block).map(Block::settled)
    }

    /// Moves `cover`'s open block to the closing ones (or settles it now when none of its
    /// calls is running), and sizes the next block by how much of this one was used.
    fn close(&mut self, cover: &str, out: &mut Vec<BlockSettle>) {
        let Some(b) = self.open.remove(cover) else {
            return;
        };
        let next = if b.used_up {
            b.k.saturating_mul(2)
        } else {
            b.drawn.saturating_mul(2)
        };
        if self.size.len() >= MAX_COVERS && !self.size.contains_key(&b.cover) {
            // Covers name their day: yesterday's sizes are of no use (bounded memory).
            self.size.clear();
        }
        self.size.insert(b.cover.clone(), next.clamp(1, MAX_BLOCK));
        if b.outstanding == 0 {
            out.push(b.settled());
        } else {
            self.closing.insert(b.id, b);
        }
    }
}

impl Block {
    fn settled(self) -> BlockSettle {
        BlockSettle {
            reservation: self.reservation,
            cost_picos: self.spent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(id: &str) -> Reservation {
        Reservation {
            id: id.into(),
            keys: vec!["{llm}:budget:b:*:d:2026-12-04".into()],
        }
    }

    fn fetch(b: &Blocks, cover: &str, worst: i64) -> Fetching {
        match b.take(cover, worst).0 {
            Take::Fetch(f) => f,
            _ => panic!("expected to fetch"),
        }
    }

    fn drawn(b: &Blocks, cover: &str, worst: i64) -> Option<Draw> {
        match b.take(cover, worst).0 {
            Take::Drawn(d) => Some(d),
            _ => None,
        }
    }

    /// Four calls' worst cases reserved at once: calls draw while their worst cases fit
    /// what is left (ended calls count at their real cost), and once every call ended one
    /// settle carries what they cost in all.
    #[test]
    fn a_block_is_drawn_on_while_worst_cases_fit_and_settles_once_with_the_real_costs() {
        let b = Blocks::default();
        let f = fetch(&b, "c", 10);
        let (first, closed) = b.open(f, res("r1"), 4, 40, 10);
        assert!(closed.is_empty());
        let mut draws = vec![first];
        for _ in 0..3 {
            draws.push(drawn(&b, "c", 10).expect("room left"));
        }
        // 40 reserved, 40 running: no room; another caller then fetches the next block.
        assert!(drawn(&b, "c", 1).is_none(), "used up: the block closes");
        let costs = [Some(4), Some(10), None, Some(0)];
        let mut settles = vec![];
        for (d, c) in draws.into_iter().zip(costs) {
            settles.extend(b.settle(d, c));
        }
        assert_eq!(settles.len(), 1, "one settle, after the last call");
        assert_eq!(
            settles[0].cost_picos,
            4 + 10 + 10,
            "unknown = its worst case"
        );
        assert_eq!(settles[0].reservation.id, "r1");
        assert_eq!(b.size("c", 32), 8, "used up: twice as large next time");
        assert_eq!(b.size("c", 3), 3, "never above the limits' own bound");
    }

    /// What an ended call did not use goes back to its open block: the worst cases of
    /// calls running plus the costs of calls ended never exceed the amount reserved.
    #[test]
    fn an_ended_calls_unused_worst_case_can_be_drawn_again_within_the_amount() {
        let b = Blocks::default();
        let f = fetch(&b, "c", 10);
        let (first, _) = b.open(f, res("r1"), 2, 20, 10);
        let second = drawn(&b, "c", 10).expect("room");
        assert!(b.settle(first, Some(3)).is_none(), "open: no settle yet");
        // 20 - 10 running - 3 spent = 7 left.
        assert!(drawn(&b, "c", 8).is_none(), "8 does not fit in 7");
        let f = fetch(&b, "c", 8);
        drop(f);
        // The block closed for the call that did not fit; its second call still runs.
        let s = b
            .settle(second, Some(10))
            .expect("last call of a closed block");
        assert_eq!(s.cost_picos, 13);
        let b = Blocks::default();
        let f = fetch(&b, "c", 10);
        let (first, _) = b.open(f, res("r2"), 2, 20, 10);
        let second = drawn(&b, "c", 10).expect("room");
        assert!(b.settle(first, Some(3)).is_none());
        let third = drawn(&b, "c", 7).expect("7 fits in 7");
        assert!(b.settle(second, Some(10)).is_none());
        assert!(b.settle(third, Some(7)).is_none());
        let s = b.sweep(true);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].cost_picos, 20, "never more than the amount reserved");
    }

    /// A draw dropped before its call was sent gives its room back; one dropped after
    /// counts its worst case; the block's settle goes with the next sweep.
    #[test]
    fn dropped_draws_end_by_themselves_and_their_block_settles_at_the_sweep() {
        let b = Blocks::default();
        let f = fetch(&b, "c", 10);
        let (first, _) = b.open(f, res("r1"), 4, 40, 10);
        let second = drawn(&b, "c", 10).expect("room");
        let mut third = drawn(&b, "c", 10).expect("room");
        third.mark_sent();
        assert!(b.settle(first, Some(2)).is_none());
        drop(second);
        drop(third);
        let s = b.sweep(true);
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!(
            s[0].cost_picos,
            2 + 10,
            "unsent: nothing; sent: its worst case"
        );
        assert!(b.sweep(true).is_empty(), "sent once");
        // The same on a block already closed, waiting for its calls.
        let f = fetch(&b, "c", 10);
        let (first, _) = b.open(f, res("r2"), 1, 10, 10);
        let mut first = first;
        first.mark_sent();
        drop(first);
        let s = b.sweep(false);
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!(s[0].cost_picos, 10);
    }

    /// One call reserves a cover's block at a time; the others wait for it and then draw.
    /// A reservation that failed (its token dropped) lets the next caller try.
    #[test]
    fn one_call_reserves_a_block_while_the_others_wait() {
        let b = Blocks::default();
        let f = fetch(&b, "c", 10);
        assert!(matches!(b.take("c", 10).0, Take::Wait));
        assert!(matches!(b.take("other", 10).0, Take::Fetch(_)), "per cover");
        drop(f);
        let f = fetch(&b, "c", 10);
        let (_first, _) = b.open(f, res("r1"), 4, 40, 10);
        assert!(matches!(b.take("c", 10).0, Take::Drawn(_)));
    }

    /// Review findings: a draw held past its block's life says so (its call is then
    /// admitted afresh, never sent on room whose reservation may lapse), and the room a
    /// process's own blocks hold unused is known (a refused call waits for it).
    #[tokio::test(start_paused = true)]
    async fn a_stale_draw_says_so_and_unused_room_is_known() {
        let b = Blocks::default();
        let f = fetch(&b, "c", 10);
        let (first, _) = b.open(f, res("r1"), 4, 40, 10);
        let second = drawn(&b, "c", 10).expect("room");
        assert!(first.usable() && second.usable());
        tokio::time::advance(BLOCK_LIFE).await;
        assert!(!first.usable() && !second.usable());
        assert!(b.settle(first, Some(4)).is_none());
        // 40 reserved, 10 running, 4 spent: 26 unused until the second call ends.
        let (unused, closed) = b.release_unused("c");
        assert!(closed.is_empty(), "its second call still runs");
        assert_eq!(unused, 26);
        let s = b.settle(second, Some(10)).expect("closed, last call");
        assert_eq!(s.cost_picos, 14);
        assert_eq!(b.release_unused("c").0, 0);
    }

    /// A block is drawn on for its life only; a block of one call serves that call alone
    /// and settles when it ends.
    #[tokio::test(start_paused = true)]
    async fn a_block_past_its_life_closes_and_a_block_of_one_serves_its_call_alone() {
        let b = Blocks::default();
        let f = fetch(&b, "c", 10);
        let (first, _) = b.open(f, res("r1"), 8, 80, 10);
        assert!(b.settle(first, Some(5)).is_none(), "open");
        assert!(b.sweep(false).is_empty(), "within its life");
        tokio::time::advance(BLOCK_LIFE + Duration::from_millis(1)).await;
        let s = b.sweep(false);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].cost_picos, 5);
        assert_eq!(b.size("c", 32), 2, "served one call: two next time");
        let f = fetch(&b, "c", 10);
        let (lone, closed) = b.open(f, res("r2"), 1, 10, 10);
        assert!(closed.is_empty());
        assert!(matches!(b.take("c", 0).0, Take::Fetch(_)), "its call only");
        let s = b.undo(lone).expect("closed and ended");
        assert_eq!(s.cost_picos, 0, "a call never made costs nothing");
    }
}
