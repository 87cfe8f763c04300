//! Every Lua script of `lua/`, one `redis::Script` each, loaded once (`include_str!`, run
//! with EVALSHA and loaded on NOSCRIPT). The callers (`queue`, `slots`) own what the
//! scripts mean; this room only owns that each file is compiled in exactly once.
//!
//! Invariant: every key a script touches shares the `{namespace}` hash tag. The queue
//! scripts (and `replay.lua`) pass every key in KEYS; the slot scripts also build keys from ARGV prefixes
//! (waiter liveness, hand-off lists, restored slot keys): allowed by Redis Cluster (same
//! slot), refused by proxies that enforce declared keys (see the README's Cluster notes).

use redis::Script;
use std::sync::LazyLock;

/// A script of `lua/` with a shared prelude of `lua/` prepended.
macro_rules! with_prelude {
    ($prelude:literal, $file:literal) => {
        LazyLock::new(|| {
            Script::new(concat!(
                include_str!(concat!("../lua/", $prelude)),
                include_str!(concat!("../lua/", $file))
            ))
        })
    };
}

/// Result + dead letter + cost + result marker + XACK, checks before the first write.
pub static COMMIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/commit.lua")));
/// One letter pushed again as a job, once (only if it is still there), and deleted.
pub static REPLAY: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/replay.lua")));
/// Idempotency by job id: done / claimed / busy.
pub static CLAIM_ID: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/claim_id.lua")));
/// Scripts that beat the fleet heartbeat and read the stall gate start with its prelude
/// (`lua/stall_gate.lua`).
macro_rules! gated_script {
    ($file:literal) => {
        with_prelude!("stall_gate.lua", $file)
    };
}

/// Fleet heartbeat, stall gate, idle reset of this consumer's running entries.
pub static KEEPALIVE: LazyLock<Script> = gated_script!("keepalive.lua");
/// Stall gate + XAUTOCLAIM + delivery counts + tombstones of entries found deleted.
pub static RECLAIM: LazyLock<Script> = gated_script!("reclaim.lua");
/// Shutdown hand-back of unfinished entries as new entries.
pub static HAND_BACK: LazyLock<Script> = with_prelude!("move_entry.lua", "handback.lua");
/// A tenant's place under its cap, or the job parked (same move as a hand-back).
pub static TENANT_ADMIT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("../lua/tenant_clock.lua"),
        include_str!("../lua/move_entry.lua"),
        include_str!("../lua/tenant_admit.lua")
    ))
});
/// A tenant place given back; parked jobs moved back for the free places.
pub static TENANT_RELEASE: LazyLock<Script> =
    with_prelude!("tenant_clock.lua", "tenant_release.lua");
/// Renewal of this process's tenant places.
pub static TENANT_RENEW: LazyLock<Script> = with_prelude!("tenant_clock.lua", "tenant_renew.lua");
/// Removal of consumers that own no pending entry.
pub static CONSUMERS: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/consumers.lua")));

/// Every slot script starts with the lease-clock prelude (`lua/slot_clock.lua`).
macro_rules! slot_script {
    ($file:literal) => {
        with_prelude!("slot_clock.lua", $file)
    };
}

/// Take a free slot or queue for one.
pub static SLOT_ACQUIRE: LazyLock<Script> = slot_script!("slot_acquire.lua");
/// Token-checked release with hand-off to the longest waiter.
pub static SLOT_RELEASE: LazyLock<Script> = slot_script!("slot_release.lua");
/// Lease renewal of every slot this process holds.
pub static SLOT_RENEW: LazyLock<Script> = slot_script!("slot_renew.lua");

/// A call's budget reservation and rate admission, all or nothing.
pub static QUOTA_ADMIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/quota_admit.lua")));
/// After a call: the reservation settled, the tokens corrected.
pub static QUOTA_SETTLE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/quota_settle.lua")));
/// Set or lengthen a shared cooldown.
pub static COOLDOWN: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/cooldown.lua")));
