//! The result and dead-letter wire format: what a finished job leaves in `{ns}:results`
//! and `{ns}:dead` (CONTRACT.md, "A result").
//!
//! Why a module of its own: the field names and value formatting are the contract that
//! producers, operators and black-box tests read. Writing them in one place (encode) next
//! to the one reader (decode) keeps them from drifting; the worker, `results`, `status`
//! and the demo build and read typed values and never spell a field name.
//!
//! Invariants:
//! - every field-name string literal of a result or dead letter is in this file;
//! - `ResultEntry::from_fields(e.into_fields()) == e` and likewise for [`DeadLetter`];
//! - the bytes are those the contract fixes: integers in decimal, `cost_usd` as
//!   [`cost::format_usd`] (normalized, `0` when nothing was billed), `tried`
//!   comma-separated (empty when no model was called), `metadata` as the job's JSON text;
//!   optional fields are absent (never empty) when they have no value.

use super::reply::Field;
use crate::cost;
use rust_decimal::Decimal;
use std::collections::HashMap;
use std::str::FromStr;

/// Why an entry read from a stream is not a well-formed result or dead letter.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("{kind} entry has no field `{field}` (was it written by llm-worker?)")]
    Missing {
        kind: &'static str,
        field: &'static str,
    },
    #[error(
        "{kind} entry field `{field}` = {value:?} is not {expected} (was it written by llm-worker?)"
    )]
    Bad {
        kind: &'static str,
        field: &'static str,
        value: String,
        expected: &'static str,
    },
}

/// A result's `status` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResultStatus {
    /// A model answered.
    Ok,
    /// Every route option exhausted (or the result could not be written as it was).
    Failed,
    /// The payload could not be processed; a dead letter goes with it.
    Invalid,
    /// Delivered too many times; a dead letter goes with it.
    Dead,
    /// Cancelled (`llm-worker cancel`, or the `{ns}:cancel:<id>` marker): no call if it
    /// had not started one, else its call aborted.
    Cancelled,
    /// Its `deadline_ms` passed: no call if it had not started one, else its call aborted.
    Expired,
}

impl ResultStatus {
    /// Every status, in declaration order.
    pub const ALL: [ResultStatus; 6] = [
        ResultStatus::Ok,
        ResultStatus::Failed,
        ResultStatus::Invalid,
        ResultStatus::Dead,
        ResultStatus::Cancelled,
        ResultStatus::Expired,
    ];

    /// This status's place in [`ResultStatus::ALL`].
    pub fn index(self) -> usize {
        match self {
            ResultStatus::Ok => 0,
            ResultStatus::Failed => 1,
            ResultStatus::Invalid => 2,
            ResultStatus::Dead => 3,
            ResultStatus::Cancelled => 4,
            ResultStatus::Expired => 5,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ResultStatus::Ok => "ok",
            ResultStatus::Failed => "failed",
            ResultStatus::Invalid => "invalid",
            ResultStatus::Dead => "dead",
            ResultStatus::Cancelled => "cancelled",
            ResultStatus::Expired => "expired",
        }
    }

    /// The status named `s`, as [`ResultStatus::as_str`] writes it; `None` for any other text.
    pub fn parse(s: &str) -> Option<ResultStatus> {
        Some(match s {
            "ok" => ResultStatus::Ok,
            "failed" => ResultStatus::Failed,
            "invalid" => ResultStatus::Invalid,
            "dead" => ResultStatus::Dead,
            "cancelled" => ResultStatus::Cancelled,
            "expired" => ResultStatus::Expired,
            _ => return None,
        })
    }
}

