//! `status --watch`: the `status` of the namespace as a live terminal view (ratatui),
//! refreshed every second: queue length, group lag and pending, jobs/s in and results/s
//! out with sparklines, each pool's held slots with holder, age and lease left, consumers with
//! idle time, spend today per model, cooldowns, dead letters. When stdout is not a
//! terminal: the plain `status` lines every second instead.
//!
//! Invariant: drawing reads only the `status` JSON (the stable shape of `status --json`)
//! and the rates kept here, so the view is a pure function of them (snapshot-tested).

use crate::config::Config;
use crate::tools::ToolError;
use ratatui::Frame;
use ratatui::layout::{Constraint, Direction, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Row, Sparkline, Table};
use serde_json::Value;
use std::collections::VecDeque;
use std::time::Duration;
use tokio::time::Instant;

/// How many seconds of rates the sparklines show.
const HISTORY: usize = 120;

/// Jobs pushed and results written per second, from the streams' `entries-added`
/// counters between two refreshes (Redis >= 7; none before).
#[derive(Debug, Default, Clone)]
pub struct Rates {
    pub jobs_in: VecDeque<u64>,
    pub results_out: VecDeque<u64>,
    last: Option<(Instant, u64, u64)>,
}

impl Rates {
    /// Takes the counters of a fresh `status` read at `now`.
    pub fn update(&mut self, v: &Value, now: Instant) {
        let (Some(a), Some(r)) = (v["jobs_added"].as_u64(), v["results_added"].as_u64()) else {
            return;
        };
        if let Some((t, a0, r0)) = self.last {
            let secs = now.saturating_duration_since(t).as_secs_f64().max(0.001);
            let per = |x: u64, x0: u64| (x.saturating_sub(x0) as f64 / secs).round() as u64;
            push(&mut self.jobs_in, per(a, a0));
            push(&mut self.results_out, per(r, r0));
        }
        self.last = Some((now, a, r));
    }
}

fn push(h: &mut VecDeque<u64>, x: u64) {
    if h.len() == HISTORY {
        h.pop_front();
    }
    h.push_back(x);
}

fn num(v: &Value) -> String {
    v.as_u64().map_or("-".into(), |n| n.to_string())
}

