//! What the chart ships for monitoring, checked against a running kube-fence: `kube-fence run` as
//! the chart's Pod runs it (webhook and lease controller in one process, `--metrics-addr` on a
//! plain-HTTP port), on the shared control plane. Its plain-HTTP port serves /healthz, /readyz
//! (ready once the lease cache synced) and /metrics with `kube_fence_build_info`, the process
//! metrics and the lease controller's leadership; a lease granted twice and a stale write judged
//! put samples into the families the alerts read. Then:
//! - the Grafana dashboard (charts/kube-fence/dashboards/kube-fence.json) is well formed and each
//!   panel's every expression, and the namespace variable's query, reads only metrics the process
//!   exposes (and only reasons that exist);
//! - the rendered PrometheusRule passes `promtool check rules`, and `promtool test rules`
//!   evaluates every alert against series made from the scrape: as scraped (held steady, nothing
//!   fires), and with the faults each alert is about (nothing scraped, the scraped counters
//!   growing, the leadership gauge at 0: each alert fires, with its labels). promtool is built
//!   from its Go module by hack/build-promtool.sh.
//!
//! Without a cluster: the dashboard matches Grafana's dashboard schema (hack/dashboard-check, the
//! Grafana Foundation SDK's Go types, built by hack/build-dashboard-check.sh), which refuses a
//! planted bad dashboard; and every expression of its panels is PromQL that `promtool check
//! rules` parses, once Grafana's variables are put in as Grafana puts them in.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kube_fence::client::{AcquireOptions, Leases};
use serde_json::{Value, json};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/kube-fence");

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// GET `path` over plain HTTP: (status, body).
fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "--max-time", "5", "-w", "\n%{http_code}"])
        .arg(format!("http://{addr}{path}"))
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// The sample names a scrape's families expose (OpenMetrics: a counter `x` is sampled as
/// `x_total`, a histogram as `x_bucket`, `x_sum`, `x_count`, an info as `x_info`).
fn exposed_names(scrape: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in scrape.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            let suffixes: &[&str] = match kind {
                "counter" => &["_total", "_created"],
                "histogram" => &["_bucket", "_sum", "_count", "_created"],
                "info" => &["_info"],
                _ => &[""],
            };
            names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.starts_with('#') && !line.is_empty() {
            names.insert(line.split(['{', ' ']).next().unwrap_or_default().to_string());
        }
    }
    names
}

/// Each sample of a scrape: (name, labels, value).
fn samples(scrape: &str) -> Vec<(String, BTreeMap<String, String>, f64)> {
    let mut out = Vec::new();
    for line in scrape.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let (series, value) = line.rsplit_once(' ').expect("a sample: series value");
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').expect("labels end with }");
                let mut labels = BTreeMap::new();
                // Label values here never hold `",` (versions, reasons, causes).
                for pair in body.split("\",").filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once("=\"").expect("k=\"v\"");
                    labels.insert(k.to_string(), v.trim_end_matches('"').to_string());
                }
                (name.to_string(), labels)
            }
            None => (series.to_string(), BTreeMap::new()),
        };
        out.push((name, labels, value.parse::<f64>().unwrap_or_else(|e| panic!("{line}: {e}"))));
    }
    out
}

/// The metric names a PromQL expression reads: identifiers that are not functions, keywords,
/// label names (inside braces or `by (...)`) or strings, and the `__name__` matchers' values.
fn metrics_in(expr: &str) -> BTreeSet<String> {
    const WORDS: &[&str] = &[
        "sum",
        "max",
        "min",
        "avg",
        "count",
        "rate",
        "irate",
        "increase",
        "histogram_quantile",
        "absent",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "vector",
        "label_values",
        "bool",
    ];
    let mut names = BTreeSet::new();
    let (mut braces, mut in_string, mut in_grouping) = (0, false, false);
    let chars: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if in_string {
            in_string = c != '"';
        } else if c == '"' {
            in_string = true;
        } else if c == '{' {
            braces += 1;
        } else if c == '}' {
            braces -= 1;
        } else if c == '[' {
            // A range: skip to its end.
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
        } else if c == ')' && in_grouping {
            in_grouping = false;
        } else if c.is_ascii_alphabetic() || c == '_' || c == '$' {
            let start = i;
            while i + 1 < chars.len() && (chars[i + 1].is_ascii_alphanumeric() || chars[i + 1] == '_' || chars[i + 1] == ':') {
                i += 1;
            }
            let word: String = chars[start..=i].iter().collect();
            if word == "by" || word == "without" {
                in_grouping = true;
            } else if braces == 0 && !in_grouping && !word.starts_with('$') && !WORDS.contains(&word.as_str()) {
                names.insert(word);
            }
        }
        i += 1;
    }
    // {__name__=~"a|b"}
    if let Some(rest) = expr.split("__name__=~\"").nth(1) {
        names.extend(rest.split('"').next().unwrap_or_default().split('|').map(str::to_string));
    }
    names
}

