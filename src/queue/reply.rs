//! Stream replies read from the raw [`redis::Value`]: entry ids, and fields with names and
//! values as bytes, in stream order, repeated names kept.
//!
//! Why not redis-rs's typed replies (`StreamReadReply`, `StreamAutoClaimReply`,
//! `StreamRangeReply`): they hold an entry's fields in a `HashMap<String, _>`, so one
//! entry with a field name that is not UTF-8 fails the whole reply (a whole batch read,
//! every later reclaim) and a repeated name collapses into one. Here a reply fails only
//! when it is not shaped like a stream reply at all; what an entry holds is for its reader
//! to judge (the worker dead-letters an entry whose field names are not text).
//!
//! Invariant: every entry of a well-shaped reply comes out, with every field byte for byte.

use redis::{FromRedisValue, ParsingError, Value};

/// A field's name and value, as bytes.
pub type Field = (Vec<u8>, Vec<u8>);

/// One stream entry as Redis returned it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamEntry {
    pub id: String,
    /// Every field in stream order; `None` when Redis returned the id without its fields
    /// (the entry was deleted while pending).
    pub fields: Option<Vec<Field>>,
}

/// A list of entries, `[[id, [name, value, ...]], ...]` (XRANGE, XREVRANGE, XCLAIM, or a
/// script that returns entries).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Entries(pub Vec<StreamEntry>);

/// The entries of an XREAD / XREADGROUP reply, of every stream read, in order (nil when
/// the read timed out: none). RESP2 (`[[key, entries], ...]`) and RESP3 (a map).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadReply(pub Vec<StreamEntry>);

/// An XAUTOCLAIM reply: `[next cursor, entries, deleted ids]` (the last from Redis 7 on).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AutoClaimReply {
    pub next: String,
    pub claimed: Vec<StreamEntry>,
    pub deleted: Vec<String>,
}

fn shape(what: &str, v: &Value) -> ParsingError {
    format!("not a stream reply: expected {what}, got {v:?}").into()
}

fn items(v: Value, what: &str) -> Result<Vec<Value>, ParsingError> {
    match v {
        Value::Array(a) | Value::Set(a) => Ok(a),
        other => Err(shape(what, &other)),
    }
}

fn bytes(v: Value) -> Result<Vec<u8>, ParsingError> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        Value::VerbatimString { text, .. } => Ok(text.into_bytes()),
        Value::Int(i) => Ok(i.to_string().into_bytes()),
        other => Err(shape("a string", &other)),
    }
}

fn text(v: Value) -> Result<String, ParsingError> {
    String::from_utf8(bytes(v)?).map_err(|e| format!("not a stream reply: entry id {e}").into())
}

fn entry(v: Value) -> Result<StreamEntry, ParsingError> {
    let pair = items(v, "an entry [id, fields]")?;
    let [id, fields]: [Value; 2] = pair
        .try_into()
        .map_err(|p: Vec<Value>| shape("an entry [id, fields]", &Value::Array(p)))?;
    let flat = match fields {
        Value::Nil => None,
        Value::Map(m) => Some(m.into_iter().flat_map(|(k, v)| [k, v]).collect()),
        other => Some(items(other, "an entry's fields")?),
    };
    let fields = match flat {
        None => None,
        Some(flat) => {
            if flat.len() % 2 != 0 {
                return Err(shape("name/value pairs", &Value::Array(flat)));
            }
            let mut out = Vec::with_capacity(flat.len() / 2);
            let mut it = flat.into_iter();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                out.push((bytes(k)?, bytes(v)?));
            }
            Some(out)
        }
    };
    Ok(StreamEntry {
        id: text(id)?,
        fields,
    })
}

fn entries(v: Value) -> Result<Vec<StreamEntry>, ParsingError> {
    match v {
        Value::Nil => Ok(vec![]),
        // XAUTOCLAIM of Redis 6.2 lists a deleted entry as nil.
        other => items(other, "a list of entries")?
            .into_iter()
            .filter(|e| *e != Value::Nil)
            .map(entry)
            .collect(),
    }
}

impl FromRedisValue for Entries {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        entries(v).map(Entries)
    }
}

impl FromRedisValue for ReadReply {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        let streams: Vec<(Value, Value)> = match v {
            Value::Nil => vec![],
            Value::Map(m) => m,
            other => items(other, "[[stream, entries], ...]")?
                .into_iter()
                .map(|s| {
                    let pair = items(s, "[stream, entries]")?;
                    <[Value; 2]>::try_from(pair)
                        .map(|[k, e]| (k, e))
                        .map_err(|p| shape("[stream, entries]", &Value::Array(p)))
                })
                .collect::<Result<_, _>>()?,
        };
        let mut out = vec![];
        for (_, es) in streams {
            out.extend(entries(es)?);
        }
        Ok(ReadReply(out))
    }
}

