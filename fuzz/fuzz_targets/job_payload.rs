//! `job::parse` on arbitrary bytes (the stream entry's `payload` field as Redis hands it
//! over): never panics; a rejection is one short line; an accepted job is valid.
#![no_main]

mod common;

use common::{CFG, assert_one_line};
use libfuzzer_sys::fuzz_target;
use llm_worker::job::{self, JobError};
use serde_json::Value;

const MAX_BYTES: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let cfg = &*CFG;
    let res = job::parse(Some(data), "1700000000000-0", MAX_BYTES, cfg);
    if let Some(id) = job::salvage_id(Some(data)) {
        assert!(!id.is_empty() && id.len() <= 512);
    }
    if std::str::from_utf8(data).is_err() {
        assert!(matches!(res, Err(JobError::NotUtf8(_))), "{res:?}");
    }
    // The size limit is checked before anything else.
    if data.len() > 1 {
        let small = job::parse(Some(data), "1-0", data.len() - 1, cfg);
        assert!(matches!(small, Err(JobError::TooLarge { .. })));
    }
    match res {
        Ok(j) => {
            assert!(!j.id.is_empty() && j.id.len() <= 512);
            assert!(cfg.routes.contains_key(&j.route));
            if let Some(m) = &j.model {
                assert!(cfg.models.contains_key(m));
            }
            let msgs = j.body["messages"].as_array().expect("messages array");
            assert!(!msgs.is_empty());
            for m in msgs {
                let role = m.get("role").and_then(Value::as_str);
                assert!(role.is_some_and(|r| !r.is_empty()), "{m}");
            }
            let order = job::model_order(&j, cfg);
            assert!(!order.is_empty() && order.iter().all(|m| cfg.models.contains_key(m)));
        }
        Err(e) => assert_one_line("job::parse", &e.to_string(), 310),
    }
});