impl std::fmt::Display for ResultStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One entry of `{ns}:results`.
///
/// Presence rules (CONTRACT.md): `model`, `content`, `finish_reason` on `ok` results;
/// `error` on every other status; `cached_tokens` only when a model call was planned
/// (absent on `invalid`, `dead` and duplicate results); `metadata` when the job had one;
/// `duplicate_of` on the result of a copy of an id that already had one; `warning` when
/// the worker ignored something of the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultEntry {
    pub job_id: String,
    pub job_entry: String,
    pub status: ResultStatus,
    /// From taking the job to writing the result.
    pub latency_ms: u64,
    /// Consumer name of the worker that wrote it.
    pub worker: String,
    pub model: Option<String>,
    pub content: Option<String>,
    pub finish_reason: Option<String>,
    /// One line; present on every status but `ok`.
    pub error: Option<String>,
    /// Summed over every billed attempt (0 when none).
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: Option<u64>,
    /// The cost of every billed attempt of this job.
    pub cost_usd: Decimal,
    /// Provider calls made for this job.
    pub attempts: u64,
    /// Models tried, in order (written comma-separated).
    pub tried: Vec<String>,
    /// The result entry id of the original, on a duplicate's result.
    pub duplicate_of: Option<String>,
    /// The job's `metadata`, as JSON text (copied, not re-parsed, on decode).
    pub metadata: Option<String>,
    /// The job's `tenant`, when it gave one.
    pub tenant: Option<String>,
    /// JSON array of each billed attempt's raw usage object (present when a model call
    /// was planned, like `cached_tokens`).
    pub usage: Option<String>,
    /// Messages left out to fit the model's context window (`[context] policy = trim`).
    pub trimmed_messages: Option<u64>,
    pub warning: Option<String>,
}

const RESULT: &str = "result";
/// Most fields a result entry has ([`ResultEntry::into_fields`]).
const RESULT_FIELDS_MAX: usize = 21;
const DEAD: &str = "dead-letter";

impl ResultEntry {
    /// A result for which no model was called (yet): zero tokens, cost 0, no attempts,
    /// nothing tried. The caller fills in what happened.
    pub fn new(
        job_id: &str,
        job_entry: &str,
        status: ResultStatus,
        latency_ms: u64,
        worker: &str,
    ) -> ResultEntry {
        ResultEntry {
            job_id: job_id.to_string(),
            job_entry: job_entry.to_string(),
            status,
            latency_ms,
            worker: worker.to_string(),
            model: None,
            content: None,
            finish_reason: None,
            error: None,
            input_tokens: 0,
            output_tokens: 0,
            cached_tokens: None,
            cost_usd: Decimal::ZERO,
            attempts: 0,
            tried: vec![],
            duplicate_of: None,
            metadata: None,
            tenant: None,
            usage: None,
            trimmed_messages: None,
            warning: None,
        }
    }

