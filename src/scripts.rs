//! Every Lua script of `lua/`, one `redis::Script` each, loaded once (`include_str!`, run
//! with EVALSHA and loaded on NOSCRIPT). The callers (`queue`, `slots`) own what the
//! scripts mean; this room only owns that each file is compiled in exactly once.
//!
//! Invariant: every key a script touches shares the `{namespace}` hash tag and is passed
//! in KEYS: no script builds a key name from ARGV or from a value it reads (Redis Cluster
//! checks declared keys before running a script, and proxies enforce them).

use redis::Script;
use std::sync::LazyLock;

/// One call of a script of this room: the same EVALSHA (and SCRIPT LOAD on NOSCRIPT) as
/// redis-rs's `ScriptInvocation`, built straight into two command buffers (keys, then
/// arguments). `ScriptInvocation` allocates a `Vec` per key and argument and copies them
/// all into the command it sends; the commit alone has 40 to 70 per job, which made the
/// allocator the largest cost of a job in the worker (callgrind, docs/performance.md).
pub struct Call<'a> {
    script: &'a Script,
    keys: redis::Cmd,
    args: redis::Cmd,
}

impl<'a> Call<'a> {
    /// A call of `script` with no key and no argument yet.
    pub fn new(script: &'a Script) -> Call<'a> {
        Call {
            script,
            keys: redis::Cmd::with_capacity(16, 512),
            args: redis::Cmd::with_capacity(32, 1024),
        }
    }

    /// Adds `KEYS[n]` (every key a script touches is passed so; see the tests below).
    pub fn key<T: redis::ToRedisArgs>(&mut self, key: T) -> &mut Self {
        self.keys.arg(key);
        self
    }

    /// Adds `ARGV[n]`.
    pub fn arg<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.args.arg(arg);
        self
    }

    /// The EVALSHA command: hash, key count, keys, arguments (for a pipeline; it does not
    /// load the script on NOSCRIPT as [`Call::invoke_value`] does).
    pub fn command(&self) -> redis::Cmd {
        let (keys, args) = (self.keys.args_iter(), self.args.args_iter());
        let size: usize = keys
            .clone()
            .chain(args.clone())
            .map(|a| match a {
                redis::Arg::Simple(b) => b.len(),
                _ => 0,
            })
            .sum();
        let nkeys = keys.len();
        let mut cmd = redis::Cmd::with_capacity(3 + nkeys + args.len(), size + 64);
        cmd.arg("EVALSHA").arg(self.script.get_hash()).arg(nkeys);
        for a in keys.chain(args) {
            if let redis::Arg::Simple(b) = a {
                cmd.arg(b);
            }
        }
        cmd
    }

    /// Runs the script (loading it first if Redis does not know it) and parses its reply;
    /// an error anywhere in the reply is the call's error.
    pub async fn invoke<T: redis::FromRedisValue>(
        &self,
        con: &mut impl redis::aio::ConnectionLike,
    ) -> redis::RedisResult<T> {
        let v = self.invoke_value(con).await?;
        Ok(redis::from_redis_value(v.extract_error()?)?)
    }

    /// Runs the script like [`Call::invoke`] and returns its reply as Redis gave it:
    /// error replies nested in an array stay in place as `Value::ServerError` (the
    /// commit script answers each job of a batch on its own; `invoke` would turn one
    /// job's error into an error of the whole call). A top-level error reply is an `Err`.
    pub async fn invoke_value(
        &self,
        con: &mut impl redis::aio::ConnectionLike,
    ) -> redis::RedisResult<redis::Value> {
        async fn once(
            cmd: &redis::Cmd,
            con: &mut impl redis::aio::ConnectionLike,
        ) -> redis::RedisResult<redis::Value> {
            match con.req_packed_command(cmd).await? {
                redis::Value::ServerError(e) => Err(e.into()),
                v => Ok(v),
            }
        }
        let cmd = self.command();
        match once(&cmd, con).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.script.load_async(con).await?;
                once(&cmd, con).await
            }
            r => r,
        }
    }
}

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
/// A job paused by a budget covering some jobs parked (same move as a hand-back).
pub static BUDGET_PARK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("../lua/key_types.lua"),
        include_str!("../lua/move_entry.lua"),
        include_str!("../lua/budget_park.lua")
    ))
});
/// Jobs parked by a budget moved back, as many as it has room for.
pub static BUDGET_UNPARK: LazyLock<Script> = with_prelude!("key_types.lua", "budget_unpark.lua");
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
/// Start-time probe: may the Redis user touch every key family of a job's path?
pub static ACCESS_PROBE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/access_probe.lua")));