/// The `reason="..."` and `reason=~"a|b"` values an expression names.
fn reasons_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in expr.match_indices("reason=") {
        let rest = expr[i + "reason=".len()..].trim_start_matches('~');
        let value = rest.strip_prefix('"').and_then(|r| r.split('"').next()).unwrap_or_default();
        out.extend(value.split('|').map(str::to_string));
    }
    out
}

fn promtool() -> PathBuf {
    if let Some(path) = std::env::var_os("KUBE_FENCE_PROMTOOL") {
        return path.into();
    }
    let out = Command::new(format!("{ROOT}/hack/build-promtool.sh")).stderr(Stdio::inherit()).output().expect("hack/build-promtool.sh");
    assert!(out.status.success(), "hack/build-promtool.sh failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn dashboard_check() -> PathBuf {
    if let Some(path) = std::env::var_os("KUBE_FENCE_DASHBOARD_CHECK") {
        return path.into();
    }
    let out = Command::new(format!("{ROOT}/hack/build-dashboard-check.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("hack/build-dashboard-check.sh");
    assert!(out.status.success(), "hack/build-dashboard-check.sh failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn shipped_dashboard() -> Value {
    serde_json::from_str(&std::fs::read_to_string(format!("{CHART}/dashboards/kube-fence.json")).expect("the dashboard")).expect("JSON")
}

/// dashboard-check on `dashboard`: (passed, what it printed).
fn check_dashboard(dir: &Path, name: &str, dashboard: &Value) -> (bool, String) {
    let file = dir.join(name);
    std::fs::write(&file, serde_json::to_string_pretty(dashboard).expect("JSON")).expect("write the dashboard");
    let out = Command::new(dashboard_check()).arg(&file).output().expect("run dashboard-check");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// The dashboard the chart ships is one Grafana's dashboard schema accepts, field by field (the
/// panels' options and the Prometheus queries by their own types), and the same check refuses
/// dashboards with planted faults, naming where each is.
#[test]
fn the_dashboard_matches_grafanas_dashboard_schema() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shipped = shipped_dashboard();
    let panels = shipped["panels"].as_array().expect("panels").len();
    let queries: usize = shipped["panels"].as_array().expect("panels").iter().map(|p| p["targets"].as_array().map_or(0, Vec::len)).sum();
    let (ok, said) = check_dashboard(dir.path(), "shipped.json", &shipped);
    assert!(ok, "dashboard-check refuses the chart's dashboard:\n{said}");
    assert!(said.contains(&format!("ok ({panels} panels, {queries} queries, 2 variables)")), "every panel and query checked: {said}");

    // (the fault, how it is planted, where the refusal must say it is)
    type Planted = (&'static str, fn(&mut Value), &'static str);
    let planted: [Planted; 5] = [
        (
            "a misspelt query field",
            |d| d["panels"][1]["targets"][0]["exp"] = d["panels"][1]["targets"][0]["expr"].take(),
            "panels[1].targets[0]",
        ),
        (
            "a legend without calcs",
            |d| _ = d["panels"][2]["options"]["legend"].as_object_mut().expect("legend").remove("calcs"),
            "panels[2].options.legend.calcs",
        ),
        ("a width as a string", |d| d["panels"][0]["gridPos"]["w"] = json!("12"), "panels[0].gridPos.w"),
        ("an unknown panel type", |d| d["panels"][3]["type"] = json!("timeseries2"), "panels[3].type"),
        ("a field of no dashboard", |d| d["refreshInterval"] = json!("30s"), "unexpected field 'refreshInterval'"),
    ];
    for (i, (fault, plant, named)) in planted.into_iter().enumerate() {
        let mut bad = shipped.clone();
        plant(&mut bad);
        assert_ne!(bad, shipped, "{fault}: planted");
        let (ok, said) = check_dashboard(dir.path(), &format!("bad-{i}.json"), &bad);
        assert!(!ok, "dashboard-check accepts a dashboard with {fault}:\n{said}");
        assert!(said.contains(named), "{fault}: the refusal names {named}:\n{said}");
    }
}

/// An expression as Grafana sends it to Prometheus: each variable (`$name`, `${name}`) replaced
/// by a value of its (the multi-value namespace variable as Grafana puts it into a regex match,
/// Grafana's own `$__…` intervals by durations). A variable that is neither is left as it is.
fn interpolated(expr: &str, variables: &BTreeSet<&str>) -> String {
    let value = |name: &str| match name {
        "__rate_interval" | "__interval" => Some("1m"),
        "__range" => Some("6h"),
        "namespace" if variables.contains(name) => Some("(?:kube-fence|kube-fence-canary)"),
        _ if variables.contains(name) => Some("x"),
        _ => None,
    };
    let mut out = String::new();
    let mut rest = expr;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let (name, len) = match after.strip_prefix('{') {
            Some(braced) => braced.split_once('}').map_or(("", 0), |(name, _)| (name, name.len() + 2)),
            None => {
                let len = after.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(after.len());
                (&after[..len], len)
            }
        };
        match value(name) {
            Some(v) => out.push_str(v),
            None => out.push_str(&rest[at..at + 1 + len]),
        }
        rest = &after[len..];
    }
    out.push_str(rest);
    out
}

/// `promtool check rules` on recording rules made of `exprs`: (passed, what it printed).
fn promql_parses(dir: &Path, exprs: &[(String, String)]) -> (bool, String) {
    let rules: Vec<Value> = exprs.iter().map(|(record, expr)| json!({"record": record, "expr": expr})).collect();
    let file = dir.join("dashboard-rules.yaml");
    std::fs::write(&file, serde_saphyr::to_string(&json!({"groups": [{"name": "dashboard", "rules": rules}]})).expect("yaml"))
        .expect("rules file");
    let out = Command::new(promtool()).arg("check").arg("rules").arg(&file).output().expect("promtool check rules");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Every query of the dashboard is PromQL Prometheus parses (promtool's parser, on recording
/// rules made of them), using only variables the dashboard defines; a planted syntax error is
/// refused, so the check can fail.
#[test]
fn the_dashboards_expressions_parse_as_promql() {
    let dir = tempfile::tempdir().expect("temp dir");
    let dashboard = shipped_dashboard();
    let variables: BTreeSet<&str> =
        dashboard["templating"]["list"].as_array().expect("variables").iter().filter_map(|v| v["name"].as_str()).collect();
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap_or_else(|| panic!("{}: an expr", panel["title"]));
            let sent = interpolated(expr, &variables);
            assert!(!sent.contains('$'), "{}: {expr} uses a variable the dashboard does not define", panel["title"]);
            exprs.push((format!("dashboard:panel{}:{}", panel["id"], target["refId"].as_str().expect("refId")), sent));
        }
    }
    assert!(exprs.len() >= 12, "the queries: {exprs:?}");
    let (ok, said) = promql_parses(dir.path(), &exprs);
    assert!(ok, "promtool check rules on the dashboard's queries:\n{said}\n{exprs:#?}");
    assert!(said.contains(&format!("{} rules found", exprs.len())), "promtool read every query: {said}");

    let mut bad = exprs.clone();
    bad[0].1 = bad[0].1.replacen("sum by (verdict, reason) (", "sum by (verdict, reason) ((", 1);
    assert_ne!(bad, exprs, "the syntax error is planted");
    let (ok, said) = promql_parses(dir.path(), &bad);
    assert!(!ok, "promtool parses an unbalanced expression: {said}");
}

/// kube-fence run, as the chart's Pod runs it, fencing only `ns` (where nothing is labelled).
fn start(ns: &str, dir: &Path) -> (Process, PathBuf, String) {
    let tls = kube_fence::admission::http::tls::SelfSigned::generate(&["localhost".into()], &[std::net::Ipv4Addr::LOCALHOST.into()])
        .expect("a certificate");
    let (cert, key, ca) = (dir.join("tls.crt"), dir.join("tls.key"), dir.join("ca.crt"));
    std::fs::write(&cert, &tls.serving.cert).expect("cert");
    std::fs::write(&key, &tls.serving.key).expect("key");
    std::fs::write(&ca, &tls.ca_cert).expect("ca");
    let ready = dir.join("ready");
    let child = Command::new(env!("CARGO_BIN_EXE_kube-fence"))
        .args(["run", "--addr=127.0.0.1:0", "--metrics-addr=127.0.0.1:0", "--leader-election", "--log-format=text"])
        .arg("--tls-cert-file")
        .arg(&cert)
        .arg("--tls-key-file")
        .arg(&key)
        .arg("--ready-file")
        .arg(&ready)
        .args(["--namespace", ns, "--watch-namespace", ns, "--only-namespace", ns])
        .arg(format!("--webhook-configuration=kf-monitoring-{ns}"))
        .env("KUBECONFIG", kube_fence_testenv::shared_kubeconfig())
        .env("POD_NAME", format!("kube-fence-{ns}"))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start kube-fence run");
    (Process(child), ready, String::from_utf8_lossy(&std::fs::read(&ca).expect("ca")).into_owned())
}

/// A stale write, as the API server would send it for review: the object records `recorded`,
/// the update presents `presented`.
fn stale_review(ns: &str, lease: &str, presented: u64, recorded: u64) -> String {
    let configmap = |token: u64| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "state", "namespace": ns, "uid": "6c1f0c47-0001-4000-8000-000000000001",
                            "labels": {"kubefence.io/lease": lease}, "annotations": {"kubefence.io/token": token.to_string()}},
               "data": {"n": token.to_string()}})
    };
    let gvk = json!({"group": "", "version": "v1", "kind": "ConfigMap"});
    let gvr = json!({"group": "", "version": "v1", "resource": "configmaps"});
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "7f0e4c9a-0000-4000-8000-000000000001", "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
        "name": "state", "namespace": ns, "operation": "UPDATE",
        "userInfo": {"username": "system:serviceaccount:app:worker", "groups": ["system:authenticated"]},
        "object": configmap(presented), "oldObject": configmap(recorded), "dryRun": false,
        "options": {"kind": "UpdateOptions", "apiVersion": "meta.k8s.io/v1"}}})
    .to_string()
}

