//! A long run made of chunks (issue 36: ≥ 2,000 faults take longer than one sitting): each chunk
//! is a complete run of its own — its own control plane, its own seed, its own history, checked
//! on its own — whose result is written as JSON ([`ChunkResult`]); [`Sum`] adds the results of a
//! directory of chunks into one table. A violation in any chunk is a violation of the sum, and a
//! chunk that did not inject every fault it was asked for is named as incomplete, not hidden.
//!
//! `hack/torture.sh --ha --chunk N` runs chunk N (seed 36000 + N) and writes
//! `chunk-NNNN.json` (and the chunk's full table as `chunk-NNNN.md`) under `KF_HA_CHUNK_DIR`
//! (default `docs/proof/ha-runs`); `hack/torture.sh --ha --sum [DIR]` prints the sum.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path as FsPath;

use serde::{Deserialize, Serialize};

use super::{Availability, HaFault, HaReport, Path};

/// Genuine writes: attempted, admitted, refused as stale, failed closed / unavailable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub attempted: u64,
    pub admitted: u64,
    pub refused: u64,
    pub failed: u64,
}

impl From<Availability> for Counts {
    fn from(a: Availability) -> Counts {
        Counts { attempted: a.attempted, admitted: a.admitted, refused: a.refused, failed: a.failed }
    }
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, o: Counts) {
        self.attempted += o.attempted;
        self.admitted += o.admitted;
        self.refused += o.refused;
        self.failed += o.failed;
    }
}

/// One path of one chunk.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathResult {
    /// Distinct versions the watches saw admitted (the arbiter: effects the database committed).
    pub writes_accepted: u64,
    /// Distinct grants / acquisitions the watches saw.
    pub grants: u64,
    /// Delayed writes after a pause: refused as stale, accepted (no newer write in between), failed.
    pub delayed_refused: u64,
    pub delayed_accepted: u64,
    pub delayed_failed: u64,
    /// The scripted stale write: "refused", "accepted" or "not sent".
    pub planted: String,
    pub violations: u64,
    /// Genuine writes by the fault in place (`HaFault` name, or "none").
    pub genuine: BTreeMap<String, Counts>,
}

/// What one chunk (one complete run) wrote.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChunkResult {
    pub seed: u64,
    /// The webhook registered and the arbiter's check in place (false: the planted-fault run).
    pub fenced: bool,
    pub faults_asked: u64,
    pub elapsed_s: f64,
    /// The commit the chunk ran (`KF_HA_COMMIT`, set by hack/torture.sh).
    pub commit: String,
    /// Faults injected, by `HaFault` name.
    pub faults: BTreeMap<String, u64>,
    /// "kube_fence_leases" (the main workers') and each [`Path::slug`].
    pub paths: BTreeMap<String, PathResult>,
    pub observations: u64,
    /// The checker's findings, in words (empty: none).
    pub violations: Vec<String>,
    /// §6b's CREATE window (reported, not violations).
    pub creates_in_window: u64,
    /// Where the faults' time went, seconds in all per phase.
    pub phases_s: BTreeMap<String, f64>,
    /// What the watches saw around each violation on a client-go Lease path, in words (absent in
    /// results from before it was recorded).
    #[serde(default)]
    pub explained: Vec<String>,
    /// Per client-go Lease, the acquisitions (tokens) no watch delivered (absent in results from
    /// before it was recorded).
    #[serde(default)]
    pub unseen_grants: BTreeMap<String, Vec<u64>>,
    /// Of those, the ones no answer of the API server named either (`None`: the chunk recorded no
    /// answers, so nothing else saw any of them).
    #[serde(default)]
    pub unseen_by_nothing: Option<BTreeMap<String, Vec<u64>>>,
    /// The fenced controller's creates the audit logs say were judged for the holder, and the
    /// creates the watches saw (`None`: the chunk ran without audit logs, chunks 1–17, so
    /// nothing showed when the webhook judged a late create).
    #[serde(default)]
    pub audited_creates: Option<[u64; 2]>,
}

/// The main workers' leases, in [`ChunkResult::paths`].
pub const MAIN: &str = "kube_fence_leases";

fn fault_key(fault: Option<HaFault>) -> String {
    fault.map_or_else(|| "none".to_string(), |f| format!("{f:?}"))
}

