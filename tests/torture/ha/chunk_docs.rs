//! What the committed documents say about the long run in chunks. The tables of the long run in
//! README.md, docs/proof.md and docs/proof/ha-runs/ (its README's list of chunks, and sum.md) are
//! made from the chunk results committed under docs/proof/ha-runs, never typed: the test
//! `committed_ha_documents_are_the_sum_of_the_committed_chunks` (tests/faults.rs) fails when a
//! document and the results drift apart, and rewrites them with `KUBE_FENCE_WRITE_HA_DOCS=1`
//! (which `hack/torture.sh --ha --sum` sets).

pub use super::chunks::thousands;
use super::chunks::{ChunkLine, Sum};

/// Where the chunk results are committed, from the repository's root.
pub const CHUNK_DIR: &str = "docs/proof/ha-runs";
/// What the long run must reach: 2,000 faults, run as 10 chunks of 200.
pub const LONG_RUN_FAULTS: u64 = 2_000;
pub const LONG_RUN_CHUNKS: u64 = 10;
/// Chunk N runs with seed 36000 + N (hack/torture.sh).
const CHUNK_SEED_BASE: u64 = 36_000;

/// Where in a document its generated text goes.
#[derive(Debug)]
pub enum Place {
    /// The whole file.
    Whole,
    /// Between two marker lines, kept.
    Between(&'static str, &'static str),
}

/// One generated piece of a document.
#[derive(Debug)]
pub struct Generated {
    /// From the repository's root.
    pub path: &'static str,
    pub place: Place,
    pub text: String,
}

/// Why a document could not take its generated text.
#[derive(Debug, PartialEq, Eq)]
pub enum SpliceError {
    /// A marker line is missing, or the end comes before the start.
    MarkersMissing { start: &'static str, end: &'static str },
}

impl std::fmt::Display for SpliceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpliceError::MarkersMissing { start, end } => {
                write!(f, "the lines `{start}` and `{end}` (in this order) are not both in the document")
            }
        }
    }
}

impl Generated {
    /// `current` with this piece in its place.
    pub fn splice(&self, current: &str) -> Result<String, SpliceError> {
        let (start, end) = match self.place {
            Place::Whole => return Ok(self.text.clone()),
            Place::Between(start, end) => (start, end),
        };
        let missing = SpliceError::MarkersMissing { start, end };
        let from = current.find(&format!("{start}\n")).ok_or(missing)?;
        let inner = from + start.len() + 1;
        let to = current[inner..].find(&format!("{end}\n")).map(|i| inner + i);
        let to = to.ok_or(SpliceError::MarkersMissing { start, end })?;
        Ok(format!("{}{}{}", &current[..inner], self.text, &current[to..]))
    }
}

/// "18–19 of each of the 11 kinds", "200 of one kind".
fn spread(faults: &std::collections::BTreeMap<String, u64>) -> String {
    let counts: Vec<u64> = faults.values().copied().filter(|n| *n > 0).collect();
    match (counts.iter().min(), counts.iter().max()) {
        (Some(min), Some(max)) if counts.len() > 1 && min == max => format!("{min} of each of the {} kinds", counts.len()),
        (Some(min), Some(max)) if counts.len() > 1 => format!("{min}–{max} of each of the {} kinds", counts.len()),
        (Some(n), _) => format!("{n} of one kind"),
        _ => "none".to_string(),
    }
}

/// The chunk's number: its seed less 36000, for a seed of that kind.
fn chunk_number(line: &ChunkLine) -> Option<u64> {
    line.seed.checked_sub(CHUNK_SEED_BASE).filter(|n| *n > 0)
}

/// The chunk's number, or its file's name for a seed of another kind.
fn number(line: &ChunkLine) -> String {
    chunk_number(line).map_or_else(|| line.file.trim_end_matches(".json").to_string(), |n| n.to_string())
}

/// The short commit a chunk ran, or "unknown".
fn short(commit: &str) -> String {
    if commit.is_empty() { "unknown".to_string() } else { format!("`{}`", &commit[..commit.len().min(7)]) }
}

