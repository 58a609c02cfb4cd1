//! Latency samples and the printed table.

use std::time::Duration;

/// Latencies of one series.
#[derive(Clone, Debug, Default)]
pub struct Samples(pub Vec<Duration>);

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }
    pub fn extend(&mut self, other: Samples) {
        self.0.extend(other.0);
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// The `p`-quantile (nearest rank); zero when empty.
    pub fn quantile(&self, p: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        if v.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((v.len() as f64) * p).ceil() as usize;
        v[rank.clamp(1, v.len()) - 1]
    }
    pub fn p50(&self) -> Duration {
        self.quantile(0.5)
    }
    pub fn p99(&self) -> Duration {
        self.quantile(0.99)
    }
    pub fn mean(&self) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        self.0.iter().sum::<Duration>() / self.0.len() as u32
    }
}

/// Whether a target was met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Met {
    Yes,
    No,
    /// No target for this row.
    Info,
}

/// One row: what was measured, kube-fence's figure, the limit/baseline's, the ratio, the target.
#[derive(Clone, Debug)]
pub struct Row {
    pub section: &'static str,
    pub measure: String,
    pub fence: String,
    pub limit: String,
    pub ratio: String,
    pub target: String,
    pub met: Met,
}

#[derive(Default)]
pub struct Table {
    rows: Vec<Row>,
}

impl Table {
    #[allow(clippy::too_many_arguments)] // one argument per column
    pub fn add(
        &mut self,
        section: &'static str,
        measure: impl Into<String>,
        fence: impl Into<String>,
        limit: impl Into<String>,
        ratio: impl Into<String>,
        target: impl Into<String>,
        met: Met,
    ) {
        let row = Row {
            section,
            measure: measure.into(),
            fence: fence.into(),
            limit: limit.into(),
            ratio: ratio.into(),
            target: target.into(),
            met,
        };
        eprintln!("  {} | {} | {} | {} | {} | {}", row.measure, row.fence, row.limit, row.ratio, row.target, mark(row.met));
        self.rows.push(row);
    }

    pub fn print(&self) {
        println!("| # | measure | kube-fence | limit / baseline | ratio | target | met |");
        println!("|---|---|---|---|---|---|---|");
        for r in &self.rows {
            println!("| {} | {} | {} | {} | {} | {} | {} |", r.section, r.measure, r.fence, r.limit, r.ratio, r.target, mark(r.met));
        }
    }
}

fn mark(met: Met) -> &'static str {
    match met {
        Met::Yes => "yes",
        Met::No => "**no**",
        Met::Info => "",
    }
}

pub fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms >= 100.0 {
        format!("{ms:.0} ms")
    } else if ms >= 10.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{ms:.2} ms")
    }
}

pub fn us(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us >= 1000.0 { ms(d) } else { format!("{us:.1} µs") }
}

pub fn rate(per_sec: f64, unit: &str) -> String {
    if per_sec >= 10_000.0 { format!("{:.1}k {unit}/s", per_sec / 1000.0) } else { format!("{per_sec:.0} {unit}/s") }
}

pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

pub fn met(ok: bool) -> Met {
    if ok { Met::Yes } else { Met::No }
}