#[cfg(test)]
mod tests {
    //! A static check of `lua/`: no key argument of a Redis command is built inside a
    //! script. It reads the scripts as text, so it is deliberately simple: a key argument
    //! (the first argument after the command; every argument of DEL, EXISTS, MGET, ...)
    //! must not concatenate (`..`), use ARGV, be a string literal, or be a local assigned
    //! (directly or through other locals, over several lines) from any of those or from
    //! a value read from Redis. Not covered: function parameters (the preludes' `h`,
    //! `jobs`, ...) are trusted and their call sites are not checked, nor are keys in
    //! later positions (RENAME's second, ZUNIONSTORE's sources; no script uses those).

    /// Splits `s` at commas outside brackets and strings.
    fn split_top(s: &str) -> Vec<String> {
        let (mut out, mut cur, mut depth, mut quote) = (vec![], String::new(), 0i32, None);
        for ch in s.chars() {
            match (quote, ch) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '\'' | '"') => quote = Some(ch),
                (None, '(' | '[' | '{') => depth += 1,
                (None, ')' | ']' | '}') => depth -= 1,
                (None, ',') if depth == 0 => {
                    out.push(cur.trim().to_string());
                    cur.clear();
                    continue;
                }
                _ => {}
            }
            cur.push(ch);
        }
        if !cur.trim().is_empty() {
            out.push(cur.trim().to_string());
        }
        out
    }

    /// The argument list of the call whose `(` is at `open`.
    fn call_args(src: &str, open: usize) -> String {
        let (mut depth, mut quote) = (0i32, None);
        for (i, ch) in src[open..].char_indices() {
            match (quote, ch) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '\'' | '"') => quote = Some(ch),
                (None, '(') => depth += 1,
                (None, ')') => {
                    depth -= 1;
                    if depth == 0 {
                        return src[open + 1..open + i].to_string();
                    }
                }
                _ => {}
            }
        }
        String::new()
    }

    fn tainted(expr: &str) -> bool {
        expr.contains("..") || expr.contains("ARGV") || expr.contains('\'') || expr.contains('"')
    }

    /// Every key argument in `src` that is built rather than taken from KEYS.
    fn built_keys(src: &str) -> Vec<String> {
        // Comments dropped; a statement continued on the next line joined to it.
        let mut code = String::new();
        for l in src.lines() {
            let l = l.split("--").next().unwrap_or("").trim_end();
            code.push_str(l);
            let open = l.ends_with(['=', ',', '(']) || l.ends_with("..");
            code.push(if open { ' ' } else { '\n' });
        }
        // Locals assigned from something that is not KEYS, directly or through others.
        let mut built = std::collections::HashSet::new();
        let uses_built = |v: &str, built: &std::collections::HashSet<String>| {
            v.split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .any(|w| built.contains(w))
        };
        for line in code.lines().cycle().take(code.lines().count() * 4) {
            let line = line.trim().trim_start_matches("local ");
            let Some((lhs, rhs)) = line.split_once('=') else {
                continue;
            };
            if rhs.starts_with('=') || lhs.ends_with(['~', '<', '>', '=']) {
                continue; // a comparison, not an assignment
            }
            let names: Vec<&str> = lhs.split(',').map(str::trim).collect();
            if names
                .iter()
                .any(|n| !n.chars().all(|c| c.is_alphanumeric() || c == '_'))
            {
                continue;
            }
            let values = split_top(rhs);
            for (n, name) in names.iter().enumerate() {
                let v = values.get(n).map_or("", String::as_str);
                // An element of KEYS is a declared key, whatever its index.
                let from_keys = v.contains("KEYS[") && !tainted(v) && !v.contains("redis.");
                if !from_keys && (tainted(v) || v.contains("redis.") || uses_built(v, &built)) {
                    built.insert(name.to_string());
                }
            }
        }
        let mut bad = vec![];
        for pat in ["redis.call(", "redis.pcall("] {
            for (at, _) in code.match_indices(pat) {
                let args = split_top(&call_args(&code, at + pat.len() - 1));
                let Some(cmd) = args.first() else { continue };
                let cmd = cmd.trim_matches(['\'', '"']).to_ascii_uppercase();
                let keys: &[String] = match cmd.as_str() {
                    "TIME" => &[],
                    "DEL" | "EXISTS" | "MGET" | "UNLINK" | "TOUCH" => &args[1..],
                    "XINFO" | "XGROUP" => args.get(2..3).unwrap_or(&[]),
                    _ => args.get(1..2).unwrap_or(&[]),
                };
                for k in keys {
                    let name = k.split('[').next().unwrap_or("");
                    if tainted(k) || (built.contains(name) && !k.starts_with("KEYS")) {
                        bad.push(format!("{cmd} {k}"));
                    }
                }
            }
        }
        bad
    }

    #[test]
    fn a_call_sends_evalsha_with_keys_then_arguments_byte_for_byte() {
        let script = redis::Script::new("return 1");
        let mut call = super::Call::new(&script);
        call.arg("a1")
            .key("k1")
            .arg(&b"\0\xff\r\n$"[..])
            .key(b"k2".to_vec())
            .arg("")
            .arg(&[] as &[u8])
            .arg(vec!["x", ""])
            .arg(None::<&str>)
            .arg(u64::MAX)
            .arg(-7i64);
        let mut want = redis::cmd("EVALSHA");
        want.arg(script.get_hash())
            .arg(2)
            .arg("k1")
            .arg("k2")
            .arg("a1")
            .arg(&b"\0\xff\r\n$"[..])
            .arg("")
            .arg("")
            .arg("x")
            .arg("")
            .arg(u64::MAX)
            .arg(-7i64);
        assert_eq!(
            call.command().get_packed_command(),
            want.get_packed_command()
        );
    }

    #[test]
    fn the_check_finds_keys_built_in_a_script() {
        let src = "local key = prefix .. f\nredis.call('GET', key)\n\
                   redis.call('EXISTS', ARGV[5] .. h[1])\n\
                   local k = KEYS[1]\nredis.call('SET', k, ARGV[1] .. 'x')\n\
                   redis.call('DEL', KEYS[2], ARGV[4] .. token)\n\
                   local p = ARGV[1]\nlocal q = p\nredis.call('GET', q)\n\
                   local m =\n  ARGV[2] ..\n  'x'\nredis.call('GET', m)\n";
        assert_eq!(
            built_keys(src),
            vec![
                "GET key",
                "EXISTS ARGV[5] .. h[1]",
                "DEL ARGV[4] .. token",
                "GET q",
                "GET m"
            ]
        );
    }

    #[test]
    fn no_script_builds_a_key_name() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("lua");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .expect("lua/")
            .map(|e| e.expect("lua/ entry").path())
            .collect();
        files.sort();
        assert!(files.len() >= 10, "the scripts are where expected");
        let mut bad = vec![];
        for f in files {
            let src = std::fs::read_to_string(&f).expect("a script");
            for b in built_keys(&src) {
                bad.push(format!("{}: {b}", f.display()));
            }
        }
        assert!(
            bad.is_empty(),
            "keys built inside scripts:\n{}",
            bad.join("\n")
        );
    }
}