/// Draws the whole view of `v` (a `status --json` object) and `rates` into `f`.
pub fn draw(f: &mut Frame, v: &Value, rates: &Rates) {
    let rows = Layout::default()
        .direction(Direction::Vertical)
        .constraints([
            Constraint::Length(4),
            Constraint::Length(5),
            Constraint::Min(6),
            Constraint::Length(7),
            Constraint::Length(1),
        ])
        .split(f.area());

    let group = match v["group"]["name"].as_str() {
        Some(g) => format!(
            "group {g}: lag {}  pending {}",
            num(&v["group"]["lag"]),
            num(&v["group"]["pending"])
        ),
        None => "no group yet: no worker has started on this namespace".into(),
    };
    let queue = Paragraph::new(vec![
        Line::from(format!(
            "{}  {} entries   {group}",
            v["stream"].as_str().unwrap_or(""),
            num(&v["jobs_in_stream"])
        )),
        Line::from(format!(
            "results {}   dead letters {}   failed kept {}   cost total ${}",
            num(&v["results"]),
            num(&v["dead_letters"]),
            num(&v["failed_kept"]),
            v["cost"]["total_usd"].as_str().unwrap_or("0")
        )),
    ])
    .block(Block::default().borders(Borders::ALL).title(" llm-worker "));
    f.render_widget(queue, rows[0]);

    let spark = Layout::default()
        .direction(Direction::Horizontal)
        .constraints([Constraint::Percentage(50), Constraint::Percentage(50)])
        .split(rows[1]);
    for (area, title, h) in [
        (spark[0], "jobs in/s", &rates.jobs_in),
        (spark[1], "results out/s", &rates.results_out),
    ] {
        let data: Vec<u64> = h.iter().copied().collect();
        let now = data.last().map_or("-".into(), |x| x.to_string());
        // The newest values at the right edge.
        let width = area.width.saturating_sub(2) as usize;
        let shown = &data[data.len().saturating_sub(width)..];
        let s = Sparkline::default()
            .block(
                Block::default()
                    .borders(Borders::ALL)
                    .title(format!(" {title}: {now} ")),
            )
            .data(shown);
        f.render_widget(s, area);
    }

    let mid = Layout::default()
        .direction(Direction::Horizontal)
        .constraints([Constraint::Percentage(55), Constraint::Percentage(45)])
        .split(rows[2]);
    let mut slot_rows = vec![];
    let mut summary = vec![];
    for (pool, p) in v["pools"].as_object().into_iter().flatten() {
        let held = p["held"].as_array().cloned().unwrap_or_default();
        summary.push(format!("{pool} {}/{}", held.len(), num(&p["slots"])));
        for h in held {
            slot_rows.push(Row::new(vec![
                pool.clone(),
                num(&h["slot"]),
                h["holder"].as_str().unwrap_or("").to_string(),
                h["age_ms"]
                    .as_u64()
                    .map_or("-".into(), |a| format!("{:.1} s", a as f64 / 1000.0)),
                format!("{} ms", h["ttl_ms"].as_i64().unwrap_or(0)),
            ]));
        }
    }
    let slots = Table::new(
        slot_rows,
        [
            Constraint::Length(9),
            Constraint::Length(4),
            Constraint::Min(12),
            Constraint::Length(8),
            Constraint::Length(10),
        ],
    )
    .header(
        Row::new(vec!["pool", "slot", "holder", "held", "lease left"])
            .style(Style::default().add_modifier(Modifier::BOLD)),
    )
    .block(
        Block::default()
            .borders(Borders::ALL)
            .title(format!(" slots held: {} ", summary.join(", "))),
    );
    f.render_widget(slots, mid[0]);
    let consumer_rows: Vec<Row> = v["consumers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            Row::new(vec![
                c["name"].as_str().unwrap_or("").to_string(),
                num(&c["pending"]),
                format!(
                    "{:.1} s",
                    c["idle_ms"].as_u64().unwrap_or(0) as f64 / 1000.0
                ),
            ])
        })
        .collect();
    let consumers = Table::new(
        consumer_rows,
        [
            Constraint::Min(12),
            Constraint::Length(8),
            Constraint::Length(9),
        ],
    )
    .header(
        Row::new(vec!["consumer", "pending", "idle"])
            .style(Style::default().add_modifier(Modifier::BOLD)),
    )
    .block(Block::default().borders(Borders::ALL).title(" consumers "));
    f.render_widget(consumers, mid[1]);

    let low = Layout::default()
        .direction(Direction::Horizontal)
        .constraints([Constraint::Percentage(50), Constraint::Percentage(50)])
        .split(rows[3]);
    let today = &v["spend"]["today"];
    let spend: Vec<Line> = today["models"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(m, usd)| Line::from(format!("{m:<20} ${}", usd.as_str().unwrap_or("0"))))
        .collect();
    f.render_widget(
        Paragraph::new(spend).block(Block::default().borders(Borders::ALL).title(format!(
            " spend today: ${} ",
            today["total_usd"].as_str().unwrap_or("0")
        ))),
        low[0],
    );
    let cooling: Vec<Line> = v["cooldowns"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            Line::from(format!(
                "{:<18} {:>6.1} s  {}",
                c["what"].as_str().unwrap_or(""),
                c["ms_left"].as_u64().unwrap_or(0) as f64 / 1000.0,
                c["reason"].as_str().unwrap_or("")
            ))
        })
        .collect();
    let cooling = if cooling.is_empty() {
        vec![Line::from("none")]
    } else {
        cooling
    };
    f.render_widget(
        Paragraph::new(cooling).block(Block::default().borders(Borders::ALL).title(" cooldowns ")),
        low[1],
    );
    f.render_widget(
        Paragraph::new("q: quit   refreshed every second   status --json for scripts"),
        rows[4],
    );
}

