//! The reference pages under docs/reference/ that are generated from the code, and the ones that
//! are checked against it. Each generated part sits between `<!-- generated: WHAT -->` and
//! `<!-- end generated -->`; this fails when the committed page and what the code says now
//! differ. Regenerate with
//!
//!     KUBE_FENCE_WRITE_DOCS=1 cargo test --test reference
//!
//! - docs/reference/cli.md: the `--help` of the built binary and of each of its commands;
//! - docs/reference/metrics.md: every metric kube-fence registers (`kube_fence::cli::run::every_metric`),
//!   and no `kube_fence_*` name anywhere in the docs that it does not register;
//! - docs/reference/events.md: the webhook's reasons table lists exactly `kube_fence_api::denial::Reason::ALL`.
//!
//! Pure: no cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const END: &str = "<!-- end generated -->";

/// `page` with the region after the marker `<!-- generated: WHAT -->` replaced by `content`.
fn with_region(page: &str, what: &str, content: &str) -> String {
    let start = format!("<!-- generated: {what} -->\n");
    let from = page.find(&start).unwrap_or_else(|| panic!("no {start:?} marker")) + start.len();
    let to = from + page[from..].find(END).unwrap_or_else(|| panic!("no {END:?} after {start:?}"));
    format!("{}{content}{}", &page[..from], &page[to..])
}

/// Compares (or, with KUBE_FENCE_WRITE_DOCS set, writes) the region `what` of `page`.
fn check_region(page: &str, what: &str, content: &str) {
    let path = Path::new(ROOT).join(page);
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let generated = with_region(&committed, what, content);
    if std::env::var_os("KUBE_FENCE_WRITE_DOCS").is_some() {
        std::fs::write(&path, &generated).expect("write the page");
        return;
    }
    if committed != generated {
        let diff = committed.lines().zip(generated.lines()).enumerate().find(|(_, (a, b))| a != b);
        panic!(
            "{page} is out of date with the code ({what}); first difference: {diff:?}\nregenerate it with\n    KUBE_FENCE_WRITE_DOCS=1 cargo test --test reference"
        );
    }
}

/// The built binary's `--help` for `args`, with an empty environment (no variable a flag reads
/// shows up as its value) and no terminal (clap wraps at 100 columns).
fn help(args: &[&str]) -> String {
    let home = tempfile::tempdir().expect("HOME");
    let out = Command::new(env!("CARGO_BIN_EXE_kube-fence"))
        .args(args)
        .arg("--help")
        .env_clear()
        .env("HOME", home.path())
        .env("COLUMNS", "100")
        // No terminal anywhere: clap would wrap to its width.
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run kube-fence");
    assert!(out.status.success(), "kube-fence {} --help: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8 help")
}

/// The commands a `--help` lists under `Commands:` (not `help`).
fn commands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| *l != "Commands:")
        .skip(1)
        .take_while(|l| l.starts_with(' '))
        .filter(|l| l.len() > 2 && !l[2..].starts_with(' '))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// Every command path, depth first: [], [lease], [lease, acquire], ...
fn command_paths(prefix: Vec<String>, out: &mut Vec<(Vec<String>, String)>) {
    let args: Vec<&str> = prefix.iter().map(String::as_str).collect();
    let text = help(&args);
    let subs = commands(&text);
    out.push((prefix.clone(), text));
    for sub in subs {
        let mut path = prefix.clone();
        path.push(sub);
        command_paths(path, out);
    }
}

#[test]
fn the_cli_reference_is_every_commands_help() {
    let mut paths = Vec::new();
    command_paths(Vec::new(), &mut paths);
    let names: Vec<String> = paths.iter().map(|(p, _)| p.join(" ")).collect();
    for expected in ["", "lease", "lease acquire", "lease run", "patch", "delete", "delegate", "status", "selftest", "run"] {
        assert!(names.iter().any(|n| n == expected), "the help lists `kube-fence {expected}`: {names:?}");
    }
    let mut content = String::new();
    for (path, text) in &paths {
        let name = if path.is_empty() { "kube-fence".to_string() } else { format!("kube-fence {}", path.join(" ")) };
        content.push_str(&format!("\n### `{name}`\n\n```text\n{}\n```\n", text.trim_end()));
    }
    content.push('\n');
    check_region("docs/reference/cli.md", "kube-fence --help", &content);
}

/// One metric family as the exposition describes it.
#[derive(Debug, Default)]
struct Family {
    kind: String,
    help: String,
    labels: BTreeSet<String>,
}

