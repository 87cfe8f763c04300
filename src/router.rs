//! Pure routing: the ordered plan of models for one job, and what to do after each
//! failed attempt (retry the same model after a delay, switch to another model, or fail).
//!
//! Invariant: no IO and no clock. Randomness (jitter) is passed in as a number in [0, 1),
//! so every decision is reproducible in a unit test.

use crate::backoff::Backoff;
pub use crate::outcome::ErrorClass;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// How many different models of one provider must answer 401/403 before the provider
/// is excluded for the job: one denial may be about that model only, a second one about
/// another model points at the key.
pub const KEY_REJECTED_AFTER: usize = 2;

/// One model the job may run on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub model: String,
    pub provider: String,
    pub pool: String,
    pub context_window: u64,
}

/// Retry policy (from `[retry]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub max_attempts_per_model: u32,
    pub base_delay: Duration,
    pub max_delay: Duration,
    pub max_retry_after: Duration,
}

impl RetryPolicy {
    /// The retry delay schedule: `base_delay` doubling to `max_delay`.
    pub fn backoff(&self) -> Backoff {
        Backoff::new(self.base_delay, self.max_delay)
    }
}

/// The next step after a failed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Call the same model again after this delay.
    RetryAfter(Duration),
    /// Move on to the candidate at this index (now current), at once.
    Switch(usize),
    /// No option left: the job fails with the last error.
    Fail,
}

/// The route of one job and where it stands.
#[derive(Debug, Clone)]
pub struct Plan {
    candidates: Vec<Candidate>,
    current: usize,
    attempts_on_current: u32,
    excluded_providers: HashSet<String>,
    /// Provider -> its models that answered 401/403 for this job.
    denied_models: HashMap<String, HashSet<String>>,
    min_context: u64,
    /// Candidates ruled out for this job by a per-job rule (its cost cap).
    excluded: Vec<bool>,
    policy: RetryPolicy,
}

impl Plan {
    /// `candidates` must be non-empty (validated config guarantees routes are).
    pub fn new(candidates: Vec<Candidate>, policy: RetryPolicy) -> Plan {
        assert!(!candidates.is_empty(), "a plan needs at least one model");
        Plan {
            excluded: vec![false; candidates.len()],
            candidates,
            current: 0,
            attempts_on_current: 0,
            excluded_providers: HashSet::new(),
            denied_models: HashMap::new(),
            min_context: 0,
            policy,
        }
    }

    pub fn current(&self) -> &Candidate {
        &self.candidates[self.current]
    }

    pub fn candidates(&self) -> &[Candidate] {
        &self.candidates
    }

    /// Count one call of the current model (before or after it is made).
    pub fn record_attempt(&mut self) {
        self.attempts_on_current += 1;
    }

    /// Later candidates that could still be used, in order (for the slot fast path:
    /// when the current model's pool is busy, a later model with a free slot may run now).
    pub fn usable_alternatives(&self) -> Vec<usize> {
        (self.current + 1..self.candidates.len())
            .filter(|&i| self.usable(i))
            .collect()
    }

    /// Make candidate `i` current (it must come from [`Plan::usable_alternatives`]).
    pub fn switch_to(&mut self, i: usize) {
        self.current = i;
        self.attempts_on_current = 0;
    }

    fn usable(&self, i: usize) -> bool {
        let c = &self.candidates[i];
        !self.excluded[i]
            && !self.excluded_providers.contains(&c.provider)
            && c.context_window >= self.min_context
    }

    /// Index of the current candidate.
    pub fn current_index(&self) -> usize {
        self.current
    }

    /// Rules candidate `i` out for this job (a per-job rule: e.g. its worst-case cost no
    /// longer fits the job's cap). Takes effect for the current one through
    /// [`Plan::ensure_usable`].
    pub fn exclude(&mut self, i: usize) {
        if let Some(x) = self.excluded.get_mut(i) {
            *x = true;
        }
    }

    /// Excludes the current candidate and moves on to the next usable one: `false` when
    /// none is left (the job fails).
    pub fn skip_current(&mut self) -> bool {
        self.exclude(self.current);
        self.ensure_usable()
    }

    /// If the current candidate was excluded, moves on to the next usable one. `false`
    /// when none is left (the job fails).
    pub fn ensure_usable(&mut self) -> bool {
        if !self.excluded[self.current] {
            return true;
        }
        self.next_usable() != Decision::Fail
    }

    fn next_usable(&mut self) -> Decision {
        match (self.current + 1..self.candidates.len()).find(|&i| self.usable(i)) {
            Some(i) => {
                self.switch_to(i);
                Decision::Switch(i)
            }
            None => Decision::Fail,
        }
    }

