//! Shared parts of the benchmark: the bullmq-official peer (worker and producer), used
//! by the `bullmq-peer` binary and by the driver's backlog pre-fill.

pub mod peer;
