//! A line where tasks leave work for a few sender tasks: the work that comes while a send
//! is out goes together in the next one, so a burst costs one command, not one each,
//! and when nothing is out the work goes at once. Used by the commit sender
//! (`Queue::commit_shared`, two senders at once) and by the cancel-marker reads job tasks
//! make of their own (`worker::cancels`, one).
//!
//! Invariants:
//! - at most `max_senders` sender roles are held at once, and while work waits one is
//!   held (the joiner that took it spawns the task that owns it);
//! - every joiner hears back: its answer, or its answer channel closed with nothing
//!   sent (the joiner then falls back: it retries, or sends alone): the work a sender had
//!   taken goes with it should its task end early (a panic, dropped before or while it
//!   ran), and should the last role end so (other than by [`Role::next`] finding nothing
//!   left), every waiting item's channel is closed too;
//! - work whose joiner stopped waiting (its channel closed) is not taken.

use crate::sync::lock;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// The line (see the module doc): items `T`, each answered with an `A`.
pub struct Line<T, A> {
    state: Mutex<State<T, A>>,
    max_senders: usize,
}

struct State<T, A> {
    /// Left and not yet taken, in the order they came.
    waiting: Vec<Waiting<T, A>>,
    /// Sender roles held.
    senders: usize,
}

/// An item left in the line, and where its answer goes.
pub struct Waiting<T, A> {
    pub item: T,
    pub done: oneshot::Sender<A>,
}

/// A sender's role, taken by [`Line::join`] and owned by the sender task; given back by
/// [`Role::next`] when nothing waits, or by its drop (see the module doc).
pub struct Role<T, A> {
    line: Arc<Line<T, A>>,
    done: bool,
}

impl<T, A> Line<T, A> {
    pub fn new(max_senders: usize) -> Line<T, A> {
        Line {
            state: Mutex::new(State {
                waiting: Vec::new(),
                senders: 0,
            }),
            max_senders: max_senders.max(1),
        }
    }

    /// Leaves `item`; its answer comes on the receiver. With a role, the caller spawns
    /// a sender task that owns it. (The role is taken here, not in that task, so a task
    /// dropped before its first poll, spawned while the runtime shuts down, still gives
    /// it back.)
    pub fn join(self: &Arc<Self>, item: T) -> (oneshot::Receiver<A>, Option<Role<T, A>>) {
        let (done, rx) = oneshot::channel();
        let mut s = lock(&self.state);
        s.waiting.push(Waiting { item, done });
        let role = (s.senders < self.max_senders).then(|| {
            s.senders += 1;
            Role {
                line: self.clone(),
                done: false,
            }
        });
        (rx, role)
    }

    /// How many items wait (tests).
    pub fn waiting(&self) -> usize {
        lock(&self.state).waiting.len()
    }

    /// How many sender roles are held (tests).
    pub fn senders(&self) -> usize {
        lock(&self.state).senders
    }
}

impl<T, A> Role<T, A> {
    /// The next work for this sender: what `take` picks (at least one item) from the
    /// waiting items, in order, once those whose joiners stopped waiting are dropped.
    /// `None` when nothing waits: the role ends (and every later call says `None`).
    pub fn next(
        &mut self,
        take: impl FnOnce(&mut Vec<Waiting<T, A>>) -> Vec<Waiting<T, A>>,
    ) -> Option<Vec<Waiting<T, A>>> {
        if self.done {
            return None;
        }
        let mut s = lock(&self.line.state);
        s.waiting.retain(|w| !w.done.is_closed());
        if s.waiting.is_empty() {
            s.senders -= 1;
            self.done = true;
            return None;
        }
        let batch = take(&mut s.waiting);
        debug_assert!(
            !batch.is_empty(),
            "a sender took nothing from a waiting line"
        );
        Some(batch)
    }
}

impl<T, A> Drop for Role<T, A> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut s = lock(&self.line.state);
        s.senders -= 1;
        if s.senders == 0 {
            // Nobody left to send: every joiner hears back (its channel closes).
            s.waiting.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_role_at_most_per_sender_and_a_dropped_last_role_closes_every_waiter() {
        let line: Arc<Line<u32, u32>> = Arc::new(Line::new(2));
        let (mut a, ra) = line.join(1);
        let (mut b, rb) = line.join(2);
        let (mut c, rc) = line.join(3);
        assert!(ra.is_some() && rb.is_some() && rc.is_none());
        drop(ra);
        assert_eq!(
            (line.senders(), line.waiting()),
            (1, 3),
            "another role is left"
        );
        drop(rb);
        assert_eq!((line.senders(), line.waiting()), (0, 0));
        for rx in [&mut a, &mut b, &mut c] {
            assert!(rx.try_recv().is_err(), "closed, nothing sent");
        }
    }

    #[test]
    fn next_skips_joiners_that_left_and_ends_the_role_when_nothing_waits() {
        let line: Arc<Line<u32, u32>> = Arc::new(Line::new(1));
        let (gone, role) = line.join(1);
        let (_kept, _) = line.join(2);
        drop(gone);
        let mut role = role.expect("the first joiner takes the role");
        let batch = role.next(std::mem::take).expect("one waits");
        assert_eq!(batch.iter().map(|w| w.item).collect::<Vec<_>>(), vec![2]);
        assert!(role.next(std::mem::take).is_none());
        assert!(role.next(std::mem::take).is_none(), "ended stays ended");
        drop(role);
        assert_eq!(line.senders(), 0);
    }
}