    /// Decide what follows a failed attempt of the current model.
    pub fn on_error(&mut self, class: &ErrorClass, jitter: f64) -> Decision {
        let exhausted = self.attempts_on_current >= self.policy.max_attempts_per_model;
        match class {
            ErrorClass::Fatal => Decision::Fail,
            ErrorClass::ProviderRejected => {
                let p = self.current().provider.clone();
                self.excluded_providers.insert(p);
                self.next_usable()
            }
            ErrorClass::AccessDenied => {
                // This model is behind us once we move on (candidates are only ever
                // taken in order), so skipping it needs no set of its own.
                let c = self.current();
                let (provider, model) = (c.provider.clone(), c.model.clone());
                let denied = self.denied_models.entry(provider.clone()).or_default();
                denied.insert(model);
                if denied.len() >= KEY_REJECTED_AFTER {
                    self.excluded_providers.insert(provider);
                }
                self.next_usable()
            }
            ErrorClass::ContextTooLong => {
                self.min_context = self.current().context_window.saturating_add(1);
                self.next_usable()
            }
            ErrorClass::RateLimited { retry_after } => match retry_after {
                Some(after) if *after > self.policy.max_retry_after => self.next_usable(),
                _ if exhausted => self.next_usable(),
                _ => Decision::RetryAfter(self.policy.backoff().delay_or_after(
                    self.attempts_on_current,
                    jitter,
                    *retry_after,
                )),
            },
            ErrorClass::Transient => {
                if exhausted {
                    self.next_usable()
                } else {
                    Decision::RetryAfter(
                        self.policy
                            .backoff()
                            .delay(self.attempts_on_current, jitter),
                    )
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(model: &str, provider: &str, ctx: u64) -> Candidate {
        Candidate {
            model: model.into(),
            provider: provider.into(),
            pool: "default".into(),
            context_window: ctx,
        }
    }

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts_per_model: 3,
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_millis(8000),
            max_retry_after: Duration::from_secs(60),
        }
    }

    fn plan() -> Plan {
        Plan::new(
            vec![
                cand("a", "p1", 1000),
                cand("b", "p1", 4000),
                cand("c", "p2", 2000),
            ],
            policy(),
        )
    }

    #[test]
    fn transient_retries_then_falls_back_then_fails() {
        let mut p = plan();
        let mut decisions = vec![];
        loop {
            p.record_attempt();
            let d = p.on_error(&ErrorClass::Transient, 0.0);
            decisions.push(d.clone());
            if d == Decision::Fail {
                break;
            }
        }
        // 3 attempts on each of 3 models = 9 calls: 2 retries + switch, twice, then 2 retries + fail.
        assert_eq!(decisions.len(), 9);
        assert_eq!(decisions[2], Decision::Switch(1));
        assert_eq!(decisions[5], Decision::Switch(2));
        assert_eq!(decisions[8], Decision::Fail);
        assert_eq!(
            decisions[0],
            Decision::RetryAfter(Duration::from_millis(250))
        );
        assert_eq!(
            decisions[1],
            Decision::RetryAfter(Duration::from_millis(500))
        );
    }

    /// The schedule as the worker sleeps it (`tokio::time::sleep(after)` per
    /// `RetryAfter`), on paused tokio time: exact durations, no wall-clock wait.
    #[tokio::test(start_paused = true)]
    async fn backoff_schedule_sleeps_exact_durations_on_paused_time() {
        let mut p = plan();
        let started = tokio::time::Instant::now();
        let mut slept = vec![];
        loop {
            p.record_attempt();
            match p.on_error(&ErrorClass::Transient, 0.0) {
                Decision::RetryAfter(d) => {
                    let t = tokio::time::Instant::now();
                    tokio::time::sleep(d).await;
                    slept.push(t.elapsed().as_millis());
                }
                Decision::Switch(_) => slept.push(0),
                Decision::Fail => break,
            }
        }
        // Per model: 2 retries (250 ms, 500 ms at jitter 0), then a switch without waiting.
        assert_eq!(slept, [250, 500, 0, 250, 500, 0, 250, 500]);
        assert_eq!(started.elapsed(), Duration::from_millis(2250));

        // Without a per-model limit the delay doubles up to max_delay (8 s: 4 s at jitter
        // 0); the schedule itself is `backoff::Backoff`'s, tested there.
        let mut long = Plan::new(
            vec![cand("a", "p1", 1000)],
            RetryPolicy {
                max_attempts_per_model: 100,
                ..policy()
            },
        );
        let delays: Vec<Decision> = (0..7)
            .map(|_| {
                long.record_attempt();
                long.on_error(&ErrorClass::Transient, 0.0)
            })
            .collect();
        let ms = |n| Decision::RetryAfter(Duration::from_millis(n));
        assert_eq!(
            delays,
            [
                ms(250),
                ms(500),
                ms(1000),
                ms(2000),
                ms(4000),
                ms(4000),
                ms(4000)
            ]
        );
    }

    #[test]
    fn rate_limit_waits_as_told_unless_above_cap() {
        let mut p = plan();
        p.record_attempt();
        let d = p.on_error(
            &ErrorClass::RateLimited {
                retry_after: Some(Duration::from_secs(1)),
            },
            0.5,
        );
        assert_eq!(d, Decision::RetryAfter(Duration::from_secs(1)));
        p.record_attempt();
        let d = p.on_error(
            &ErrorClass::RateLimited {
                retry_after: Some(Duration::from_secs(61)),
            },
            0.5,
        );
        assert_eq!(d, Decision::Switch(1));
    }

    #[test]
    fn provider_rejection_skips_that_provider() {
        let mut p = plan();
        p.record_attempt();
        assert_eq!(
            p.on_error(&ErrorClass::ProviderRejected, 0.0),
            Decision::Switch(2)
        );
        assert_eq!(p.current().model, "c");
        p.record_attempt();
        assert_eq!(
            p.on_error(&ErrorClass::ProviderRejected, 0.0),
            Decision::Fail
        );
    }

    /// Issue 8 point 11: a 401/403 for one model of an aggregator skips that model only.
    #[test]
    fn access_denied_skips_the_model_not_the_provider() {
        let mut p = plan();
        p.record_attempt();
        assert_eq!(
            p.on_error(&ErrorClass::AccessDenied, 0.0),
            Decision::Switch(1)
        );
        assert_eq!(p.current().model, "b");
        assert_eq!(p.usable_alternatives(), vec![2]);
    }

    /// A second model of the same provider denied: the key is bad, the provider goes.
    #[test]
    fn access_denied_for_two_models_of_a_provider_excludes_it() {
        let mut p = Plan::new(
            vec![
                cand("a", "p1", 1000),
                cand("b", "p1", 1000),
                cand("x", "p1", 1000),
                cand("c", "p2", 1000),
            ],
            policy(),
        );
        p.record_attempt();
        assert_eq!(
            p.on_error(&ErrorClass::AccessDenied, 0.0),
            Decision::Switch(1)
        );
        assert_eq!(p.usable_alternatives(), vec![2, 3]);
        p.record_attempt();
        assert_eq!(
            p.on_error(&ErrorClass::AccessDenied, 0.0),
            Decision::Switch(3),
            "x is on p1, whose key was denied twice"
        );
        p.record_attempt();
        assert_eq!(p.on_error(&ErrorClass::AccessDenied, 0.0), Decision::Fail);
    }

    /// Denials on different providers do not add up: one each excludes neither.
    #[test]
    fn access_denied_counts_per_provider() {
        let mut p = Plan::new(
            vec![
                cand("a", "p1", 1000),
                cand("c", "p2", 1000),
                cand("b", "p1", 1000),
                cand("d", "p2", 1000),
            ],
            policy(),
        );
        p.record_attempt();
        assert_eq!(
            p.on_error(&ErrorClass::AccessDenied, 0.0),
            Decision::Switch(1)
        );
        p.record_attempt();
        assert_eq!(
            p.on_error(&ErrorClass::AccessDenied, 0.0),
            Decision::Switch(2)
        );
        assert_eq!(p.usable_alternatives(), vec![3]);
    }

    #[test]
    fn context_too_long_needs_a_larger_window() {
        let mut p = plan();
        p.record_attempt();
        assert_eq!(
            p.on_error(&ErrorClass::ContextTooLong, 0.0),
            Decision::Switch(1)
        );
        p.record_attempt();
        // c has 2000 < 4001
        assert_eq!(p.on_error(&ErrorClass::ContextTooLong, 0.0), Decision::Fail);
    }

    #[test]
    fn fatal_fails_at_once() {
        let mut p = plan();
        p.record_attempt();
        assert_eq!(p.on_error(&ErrorClass::Fatal, 0.0), Decision::Fail);
    }

    #[test]
    fn alternatives_respect_exclusions() {
        let mut p = plan();
        assert_eq!(p.usable_alternatives(), vec![1, 2]);
        p.record_attempt();
        p.on_error(&ErrorClass::ProviderRejected, 0.0);
        assert_eq!(p.usable_alternatives(), Vec::<usize>::new());
    }
}
