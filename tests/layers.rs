//! The import graph of `src/`, read from the code: every `use` and every path that starts with
//! `crate`, `self` or `super`, from each module file to the module file it names. It must have no
//! circle, and no arrow may run from a lower layer up to a higher one (the layers are listed in
//! [`LAYERS`], lowest first; docs/development.md's "Where things are" names them). Test modules (`mod
//! tests`) are left out: nothing imports them. Pure: no cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// The layers of `src/`, lowest first: a module may import modules of its own layer (without
/// a circle) and of the layers below it. A module belongs to the first layer with a prefix of its
/// path (`a::b` is a prefix of `a::b` and `a::b::c`; `""` is the crate root).
const LAYERS: &[(&str, &[&str])] = &[
    (
        "leaves: the rate limiter, the Event publisher, process identity, the ready file, telemetry",
        &["limit", "events", "process", "ready", "telemetry"],
    ),
    (
        "judging vocabulary: facts, verdict, exemptions, identity rule, fences, read values",
        &[
            "admission::judge::facts",
            "admission::judge::verdict",
            "admission::judge::exemptions",
            "admission::judge::identity",
            "admission::judge::fence",
            "admission::judge::read",
        ],
    ),
    (
        "what a guard is: the preamble, the guard trait, the fake reader",
        &["admission::judge::preamble", "admission::judge::guard", "admission::judge::fake"],
    ),
    ("the guards", &["admission::judge::token", "admission::judge::leader", "admission::judge::writer", "admission::judge::audit"]),
    ("the pipeline", &["admission::judge::pipeline", "admission::judge"]),
    ("the real reads and the metrics they count", &["admission::metrics", "admission::reads"]),
    ("wire and transport; the lease controller beside them", &["admission::http", "lease"]),
    ("registration", &["admission::registration"]),
    ("the FencedController status", &["fenced"]),
    ("startup", &["admission::start", "admission::local", "admission"]),
    ("the command line and the crate root", &["cli", ""]),
];

/// The module path of a file under `src/` (`admission/judge/mod.rs` → `admission::judge`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().expect("a file name");
    match last.as_str() {
        "lib.rs" | "mod.rs" => {}
        name => parts.push(name.trim_end_matches(".rs").to_string()),
    }
    parts.join("::")
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Collects the absolute module paths a file's code names.
struct Paths {
    /// The module the code being visited is in (inline `mod` blocks included).
    module: Vec<String>,
    named: BTreeSet<Vec<String>>,
}

impl Paths {
    /// `segments` made absolute (from the crate root), if it starts with `crate`, `self` or `super`.
    fn absolute(&self, segments: &[String]) -> Option<Vec<String>> {
        let mut at = self.module.clone();
        let mut rest = segments;
        match rest.first().map(String::as_str) {
            Some("crate") => {
                at.clear();
                rest = &rest[1..];
            }
            Some("self") => rest = &rest[1..],
            Some("super") => {
                while rest.first().map(String::as_str) == Some("super") {
                    at.pop()?;
                    rest = &rest[1..];
                }
            }
            _ => return None,
        }
        at.extend(rest.iter().cloned());
        Some(at)
    }

    fn note(&mut self, segments: Vec<String>) {
        if let Some(path) = self.absolute(&segments) {
            self.named.insert(path);
        }
    }

    fn use_tree(&mut self, prefix: Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                let mut next = prefix;
                next.push(p.ident.to_string());
                self.use_tree(next, &p.tree);
            }
            syn::UseTree::Name(n) => {
                let mut path = prefix;
                if n.ident != "self" {
                    path.push(n.ident.to_string());
                }
                self.note(path);
            }
            syn::UseTree::Rename(r) => {
                let mut path = prefix;
                if r.ident != "self" {
                    path.push(r.ident.to_string());
                }
                self.note(path);
            }
            syn::UseTree::Glob(_) => self.note(prefix),
            syn::UseTree::Group(g) => g.items.iter().for_each(|item| self.use_tree(prefix.clone(), item)),
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if item.content.is_some() && !is_tests(&item.ident.to_string()) {
            self.module.push(item.ident.to_string());
            syn::visit::visit_item_mod(self, item);
            self.module.pop();
        }
    }

    // `pub(crate)`, `pub(super)`: who may see an item, not what it imports.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.use_tree(Vec::new(), &item.tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        self.note(path.segments.iter().map(|s| s.ident.to_string()).collect());
        syn::visit::visit_path(self, path);
    }
}