    /// The fields to XADD, in a fixed order. Optional fields without a value are left out.
    pub fn into_fields(self) -> Vec<(&'static str, Vec<u8>)> {
        let num = |n: u64| n.to_string().into_bytes();
        // Sized for every field below at once (5 always, 16 more at most): grown from
        // `vec![..5]` it reallocated and moved twice a job.
        let mut f: Vec<(&'static str, Vec<u8>)> = Vec::with_capacity(RESULT_FIELDS_MAX);
        f.extend([
            ("job_id", self.job_id.into_bytes()),
            ("job_entry", self.job_entry.into_bytes()),
            ("status", self.status.as_str().as_bytes().to_vec()),
            ("latency_ms", num(self.latency_ms)),
            ("worker", self.worker.into_bytes()),
        ]);
        let opt = |f: &mut Vec<(&'static str, Vec<u8>)>, k, v: Option<String>| {
            if let Some(v) = v {
                f.push((k, v.into_bytes()));
            }
        };
        opt(&mut f, "model", self.model);
        opt(&mut f, "content", self.content);
        opt(&mut f, "finish_reason", self.finish_reason);
        opt(&mut f, "error", self.error);
        f.push(("input_tokens", num(self.input_tokens)));
        f.push(("output_tokens", num(self.output_tokens)));
        if let Some(c) = self.cached_tokens {
            f.push(("cached_tokens", num(c)));
        }
        f.push(("cost_usd", cost::format_usd(self.cost_usd).into_bytes()));
        f.push(("attempts", num(self.attempts)));
        f.push(("tried", self.tried.join(",").into_bytes()));
        opt(&mut f, "duplicate_of", self.duplicate_of);
        opt(&mut f, "metadata", self.metadata);
        opt(&mut f, "tenant", self.tenant);
        opt(&mut f, "usage", self.usage);
        if let Some(n) = self.trimmed_messages {
            f.push(("trimmed_messages", num(n)));
        }
        opt(&mut f, "warning", self.warning);
        f
    }

    /// Reads a result entry's fields (any map or list of name/value pairs, e.g. from
    /// XRANGE). Fields this version does not know are ignored. Errors name the field that
    /// is missing or malformed.
    pub fn from_fields<K, V>(fields: impl IntoIterator<Item = (K, V)>) -> Result<Self, WireError>
    where
        K: AsRef<str>,
        V: AsRef<[u8]>,
    {
        let m: HashMap<String, Vec<u8>> = fields
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_string(), v.as_ref().to_vec()))
            .collect();
        let r = Reader {
            kind: RESULT,
            m: &m,
        };
        let status_text = r.req("status")?;
        let status = ResultStatus::parse(&status_text).ok_or_else(|| WireError::Bad {
            kind: RESULT,
            field: "status",
            value: status_text.clone(),
            expected: "one of ok, failed, invalid, dead",
        })?;
        let tried = r.req("tried")?;
        Ok(ResultEntry {
            job_id: r.req("job_id")?,
            job_entry: r.req("job_entry")?,
            status,
            latency_ms: r.num("latency_ms")?,
            worker: r.req("worker")?,
            model: r.opt("model")?,
            content: r.opt("content")?,
            finish_reason: r.opt("finish_reason")?,
            error: r.opt("error")?,
            input_tokens: r.num("input_tokens")?,
            output_tokens: r.num("output_tokens")?,
            cached_tokens: match r.opt("cached_tokens")? {
                Some(_) => Some(r.num("cached_tokens")?),
                None => None,
            },
            cost_usd: {
                let s = r.req("cost_usd")?;
                Decimal::from_str(&s).map_err(|_| r.bad("cost_usd", &s, "a decimal number"))?
            },
            attempts: r.num("attempts")?,
            tried: if tried.is_empty() {
                vec![]
            } else {
                tried.split(',').map(str::to_string).collect()
            },
            duplicate_of: r.opt("duplicate_of")?,
            metadata: r.opt("metadata")?,
            tenant: r.opt("tenant")?,
            usage: r.opt("usage")?,
            trimmed_messages: r
                .opt("trimmed_messages")?
                .map(|s| {
                    s.parse()
                        .map_err(|_| r.bad("trimmed_messages", &s, "an integer"))
                })
                .transpose()?,
            warning: r.opt("warning")?,
        })
    }

    /// Reads a stream entry as redis-rs returns it (`StreamId::map`).
    pub fn from_redis_map(map: &HashMap<String, redis::Value>) -> Result<Self, WireError> {
        Self::from_fields(map.iter().map(|(k, v)| (k.as_str(), value_bytes(v))))
    }

    /// The answer of `original` (another result of the same id), repeated on a duplicate's
    /// result: model, content, finish_reason, error, whichever it has. Reads them leniently,
    /// field by field, so a damaged original still passes on what it has.
    pub fn copy_answer<K, V>(&mut self, original: impl IntoIterator<Item = (K, V)>)
    where
        K: AsRef<str>,
        V: AsRef<[u8]>,
    {
        for (k, v) in original {
            let v = String::from_utf8_lossy(v.as_ref()).into_owned();
            match k.as_ref() {
                "model" => self.model = Some(v),
                "content" => self.content = Some(v),
                "finish_reason" => self.finish_reason = Some(v),
                "error" => self.error = Some(v),
                _ => {}
            }
        }
    }

    /// The smallest result that says what happened when this one cannot be written (a key
    /// it touches has the wrong type): status `failed` with `error`, keeping the ids,
    /// latency, worker, usage, cost, attempts, tried and metadata; dropping the answer,
    /// `duplicate_of` and `warning`.
    pub fn minimal_failed(&self, error: String) -> ResultEntry {
        ResultEntry {
            status: ResultStatus::Failed,
            model: None,
            content: None,
            finish_reason: None,
            error: Some(error),
            duplicate_of: None,
            warning: None,
            ..self.clone()
        }
    }
}