/// Runs the view until `q`, Esc or Ctrl-C (a terminal), or for `count` refreshes.
pub async fn run(cfg: &Config, count: Option<u64>) -> Result<(), ToolError> {
    let mut rates = Rates::default();
    if !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        let mut out = std::io::stdout();
        let mut n = 0;
        loop {
            match crate::tools::status(cfg).await {
                Ok(v) => {
                    rates.update(&v, Instant::now());
                    crate::tools::print_status(&v, &mut out)?;
                }
                // Redis away for a moment (a failover): say so, try again next second.
                Err(e) => std::io::Write::write_all(
                    &mut out,
                    format!("status refresh failed: {e}; retrying\n").as_bytes(),
                )?,
            }
            std::io::Write::write_all(
                &mut out,
                format!(
                    "rates           jobs in {}/s  results out {}/s\n---\n",
                    rates.jobs_in.back().map_or("-".into(), |x| x.to_string()),
                    rates
                        .results_out
                        .back()
                        .map_or("-".into(), |x| x.to_string())
                )
                .as_bytes(),
            )?;
            std::io::Write::flush(&mut out)?;
            n += 1;
            if count.is_some_and(|c| n >= c) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    let mut terminal = ratatui::init();
    let mut n = 0;
    let mut shown: Option<Value> = None;
    let result = loop {
        // A failed refresh (Redis away, a failover) keeps the last view, marked, and
        // tries again a second later.
        let v = match crate::tools::status(cfg).await {
            Ok(v) => {
                rates.update(&v, Instant::now());
                shown = Some(v.clone());
                v
            }
            Err(e) => {
                let mut v = shown.clone().unwrap_or_else(|| serde_json::json!({}));
                v["stream"] = Value::String(format!("(refresh failed: {e}; retrying)"));
                v
            }
        };
        if let Err(e) = terminal.draw(|f| draw(f, &v, &rates)) {
            break Err(e.into());
        }
        n += 1;
        if count.is_some_and(|c| n >= c) {
            break Ok(());
        }
        // Up to a second for a key; the poll blocks, so it runs off the runtime.
        let key = tokio::task::spawn_blocking(|| {
            use ratatui::crossterm::event::{self, Event, KeyCode, KeyModifiers};
            let deadline = Instant::now() + Duration::from_secs(1);
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || !event::poll(left)? {
                    return Ok::<bool, std::io::Error>(false);
                }
                if let Event::Key(k) = event::read()? {
                    let quit = matches!(k.code, KeyCode::Char('q') | KeyCode::Esc)
                        || (k.code == KeyCode::Char('c')
                            && k.modifiers.contains(KeyModifiers::CONTROL));
                    if quit {
                        return Ok(true);
                    }
                }
            }
        })
        .await;
        match key {
            Ok(Ok(true)) => break Ok(()),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => break Err(e.into()),
            Err(_) => break Ok(()),
        }
    };
    ratatui::restore();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_per_second_between_two_reads() {
        let mut r = Rates::default();
        let t = Instant::now();
        r.update(
            &serde_json::json!({"jobs_added": 100, "results_added": 50}),
            t,
        );
        assert!(r.jobs_in.is_empty());
        r.update(
            &serde_json::json!({"jobs_added": 300, "results_added": 90}),
            t + Duration::from_secs(2),
        );
        assert_eq!(r.jobs_in.back(), Some(&100));
        assert_eq!(r.results_out.back(), Some(&20));
        // Before Redis 7 there are no counters: no rates, no panic.
        r.update(&serde_json::json!({}), t + Duration::from_secs(3));
        assert_eq!(r.jobs_in.len(), 1);
    }
}
