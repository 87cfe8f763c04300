//! llm-worker: a Redis-stream-driven LLM worker. See ARCHITECTURE.md for the map.
pub mod config;
pub mod sim;