/// One entry of `{ns}:dead`: the worker's fields first (`job_entry`, `job_id` if known,
/// `reason`, `deliveries`), then every field of the original job entry, name and value
/// verbatim as bytes, in the original's order (a name that clashes with one of ours
/// appears twice, ours first; a name that is not UTF-8 stays as it was). An entry of
/// more than [`MAX_VERBATIM_FIELDS`] fields is kept whole as one field [`PACKED_FIELDS`]
/// (see [`pack_fields`]): a Lua script cannot pass more arguments to one command.
/// The original is the producer's fields only: the hand-back's bookkeeping fields
/// (`_deliveries`, `_entry`, `_billed`) are not copied; what they say is in `deliveries`
/// and in the result (cost, attempts).
///
/// Invariant: `original` is never empty; an entry without fields is recorded as an
/// empty `payload`, so every dead letter has the contract's `payload` field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    pub job_entry: String,
    pub job_id: Option<String>,
    pub reason: String,
    pub deliveries: u64,
    original: Vec<Field>,
}

impl DeadLetter {
    pub fn new(
        job_entry: &str,
        job_id: Option<&str>,
        reason: &str,
        deliveries: u64,
        original: Vec<Field>,
    ) -> DeadLetter {
        let original = if original.is_empty() {
            vec![(b"payload".to_vec(), vec![])]
        } else {
            original
        };
        DeadLetter {
            job_entry: job_entry.to_string(),
            job_id: job_id.map(str::to_string),
            reason: reason.to_string(),
            deliveries,
            original,
        }
    }

    /// The original entry's fields, verbatim, in the order they were written.
    pub fn original(&self) -> &[Field] {
        &self.original
    }

    /// The fields to XADD (names as bytes: the original's names are the producer's).
    pub fn into_fields(self) -> Vec<Field> {
        let mut f = vec![(b"job_entry".to_vec(), self.job_entry.into_bytes())];
        if let Some(j) = self.job_id {
            f.push((b"job_id".to_vec(), j.into_bytes()));
        }
        f.push((b"reason".to_vec(), self.reason.into_bytes()));
        f.push((
            b"deliveries".to_vec(),
            self.deliveries.to_string().into_bytes(),
        ));
        if self.original.len() > MAX_VERBATIM_FIELDS {
            f.push((
                PACKED_FIELDS.as_bytes().to_vec(),
                pack_fields(&self.original),
            ));
        } else {
            f.extend(self.original);
        }
        f
    }

    /// Reads a dead letter from its fields in stream order (as XRANGE returns them; a map
    /// would lose a name the original shares with ours). Errors name the field that is
    /// missing or malformed.
    pub fn from_fields<K, V>(fields: &[(K, V)]) -> Result<Self, WireError>
    where
        K: AsRef<[u8]>,
        V: AsRef<[u8]>,
    {
        let mut it = fields
            .iter()
            .map(|(k, v)| (k.as_ref(), v.as_ref()))
            .peekable();
        let mut take = |name: &'static str, required: bool| -> Result<Option<String>, WireError> {
            match it.peek() {
                Some((k, v)) if *k == name.as_bytes() => {
                    let v = String::from_utf8(v.to_vec()).map_err(|e| WireError::Bad {
                        kind: DEAD,
                        field: name,
                        value: String::from_utf8_lossy(e.as_bytes()).into_owned(),
                        expected: "UTF-8 text",
                    })?;
                    it.next();
                    Ok(Some(v))
                }
                _ if required => Err(WireError::Missing {
                    kind: DEAD,
                    field: name,
                }),
                _ => Ok(None),
            }
        };
        let job_entry = take("job_entry", true)?.unwrap_or_default();
        let job_id = take("job_id", false)?;
        let reason = take("reason", true)?.unwrap_or_default();
        let deliveries_text = take("deliveries", true)?.unwrap_or_default();
        let deliveries = deliveries_text.parse().map_err(|_| WireError::Bad {
            kind: DEAD,
            field: "deliveries",
            value: deliveries_text.clone(),
            expected: "a non-negative integer",
        })?;
        let mut original: Vec<Field> = it.map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
        if let [(name, packed)] = original.as_slice()
            && name == PACKED_FIELDS.as_bytes()
            && let Some(fields) = unpack_fields(packed)
        {
            original = fields;
        }
        if original.is_empty() {
            return Err(WireError::Missing {
                kind: DEAD,
                field: "payload",
            });
        }
        Ok(DeadLetter {
            job_entry,
            job_id,
            reason,
            deliveries,
            original,
        })
    }
}