fn said(planted: Option<bool>) -> String {
    match planted {
        Some(true) => "accepted",
        Some(false) => "refused",
        None => "not sent",
    }
    .to_string()
}

impl ChunkResult {
    pub fn of(report: &HaReport) -> ChunkResult {
        let mut paths = BTreeMap::new();
        let main = PathResult {
            writes_accepted: report.writes_accepted,
            grants: report.grants,
            delayed_refused: report.delayed_refused,
            delayed_accepted: report.delayed_accepted,
            delayed_failed: report.delayed_failed,
            planted: said(report.planted_accepted),
            violations: report.violations_on(None) as u64,
            genuine: report.availability.iter().map(|(f, a)| (fault_key(*f), Counts::from(*a))).collect(),
        };
        paths.insert(MAIN.to_string(), main);
        for path in Path::ALL {
            let delayed = |outcome| report.path_delayed.get(&(path, outcome)).copied().unwrap_or(0);
            let genuine =
                report.paths.iter().filter(|((p, _), _)| *p == path).map(|((_, f), a)| (fault_key(*f), Counts::from(*a))).collect();
            paths.insert(
                path.slug().to_string(),
                PathResult {
                    writes_accepted: report.path_writes.get(&path).copied().unwrap_or(0),
                    grants: report.path_grants.get(&path).copied().unwrap_or(0),
                    delayed_refused: delayed("refused"),
                    delayed_accepted: delayed("accepted"),
                    delayed_failed: delayed("failed"),
                    planted: said(report.planted_on(path)),
                    violations: report.violations_on(Some(path)) as u64,
                    genuine,
                },
            );
        }
        ChunkResult {
            seed: report.config.seed,
            fenced: report.config.fenced,
            faults_asked: report.config.faults,
            elapsed_s: report.elapsed.as_secs_f64(),
            commit: std::env::var("KF_HA_COMMIT").unwrap_or_default(),
            faults: report.faults.iter().map(|(f, n)| (format!("{f:?}"), *n)).collect(),
            paths,
            observations: report.observations as u64,
            violations: report.violations.iter().map(ToString::to_string).collect(),
            creates_in_window: report.creates_in_window.len() as u64,
            phases_s: report.phases.iter().map(|(p, d)| (p.to_string(), d.as_secs_f64())).collect(),
            explained: report.explained.clone(),
            unseen_grants: report.unseen_grants.iter().map(|(l, u)| (l.clone(), u.by_no_watch.clone())).collect(),
            unseen_by_nothing: Some(report.unseen_grants.iter().map(|(l, u)| (l.clone(), u.by_nothing.clone())).collect()),
            audited_creates: Some([report.audited_creates.0 as u64, report.audited_creates.1 as u64]),
        }
    }

    pub fn injected(&self) -> u64 {
        self.faults.values().sum()
    }

    /// Whether the chunk's record is complete: it recorded the API server's answers beside the
    /// watches, and every acquisition of the client-go Leases was seen by one or the other. A
    /// chunk from before (chunks 1–7) may have missed acquisitions, and a write under one is then
    /// attributed to an older grant of its Pod: a violation the history does not have.
    pub fn record_complete(&self) -> bool {
        self.unseen_by_nothing.as_ref().is_some_and(|m| m.values().all(Vec::is_empty))
    }

    /// Which run the chunk belongs to, by what its record can tell.
    pub fn pass(&self) -> Pass {
        match (self.record_complete(), self.audited_creates.is_some()) {
            (false, _) => Pass::First,
            (true, false) => Pass::Second,
            (true, true) => Pass::Long,
        }
    }
}

/// The runs the chunks make, by what their record can tell; only [`Pass::Long`] is the long run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pass {
    /// The record could miss an acquisition of a Lease (chunks 1–7): a write under it was taken
    /// for a stale one.
    #[default]
    First,
    /// A complete record, but none of when the webhook judged each create (chunks 8–17): a create
    /// committed after a takeover could not be shown judged before it; one stayed unexplained.
    Second,
    /// A complete record, and the audit logs' record of how each create was judged.
    Long,
}

