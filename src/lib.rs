//! llm-worker: a Redis-stream-driven LLM worker. See ARCHITECTURE.md for the map.
pub mod config;
pub mod connect;
pub mod cost;
pub mod daemon;
pub mod demo;
pub mod job;
pub mod outcome;
pub mod provider;
pub mod queue;
pub mod router;
pub mod server;
pub mod shutdown;
pub mod sim;
pub mod slots;
pub mod state;
pub mod tools;
pub mod worker;