/// The list of chunks run, and what is left of the long run (docs/proof/ha-runs/README.md):
/// every chunk in `all`, the long run counted in `long`.
fn chunk_list(all: &Sum, long: &Sum) -> String {
    let mut t = String::from("| chunk | seed | faults | observations checked | violations | record | time | commit |\n");
    t += "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- |\n";
    for c in &all.chunks {
        let md = c.file.replace(".json", ".md");
        t += &format!(
            "| [{}]({md}) | {} | {} ({}) | {} | **{}** | {} | {} s | {} |\n",
            number(c),
            c.seed,
            c.injected,
            spread(&c.faults),
            thousands(c.observations),
            c.violations,
            c.pass.describe(),
            thousands(c.seconds.round() as u64),
            short(&c.commit)
        );
    }
    t += "\n";
    let injected = long.injected();
    if injected >= LONG_RUN_FAULTS {
        let verdict = match long.violations.len() {
            0 => String::new(),
            n => format!(" It has {}: [Violations](#violations).", counted(n, "violation")),
        };
        t += &format!(
            "{} faults with a complete and audited record, in {} chunks: the {} the long run asks for.{verdict} Their sum: [sum.md](sum.md).\n",
            thousands(injected),
            long.chunks.len(),
            thousands(LONG_RUN_FAULTS)
        );
    } else {
        let next = all.chunks.iter().filter_map(chunk_number).max().unwrap_or(0) + 1;
        let chunks_left = (LONG_RUN_FAULTS - injected).div_ceil(LONG_RUN_FAULTS / LONG_RUN_CHUNKS);
        let left = match chunks_left {
            1 => format!("chunk {next} (at 200 faults) is"),
            n => format!("chunks {next} to {} (at 200 faults each) are", next + n - 1),
        };
        t += &format!(
            "{} of the {} faults of the long run (a complete and audited record); {left} still to run. The sum of those run: [sum.md](sum.md); of the passes before: [second-pass.md](second-pass.md), [first-pass.md](first-pass.md).\n",
            thousands(injected),
            thousands(LONG_RUN_FAULTS),
        );
    }
    t
}

/// "2,000 faults in 10 chunks", or "1,000 faults so far (5 of the 10 chunks of the 2,000-fault
/// long run)".
fn how_far(sum: &Sum) -> String {
    let injected = thousands(sum.injected());
    if sum.injected() >= LONG_RUN_FAULTS {
        format!("{injected} faults in {} chunks", sum.chunks.len())
    } else {
        format!(
            "{injected} faults so far ({} of the {LONG_RUN_CHUNKS} chunks of the {}-fault long run)",
            sum.chunks.len(),
            thousands(LONG_RUN_FAULTS)
        )
    }
}

/// A pass before the long run, in a sentence: its chunks, faults and reported violations.
fn pass_line(sum: &Sum) -> String {
    let chunks = match (sum.chunks.first().and_then(chunk_number), sum.chunks.last().and_then(chunk_number)) {
        (Some(first), Some(last)) => format!("chunks {first}–{last}"),
        _ => counted(sum.chunks.len(), "chunk"),
    };
    format!("{chunks}, {} faults, {:.1} h, {} reported", thousands(sum.injected()), sum.hours(), counted(sum.violations.len(), "violation"))
}

/// "1 violation", "0 violations", "2 violations".
fn counted(n: usize, what: &str) -> String {
    if n == 1 { format!("1 {what}") } else { format!("{n} {what}s") }
}

fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    chars.next().map(|c| c.to_uppercase().chain(chars).collect()).unwrap_or_default()
}