impl Pass {
    /// The chunk list's "record" column.
    pub fn describe(self) -> &'static str {
        match self {
            Pass::First => "first pass",
            Pass::Second => "second pass",
            Pass::Long => "complete, audited",
        }
    }
}

/// One chunk as the sum lists it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChunkLine {
    /// The result's file name.
    pub file: String,
    pub seed: u64,
    pub injected: u64,
    pub asked: u64,
    pub violations: usize,
    pub seconds: f64,
    pub observations: u64,
    pub commit: String,
    /// Faults injected, by `HaFault` name.
    pub faults: BTreeMap<String, u64>,
    /// [`ChunkResult::pass`].
    pub pass: Pass,
}

/// The sum of chunk results.
#[derive(Debug, Default)]
pub struct Sum {
    /// Every chunk added, in file order.
    pub chunks: Vec<ChunkLine>,
    pub faults: BTreeMap<String, u64>,
    pub paths: BTreeMap<String, PathResult>,
    pub observations: u64,
    pub violations: Vec<String>,
    pub creates_in_window: u64,
    pub phases_s: BTreeMap<String, f64>,
    /// Chunks run unfenced (planted-fault runs): listed, never added.
    pub unfenced: Vec<String>,
    /// Seeds seen more than once (a chunk run again: both runs are added).
    pub repeated_seeds: Vec<u64>,
    /// Chunks that recorded the acquisitions their watches missed, and how many: delivered by no
    /// watch, and of them named by no answer either.
    pub unseen_recorded: usize,
    pub unseen_by_no_watch: u64,
    pub unseen_by_nothing: u64,
    /// What the watches saw around each violation, per chunk that recorded it.
    pub explained: Vec<String>,
}

impl Sum {
    pub fn add(&mut self, name: &str, c: &ChunkResult) {
        if !c.fenced {
            self.unfenced.push(name.to_string());
            return;
        }
        // A chunk run again with its seed is another run (the timing differs): it is added too,
        // so that a rerun can never hide a failed one; the seed is listed.
        if self.chunks.iter().any(|line| line.seed == c.seed) {
            self.repeated_seeds.push(c.seed);
        }
        self.chunks.push(ChunkLine {
            file: name.to_string(),
            seed: c.seed,
            injected: c.injected(),
            asked: c.faults_asked,
            violations: c.violations.len(),
            seconds: c.elapsed_s,
            observations: c.observations,
            commit: c.commit.clone(),
            faults: c.faults.clone(),
            pass: c.pass(),
        });
        for (f, n) in &c.faults {
            *self.faults.entry(f.clone()).or_default() += n;
        }
        for (p, r) in &c.paths {
            let s = self.paths.entry(p.clone()).or_default();
            s.writes_accepted += r.writes_accepted;
            s.grants += r.grants;
            s.delayed_refused += r.delayed_refused;
            s.delayed_accepted += r.delayed_accepted;
            s.delayed_failed += r.delayed_failed;
            s.violations += r.violations;
            if r.planted != "refused" {
                s.planted = format!("{} {name}: {}", s.planted, r.planted).trim().to_string();
            }
            for (f, counts) in &r.genuine {
                *s.genuine.entry(f.clone()).or_default() += *counts;
            }
        }
        self.observations += c.observations;
        self.violations.extend(c.violations.iter().map(|v| format!("{name}: {v}")));
        self.creates_in_window += c.creates_in_window;
        if !c.unseen_grants.is_empty() {
            self.unseen_recorded += 1;
            let count = |m: &BTreeMap<String, Vec<u64>>| m.values().map(|t| t.len() as u64).sum::<u64>();
            self.unseen_by_no_watch += count(&c.unseen_grants);
            self.unseen_by_nothing += c.unseen_by_nothing.as_ref().map_or_else(|| count(&c.unseen_grants), count);
        }
        self.explained.extend(c.explained.iter().map(|e| format!("{name}: {e}")));
        for (p, s) in &c.phases_s {
            *self.phases_s.entry(p.clone()).or_default() += s;
        }
    }

    /// Every `*.json` under `dir`.
    pub fn read_dir(dir: &FsPath) -> Result<Sum, String> {
        Sum::read_dir_where(dir, |_| true)
    }

