//! llm-worker: a Redis-stream-driven LLM worker. See ARCHITECTURE.md for the map.

/// `impl From<$cause> for $err` making `$variant(cause)`, for an error variant whose
/// message prints its cause (`#[error("redis: {0} ...")]`). thiserror's `#[from]` would
/// also make the cause the error's `source()`, and every reporter that walks the chain
/// (`{:#}` in main) would print it twice; log lines (`error = %e`) show only the message,
/// so the message is where the cause belongs.
macro_rules! from_cause {
    ($err:ty, $variant:path, $cause:ty) => {
        impl From<$cause> for $err {
            fn from(e: $cause) -> Self {
                $variant(e)
            }
        }
    };
}
pub mod backoff;
pub mod budget;
pub mod config;
pub mod connect;
pub mod context;
pub mod cooldown;
pub mod cost;
pub mod daemon;
pub mod demo;
pub mod gate;
pub mod job;
pub mod keycheck;
pub mod letters;
pub mod line;
pub mod notify;
pub mod outcome;
pub mod provider;
pub mod queue;
pub mod quota;
pub mod ratelimit;
pub mod resident;
pub mod router;
pub mod scripts;
pub mod server;
pub mod shutdown;
pub mod sim;
pub mod slots;
pub mod state;
pub mod sync;
pub mod tenants;
pub mod tools;
pub mod wait;
pub mod watch;
pub mod worker;

#[cfg(test)]
mod error_chain_tests {
    //! An error is printed as its message followed by its `source()` chain (`{:#}` in
    //! main, any reporter that walks the chain): a message that already shows its cause
    //! must not also return it as its source, or the cause is printed twice.

    use std::error::Error;

    /// The message and every source, joined as anyhow's `{:#}` joins them.
    fn chain(e: &dyn Error) -> String {
        let mut out = e.to_string();
        let mut cur = e.source();
        while let Some(s) = cur {
            out.push_str(": ");
            out.push_str(&s.to_string());
            cur = s.source();
        }
        out
    }

    fn once(e: &dyn Error, cause: &str) {
        let text = chain(e);
        assert_eq!(
            text.matches(cause).count(),
            1,
            "the cause is printed exactly once: {text}"
        );
    }

    fn redis_err() -> redis::RedisError {
        redis::RedisError::from((redis::ErrorKind::Io, "boom-cause"))
    }

    #[test]
    fn every_error_prints_its_cause_once() {
        let bad_url = reqwest::Client::new().get("not a url").build().unwrap_err();
        let text = bad_url.to_string();
        let client = crate::provider::ProviderError::Client {
            name: "p".into(),
            error: bad_url,
        };
        once(&client, &text);
        once(
            &crate::connect::ConnectError::from(redis_err()),
            "boom-cause",
        );
        once(&crate::slots::SlotError::from(redis_err()), "boom-cause");
        once(&crate::queue::QueueError::from(redis_err()), "boom-cause");
        once(&crate::tools::ToolError::from(redis_err()), "boom-cause");
        let io = std::io::Error::other("io-cause");
        once(&crate::tools::ToolError::from(io), "io-cause");
        let pool = deadpool_redis::PoolError::Timeout(deadpool_redis::TimeoutType::Wait);
        let text = pool.to_string();
        once(&crate::slots::SlotError::from(pool), &text);
        let pool = deadpool_redis::PoolError::Timeout(deadpool_redis::TimeoutType::Wait);
        once(&crate::queue::QueueError::from(pool), &text);
        // Wrapped once more (transparent): still once.
        let inner = crate::connect::ConnectError::from(redis_err());
        once(&crate::slots::SlotError::from(inner), "boom-cause");
    }
}
