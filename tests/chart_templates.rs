//! The chart's webhook configurations and policies (charts/kube-fence/templates/, the files that
//! start with the generated header) are rendered from src/admission/registration/mod.rs; this fails
//! when the committed files and the code drift apart.

use kube_fence::admission::registration::chart;

const TEMPLATES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/kube-fence/templates");
const REGENERATE: &str = "regenerate them with\n    cargo run -- chart-templates charts/kube-fence/templates";

#[test]
fn chart_templates_match_the_registration_code() {
    let templates = chart::templates().expect("the chart's templates render");
    for template in &templates {
        let path = format!("{TEMPLATES}/{}", template.file);
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == template.content,
            "{path} is out of date with the code that renders it (src/admission/registration/mod.rs, registration/chart.rs): {REGENERATE}"
        );
    }
    // A generated file the code no longer renders is stale, not hand-written.
    for entry in std::fs::read_dir(TEMPLATES).expect("templates/") {
        let path = entry.expect("a directory entry").path();
        let content = std::fs::read_to_string(&path).unwrap_or_default();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        assert!(
            !content.starts_with(chart::HEADER) || templates.iter().any(|t| t.file == name),
            "{} says it is generated, but the code renders no such file: remove it, or {REGENERATE}",
            path.display()
        );
    }
}