    /// The `*.json` under `dir` whose result `keep` keeps.
    pub fn read_dir_where(dir: &FsPath, keep: impl Fn(&ChunkResult) -> bool) -> Result<Sum, String> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        let mut sum = Sum::default();
        for file in files {
            let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            let chunk: ChunkResult = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
            let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            if keep(&chunk) {
                sum.add(&name, &chunk);
            }
        }
        Ok(sum)
    }

    pub fn injected(&self) -> u64 {
        self.faults.values().sum()
    }
    /// Chunks that injected fewer faults than asked (hit their time bound).
    pub fn incomplete(&self) -> Vec<&str> {
        self.chunks.iter().filter(|line| line.injected < line.asked).map(|line| line.file.as_str()).collect()
    }
    /// (fault, path) pairs of a fault kind injected under which the path sent no genuine write.
    pub fn unexercised(&self) -> Vec<(String, String)> {
        let mut missing = Vec::new();
        for fault in self.faults.iter().filter(|(_, n)| **n > 0).map(|(f, _)| f) {
            for (path, r) in &self.paths {
                if r.genuine.get(fault).is_none_or(|c| c.attempted == 0) {
                    missing.push((fault.clone(), path.clone()));
                }
            }
        }
        missing
    }
    /// Stale writes refused, on every path: delayed writes refused after a pause, and genuine
    /// writes refused because the writer's holder had lost the lease meanwhile.
    pub fn stale_refused(&self) -> (u64, u64) {
        let delayed = self.paths.values().map(|r| r.delayed_refused).sum();
        let genuine = self.paths.values().flat_map(|r| r.genuine.values()).map(|c| c.refused).sum();
        (delayed, genuine)
    }
}

fn describe_fault(key: &str) -> String {
    HaFault::ALL.into_iter().find(|f| format!("{f:?}") == key).map_or_else(|| key.to_string(), |f| f.describe().to_string())
}

fn describe_path(key: &str) -> String {
    if key == MAIN {
        return "kube-fence leases (token-guarded and holder-only objects)".into();
    }
    Path::ALL.into_iter().find(|p| p.slug() == key).map_or_else(|| key.to_string(), |p| p.describe().to_string())
}

impl Sum {
    /// The entries of `map` in `order`, then any others.
    fn ordered<'a, V>(&self, map: &'a BTreeMap<String, V>, order: Vec<String>) -> Vec<(&'a String, &'a V)> {
        let mut out: Vec<(&String, &V)> = order.iter().filter_map(|k| map.get_key_value(k)).collect();
        out.extend(map.iter().filter(|(k, _)| !order.contains(k)));
        out
    }
}

impl Sum {
    /// Genuine writes under `fault` (a `HaFault` name, or "none"), on every path.
    fn under(&self, fault: &str) -> Counts {
        let mut c = Counts::default();
        for r in self.paths.values() {
            c += r.genuine.get(fault).copied().unwrap_or_default();
        }
        c
    }

    /// Hours the chunks ran, in all.
    pub fn hours(&self) -> f64 {
        // `0.0 +`: an empty sum of floats is -0.0, printed "-0.0".
        0.0 + self.chunks.iter().map(|c| c.seconds).sum::<f64>() / 3600.0
    }

    /// Faults by kind: injected, and the genuine writes under each (a markdown table).
    pub fn fault_table(&self) -> String {
        let mut t =
            String::from("| fault | injected | genuine writes attempted | admitted | refused stale | failed closed / unavailable |\n");
        t += "| --- | ---: | ---: | ---: | ---: | ---: |\n";
        let row = |what: &str, injected: String, c: Counts| {
            let k = thousands;
            format!("| {what} | {injected} | {} | {} | {} | {} |\n", k(c.attempted), k(c.admitted), k(c.refused), k(c.failed))
        };
        t += &row("(none in place)", "–".to_string(), self.under("none"));
        for (fault, n) in self.ordered(&self.faults, HaFault::ALL.map(|f| format!("{f:?}")).to_vec()) {
            t += &row(&describe_fault(fault), thousands(*n), self.under(fault));
        }
        t
    }

