//! The table (markdown, on stdout) and the JSON document.

use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub scenario: String,
    pub figure: String,
    pub target: String,
    pub llm_worker: Option<f64>,
    pub peer: Option<f64>,
    /// llm-worker / peer.
    pub ratio: Option<f64>,
}

impl Row {
    pub fn new(scenario: &str, figure: &str, target: &str) -> Row {
        Row {
            scenario: scenario.into(),
            figure: figure.into(),
            target: target.into(),
            llm_worker: None,
            peer: None,
            ratio: None,
        }
    }
    pub fn vals(mut self, llm: Option<f64>, peer: Option<f64>) -> Row {
        self.llm_worker = llm;
        self.peer = peer;
        self.ratio = match (llm, peer) {
            (Some(a), Some(b)) if b != 0.0 => Some(a / b),
            _ => None,
        };
        self
    }
}

#[derive(Default)]
pub struct Report {
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
    pub json: serde_json::Map<String, serde_json::Value>,
}

pub fn fmt(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(x) if !x.is_finite() => "-".into(),
        Some(x) => {
            let a = x.abs();
            if a >= 100.0 {
                format!("{x:.0}")
            } else if a >= 10.0 {
                format!("{x:.1}")
            } else if a >= 1.0 {
                format!("{x:.2}")
            } else {
                format!("{x:.3}")
            }
        }
    }
}

impl Report {
    pub fn push(&mut self, r: Row) {
        self.rows.push(r);
    }
    pub fn note(&mut self, n: String) {
        self.notes.push(n);
    }
    pub fn print(&self) {
        println!("| scenario | figure | target | llm-worker | bullmq-official | ratio |");
        println!("|---|---|---|---|---|---|");
        for r in &self.rows {
            let ratio = r
                .ratio
                .map(|x| format!("{}x", fmt(Some(x))))
                .unwrap_or("-".into());
            println!(
                "| {} | {} | {} | {} | {} | {} |",
                r.scenario,
                r.figure,
                r.target,
                fmt(r.llm_worker),
                fmt(r.peer),
                ratio
            );
        }
        if !self.notes.is_empty() {
            println!();
            for n in &self.notes {
                println!("- {n}");
            }
        }
    }
    pub fn to_json(&self) -> serde_json::Value {
        let mut m = self.json.clone();
        m.insert(
            "table".into(),
            serde_json::to_value(&self.rows).unwrap_or_default(),
        );
        m.insert(
            "notes".into(),
            serde_json::to_value(&self.notes).unwrap_or_default(),
        );
        serde_json::Value::Object(m)
    }
}

/// A short description of the machine (cores, model name).
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpu
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    format!("{cores} cores, {model}")
}