/// Most fields of an original job entry a dead letter or a hand-back copies one by one.
/// Past it they are kept as one [`PACKED_FIELDS`] field: a Lua script passes at most
/// ~8000 arguments to one command (Lua's C stack), so a wider entry could not be written
/// in the one atomic step at all.
pub const MAX_VERBATIM_FIELDS: usize = 1000;

/// The field that holds a whole entry's fields packed by [`pack_fields`] (in a dead
/// letter, and in a handed-back job entry: `lua/handback.lua` packs the same way; the
/// reader unpacks it). A name producers must not use on its own.
pub const PACKED_FIELDS: &str = "_packed";

/// Every name and value in order, each as a netstring (`<byte length>:<bytes>,`):
/// binary-safe and verbatim, whatever the bytes.
pub fn pack_fields(fields: &[Field]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in fields {
        for b in [k.as_slice(), v.as_slice()] {
            out.extend_from_slice(b.len().to_string().as_bytes());
            out.push(b':');
            out.extend_from_slice(b);
            out.push(b',');
        }
    }
    out
}

/// The fields [`pack_fields`] packed; `None` if `packed` is not such a packing (then it
/// is an ordinary value, kept as it is). Names and values come back byte for byte.
pub fn unpack_fields(packed: &[u8]) -> Option<Vec<Field>> {
    let mut rest = packed;
    let mut items: Vec<&[u8]> = Vec::new();
    while !rest.is_empty() {
        let colon = rest.iter().position(|&b| b == b':')?;
        let digits = std::str::from_utf8(&rest[..colon]).ok()?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let len: usize = digits.parse().ok()?;
        let start = colon + 1;
        let end = start.checked_add(len)?;
        if rest.get(end) != Some(&b',') {
            return None;
        }
        items.push(&rest[start..end]);
        rest = &rest[end + 1..];
    }
    if items.len() % 2 != 0 {
        return None;
    }
    Some(
        items
            .chunks(2)
            .map(|p| (p[0].to_vec(), p[1].to_vec()))
            .collect(),
    )
}

/// A field value's bytes as redis-rs returns it (bulk or simple string, integer).
fn value_bytes(v: &redis::Value) -> Vec<u8> {
    match v {
        redis::Value::BulkString(b) => b.clone(),
        redis::Value::SimpleString(s) => s.clone().into_bytes(),
        redis::Value::Int(i) => i.to_string().into_bytes(),
        _ => vec![],
    }
}

struct Reader<'a> {
    kind: &'static str,
    m: &'a HashMap<String, Vec<u8>>,
}

