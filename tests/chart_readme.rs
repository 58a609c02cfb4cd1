//! The chart's README (charts/kube-fence/README.md) is generated from values.yaml (each key, its
//! default and the comment above it) and values.schema.json (each key's type, and the keys the
//! schema allows that values.yaml leaves unset): this fails when the committed README and what
//! they generate drift apart, and when a value has no words. Regenerate with
//!     KUBE_FENCE_WRITE_CHART_README=1 cargo test --test chart_readme

use serde_json::Value;

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/kube-fence");

/// One row of the table: a key of values.yaml (or of the schema alone).
#[derive(Debug)]
struct Row {
    key: String,
    kind: String,
    default: String,
    description: String,
}

/// The keys of values.yaml with the comment block right above each (a blank line ends a block),
/// as dotted paths. A list's items are its value, not keys.
fn keys_with_comments(yaml: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut comment: Vec<String> = Vec::new();
    let mut stack: Vec<(usize, String)> = Vec::new();
    for line in yaml.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() {
            comment.clear();
        } else if let Some(text) = trimmed.strip_prefix('#') {
            comment.push(text.strip_prefix(' ').unwrap_or(text).to_string());
        } else if trimmed.starts_with("- ") || trimmed == "-" {
            comment.clear();
        } else if let Some((key, rest)) = trimmed.split_once(':').filter(|(k, _)| k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        {
            while stack.last().is_some_and(|(i, _)| *i >= indent) {
                stack.pop();
            }
            let path: Vec<&str> = stack.iter().map(|(_, k)| k.as_str()).chain(std::iter::once(key)).collect();
            out.push((path.join("."), comment.join(" ")));
            comment.clear();
            if rest.trim().is_empty() {
                stack.push((indent, key.to_string()));
            }
        }
    }
    out
}

/// The schema of `path` (dotted), if the schema describes it.
fn schema_at<'s>(schema: &'s Value, path: &str) -> Option<&'s Value> {
    path.split('.').try_fold(schema, |node, key| node.get("properties")?.get(key))
}

fn kind(schema: Option<&Value>) -> String {
    let Some(schema) = schema else { return "any".into() };
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        return values.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(" | ");
    }
    match schema.get("type") {
        Some(Value::String(t)) if t == "array" => match schema.pointer("/items/type").and_then(Value::as_str) {
            Some(item) => format!("array of {item}"),
            None => "array".into(),
        },
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(" or "),
        _ => "any".into(),
    }
}

fn value_at<'v>(values: &'v Value, path: &str) -> Option<&'v Value> {
    path.split('.').try_fold(values, |node, key| node.get(key))
}

/// Text in a table cell: a `|` would end the cell, a `<` start an HTML tag.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('<', "&lt;")
}

fn rows() -> Vec<Row> {
    let yaml = std::fs::read_to_string(format!("{CHART}/values.yaml")).expect("values.yaml");
    let values: Value = serde_saphyr::from_str(&yaml).expect("values.yaml parses");
    let schema: Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{CHART}/values.schema.json")).expect("schema")).expect("schema parses");
    let mut rows = Vec::new();
    // A free-form map of the schema (no properties: resources, securityContext...) is one value.
    let free_form = |key: &str| {
        let parts: Vec<&str> = key.split('.').collect();
        (1..parts.len()).any(|n| schema_at(&schema, &parts[..n].join(".")).is_some_and(|node| node.get("properties").is_none()))
    };
    let listed: Vec<(String, String)> = keys_with_comments(&yaml).into_iter().filter(|(key, _)| !free_form(key)).collect();
    for (key, comment) in &listed {
        let value = value_at(&values, key).expect("a key of values.yaml has a value");
        let node = schema_at(&schema, key);
        // A map whose keys are rows of their own is said by them.
        let parent = value.as_object().is_some_and(|m| !m.is_empty()) && listed.iter().any(|(k, _)| k.starts_with(&format!("{key}.")));
        if parent && comment.is_empty() {
            continue;
        }
        let default = if parent { "(see below)".to_string() } else { format!("`{}`", serde_json::to_string(value).expect("json")) };
        let description = if comment.is_empty() {
            node.and_then(|n| n.get("description")).and_then(Value::as_str).unwrap_or_default().to_string()
        } else {
            comment.clone()
        };
        rows.push(Row { key: key.clone(), kind: kind(node), default, description });
    }
    // What the schema allows that values.yaml leaves unset.
    fn walk(schema: &Value, prefix: &str, out: &mut Vec<(String, Value)>) {
        if let Some(props) = schema.get("properties").and_then(Value::as_object) {
            for (key, node) in props {
                let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
                out.push((path.clone(), node.clone()));
                walk(node, &path, out);
            }
        }
    }
    let mut all = Vec::new();
    walk(&schema, "", &mut all);
    for (path, node) in all {
        let covered = listed.iter().any(|(k, _)| *k == path) || listed.iter().any(|(k, _)| path.starts_with(&format!("{k}.")));
        if !covered {
            let description = node.get("description").and_then(Value::as_str).unwrap_or_default().to_string();
            rows.push(Row { key: path, kind: kind(Some(&node)), default: "(unset)".into(), description });
        }
    }
    rows
}