#[tokio::test]
async fn the_dashboard_and_the_alerts_read_what_a_running_kube_fence_exposes() {
    let client = common::client().await;
    let ns = common::namespace(&client, "monitoring").await;
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut process, ready_file, ca) = start(&ns, dir.path());
    let ready = common::wait_ready_file(&ready_file, &mut process.0, Duration::from_secs(60)).await;
    let (webhook, metrics) = (ready.webhook.expect("webhook= in the ready file"), ready.metrics.expect("metrics= in the ready file"));
    assert_eq!(http_get(metrics, "/healthz"), (200, "ok".to_string()), "/healthz on the plain-HTTP port");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, body) = http_get(metrics, "/readyz");
        if code == 200 {
            break;
        }
        assert_eq!((code, body.as_str()), (503, "lease cache not synced yet"), "/readyz says what the webhook port's says");
        assert!(Instant::now() < deadline, "not ready within 60 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Reviews are served on the webhook port alone.
    assert_eq!(http_get(metrics, "/validate").0, 404);

    // Work for the families the alerts read: a lease granted twice, a stale write refused.
    let leases = Leases::new(client.clone(), &ns);
    let opts = AcquireOptions::default().duration(Duration::from_secs(60)).timeout(Duration::from_secs(60));
    let older = leases.acquire("work", "first", opts.clone()).await.expect("first grant");
    leases.release(&older).await.expect("release");
    let newer = leases.acquire("work", "second", opts).await.expect("second grant");
    let review = dir.path().join("review.json");
    std::fs::write(&review, stale_review(&ns, "work", older.token.get(), newer.token.get())).expect("review");
    let out = Command::new("curl")
        .args(["-s", "--max-time", "10", "--cacert"])
        .arg(dir.path().join("ca.crt"))
        .args(["-H", "Content-Type: application/json", "--data-binary"])
        .arg(format!("@{}", review.display()))
        .arg(format!("https://localhost:{}/validate", webhook.port()))
        .args(["--resolve", &format!("localhost:{}:127.0.0.1", webhook.port())])
        .output()
        .expect("curl");
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(
        (&answer["response"]["allowed"], &answer["response"]["status"]["reason"]),
        (&json!(false), &json!("StaleToken")),
        "{answer}"
    );
    let _ = ca;

    // The scrape, once the controller counted both grants.
    let deadline = Instant::now() + Duration::from_secs(30);
    let scrape = loop {
        let (code, body) = http_get(metrics, "/metrics");
        assert_eq!(code, 200, "{body}");
        let grants = samples(&body).iter().find(|(n, _, _)| n == "kube_fence_lease_grants_total").map(|s| s.2).unwrap_or(0.0);
        let leading = samples(&body).iter().find(|(n, _, _)| n == "kube_fence_lease_leading").map(|s| s.2).unwrap_or(0.0);
        if grants >= 2.0 && leading == 1.0 {
            break body;
        }
        assert!(Instant::now() < deadline, "the controller did not count two grants while leading within 30 s:\n{body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let scraped = samples(&scrape);
    let value = |name: &str, label: Option<(&str, &str)>| {
        scraped
            .iter()
            .find(|(n, l, _)| n == name && label.is_none_or(|(k, v)| l.get(k).map(String::as_str) == Some(v)))
            .map(|s| s.2)
            .unwrap_or_else(|| panic!("{name} {label:?} is scraped:\n{scrape}"))
    };
    assert_eq!(value("kube_fence_build_info", Some(("version", env!("CARGO_PKG_VERSION")))), 1.0);
    assert!(value("process_cpu_seconds_total", None) > 0.0);
    assert!(value("process_resident_memory_bytes", None) > 1e6);
    assert!(value("process_open_fds", None) >= 3.0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs_f64();
    let started = value("process_start_time_seconds", None);
    assert!(started <= now && started > now - 600.0, "started {started}, now {now}");
    assert_eq!(value("kube_fence_webhook_decisions_total", Some(("reason", "StaleToken"))), 1.0);
    let exposed = exposed_names(&scrape);
    let reasons: BTreeSet<&str> = kube_fence_api::denial::Reason::ALL.iter().map(|r| r.as_str()).collect();

    // The dashboard.
    let dashboard = shipped_dashboard();
    for key in ["title", "uid", "schemaVersion", "panels", "templating"] {
        assert!(dashboard.get(key).is_some(), "the dashboard has {key}");
    }
    let variables: BTreeSet<&str> =
        dashboard["templating"]["list"].as_array().expect("variables").iter().filter_map(|v| v["name"].as_str()).collect();
    assert_eq!(variables, BTreeSet::from(["datasource", "namespace"]));
    // The namespace variable's values: label_values(METRIC, namespace).
    let namespace = dashboard["templating"]["list"].as_array().into_iter().flatten().find(|v| v["name"] == "namespace");
    let query = namespace.and_then(|v| v["query"]["query"].as_str()).expect("the namespace variable's query");
    let metric = query.strip_prefix("label_values(").and_then(|q| q.split(',').next()).unwrap_or_else(|| panic!("{query}"));
    assert!(exposed.contains(metric.trim()), "the namespace variable reads {metric}, which kube-fence does not expose");
    let panels = dashboard["panels"].as_array().expect("panels");
    let ids: BTreeSet<i64> = panels.iter().map(|p| p["id"].as_i64().expect("a panel id")).collect();
    assert_eq!(ids.len(), panels.len(), "panel ids are unique");
    let mut read = BTreeSet::new();
    for panel in panels {
        let title = panel["title"].as_str().expect("a title");
        let grid = &panel["gridPos"];
        assert!(["h", "w", "x", "y"].iter().all(|k| grid[k].is_u64()), "{title}: gridPos");
        assert!(grid["x"].as_u64().unwrap_or(99) + grid["w"].as_u64().unwrap_or(99) <= 24, "{title}: within 24 columns");
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        let targets = panel["targets"].as_array().filter(|t| !t.is_empty()).unwrap_or_else(|| panic!("{title}: targets"));
        let refs: BTreeSet<&str> = targets.iter().map(|t| t["refId"].as_str().expect("refId")).collect();
        assert_eq!(refs.len(), targets.len(), "{title}: refIds are unique");
        for target in targets {
            let expr = target["expr"].as_str().expect("expr");
            let names = metrics_in(expr);
            assert!(!names.is_empty(), "{title}: {expr} reads some metric");
            for name in &names {
                assert!(exposed.contains(name), "{title}: {expr} reads {name}, which kube-fence does not expose:\n{exposed:?}");
            }
            for reason in reasons_in(expr) {
                assert!(reasons.contains(reason.as_str()), "{title}: no reason {reason}");
            }
            read.extend(names);
        }
    }
    for wanted in [
        "kube_fence_webhook_decisions_total",
        "kube_fence_webhook_lease_reads_total",
        "kube_fence_webhook_reads_throttled_total",
        "kube_fence_webhook_decision_duration_seconds_bucket",
        "kube_fence_webhook_quorum_read_duration_seconds_bucket",
        "kube_fence_lease_grants_total",
        "kube_fence_lease_expiries_total",
        "kube_fence_lease_reconcile_errors_total",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
    ] {
        assert!(read.contains(wanted), "the dashboard shows {wanted}");
    }

    // The alerts, as the chart renders them for release `mon` in namespace `monitoring`.
    let rendered = Command::new(kube_fence_testenv::binaries().expect("binaries").join("helm"))
        .args(["template", "mon", CHART, "-n", "monitoring", "--set", "prometheusRule.enabled=true"])
        .env("HELM_CACHE_HOME", std::env::temp_dir().join("kube-fence-helm-cache"))
        .output()
        .expect("helm template");
    assert!(rendered.status.success(), "{}", String::from_utf8_lossy(&rendered.stderr));
    let rule = String::from_utf8_lossy(&rendered.stdout)
        .split("\n---")
        .filter_map(|doc| serde_saphyr::from_str::<Value>(doc).ok())
        .find(|doc| doc["kind"] == "PrometheusRule")
        .expect("a PrometheusRule");
    let rules_file = dir.path().join("rules.yaml");
    std::fs::write(&rules_file, serde_saphyr::to_string(&rule["spec"]).expect("yaml")).expect("rules file");
    let promtool = promtool();
    let checked = Command::new(&promtool).arg("check").arg("rules").arg(&rules_file).output().expect("promtool check rules");
    assert!(
        checked.status.success(),
        "promtool check rules:\n{}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    let alerts: Vec<Value> = rule["spec"]["groups"][0]["rules"].as_array().expect("rules").clone();
    assert_eq!(alerts.len(), 7);
    for alert in &alerts {
        let expr = alert["expr"].as_str().expect("expr");
        for name in metrics_in(expr).iter().filter(|n| *n != "up") {
            assert!(exposed.contains(name), "{}: {expr} reads {name}, which kube-fence does not expose", alert["alert"]);
        }
        for reason in reasons_in(expr) {
            assert!(reasons.contains(reason.as_str()), "{}: no reason {reason}", alert["alert"]);
        }
    }

    // Series from the scrape, labelled as the ServiceMonitor's scrape labels them.
    let target =
        [("job", "mon-kube-fence-webhook"), ("namespace", "monitoring"), ("instance", "10.0.0.7:9090"), ("pod", "mon-kube-fence-0")];
    let series = |name: &str, labels: &BTreeMap<String, String>| {
        let mut all: BTreeMap<String, String> = labels.clone();
        all.extend(target.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let inner: Vec<String> = all.iter().map(|(k, v)| format!("{k}={}", json!(v))).collect();
        format!("{name}{{{}}}", inner.join(","))
    };
    let steady: Vec<Value> = scraped
        .iter()
        .map(|(name, labels, v)| json!({"series": series(name, labels), "values": format!("{v}+0x60")}))
        .chain(std::iter::once(json!({"series": series("up", &BTreeMap::new()), "values": "1+0x60"})))
        .collect();
    // The faults: nothing scraped (up 0), the scraped counters growing by one a second, the
    // NotHolder refusals a copy of the scraped StaleToken ones (reason relabelled), no replica
    // leading.
    let mut faulty: Vec<Value> = Vec::new();
    for (name, labels, v) in &scraped {
        let values = if name.ends_with("_total") && !name.starts_with("process_") {
            format!("{v}+60x60")
        } else if name == "kube_fence_lease_leading" {
            "0+0x60".into()
        } else {
            format!("{v}+0x60")
        };
        faulty.push(json!({"series": series(name, labels), "values": values}));
        if name == "kube_fence_webhook_decisions_total" && labels.get("reason").map(String::as_str) == Some("StaleToken") {
            let mut relabelled = labels.clone();
            relabelled.insert("reason".into(), "NotHolder".into());
            faulty.push(json!({"series": series(name, &relabelled), "values": format!("{v}+60x60")}));
        }
    }
    faulty.push(json!({"series": series("up", &BTreeMap::new()), "values": "0+0x60"}));
    let expected = |alert: &Value| {
        let mut labels = alert["labels"].clone();
        labels["namespace"] = json!("monitoring");
        if alert["alert"] == "KubeFenceWebhookDown" {
            labels["job"] = json!("mon-kube-fence-webhook");
        }
        json!({"exp_labels": labels, "exp_annotations": alert["annotations"]})
    };
    let names: Vec<&str> = alerts.iter().map(|a| a["alert"].as_str().expect("alert")).collect();
    let tests = json!({
        "rule_files": [rules_file.display().to_string()],
        "evaluation_interval": "1m",
        "tests": [
            {"interval": "1m", "input_series": steady,
             "alert_rule_test": names.iter().map(|n| json!({"eval_time": "40m", "alertname": n, "exp_alerts": []})).collect::<Vec<_>>()},
            // Nothing scraped at all (no `up` series either): the webhook is down all the same.
            {"interval": "1m", "input_series": steady.iter().filter(|s| !s["series"].as_str().is_some_and(|n| n.starts_with("up{"))).collect::<Vec<_>>(),
             "alert_rule_test": [{"eval_time": "40m", "alertname": "KubeFenceWebhookDown",
                                  "exp_alerts": [expected(alerts.iter().find(|a| a["alert"] == "KubeFenceWebhookDown").expect("the alert"))]}]},
            {"interval": "1m", "input_series": faulty,
             "alert_rule_test": alerts.iter().map(|a| json!({"eval_time": "40m", "alertname": a["alert"], "exp_alerts": [expected(a)]})).collect::<Vec<_>>()},
        ],
    });
    let tests_file = dir.path().join("tests.yaml");
    std::fs::write(&tests_file, serde_saphyr::to_string(&tests).expect("yaml")).expect("tests file");
    let tested = Command::new(&promtool).arg("test").arg("rules").arg(&tests_file).output().expect("promtool test rules");
    assert!(
        tested.status.success(),
        "promtool test rules ({}):\n{}{}",
        tests_file.display(),
        String::from_utf8_lossy(&tested.stdout),
        String::from_utf8_lossy(&tested.stderr)
    );
    eprintln!("MEASURED monitoring: {} series scraped; {} alerts evaluated steady and faulty", scraped.len(), names.len());
    drop(process);
}

#[test]
fn grafana_variables_are_put_into_expressions_as_grafana_does() {
    let variables = BTreeSet::from(["namespace", "datasource"]);
    assert_eq!(
        interpolated(r#"rate(x{namespace=~"$namespace",ds="${datasource}"}[$__rate_interval])"#, &variables),
        r#"rate(x{namespace=~"(?:kube-fence|kube-fence-canary)",ds="x"}[1m])"#
    );
    // Not a variable of the dashboard: left in, so the test of the dashboard's queries fails.
    assert_eq!(interpolated(r#"x{namespace=~"$namespaces"}"#, &variables), r#"x{namespace=~"$namespaces"}"#);
    assert_eq!(interpolated("x{a=\"${nope}\"}", &variables), "x{a=\"${nope}\"}");
}

#[test]
fn promql_metric_names_are_read_out_of_expressions() {
    let expr = r#"histogram_quantile(0.99, sum by (le) (rate(kube_fence_webhook_decision_duration_seconds_bucket{namespace=~"$namespace",job="x"}[$__rate_interval]))) + max by (namespace) (kube_fence_lease_leading) or absent(up{job="a"} == 1)"#;
    assert_eq!(
        metrics_in(expr),
        BTreeSet::from(["kube_fence_webhook_decision_duration_seconds_bucket", "kube_fence_lease_leading", "up"].map(String::from))
    );
    assert_eq!(
        metrics_in(r#"sum(rate({__name__=~"a_total|b_total", job="j"}[5m]))"#),
        BTreeSet::from(["a_total".to_string(), "b_total".to_string()])
    );
    assert_eq!(
        reasons_in(r#"x{reason=~"StaleToken|NotHolder",verdict="denied"} + y{reason="ReadsThrottled"}"#),
        ["StaleToken", "NotHolder", "ReadsThrottled"]
    );
}