impl Reader<'_> {
    fn bad(&self, field: &'static str, value: &str, expected: &'static str) -> WireError {
        WireError::Bad {
            kind: self.kind,
            field,
            value: value.to_string(),
            expected,
        }
    }
    fn opt(&self, field: &'static str) -> Result<Option<String>, WireError> {
        match self.m.get(field) {
            None => Ok(None),
            Some(b) => String::from_utf8(b.clone())
                .map(Some)
                .map_err(|e| self.bad(field, &String::from_utf8_lossy(e.as_bytes()), "UTF-8 text")),
        }
    }
    fn req(&self, field: &'static str) -> Result<String, WireError> {
        self.opt(field)?.ok_or(WireError::Missing {
            kind: self.kind,
            field,
        })
    }
    fn num(&self, field: &'static str) -> Result<u64, WireError> {
        let s = self.req(field)?;
        s.parse()
            .map_err(|_| self.bad(field, &s, "a non-negative integer"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full_ok() -> ResultEntry {
        let mut e = ResultEntry::new("job-1", "1-0", ResultStatus::Ok, 42, "host-1");
        e.model = Some("m1".into());
        e.content = Some("hi, there".into());
        e.finish_reason = Some("stop".into());
        e.input_tokens = 10;
        e.output_tokens = 3;
        e.cached_tokens = Some(4);
        e.cost_usd = Decimal::from_str("0.0004109").unwrap();
        e.attempts = 2;
        e.tried = vec!["m0".into(), "m1".into()];
        e.metadata = Some(r#"{"k":1}"#.into());
        e.tenant = Some("acme".into());
        e.usage = Some(r#"[{"prompt_tokens":10}]"#.into());
        e.trimmed_messages = Some(3);
        e.warning = Some("ignored stream fields other than payload: x".into());
        e
    }

    fn get<'a>(f: &'a [(&'static str, Vec<u8>)], k: &str) -> Option<&'a str> {
        f.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| std::str::from_utf8(v).unwrap())
    }

    #[test]
    fn status_names_round_trip() {
        for s in ResultStatus::ALL {
            assert_eq!(ResultStatus::parse(s.as_str()), Some(s));
            assert_eq!(ResultStatus::ALL[s.index()], s);
        }
        assert_eq!(ResultStatus::parse("OK"), None);
    }

    #[test]
    fn a_result_with_every_field_fits_the_first_allocation() {
        // Every Option of ResultEntry set: the field list never grows past its capacity
        // (a new field must raise RESULT_FIELDS_MAX, or each job reallocates again).
        let mut e = full_ok();
        e.error = Some("e".into());
        e.duplicate_of = Some("9-0".into());
        let f = e.into_fields();
        // Every field, in the results stream's order: a field added to ResultEntry must
        // be added here too, and so to the count.
        let names: Vec<&str> = f.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "job_id",
                "job_entry",
                "status",
                "latency_ms",
                "worker",
                "model",
                "content",
                "finish_reason",
                "error",
                "input_tokens",
                "output_tokens",
                "cached_tokens",
                "cost_usd",
                "attempts",
                "tried",
                "duplicate_of",
                "metadata",
                "tenant",
                "usage",
                "trimmed_messages",
                "warning",
            ]
        );
        // Vec::with_capacity(n) holds exactly n today; grown from five it held 40.
        assert_eq!(
            (f.len(), f.capacity()),
            (RESULT_FIELDS_MAX, RESULT_FIELDS_MAX)
        );
    }

    #[test]
    fn result_round_trips() {
        let mut failed = ResultEntry::new("j", "2-0", ResultStatus::Failed, 0, "w");
        failed.error = Some("m: boom".into());
        failed.cached_tokens = Some(0);
        let mut dup = ResultEntry::new("j", "3-0", ResultStatus::Ok, 1, "w");
        dup.duplicate_of = Some("9-0".into());
        dup.model = Some("m".into());
        let mut one_tried = ResultEntry::new("j", "4-0", ResultStatus::Dead, 7, "w");
        one_tried.tried = vec!["only".into()];
        for e in [full_ok(), failed, dup, one_tried] {
            let back = ResultEntry::from_fields(e.clone().into_fields()).unwrap();
            assert_eq!(back, e);
        }
    }

    #[test]
    fn result_bytes_are_the_contracts() {
        let f = full_ok().into_fields();
        assert_eq!(get(&f, "status"), Some("ok"));
        assert_eq!(get(&f, "cost_usd"), Some("0.0004109"));
        assert_eq!(get(&f, "tried"), Some("m0,m1"));
        assert_eq!(get(&f, "latency_ms"), Some("42"));
        assert_eq!(get(&f, "metadata"), Some(r#"{"k":1}"#));
        assert_eq!(get(&f, "error"), None);
        // No call made: cost "0", tried empty (present), optional fields absent.
        let f = ResultEntry::new("j", "1-0", ResultStatus::Invalid, 5, "w").into_fields();
        let names: Vec<_> = f.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            names,
            [
                "job_id",
                "job_entry",
                "status",
                "latency_ms",
                "worker",
                "input_tokens",
                "output_tokens",
                "cost_usd",
                "attempts",
                "tried"
            ]
        );
        assert_eq!(get(&f, "cost_usd"), Some("0"));
        assert_eq!(get(&f, "tried"), Some(""));
        // A trailing-zero cost is normalized as before.
        let mut e = ResultEntry::new("j", "1-0", ResultStatus::Ok, 5, "w");
        e.cost_usd = Decimal::from_str("0.001000").unwrap();
        assert_eq!(get(&e.into_fields(), "cost_usd"), Some("0.001"));
    }

    #[test]
    fn decode_names_the_missing_or_bad_field() {
        let mut f = full_ok().into_fields();
        f.retain(|(k, _)| *k != "cost_usd");
        let err = ResultEntry::from_fields(f).unwrap_err();
        assert_eq!(
            err,
            WireError::Missing {
                kind: "result",
                field: "cost_usd"
            }
        );
        assert!(err.to_string().contains("`cost_usd`"), "{err}");
        let mut f = full_ok().into_fields();
        for (k, v) in &mut f {
            if *k == "attempts" {
                *v = b"two".to_vec();
            }
        }
        let err = ResultEntry::from_fields(f).unwrap_err();
        assert!(err.to_string().contains("`attempts`"), "{err}");
        let mut f = full_ok().into_fields();
        for (k, v) in &mut f {
            if *k == "status" {
                *v = b"weird".to_vec();
            }
        }
        assert!(matches!(
            ResultEntry::from_fields(f),
            Err(WireError::Bad {
                field: "status",
                ..
            })
        ));
    }

    #[test]
    fn decode_from_a_redis_map() {
        let m: HashMap<String, redis::Value> = full_ok()
            .into_fields()
            .into_iter()
            .map(|(k, v)| (k.to_string(), redis::Value::BulkString(v)))
            .collect();
        assert_eq!(ResultEntry::from_redis_map(&m).unwrap(), full_ok());
    }

    #[test]
    fn minimal_failed_keeps_usage_drops_answer() {
        let m = full_ok().minimal_failed("result could not be written".into());
        assert_eq!(m.status, ResultStatus::Failed);
        assert_eq!((m.model, m.content, m.warning), (None, None, None));
        assert_eq!(m.cost_usd, full_ok().cost_usd);
        assert_eq!(m.tried, full_ok().tried);
        assert_eq!(m.metadata, full_ok().metadata);
    }

    #[test]
    fn dead_letter_round_trips_and_keeps_original_fields() {
        let original = vec![
            (b"body".to_vec(), b"{\"x\":1}".to_vec()),
            (b"job_id".to_vec(), vec![0xff, 0x00]),
            (b"\xffx".to_vec(), b"name not UTF-8".to_vec()),
            (b"body".to_vec(), b"repeated".to_vec()),
        ];
        for d in [
            DeadLetter::new("1-0", Some("j"), "bad", 3, original.clone()),
            DeadLetter::new("1-0", None, "bad", 1, original.clone()),
            DeadLetter::new("1-0", None, "empty", 1, vec![]),
        ] {
            let f = d.clone().into_fields();
            assert_eq!(f[0].0, b"job_entry");
            assert_eq!(DeadLetter::from_fields(&f).unwrap(), d);
        }
        let f = DeadLetter::new("1-0", Some("j"), "bad", 3, original.clone()).into_fields();
        assert_eq!(&f[4..], &original[..]);
        let empty = DeadLetter::new("1-0", None, "empty", 1, vec![]).into_fields();
        assert_eq!(empty.last().unwrap(), &(b"payload".to_vec(), vec![]));
    }

    #[test]
    fn wide_dead_letter_packs_its_original_and_round_trips() {
        let wide: Vec<Field> = (0..=MAX_VERBATIM_FIELDS)
            .map(|i| {
                (
                    vec![b'f', 0xff, i as u8],
                    vec![b'1', b':', b',', 0xff, i as u8],
                )
            })
            .collect();
        let d = DeadLetter::new("1-0", None, "bad", 1, wide.clone());
        let f = d.clone().into_fields();
        assert_eq!(f.len(), 4, "job_entry, reason, deliveries, {PACKED_FIELDS}");
        assert_eq!(f[3].0, PACKED_FIELDS.as_bytes());
        assert_eq!(unpack_fields(&f[3].1).unwrap(), wide);
        assert_eq!(DeadLetter::from_fields(&f).unwrap(), d);
        // At the limit: verbatim.
        let d = DeadLetter::new("1-0", None, "bad", 1, wide[1..].to_vec());
        assert_eq!(d.into_fields().len(), 3 + MAX_VERBATIM_FIELDS);
    }

    #[test]
    fn unpack_rejects_what_pack_never_writes() {
        assert_eq!(unpack_fields(b""), Some(vec![]));
        assert_eq!(
            unpack_fields(b"1:a,0:,"),
            Some(vec![(b"a".to_vec(), vec![])])
        );
        for bad in [
            &b"1:a,"[..],
            b"x",
            b"2:a,",
            b"1:ab",
            b":a,1:b,",
            b"+1:a,1:b,",
        ] {
            assert_eq!(
                unpack_fields(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn dead_letter_decode_names_the_missing_field() {
        let mut f = DeadLetter::new("1-0", None, "bad", 2, vec![]).into_fields();
        f.retain(|(k, _)| k != b"reason");
        let err = DeadLetter::from_fields(&f).unwrap_err();
        assert_eq!(
            err,
            WireError::Missing {
                kind: "dead-letter",
                field: "reason"
            }
        );
    }

    /// Source files under `src/` whose path starts with `prefix` (a file or a directory).
    fn sources(prefix: &str) -> Vec<(String, String)> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut out = vec![];
        let mut stack = vec![root.clone()];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                    continue;
                }
                let rel = p
                    .strip_prefix(&root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                if rel.starts_with(prefix) && rel.ends_with(".rs") {
                    out.push((rel, std::fs::read_to_string(&p).unwrap()));
                }
            }
        }
        assert!(!out.is_empty(), "no source under src/{prefix}");
        out
    }

    /// Occurrences of `"name"` used as a value (not a metrics label `"name" =>`).
    fn literal_uses(text: &str, name: &str) -> usize {
        let lit = format!("\"{name}\"");
        text.match_indices(&lit)
            .filter(|(i, _)| !text[i + lit.len()..].trim_start().starts_with("=>"))
            .count()
    }

    /// The point of this module: the worker, `results` and the demo never spell a result
    /// or dead-letter field name; only this file does.
    #[test]
    fn field_names_are_spelled_only_here() {
        let every = [
            "job_id",
            "job_entry",
            "status",
            "model",
            "content",
            "finish_reason",
            "error",
            "input_tokens",
            "output_tokens",
            "cached_tokens",
            "cost_usd",
            "attempts",
            "tried",
            "latency_ms",
            "worker",
            "metadata",
            "tenant",
            "usage",
            "trimmed_messages",
            "warning",
            "duplicate_of",
            "reason",
            "deliveries",
        ];
        // tools and demo also build job payloads ("model", "content", "metadata") and
        // the status JSON (cost totals); these names belong to results alone.
        let result_only = [
            "job_id",
            "job_entry",
            "finish_reason",
            "attempts",
            "tried",
            "latency_ms",
            "duplicate_of",
        ];
        let mut found = vec![];
        for (prefix, names) in [
            ("worker", &every[..]),
            ("tools.rs", &result_only[..]),
            ("demo.rs", &result_only[..]),
        ] {
            for (file, text) in sources(prefix) {
                for n in names {
                    if literal_uses(&text, n) > 0 {
                        found.push(format!("src/{file}: \"{n}\""));
                    }
                }
            }
        }
        assert!(
            found.is_empty(),
            "result field names spelled outside queue/wire.rs: {found:?}"
        );
    }
}