/// Every generated piece of every document: the long run from the chunks whose record is
/// complete and audited (`long`), and the passes before it (`second`: complete, not audited;
/// `first`: incomplete).
pub fn documents(long: &Sum, second: &Sum, first: &Sum, all: &Sum) -> Vec<Generated> {
    let violations = match long.violations.len() {
        0 => counted(0, "violation"),
        n => format!(
            "{} (what is known of {}: [docs/proof/ha-runs](docs/proof/ha-runs/README.md#violations))",
            counted(n, "violation"),
            if n == 1 { "it" } else { "them" }
        ),
    };
    let readme = format!(
        "**{}: {violations}**
in {} observations checked ({:.1} h on the 2-core development machine).

On the topology production control planes run — three etcd members, two kube-apiservers and two
kube-fence replicas, each in a network namespace of its own — a nemesis injected partitions, etcd
and API server kills, kube-fence replicas cut and killed, and clock skew, one at a time, each
healed before the next. Meanwhile workers wrote on every path at once (token-guarded and
holder-only objects, a client-go leader Lease, a fenced controller, delegated grants, the
PostgreSQL arbiter), some paused past their leases and sending their stale writes on waking. The
history was read from watches, the API server's answers to committed writes, its audit log and
the database, never from what a client believed. A genuine write is a current holder's; one that
\"failed closed\" was refused because what it needed could not be read, never admitted on a
guess. How it runs, each chunk and every path: [docs/proof.md](docs/proof.md) and
[docs/proof/ha-runs](docs/proof/ha-runs/README.md); what it taught: [docs/design.md](docs/design.md)
§10a.

{}
{}
Not counted in it ([docs/proof/ha-runs](docs/proof/ha-runs/README.md) says why): a first pass
({}) whose record could miss an acquisition of a Lease, so that a write under it was taken for a
stale one; and a second pass ({}) with a complete record but none of when the webhook judged each
create, so that a create committed after a takeover could not be shown judged before it (§6b's
CREATE window), which left what it reported [not explained](docs/proof/ha-runs/README.md#violations).
",
        capitalized(&how_far(long)),
        thousands(long.observations),
        long.hours(),
        long.fault_table(),
        long.measure_table(),
        pass_line(first),
        pass_line(second)
    );
    let proof = format!(
        "The long run in chunks ([proof/ha-runs](proof/ha-runs/README.md); each chunk a complete
run with its own seed, checked on its own, every path exercised under every fault kind in each;
summed by `hack/torture.sh --ha --sum`, which writes [sum.md](proof/ha-runs/sum.md), where the
table by path is), counting the chunks whose record is complete and audited (the API servers'
audit logs say how each create of the fenced controller was judged): {}, {:.1} h:

{}
{}
Before it, two passes, not counted. A first pass ({};
[first-pass.md](proof/ha-runs/first-pass.md)): its reported violations were writes under
acquisitions of a Lease that no watch delivered ([proof/ha-runs](proof/ha-runs/README.md), \"The
first pass\"). A second pass ({}; [second-pass.md](proof/ha-runs/second-pass.md)), with a
complete record: what it reported is not explained ([proof/ha-runs](proof/ha-runs/README.md#violations)),
because nothing in its record showed when the webhook judged a create that committed after a
takeover. The second pass's figures of availability stand:

{}
{}",
        how_far(long),
        long.hours(),
        long.fault_table(),
        long.measure_table(),
        pass_line(first),
        pass_line(second),
        second.fault_table(),
        second.measure_table()
    );
    vec![
        Generated { path: "README.md", place: Place::Between("<!-- ha-sum: start -->", "<!-- ha-sum: end -->"), text: readme },
        Generated {
            path: "docs/proof.md",
            place: Place::Between("<!-- ha-chunks-sum: start -->", "<!-- ha-chunks-sum: end -->"),
            text: proof,
        },
        Generated {
            path: "docs/proof/ha-runs/README.md",
            place: Place::Between("<!-- ha-chunks: start -->", "<!-- ha-chunks: end -->"),
            text: chunk_list(all, long),
        },
        Generated { path: "docs/proof/ha-runs/sum.md", place: Place::Whole, text: long.to_string() },
        Generated { path: "docs/proof/ha-runs/second-pass.md", place: Place::Whole, text: second.to_string() },
        Generated { path: "docs/proof/ha-runs/first-pass.md", place: Place::Whole, text: first.to_string() },
    ]
}