impl FromRedisValue for AutoClaimReply {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        let mut parts = items(v, "[cursor, entries, deleted]")?.into_iter();
        let (Some(next), Some(claimed)) = (parts.next(), parts.next()) else {
            return Err("not a stream reply: XAUTOCLAIM without cursor and entries".into());
        };
        let deleted = match parts.next() {
            None | Some(Value::Nil) => vec![],
            Some(d) => items(d, "deleted ids")?
                .into_iter()
                .map(text)
                .collect::<Result<_, _>>()?,
        };
        Ok(AutoClaimReply {
            next: text(next)?,
            claimed: entries(claimed)?,
            deleted,
        })
    }
}

/// The field/value pairs of an XINFO-style reply (an array of pairs, or a RESP3 map) as
/// strings; values that are not scalars are left out.
pub fn flat_map(v: redis::Value) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    let items = match v {
        redis::Value::Array(a) => a,
        redis::Value::Map(m) => m.into_iter().flat_map(|(k, v)| [k, v]).collect(),
        _ => return out,
    };
    let s = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        redis::Value::SimpleString(s) => Some(s.clone()),
        redis::Value::Int(i) => Some(i.to_string()),
        _ => None,
    };
    for pair in items.chunks(2) {
        if let [k, v] = pair
            && let (Some(k), Some(v)) = (s(k), s(v))
        {
            out.insert(k, v);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &[u8]) -> Value {
        Value::BulkString(s.to_vec())
    }

    fn raw_entry(id: &str, fields: &[&[u8]]) -> Value {
        Value::Array(vec![
            b(id.as_bytes()),
            Value::Array(fields.iter().map(|f| b(f)).collect()),
        ])
    }

    #[test]
    fn names_that_are_not_utf8_and_repeats_come_out_verbatim_in_order() {
        let v = Value::Array(vec![
            raw_entry("1-0", &[b"payload", b"{}"]),
            raw_entry("2-0", &[b"\xffx", b"v\xfe", b"n", b"a", b"n", b"b"]),
        ]);
        let Entries(got) = Entries::from_redis_value(v).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[1].fields.as_deref().unwrap(),
            &[
                (b"\xffx".to_vec(), b"v\xfe".to_vec()),
                (b"n".to_vec(), b"a".to_vec()),
                (b"n".to_vec(), b"b".to_vec()),
            ]
        );
    }

    #[test]
    fn read_reply_resp2_resp3_and_timeout() {
        let es = Value::Array(vec![raw_entry("1-0", &[b"\xff", b"1"])]);
        let resp2 = Value::Array(vec![Value::Array(vec![b(b"{llm}:jobs"), es.clone()])]);
        let resp3 = Value::Map(vec![(b(b"{llm}:jobs"), es)]);
        for v in [resp2, resp3] {
            let ReadReply(got) = ReadReply::from_redis_value(v).unwrap();
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].id, "1-0");
        }
        assert_eq!(ReadReply::from_redis_value(Value::Nil).unwrap().0, vec![]);
    }

    #[test]
    fn autoclaim_with_deleted_entries_both_ways() {
        // Redis 7: deleted ids in the third element.
        let v = Value::Array(vec![
            b(b"0-0"),
            Value::Array(vec![raw_entry("1-0", &[b"\xffx", b"1"])]),
            Value::Array(vec![b(b"2-0")]),
        ]);
        let r = AutoClaimReply::from_redis_value(v).unwrap();
        assert_eq!((r.next.as_str(), r.claimed.len()), ("0-0", 1));
        assert_eq!(r.deleted, ["2-0"]);
        // Redis 6.2: no third element; a deleted entry is nil or has nil fields.
        let v = Value::Array(vec![
            b(b"3-0"),
            Value::Array(vec![Value::Nil, Value::Array(vec![b(b"2-0"), Value::Nil])]),
        ]);
        let r = AutoClaimReply::from_redis_value(v).unwrap();
        assert_eq!(r.next, "3-0");
        assert_eq!(
            r.claimed,
            [StreamEntry {
                id: "2-0".into(),
                fields: None
            }]
        );
    }

    #[test]
    fn a_reply_of_another_shape_is_an_error() {
        for v in [
            Value::Int(1),
            Value::Array(vec![Value::Array(vec![b(b"1-0")])]),
            Value::Array(vec![raw_entry("1-0", &[b"odd"])]),
        ] {
            assert!(Entries::from_redis_value(v.clone()).is_err(), "{v:?}");
        }
    }
}