    /// Each path: writes accepted, stale writes refused, failed closed, the scripted stale write.
    pub fn path_table(&self) -> String {
        let mut t = String::from(
            "| path | writes accepted | stale writes refused (delayed after a pause / genuine, holder had lost) | delayed writes accepted (nothing newer in between) | failed closed (genuine / delayed) | scripted stale write | violations |\n",
        );
        t += "| --- | ---: | ---: | ---: | ---: | --- | ---: |\n";
        let order = std::iter::once(MAIN.to_string()).chain(Path::ALL.map(|p| p.slug().to_string())).collect();
        for (path, r) in self.ordered(&self.paths, order) {
            let genuine = r.genuine.values().fold(Counts::default(), |mut a, c| {
                a += *c;
                a
            });
            let planted = if r.planted.is_empty() { "refused in every chunk".to_string() } else { r.planted.clone() };
            t += &format!(
                "| {} | {} | {} / {} | {} | {} / {} | {planted} | {} |\n",
                describe_path(path),
                thousands(r.writes_accepted),
                thousands(r.delayed_refused),
                thousands(genuine.refused),
                thousands(r.delayed_accepted),
                thousands(genuine.failed),
                thousands(r.delayed_failed),
                r.violations
            );
        }
        t
    }

    /// The totals: faults, writes accepted, stale refused, failed closed, observations, violations.
    pub fn measure_table(&self) -> String {
        let (delayed, genuine) = self.stale_refused();
        let accepted: u64 = self.paths.values().map(|r| r.writes_accepted).sum();
        let failed: u64 = self.paths.values().map(|r| r.delayed_failed + r.genuine.values().map(|c| c.failed).sum::<u64>()).sum();
        let mut t = String::from("| measure | count |\n| --- | ---: |\n");
        let k = thousands;
        t += &format!("| faults injected | {} |\n", k(self.injected()));
        t += &format!("| writes accepted (all paths) | {} |\n", k(accepted));
        t += &format!("| stale writes refused (delayed / genuine) | {} ({} / {}) |\n", k(delayed + genuine), k(delayed), k(genuine));
        t += &format!("| writes failed closed / unavailable | {} |\n", k(failed));
        t += &format!("| observations checked | {} |\n", k(self.observations));
        t += &format!("| §6b CREATE window (reported, not violations) | {} |\n", self.creates_in_window);
        t += &format!("| **violations** | **{}** |\n", self.violations.len());
        t
    }
}

impl fmt::Display for Sum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kube-fence on the HA topology, {} chunks (each a complete run with its own seed, checked on its own): {} faults, {:.1} h",
            self.chunks.len(),
            self.injected(),
            self.hours()
        )?;
        writeln!(f)?;
        writeln!(f, "{}", self.fault_table())?;
        writeln!(f, "{}", self.path_table())?;
        writeln!(f, "{}", self.measure_table())?;
        let injected = self.injected().max(1) as f64;
        writeln!(f, "Where a fault's time goes (mean per fault, {:.2} s in all):", 0.0 + self.phases_s.values().sum::<f64>() / injected)?;
        for (phase, s) in &self.phases_s {
            writeln!(f, "- {phase}: {:.2} s", s / injected)?;
        }
        writeln!(f)?;
        writeln!(f, "Chunks (file, seed, faults injected / asked, violations, minutes):")?;
        for c in &self.chunks {
            writeln!(f, "- {}: seed {}, {} / {}, {}, {:.0}", c.file, c.seed, c.injected, c.asked, c.violations, c.seconds / 60.0)?;
        }
        for name in &self.unfenced {
            writeln!(f, "- {name}: unfenced (a planted-fault run), not added")?;
        }
        for seed in &self.repeated_seeds {
            writeln!(f, "- seed {seed} run again: every run of it added")?;
        }
        for v in self.violations.iter().take(50) {
            writeln!(f, "  - {v}")?;
        }
        if self.unseen_recorded > 0 {
            writeln!(
                f,
                "\nClient-go Lease acquisitions no watch delivered: {} (of them named by no answer of the API server either: {}), counted in {} of the chunks",
                self.unseen_by_no_watch, self.unseen_by_nothing, self.unseen_recorded
            )?;
        }
        for e in self.explained.iter().take(20) {
            writeln!(f, "\nAround {e}")?;
        }
        Ok(())
    }
}

/// 94753 → "94,753".
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, d) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(d);
    }
    out
}