/// The families of an exposition (`# HELP`, `# TYPE`, and the label names of its samples), by the
/// name a query uses: a counter's `_total`, an info's `_info`, others as named.
fn families(text: &str) -> BTreeMap<String, Family> {
    let mut by_base: BTreeMap<String, Family> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            by_base.entry(name.to_string()).or_default().help = help.to_string();
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            by_base.entry(name.to_string()).or_default().kind = kind.to_string();
        } else if !line.starts_with('#') && !line.is_empty() {
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let sample = &line[..name_end];
            let base = by_base.keys().filter(|b| sample.starts_with(b.as_str())).max_by_key(|b| b.len()).cloned();
            let (Some(base), Some(labels)) = (base, line[name_end..].strip_prefix('{')) else { continue };
            let labels = &labels[..labels.find('}').unwrap_or(labels.len())];
            for pair in labels.split(',').filter(|p| !p.is_empty()) {
                let label = pair.split_once('=').map_or(pair, |(l, _)| l);
                if label != "le" {
                    by_base.get_mut(&base).expect("family").labels.insert(label.to_string());
                }
            }
        }
    }
    by_base
        .into_iter()
        .map(|(base, family)| {
            let name = match family.kind.as_str() {
                "counter" => format!("{base}_total"),
                "info" => format!("{base}_info"),
                _ => base,
            };
            (name, family)
        })
        .collect()
}

/// Every `kube_fence_*` word in `text`, with a histogram's `_bucket`, `_sum` and `_count` cut.
fn metric_names_in(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("kube_fence_") {
        let boundary = at == 0 || !rest.as_bytes()[at - 1].is_ascii_alphanumeric() && rest.as_bytes()[at - 1] != b'_';
        let word: String = rest[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        rest = &rest[at + word.len()..];
        // A prefix written for a family of names (`kube_fence_lease_{grants,renewals}_total`).
        if !boundary || word.ends_with('_') {
            continue;
        }
        let word = ["_bucket", "_sum", "_count"].iter().fold(word, |w, s| w.strip_suffix(s).map(str::to_string).unwrap_or(w));
        names.insert(word);
    }
    names
}

/// Every Markdown page the reference is checked against: README.md and docs/**/*.md.
fn pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read docs/") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut out = vec![Path::new(ROOT).join("README.md")];
    walk(&Path::new(ROOT).join("docs"), &mut out);
    out.sort();
    out
}

#[test]
fn the_metrics_reference_is_every_metric_the_code_registers() {
    let families = families(&kube_fence::cli::run::every_metric());
    // The prefixes the code registers under (sub-registries and whole names), read from src/: each
    // must have a metric in the exposition, so a registration every_metric() misses fails here.
    let mut prefixes = BTreeSet::new();
    let mut stack = vec![Path::new(ROOT).join("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src/") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let code = std::fs::read_to_string(&path).expect("read a source file");
                for call in ["sub_registry_with_prefix(\"", "register(\n        \"", "register(\""] {
                    for (at, _) in code.match_indices(call) {
                        let name: String = code[at + call.len()..].chars().take_while(|c| *c != '"').collect();
                        if name.starts_with("kube_fence_") {
                            prefixes.insert(name);
                        }
                    }
                }
            }
        }
    }
    assert!(prefixes.len() >= 4, "the registrations in src/: {prefixes:?}");
    for prefix in &prefixes {
        assert!(families.keys().any(|m| m.starts_with(prefix.as_str())), "src/ registers {prefix}, which every_metric() lacks");
    }

    let mut content = String::from("\n| metric | type | labels | what it counts |\n| --- | --- | --- | --- |\n");
    for (name, family) in &families {
        let labels = family.labels.iter().map(|l| format!("`{l}`")).collect::<Vec<_>>().join(", ");
        content.push_str(&format!("| `{name}` | {} | {labels} | {} |\n", family.kind, family.help.replace('|', "\\|")));
    }
    content.push('\n');
    check_region("docs/reference/metrics.md", "metrics", &content);

    // And the other way: every kube_fence_* metric a page names exists.
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("read a page");
        for name in metric_names_in(&text) {
            // Crate and module paths (kube_fence_api, kube_fence_client::...) are not metrics.
            if ["kube_fence_api", "kube_fence_client", "kube_fence_test_support", "kube_fence_testenv"].contains(&name.as_str()) {
                continue;
            }
            assert!(families.contains_key(&name), "{} names {name}, which kube-fence does not register", page.display());
        }
    }
}

#[test]
fn the_events_reference_lists_every_reason_of_the_webhook() {
    let page = std::fs::read_to_string(Path::new(ROOT).join("docs/reference/events.md")).expect("events.md");
    let listed: Vec<String> = page
        .lines()
        .skip_while(|l| !l.starts_with("| reason | verdict | meaning |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| l.split('|').nth(1).expect("a cell").trim().trim_matches('`').to_string())
        .collect();
    let code: Vec<String> = kube_fence_api::denial::Reason::ALL.iter().map(|r| r.as_str().to_string()).collect();
    assert_eq!(listed, code, "docs/reference/events.md's reasons table lists Reason::ALL, in its order");
}

#[test]
fn the_metric_names_in_a_text_are_found() {
    let names =
        metric_names_in("`kube_fence_lease_grants_total`, rate(kube_fence_webhook_decision_duration_seconds_bucket[5m]) my_kube_fence_x");
    assert_eq!(names.into_iter().collect::<Vec<_>>(), ["kube_fence_lease_grants_total", "kube_fence_webhook_decision_duration_seconds"]);
}