/// Whether a module is a test module (`mod tests`, inline or a file): tests are leaves nothing
/// imports, so they add no circle, and a guard's table may run through the pipeline above it.
fn is_tests(segment: &str) -> bool {
    segment == "tests"
}

/// The arrows between module files: from each module to the modules it names.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    // main.rs is the binary: a crate of its own, naming the library as `kube_fence`.
    all.retain(|f| !f.ends_with("main.rs") && !f.file_stem().is_some_and(|s| is_tests(&s.to_string_lossy())));
    let modules: BTreeSet<String> = all.iter().map(|f| module_of(&src, f)).collect();
    let mut arrows = BTreeMap::new();
    for file in &all {
        let from = module_of(&src, file);
        let text = std::fs::read_to_string(file).expect("read");
        let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let mut paths = Paths { module: from.split("::").filter(|s| !s.is_empty()).map(String::from).collect(), named: BTreeSet::new() };
        paths.visit_file(&ast);
        let to: &mut BTreeSet<String> = arrows.entry(from.clone()).or_default();
        for named in paths.named {
            // The module file a path names: its longest prefix that is a module file.
            let target = (0..=named.len()).rev().map(|n| named[..n].join("::")).find(|m| modules.contains(m)).unwrap_or_default();
            if target != from {
                to.insert(target);
            }
        }
    }
    arrows
}

fn layer_of(module: &str) -> usize {
    let under = |prefix: &str| prefix.is_empty() && module.is_empty() || module == prefix || module.starts_with(&format!("{prefix}::"));
    LAYERS
        .iter()
        .position(|(_, prefixes)| prefixes.iter().any(|p| under(p)))
        .unwrap_or_else(|| panic!("module {module:?} is in no layer: add it to LAYERS"))
}

/// The circles of `arrows`: its strongly connected components of more than one module.
fn circles(arrows: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    // Tarjan's algorithm, recursive: the graph has a hundred nodes.
    struct State<'a> {
        arrows: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.arrows.get(v).into_iter().flatten() {
            if !s.index.contains_key(w.as_str()) {
                visit(s, w);
                let low = s.low[w.as_str()].min(s.low[v]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w.as_str()) {
                let low = s.index[w.as_str()].min(s.low[v]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut state =
        State { arrows, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on_stack: BTreeSet::new(), found: Vec::new() };
    for v in arrows.keys() {
        if !state.index.contains_key(v.as_str()) {
            visit(&mut state, v);
        }
    }
    state.found
}

#[test]
fn the_import_graph_of_src_has_no_circle() {
    let arrows = graph();
    let found = circles(&arrows);
    let described: Vec<String> = found
        .iter()
        .map(|c| {
            let inside: Vec<String> =
                c.iter().flat_map(|a| arrows[a].iter().filter(|b| c.contains(b)).map(move |b| format!("{a} -> {b}"))).collect();
            format!("{c:?}: {}", inside.join(", "))
        })
        .collect();
    assert!(found.is_empty(), "import circles in src/:\n{}", described.join("\n"));
}

#[test]
fn no_arrow_runs_up_the_layers() {
    let arrows = graph();
    let up: Vec<String> = arrows
        .iter()
        .flat_map(|(from, to)| to.iter().map(move |to| (from, to)))
        .filter(|(from, to)| layer_of(to) > layer_of(from))
        .map(|(from, to)| format!("{from} ({}) -> {to} ({})", LAYERS[layer_of(from)].0, LAYERS[layer_of(to)].0))
        .collect();
    assert!(up.is_empty(), "arrows running up the layers:\n{}", up.join("\n"));
}

/// The checker itself: a planted circle and a planted upward arrow are found.
#[test]
fn the_checks_find_a_planted_circle_and_an_upward_arrow() {
    let mut arrows = graph();
    assert!(
        arrows.contains_key("admission::judge::facts") && arrows.contains_key("admission::judge::pipeline"),
        "the graph reads the judging core"
    );
    arrows.get_mut("admission::judge::facts").expect("facts").insert("admission::judge::pipeline".into());
    let found = circles(&arrows);
    assert!(
        found.iter().any(|c| c.contains(&"admission::judge::facts".to_string()) && c.contains(&"admission::judge::pipeline".to_string())),
        "{found:?}"
    );
    assert!(layer_of("admission::judge::pipeline") > layer_of("admission::judge::facts"));
    // Arrows the code really has are found too: the pipeline names the token guard.
    assert!(graph()["admission::judge::pipeline"].contains("admission::judge::token"));
}