fn readme(rows: &[Row]) -> String {
    let mut out = String::from(
        "# kube-fence Helm chart\n\n\
         Fencing tokens for Kubernetes: a Lease controller that grants strictly increasing tokens, and a\n\
         validating webhook that rejects stale writes. The project's README says what it is;\n\
         docs/install.md how to install, check and upgrade it; docs/fence-a-worker.md and\n\
         docs/fence-an-existing-operator.md how to fence a worker or a controller;\n\
         docs/operations/when-kube-fence-is-down.md what to do when its webhook is down.\n\n\
         ```sh\n\
         kubectl apply -f crds/\n\
         helm install kube-fence charts/kube-fence --namespace kube-fence --create-namespace\n\
         helm test kube-fence --namespace kube-fence   # with tests.namespace set\n\
         ```\n\n\
         ## Values\n\n\
         Generated from values.yaml and values.schema.json by tests/chart_readme.rs (do not edit; it\n\
         fails when this table and the values drift apart).\n\n\
         | Key | Type | Default | Description |\n\
         | --- | --- | --- | --- |\n",
    );
    for row in rows {
        out.push_str(&format!("| `{}` | {} | {} | {} |\n", row.key, cell(&row.kind), cell(&row.default), cell(&row.description)));
    }
    out
}

#[test]
fn the_chart_readme_is_generated_from_the_values_and_their_schema() {
    let rows = rows();
    let undocumented: Vec<&str> = rows.iter().filter(|r| r.description.trim().is_empty()).map(|r| r.key.as_str()).collect();
    assert!(
        undocumented.is_empty(),
        "values without a word in values.yaml (a comment above) or the schema (description): {undocumented:?}"
    );
    for key in ["fencedControllers", "leaseAdmins", "leaderLeases", "leaderIdentity.separator", "leaseStatusWriters", "global"] {
        assert!(rows.iter().any(|r| r.key == key), "{key} is in the chart README");
    }
    let generated = readme(&rows);
    let path = format!("{CHART}/README.md");
    if std::env::var_os("KUBE_FENCE_WRITE_CHART_README").is_some() {
        std::fs::write(&path, &generated).expect("write the chart README");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{path} is out of date with values.yaml / values.schema.json: regenerate it with\n    KUBE_FENCE_WRITE_CHART_README=1 cargo test --test chart_readme"
    );
}

#[test]
fn keys_are_read_with_the_comment_above_them() {
    let yaml = "# top\na: 1\n\n# lost\n\nb:\n  # inner\n  c: [x]\n  d:\n    - e: 1\n  # f's\n  f: {}\n";
    let keys = keys_with_comments(yaml);
    let expected = [("a", "top"), ("b", ""), ("b.c", "inner"), ("b.d", ""), ("b.f", "f's")];
    assert_eq!(keys, expected.map(|(k, c)| (k.to_string(), c.to_string())));
}
