//! The Helm chart, checked by helm and by a real API server: it lints, every object it renders is
//! accepted by a server-side dry run, it installs, what it creates is what the values say, its
//! ServiceAccount can do exactly what kube-fence needs and nothing more, and uninstalling it
//! leaves no webhook configuration behind.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Output};

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/kube-fence");

fn tool(name: &str) -> PathBuf {
    kube_fence_testenv::binaries().expect("control-plane binaries").join(name)
}

fn run(name: &str, args: &[&str], stdin: Option<&[u8]>) -> Output {
    use std::io::Write;
    let kubeconfig = kube_fence_testenv::shared_kubeconfig();
    let mut cmd = Command::new(tool(name));
    cmd.args(args).env("KUBECONFIG", &kubeconfig).env("HELM_CACHE_HOME", std::env::temp_dir().join("kube-fence-helm-cache"));
    cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("running {name}: {e}"));
    if let Some(input) = stdin {
        child.stdin.take().expect("stdin").write_all(input).expect("write stdin");
    }
    drop(child.stdin.take());
    child.wait_with_output().expect("wait")
}

fn ok(name: &str, args: &[&str], stdin: Option<&[u8]>) -> String {
    let out = run(name, args, stdin);
    assert!(
        out.status.success(),
        "{name} {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `helm template` of release `cmp` in `kf-system` with the values file `values`, rendered
/// without a cluster (no control plane is started for it).
fn template(values: &std::path::Path) -> String {
    let out = Command::new(tool("helm"))
        .args(["template", "cmp", CHART, "-n", "kf-system", "-f"])
        .arg(values)
        .env("HELM_CACHE_HOME", std::env::temp_dir().join("kube-fence-helm-cache"))
        .output()
        .unwrap_or_else(|e| panic!("running helm: {e}"));
    assert!(out.status.success(), "helm template failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Values that keep a test release from fencing anything but a namespace no test uses: the
/// chart's webhook fails closed and has no running Pods here (no node), so it must not judge
/// other tests' guarded objects.
/// The objects of a rendered chart (`helm template` output), as JSON.
fn documents(rendered: &str) -> Vec<serde_json::Value> {
    rendered.split("\n---").filter_map(|doc| serde_saphyr::from_str::<serde_json::Value>(doc).ok()).filter(|doc| doc.is_object()).collect()
}

/// The rendered object of `kind` whose name ends with `suffix`.
fn named(docs: &[serde_json::Value], kind: &str, suffix: &str) -> serde_json::Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"].as_str().is_some_and(|n| n.ends_with(suffix)))
        .cloned()
        .unwrap_or_else(|| panic!("the chart renders a {kind} named *{suffix}"))
}

fn isolated(ns: &str) -> Vec<String> {
    vec!["--set".into(), format!("webhook.onlyNamespaces={{{ns}-nothing}}")]
}

#[test]
fn chart_crds_are_the_generated_crds() {
    let chart = std::fs::read_to_string(format!("{CHART}/crds/kubefence.io_leases.yaml")).expect("chart CRD");
    let generated = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/crds/kubefence.io_leases.yaml")).expect("crds/");
    assert!(chart == generated, "charts/kube-fence/crds/ differs from crds/: cp crds/*.yaml charts/kube-fence/crds/");
}

/// The chart's values that shape what is registered, as a table row.
#[derive(Default)]
struct Values {
    only: &'static [&'static str],
    excluded: Option<&'static [&'static str]>,
    timeout: Option<i32>,
    policy_path: bool,
    admins: &'static [&'static str],
    leader_leases: &'static [&'static str],
    status_writers: &'static [&'static str],
    separator: Option<&'static str>,
}

impl Values {
    fn file(&self) -> serde_json::Value {
        let mut webhook = serde_json::json!({"onlyNamespaces": self.only});
        if let Some(excluded) = self.excluded {
            webhook["excludedNamespaces"] = serde_json::json!(excluded);
        }
        if let Some(timeout) = self.timeout {
            webhook["timeoutSeconds"] = serde_json::json!(timeout);
        }
        let mut values = serde_json::json!({
            "webhook": webhook,
            "policyPath": {"enabled": self.policy_path},
            "leaseAdmins": self.admins,
            "leaderLeases": self.leader_leases,
            "leaseStatusWriters": self.status_writers,
        });
        if let Some(separator) = self.separator {
            values["leaderIdentity"] = serde_json::json!({"separator": separator});
        }
        values
    }

    /// What `run --local` registers with these settings, for release `cmp` in `kf-system`: the
    /// webhook configurations and the policies with their bindings, labels left out (the chart's).
    fn registered(&self) -> Vec<serde_json::Value> {
        use kube_fence::admission::registration::{Endpoint, Registration};
        let strings = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let mut reg = Registration::new(
            "cmp-kube-fence",
            Endpoint::Service { namespace: "kf-system".into(), name: "cmp-kube-fence-webhook".into(), port: 443 },
        );
        reg.operator_namespace = Some("kf-system".into());
        if let Some(excluded) = self.excluded {
            reg.excluded_namespaces = strings(excluded);
        }
        reg.only_namespaces = (!self.only.is_empty()).then(|| strings(self.only));
        reg.timeout_seconds = self.timeout.unwrap_or(5);
        reg.policy_path = self.policy_path;
        reg.leader_leases = strings(self.leader_leases);
        if let Some(separator) = self.separator {
            reg.leader_identity = separator.parse().expect("a separator the flag parses");
        }
        let controller = "system:serviceaccount:kf-system:cmp-kube-fence".to_string();
        let admins = strings(self.admins);
        let mut writers = vec![controller.clone()];
        writers.extend(strings(self.status_writers));
        let json = |v: serde_json::Result<serde_json::Value>| v.expect("serializes");
        let mut objects = vec![json(serde_json::to_value(reg.configuration()))];
        objects.push(serde_json::json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "cmp-kube-fence-writers"},
        }));
        let mut policies = vec![
            reg.status_policy(&writers),
            reg.identity_policy(&admins),
            reg.holder_policy(&admins),
            reg.fenced_holder_policy(),
            reg.fence_owner_policy(),
        ];
        if self.policy_path {
            policies.push(reg.policy_path_policy());
            policies.push(reg.params_policy(&[controller]));
        }
        for (policy, binding) in policies {
            objects.push(json(serde_json::to_value(policy)));
            objects.push(json(serde_json::to_value(binding)));
        }
        objects.iter_mut().for_each(without_labels);
        objects
    }
}

fn without_labels(object: &mut serde_json::Value) {
    if let Some(metadata) = object["metadata"].as_object_mut() {
        metadata.remove("labels");
    }
}

/// What the chart registers is what local mode registers with the same values: every webhook
/// configuration, policy and binding it renders, whole (labels aside), for a table of values.
/// The templates are generated from the same code (tests/chart_templates.rs); this checks that
/// the chart's values land where the code puts them.
#[test]
fn the_chart_registers_what_local_mode_registers() {
    let table = [
        Values::default(),
        Values { only: &["a", "b"], timeout: Some(7), ..Default::default() },
        Values { excluded: Some(&["kube-system", "other"]), only: &["a"], ..Default::default() },
        Values { excluded: Some(&[]), ..Default::default() },
        Values {
            policy_path: true,
            admins: &["admin", "system:serviceaccount:ops:break-glass"],
            leader_leases: &["op-a", "op-b"],
            status_writers: &["w1", "w2"],
            ..Default::default()
        },
        Values { admins: &["a"], leader_leases: &["l"], status_writers: &["w"], separator: Some("none"), ..Default::default() },
        Values { policy_path: true, only: &["a"], separator: Some(":uid="), ..Default::default() },
    ];
    let dir = tempfile::tempdir().expect("temp dir");
    let registering = ["ValidatingWebhookConfiguration", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"];
    for (i, values) in table.iter().enumerate() {
        let file = dir.path().join(format!("values-{i}.yaml"));
        std::fs::write(&file, serde_saphyr::to_string(&values.file()).expect("values")).expect("write values");
        let rendered = ok("helm", &["template", "cmp", CHART, "-n", "kf-system", "-f", file.to_str().expect("path")], None);
        let mut chart: Vec<serde_json::Value> =
            documents(&rendered).into_iter().filter(|d| d["kind"].as_str().is_some_and(|k| registering.contains(&k))).collect();
        chart.iter_mut().for_each(without_labels);
        let ours = values.registered();
        let key = |o: &serde_json::Value| format!("{}/{}", o["kind"], o["metadata"]["name"]);
        assert_eq!(
            chart.iter().map(key).collect::<BTreeSet<_>>(),
            ours.iter().map(key).collect::<BTreeSet<_>>(),
            "values {}",
            values.file()
        );
        for object in &ours {
            let rendered = chart.iter().find(|c| key(c) == key(object)).expect("rendered");
            assert_eq!(rendered, object, "values {}: {}", values.file(), key(object));
        }
        let deployment = named(&documents(&rendered), "Deployment", "kube-fence");
        let args = &deployment["spec"]["template"]["spec"]["containers"][0]["args"];
        let policy_path = args.as_array().is_some_and(|a| a.iter().any(|x| x == "--policy-path"));
        assert_eq!(policy_path, values.policy_path, "kube-fence runs with --policy-path exactly when the chart registers it: {args}");
    }
}

/// The leader identity rule (`leaderIdentity.separator`) is one rule in three places: the chart
/// admits exactly the separators `--leader-identity-separator` parses, renders the holder policy
/// that local mode registers for that rule (worker with ordinary RBAC: the CEL that refuses a
/// spoofed holder), and passes the webhook (stale-but-honest writer: the rule that judges a
/// leader-guarded write) the flag that parses to the same rule.
#[test]
fn the_chart_renders_the_leader_identity_rule_as_local_mode_and_the_webhook_read_it() {
    use clap::Parser;
    use kube_fence::admission::judge::identity::IdentityRule;
    use kube_fence::admission::registration::{Endpoint, Registration};
    use kube_fence::cli::{Cli, Command};
    let dir = tempfile::tempdir().expect("temp dir");
    for separator in ["_", "none", ":", "@pod:", "~", "/", "#", "X", "-", ".", "p", "7", "", "_'", "\\", " ", "·", "none_"] {
        let values = dir.path().join("values.yaml");
        let yaml = serde_saphyr::to_string(&serde_json::json!({"leaderIdentity": {"separator": separator}})).expect("values");
        std::fs::write(&values, yaml).expect("write values");
        let out = run("helm", &["template", "cmp", CHART, "-n", "kf-system", "-f", values.to_str().expect("path")], None);
        let parsed = separator.parse::<IdentityRule>();
        assert_eq!(out.status.success(), parsed.is_ok(), "separator {separator:?}: chart {}, flag {parsed:?}", out.status);
        let Ok(rule) = parsed else { continue };
        let docs = documents(&String::from_utf8_lossy(&out.stdout));
        let mut reg = Registration::new("cmp-kube-fence", Endpoint::Service { namespace: "kf-system".into(), name: "x".into(), port: 443 });
        reg.leader_identity = rule.clone();
        let ours = serde_json::to_value(reg.holder_policy(&[]).0).expect("holder policy");
        let chart = named(&docs, "ValidatingAdmissionPolicy", "-leader-holder");
        assert_eq!(chart["spec"], ours["spec"], "separator {separator:?}: the holder policy");
        let deployment = named(&docs, "Deployment", "kube-fence");
        let args: Vec<String> =
            serde_json::from_value(deployment["spec"]["template"]["spec"]["containers"][0]["args"].clone()).expect("args");
        let cli = Cli::try_parse_from(std::iter::once("kube-fence".to_string()).chain(args.clone()))
            .unwrap_or_else(|e| panic!("the chart's args {args:?} parse: {e}"));
        match cli.command {
            Command::Run(run) => assert_eq!(run.webhook.leader_identity, rule, "separator {separator:?}: {args:?}"),
            _ => panic!("the chart runs `kube-fence run`: {args:?}"),
        }
    }
}

/// Whether `selector` (a namespace selector on the namespace's name, as the chart renders it)
/// selects namespace `ns`.
fn selects(selector: &serde_json::Value, ns: &str) -> bool {
    assert!(selector.get("matchLabels").is_none(), "{selector}");
    selector["matchExpressions"].as_array().expect("match expressions").iter().all(|rule| {
        assert_eq!(rule["key"], "kubernetes.io/metadata.name", "{selector}");
        let values: Vec<&str> = rule["values"].as_array().expect("values").iter().map(|v| v.as_str().expect("a name")).collect();
        match rule["operator"].as_str() {
            Some("In") => values.contains(&ns),
            Some("NotIn") => !values.contains(&ns),
            other => panic!("operator {other:?} in {selector}"),
        }
    })
}

/// The writer webhooks kube-fence registers in a cluster (`<release>-writers`, kept in step by
/// the Pods the chart runs) carry the chart's `webhook.timeoutSeconds` and fence the namespaces
/// of its `webhook.onlyNamespaces`, as the chart's own configuration does: the chart is rendered
/// with fenced controllers in three namespaces; the arguments its Deployment gives kube-fence
/// are parsed by kube-fence's command line into the webhook's configuration, and the writers
/// configuration the routing builds from it (`routing::routes_in_scope`, `routing::desired`:
/// what `keep_in_step` applies) for the chart's FencedControllers is compared with the chart's
/// configuration: the same timeout, exactly the ServiceAccounts of the namespaces its selector fences,
/// its client configuration. Pure (`helm template`, no cluster).
#[test]
fn the_writer_webhooks_registered_in_cluster_carry_the_charts_timeout_and_namespaces() {
    use clap::Parser;
    use k8s_openapi::api::admissionregistration::v1::WebhookClientConfig;
    use kube_fence::admission::registration::routing;
    use kube_fence::cli::{Cli, Command};
    use kube_fence_api::FencedController;
    let controllers = [("team-a", "op-a"), ("team-b", "op-b"), ("team-c", "op-c")];
    let table: [(Option<i32>, &[&str]); 4] =
        [(None, &[]), (Some(9), &["team-a", "team-b"]), (Some(30), &["team-c"]), (Some(1), &["team-b", "elsewhere"])];
    let dir = tempfile::tempdir().expect("temp dir");
    for (row, (timeout, only)) in table.into_iter().enumerate() {
        // Every other row also tries the holder fences in audit mode.
        let audit = row % 2 == 1;
        let mut webhook = serde_json::json!({"onlyNamespaces": only});
        if audit {
            webhook["holderFences"] = serde_json::json!("Audit");
        }
        if let Some(timeout) = timeout {
            webhook["timeoutSeconds"] = serde_json::json!(timeout);
        }
        let fenced: Vec<_> = controllers
            .iter()
            .map(|(namespace, lease)| serde_json::json!({"namespace": namespace, "lease": lease, "serviceAccounts": [lease]}))
            .collect();
        let values = serde_json::json!({"webhook": webhook, "fencedControllers": fenced});
        let file = dir.path().join("values.yaml");
        std::fs::write(&file, serde_saphyr::to_string(&values).expect("values")).expect("write values");
        let docs = documents(&template(&file));

        // What the chart registers itself: its webhooks all share one timeout and one selector.
        let main = named(&docs, "ValidatingWebhookConfiguration", "cmp-kube-fence");
        let hooks = main["webhooks"].as_array().expect("webhooks");
        for hook in hooks {
            for same in ["timeoutSeconds", "namespaceSelector", "clientConfig"] {
                assert_eq!(hook[same], hooks[0][same], "values {values}: {same}");
            }
        }
        let (timeout_seconds, selector) = (&hooks[0]["timeoutSeconds"], &hooks[0]["namespaceSelector"]);
        assert_eq!(timeout_seconds, &serde_json::json!(timeout.unwrap_or(5)), "values {values}");

        // What kube-fence, started with the Deployment's arguments, registers for the writers.
        let deployment = named(&docs, "Deployment", "kube-fence");
        let args: Vec<String> =
            serde_json::from_value(deployment["spec"]["template"]["spec"]["containers"][0]["args"].clone()).expect("args");
        let cli = Cli::try_parse_from(std::iter::once("kube-fence".to_string()).chain(args.clone()))
            .unwrap_or_else(|e| panic!("the chart's args {args:?} parse: {e}"));
        let Command::Run(run) = cli.command else { panic!("the chart runs `kube-fence run`: {args:?}") };
        let config = run.webhook.config();
        assert_eq!(serde_json::json!(config.scope.configuration_name), main["metadata"]["name"], "{args:?}");
        let mode =
            if audit { kube_fence::admission::judge::preamble::Mode::Audit } else { kube_fence::admission::judge::preamble::Mode::Enforce };
        assert_eq!(config.holder_fences, mode, "values {values}: webhook.holderFences reaches the webhook, args {args:?}");
        let fences: Vec<FencedController> = docs
            .iter()
            .filter(|d| d["kind"] == "FencedController")
            .map(|d| serde_json::from_value(d.clone()).expect("a FencedController"))
            .collect();
        assert_eq!(fences.len(), controllers.len(), "the chart renders the fenced controllers' FencedControllers");
        let routes = routing::routes_in_scope(&config.scope, &fences);
        assert!(routes.left_out.is_empty(), "{:?}", routes.left_out);
        let template: WebhookClientConfig = serde_json::from_value(hooks[0]["clientConfig"].clone()).expect("client configuration");
        let writers = routing::desired(&config.scope, &template, &routes);
        let chart_writers = named(&docs, "ValidatingWebhookConfiguration", "-writers");
        assert_eq!(serde_json::json!(writers.metadata.name), chart_writers["metadata"]["name"], "the configuration the chart creates");

        for hook in writers.webhooks.as_deref().unwrap_or_default() {
            assert_eq!(&serde_json::json!(hook.timeout_seconds), timeout_seconds, "values {values}, args {args:?}: {}", hook.name);
            assert_eq!(hook.client_config.service.as_ref().and_then(|s| s.path.as_deref()), Some("/writer"));
        }
        let routed: BTreeSet<&str> = controllers
            .iter()
            .filter(|(ns, lease)| routes.routes(&format!("system:serviceaccount:{ns}:{lease}")))
            .map(|(ns, _)| *ns)
            .collect();
        let expected: BTreeSet<&str> = controllers.iter().filter(|(ns, _)| selects(selector, ns)).map(|(ns, _)| *ns).collect();
        assert!(!expected.is_empty(), "values {values}: some controller is fenced");
        assert_eq!(routed, expected, "values {values}, args {args:?}: the ServiceAccounts of the fenced namespaces");
    }
}

#[test]
fn chart_lints_and_the_schema_rejects_bad_values() {
    ok("helm", &["lint", "--strict", CHART], None);
    for bad in
        ["replicaCount=0", "tls.mode=bogus", "webhook.timeoutSeconds=60", "logFormat=xml", "nosuchvalue=1", "leaseStatusWriters={o'brien}"]
    {
        let out = run("helm", &["template", "t", CHART, "--set", bad], None);
        assert!(!out.status.success(), "values {bad} must be rejected by values.schema.json");
    }
    // As a subchart it is handed the parent's `global` values, which the schema must let through.
    let out = run("helm", &["template", "t", CHART, "--set", "global.imageRegistry=registry.example"], None);
    assert!(out.status.success(), "global values are accepted: {}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test]
async fn rendered_objects_pass_a_server_side_dry_run_in_both_tls_modes() {
    let client = common::client().await;
    let ns = common::namespace(&client, "chart-dry-run").await;
    let manifests = ok("helm", &["template", "dry", CHART, "-n", &ns, "--set", &format!("webhook.onlyNamespaces={{{ns}-nothing}}")], None);
    let out = ok("kubectl", &["apply", "--dry-run=server", "-n", &ns, "-f", "-"], Some(manifests.as_bytes()));
    for kind in [
        "deployment.apps/dry-kube-fence",
        "service/dry-kube-fence-webhook",
        "validatingwebhookconfiguration.admissionregistration.k8s.io/dry-kube-fence",
        "clusterrole.rbac.authorization.k8s.io/dry-kube-fence",
        "poddisruptionbudget.policy/dry-kube-fence",
        "validatingadmissionpolicy.admissionregistration.k8s.io/dry-kube-fence-lease-status",
        "validatingadmissionpolicybinding.admissionregistration.k8s.io/dry-kube-fence-lease-status",
        "validatingadmissionpolicy.admissionregistration.k8s.io/dry-kube-fence-fenced-holder",
        "validatingadmissionpolicybinding.admissionregistration.k8s.io/dry-kube-fence-fenced-holder",
        "validatingadmissionpolicy.admissionregistration.k8s.io/dry-kube-fence-fence-owner",
        "clusterrole.rbac.authorization.k8s.io/dry-kube-fence-fencedcontrollers-edit",
        "clusterrole.rbac.authorization.k8s.io/dry-kube-fence-fencedcontrollers-view",
    ] {
        assert!(out.contains(kind), "dry run covered {kind}:\n{out}");
    }
    // The API server compiles the holder policy's CEL under the other shape of the identity rule
    // too (the Pod's name exactly).
    let exact = ok(
        "helm",
        &[
            "template",
            "dry",
            CHART,
            "-n",
            &ns,
            "--set",
            &format!("webhook.onlyNamespaces={{{ns}-nothing}}"),
            "--set",
            "leaderIdentity.separator=none",
        ],
        None,
    );
    let out = ok("kubectl", &["apply", "--dry-run=server", "-n", &ns, "-f", "-"], Some(exact.as_bytes()));
    assert!(out.contains("validatingadmissionpolicy.admissionregistration.k8s.io/dry-kube-fence-leader-holder"), "{out}");
    // cert-manager mode renders the injection annotation and a Certificate for the Service names.
    let cm = ok("helm", &["template", "dry", CHART, "-n", &ns, "--set", "tls.mode=certManager"], None);
    assert!(cm.contains(&format!("cert-manager.io/inject-ca-from: {ns}/dry-kube-fence-webhook")), "{cm}");
    assert!(cm.contains(&format!("dry-kube-fence-webhook.{ns}.svc")), "{cm}");
    assert!(cm.contains("--tls-cert-file=/etc/kube-fence/tls/tls.crt") && !cm.contains("--self-managed-tls"));
    // Client-certificate authentication of the API server: the flag, the CA mounted, probes on the port.
    let mtls = ok("helm", &["template", "dry", CHART, "-n", &ns, "--set", "webhook.clientCASecret=api-server-ca"], None);
    assert!(mtls.contains("--client-ca-file=/etc/kube-fence/client-ca/ca.crt") && mtls.contains("secretName: api-server-ca"), "{mtls}");
    // The kubelet presents no client certificate: the probes use the plain-HTTP metrics port.
    assert!(mtls.contains("httpGet: {path: /readyz, port: metrics, scheme: HTTP}") && !mtls.contains("scheme: HTTPS"), "{mtls}");
}

#[tokio::test]
async fn install_creates_what_the_values_say_and_uninstall_removes_the_webhook() {
    let client = common::client().await;
    let ns = common::namespace(&client, "chart-install").await;
    let release = "inst";
    // This release fences one namespace of its own: with no node here its Pods never run, so a
    // guarded write there fails closed until uninstall removes the webhook.
    let fenced = common::namespace(&client, "chart-fenced").await;
    let only = format!("webhook.onlyNamespaces={{{fenced}}}");
    let args = [
        "install",
        release,
        CHART,
        "-n",
        &ns,
        "--set",
        "replicaCount=3",
        "--set",
        "webhook.timeoutSeconds=7",
        "--set",
        "leaderElection=false",
        "--set",
        &only,
    ];
    ok("helm", &args, None);

    let deploy = Api::<Deployment>::namespaced(client.clone(), &ns).get("inst-kube-fence").await.expect("deployment");
    let spec = deploy.spec;
    assert_eq!(spec.replicas, Some(3));
    let pod = spec.template.spec.expect("pod spec");
    let container = &pod.containers[0];
    let args = container.args.clone().unwrap_or_default();
    assert!(args.contains(&"--self-managed-tls".to_string()), "{args:?}");
    assert!(!args.contains(&"--leader-election".to_string()), "leaderElection=false drops the flag: {args:?}");
    let sc = container.security_context.clone().expect("container securityContext");
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    let psc = pod.security_context.expect("pod securityContext");
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(psc.seccomp_profile.map(|p| p.type_), Some("RuntimeDefault".to_string()));

    let vwcs: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let vwc = vwcs.get("inst-kube-fence").await.expect("webhook configuration installed");
    let hook = &vwc.webhooks.expect("webhooks")[0];
    assert_eq!(hook.timeout_seconds, Some(7));
    assert_eq!(hook.failure_policy.as_deref(), Some("Fail"));
    let excluded = &hook.namespace_selector.as_ref().and_then(|s| s.match_expressions.clone()).expect("namespace selector")[0];
    assert!(excluded.values.clone().unwrap_or_default().contains(&ns), "the release namespace is never fenced");

    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), &fenced);
    // The API server picks up a new webhook configuration within a moment; with no Pods
    // behind it, guarded writes fail closed.
    common::wait_fenced(&client, &fenced, &Default::default(), common::Fencing::FailsClosed, Duration::from_secs(20)).await;

    ok("helm", &["uninstall", release, "-n", &ns, "--wait"], None);
    assert!(vwcs.get_opt("inst-kube-fence").await.expect("get").is_none(), "uninstall leaves no webhook configuration behind");
    let deadline = Instant::now() + Duration::from_secs(20);
    while let Err(e) = configmaps.create(&PostParams::default(), &common::guarded_configmap("guarded", "l")).await {
        assert!(Instant::now() < deadline, "guarded objects are writable again after uninstall: {e}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn the_service_account_can_do_exactly_what_kube_fence_needs() {
    let client = common::client().await;
    let ns = common::namespace(&client, "chart-rbac").await;
    let mut args: Vec<String> = ["install", "rbac", CHART, "-n", &ns].iter().map(|s| s.to_string()).collect();
    args.extend(isolated(&ns));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ok("helm", &args, None);
    let sa = format!("system:serviceaccount:{ns}:rbac-kube-fence");

    let can_i = |who: &str, namespace: &str| -> BTreeSet<String> {
        let out = ok("kubectl", &["auth", "can-i", "--list", "--as", who, "-n", namespace, "--no-headers"], None);
        out.lines().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" ")).collect()
    };
    // What every service account may do anyway (discovery, self reviews, ...) is not kube-fence's:
    // subtract what the namespace's `default` service account, which nothing binds, can do.
    let rules = |namespace: &str| -> BTreeSet<String> {
        let baseline = can_i(&format!("system:serviceaccount:{ns}:default"), namespace);
        can_i(&sa, namespace).difference(&baseline).cloned().collect()
    };
    let expected_everywhere = [
        "events.events.k8s.io [] [] [create]",
        "fencedcontrollers.kubefence.io [] [] [get list watch]",
        "fencedcontrollers.kubefence.io/status [] [] [get update patch]",
        "pods [] [] [get list watch]",
        "leases.kubefence.io [] [] [get list watch]",
        "leases.coordination.k8s.io [] [] [get list watch]",
        "leases.kubefence.io/status [] [] [get update patch]",
        "validatingwebhookconfigurations.admissionregistration.k8s.io [] [rbac-kube-fence] [get update]",
        "validatingwebhookconfigurations.admissionregistration.k8s.io [] [rbac-kube-fence-writers] [get list watch patch]",
    ];
    let mut expected_own: BTreeSet<String> = expected_everywhere.iter().map(|s| s.to_string()).collect();
    // kubectl merges the verbs of one resource: leader election's create joins the webhook's get.
    expected_own.remove("leases.coordination.k8s.io [] [] [get list watch]");
    expected_own.extend(
        [
            "secrets [] [] [create]",
            "secrets [] [kube-fence-webhook-tls] [get]",
            "leases.coordination.k8s.io [] [] [get list watch create]",
            "leases.coordination.k8s.io [] [kube-fence-controller] [get update]",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    assert_eq!(rules(&ns), expected_own, "permissions in kube-fence's own namespace");
    let elsewhere = common::namespace(&client, "chart-rbac-other").await;
    assert_eq!(
        rules(&elsewhere),
        expected_everywhere.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>(),
        "permissions in any other namespace"
    );
    ok("helm", &["uninstall", "rbac", "-n", &ns], None);
}

/// `fencedControllers` renders one FencedController per entry, as the CRD reads it (name
/// defaulting to the lease, mode to Audit, exemptions when given), and never the controller's
/// Lease: client-go creates and writes it.
#[test]
fn the_chart_declares_fenced_controllers_as_fenced_controller_objects() {
    use kube_fence_api::{FenceMode, FencedController};
    let dir = tempfile::tempdir().expect("temp dir");
    let values = dir.path().join("values.yaml");
    std::fs::write(
        &values,
        "fencedControllers:\n  - {namespace: operators, lease: my-operator, serviceAccounts: [my-operator, helper], exempt: [configmaps, deployments.apps]}\n  - {name: other-fence, namespace: kube-system, lease: other, serviceAccounts: [other], mode: Enforce}\n",
    )
    .expect("write values");
    let rendered = ok("helm", &["template", "cmp", CHART, "-n", "kf-system", "-f", values.to_str().expect("path")], None);
    let docs = documents(&rendered);
    assert!(!docs.iter().any(|d| d["kind"] == "Lease"), "the controller's Lease is never rendered");
    let fences: Vec<FencedController> = docs
        .iter()
        .filter(|d| d["kind"] == "FencedController" && d["apiVersion"] == "kubefence.io/v1alpha1")
        .map(|d| serde_json::from_value(d.clone()).expect("a FencedController"))
        .collect();
    assert_eq!(fences.len(), 2);
    let (first, second) = (&fences[0], &fences[1]);
    assert_eq!((first.metadata.name.as_deref(), first.metadata.namespace.as_deref()), (Some("my-operator"), Some("operators")));
    assert_eq!(first.spec.lease, "my-operator");
    assert_eq!(first.spec.service_accounts, ["my-operator", "helper"]);
    assert_eq!(first.spec.exempt, ["configmaps", "deployments.apps"]);
    assert_eq!(first.spec.mode, FenceMode::Audit, "Audit unless given");
    assert_eq!((second.metadata.name.as_deref(), second.metadata.namespace.as_deref()), (Some("other-fence"), Some("kube-system")));
    assert_eq!((second.spec.lease.as_str(), second.spec.mode), ("other", FenceMode::Enforce));
    assert!(second.spec.exempt.is_empty());
    assert!(rendered.contains("mode: Enforce") && !rendered.contains("exempt: null"), "{rendered}");
    // Off by default.
    assert!(!documents(&ok("helm", &["template", "cmp", CHART, "-n", "kf-system"], None)).iter().any(|d| d["kind"] == "FencedController"));
    // The schema refuses what the CRD would: too many ServiceAccounts or exemptions, a bad mode.
    let nine: Vec<String> = (0..9).map(|i| format!("sa{i}")).collect();
    let exempt: Vec<String> = (0..33).map(|i| format!("r{i}")).collect();
    for bad in [
        format!("fencedControllers[0].namespace=a,fencedControllers[0].lease=l,fencedControllers[0].serviceAccounts={{{}}}", nine.join(",")),
        format!(
            "fencedControllers[0].namespace=a,fencedControllers[0].lease=l,fencedControllers[0].serviceAccounts={{s}},fencedControllers[0].exempt={{{}}}",
            exempt.join(",")
        ),
        "fencedControllers[0].namespace=a,fencedControllers[0].lease=l,fencedControllers[0].serviceAccounts={s},fencedControllers[0].mode=Off".into(),
        "fencedControllers[0].namespace=a,fencedControllers[0].lease=l,fencedControllers[0].serviceAccounts={s},fencedControllers[0].exempt={Bad_Name}".into(),
    ] {
        let out = run("helm", &["template", "t", CHART, "--set", &bad], None);
        assert!(!out.status.success(), "values {bad} must be rejected by values.schema.json");
    }
}

/// `helm template` of the chart with `values` (a JSON object written as a values file), or its
/// failure (stderr).
fn render(values: &serde_json::Value) -> Result<Vec<serde_json::Value>, String> {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("values.yaml");
    std::fs::write(&file, serde_saphyr::to_string(values).expect("values")).expect("write values");
    let out = Command::new(tool("helm"))
        .args(["template", "cmp", CHART, "-n", "kf-system", "-f"])
        .arg(&file)
        .env("HELM_CACHE_HOME", std::env::temp_dir().join("kube-fence-helm-cache"))
        .output()
        .unwrap_or_else(|e| panic!("running helm: {e}"));
    if out.status.success() {
        Ok(documents(&String::from_utf8_lossy(&out.stdout)))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn pod_spec(docs: &[serde_json::Value]) -> serde_json::Value {
    named(docs, "Deployment", "kube-fence")["spec"]["template"]["spec"].clone()
}

/// The Deployment's arguments, parsed by kube-fence's own command line.
fn parsed_run_args(docs: &[serde_json::Value]) -> kube_fence::cli::run::RunArgs {
    use clap::Parser;
    let args: Vec<String> = serde_json::from_value(pod_spec(docs)["containers"][0]["args"].clone()).expect("args");
    let cli = kube_fence::cli::Cli::try_parse_from(std::iter::once("kube-fence".to_string()).chain(args.clone()))
        .unwrap_or_else(|e| panic!("the chart's args {args:?} parse: {e}"));
    match cli.command {
        kube_fence::cli::Command::Run(run) => run,
        _ => panic!("the chart runs `kube-fence run`: {args:?}"),
    }
}

/// The chart used as a subchart: a parent chart made here, with the chart in its charts/ and
/// `global` values (and values for the subchart), lints and renders.
#[test]
fn the_chart_works_as_a_subchart_with_global_values() {
    let dir = tempfile::tempdir().expect("temp dir");
    let parent = dir.path().join("platform");
    std::fs::create_dir_all(parent.join("charts")).expect("parent chart");
    std::fs::create_dir_all(parent.join("templates")).expect("parent templates");
    std::fs::write(
        parent.join("templates/configmap.yaml"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: platform\ndata:\n  registry: {{ .Values.global.imageRegistry | quote }}\n",
    )
    .expect("a parent template");
    std::fs::write(
        parent.join("Chart.yaml"),
        "apiVersion: v2\nname: platform\nversion: 1.0.0\ndescription: a parent chart\ndependencies:\n  - name: kube-fence\n    version: 0.1.0\n",
    )
    .expect("Chart.yaml");
    std::fs::write(
        parent.join("values.yaml"),
        "global:\n  imageRegistry: registry.example\n  labels: {team: platform}\nkube-fence:\n  replicaCount: 3\n  commonLabels: {team: platform}\n",
    )
    .expect("values.yaml");
    let copied = Command::new("cp").arg("-r").arg(CHART).arg(parent.join("charts/kube-fence")).status().expect("cp");
    assert!(copied.success());
    let parent = parent.to_str().expect("path");
    ok("helm", &["lint", "--strict", parent], None);
    let rendered = ok("helm", &["template", "p", parent, "-n", "kf-system", "--set", "global.other=1"], None);
    let docs = documents(&rendered);
    let deployment = named(&docs, "Deployment", "p-kube-fence");
    assert_eq!(deployment["spec"]["replicas"], 3, "the parent's values reach the subchart");
    assert_eq!(deployment["metadata"]["labels"]["team"], "platform");
}

/// Every new value lands where values.yaml says, and the defaults are what a fail-closed webhook
/// wants: a priority class, replicas spread softly, a PDB only where it cannot block a drain, the
/// container's and Pod's security contexts as they were hard-coded, a plain-HTTP metrics port.
#[test]
fn the_chart_values_render_where_they_say() {
    use serde_json::json;
    // The defaults (replicaCount 2).
    let docs = render(&json!({})).expect("defaults render");
    let pod = pod_spec(&docs);
    assert_eq!(pod["priorityClassName"], "system-cluster-critical");
    let selector = json!({"matchLabels": {"app.kubernetes.io/name": "kube-fence", "app.kubernetes.io/instance": "cmp"}});
    let anti = &pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"];
    assert_eq!((&anti["topologyKey"], &anti["labelSelector"]), (&json!("kubernetes.io/hostname"), &selector), "{pod}");
    assert!(pod["affinity"]["podAntiAffinity"].get("requiredDuringSchedulingIgnoredDuringExecution").is_none(), "soft only");
    let spread = pod["topologySpreadConstraints"].as_array().expect("spread constraints");
    assert_eq!(
        spread.iter().map(|c| (c["topologyKey"].as_str().unwrap_or(""), c["whenUnsatisfiable"].as_str().unwrap_or(""))).collect::<Vec<_>>(),
        [("topology.kubernetes.io/zone", "ScheduleAnyway"), ("kubernetes.io/hostname", "ScheduleAnyway")]
    );
    assert!(spread.iter().all(|c| c["labelSelector"] == selector));
    assert_eq!(
        pod["securityContext"],
        json!({"runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}})
    );
    let container = &pod["containers"][0];
    assert_eq!(
        container["securityContext"],
        json!({"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true, "capabilities": {"drop": ["ALL"]}})
    );
    assert_eq!(container["image"], "ghcr.io/kube-fence/kube-fence:0.1.0");
    let pdb = named(&docs, "PodDisruptionBudget", "kube-fence");
    assert_eq!((pdb["spec"].get("minAvailable"), &pdb["spec"]["maxUnavailable"]), (None, &json!(1)), "{pdb}");
    // The metrics port: the flag kube-fence parses, the container's port, the Service's, the probes.
    assert_eq!(parsed_run_args(&docs).webhook.metrics_addr, Some("0.0.0.0:9090".parse().expect("an address")));
    assert!(container["ports"].as_array().expect("ports").contains(&json!({"name": "metrics", "containerPort": 9090, "protocol": "TCP"})));
    let service = named(&docs, "Service", "kube-fence-webhook");
    assert!(service["spec"]["ports"].as_array().expect("ports").iter().any(|p| p["name"] == "metrics" && p["targetPort"] == "metrics"));
    assert_eq!(container["readinessProbe"]["httpGet"], json!({"path": "/readyz", "port": "webhook", "scheme": "HTTPS"}));
    for kind in ["PrometheusRule", "ConfigMap", "ServiceMonitor", "Pod"] {
        assert!(!docs.iter().any(|d| d["kind"] == kind), "no {kind} by default");
    }

    // One replica: nothing can keep it during a drain, so no PDB; no spreading either.
    let docs = render(&json!({"replicaCount": 1})).expect("renders");
    assert!(!docs.iter().any(|d| d["kind"] == "PodDisruptionBudget"), "no PDB with one replica");
    let pod = pod_spec(&docs);
    assert!(pod.get("affinity").is_none() && pod.get("topologySpreadConstraints").is_none(), "{pod}");
    // Spreading turned off; an explicit minAvailable; no priority class.
    let docs =
        render(&json!({"replicaCount": 3, "spreadReplicas": false, "priorityClassName": "", "podDisruptionBudget": {"minAvailable": 2}}))
            .expect("renders");
    let pod = pod_spec(&docs);
    assert!(pod.get("affinity").is_none() && pod.get("topologySpreadConstraints").is_none() && pod.get("priorityClassName").is_none());
    assert_eq!(named(&docs, "PodDisruptionBudget", "kube-fence")["spec"]["minAvailable"], 2);

    // Everything set at once.
    let digest = format!("sha256:{}", "0123456789abcdef".repeat(4));
    let affinity = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]}}});
    let spread = json!([{"maxSkew": 2, "topologyKey": "rack", "whenUnsatisfiable": "DoNotSchedule", "labelSelector": selector}]);
    let values = json!({
        "image": {"repository": "registry.example/kf", "tag": "ignored", "digest": digest},
        "priorityClassName": "platform-critical",
        "affinity": affinity,
        "topologySpreadConstraints": spread,
        "nodeSelector": {"pool": "system"},
        "tolerations": [{"key": "dedicated", "operator": "Exists"}],
        // Helm merges a map given with the default one: null removes a default key.
        "podSecurityContext": {"fsGroup": 2000, "runAsUser": null, "runAsGroup": null},
        "securityContext": {"capabilities": null, "runAsUser": 1000},
        "extraArgs": ["--quorum-reads-per-namespace=50", "--max-connections=77"],
        "extraEnv": [{"name": "RUST_LOG", "value": "debug"}],
        "podLabels": {"tier": "control"},
        "podAnnotations": {"note": "x"},
        "commonLabels": {"team": "platform", "cost-center": "42"},
        "metrics": {"port": 9100, "serviceMonitor": {"enabled": true}},
        "prometheusRule": {"enabled": true, "labels": {"release": "prom"}},
        "dashboards": {"enabled": true, "annotations": {"grafana_folder": "kube-fence"}},
        "tests": {"namespace": "kf-test"},
        "networkPolicy": {"enabled": true},
        "webhook": {"clientCASecret": "api-server-ca"},
    });
    let docs = render(&values).expect("every value renders");
    let pod = pod_spec(&docs);
    let container = &pod["containers"][0];
    assert_eq!(container["image"], format!("registry.example/kf@{digest}"));
    assert_eq!(pod["priorityClassName"], "platform-critical");
    assert_eq!((&pod["affinity"], &pod["topologySpreadConstraints"]), (&affinity, &spread), "given ones replace the defaults");
    assert_eq!((&pod["nodeSelector"], &pod["tolerations"]), (&values["nodeSelector"], &values["tolerations"]));
    assert_eq!(pod["securityContext"], json!({"fsGroup": 2000, "runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}}));
    assert_eq!(container["securityContext"], json!({"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true, "runAsUser": 1000}));
    let run = parsed_run_args(&docs);
    assert_eq!((run.webhook.quorum_reads_per_namespace, run.webhook.max_connections), (50, 77), "extraArgs reach kube-fence");
    assert_eq!(run.webhook.metrics_addr, Some("0.0.0.0:9100".parse().expect("an address")));
    assert!(container["env"].as_array().expect("env").contains(&json!({"name": "RUST_LOG", "value": "debug"})));
    let deployment = named(&docs, "Deployment", "kube-fence");
    let template_labels = &deployment["spec"]["template"]["metadata"]["labels"];
    assert_eq!((&template_labels["tier"], &template_labels["team"]), (&json!("control"), &json!("platform")));
    assert_eq!(deployment["spec"]["selector"], selector, "the selector stays as it was (it cannot change on upgrade)");
    assert_eq!(deployment["spec"]["template"]["metadata"]["annotations"]["note"], "x");
    // commonLabels on every object the chart renders.
    for doc in &docs {
        assert_eq!(
            (&doc["metadata"]["labels"]["team"], &doc["metadata"]["labels"]["cost-center"]),
            (&json!("platform"), &json!("42")),
            "{} {}",
            doc["kind"],
            doc["metadata"]["name"]
        );
    }
    // The ServiceMonitor scrapes the plain-HTTP port, no TLS to skip, also with clientCASecret;
    // the probes then use that port's /readyz and /healthz.
    let monitor = named(&docs, "ServiceMonitor", "kube-fence");
    assert_eq!(monitor["spec"]["endpoints"], json!([{"port": "metrics", "scheme": "http", "path": "/metrics", "interval": "30s"}]));
    assert_eq!(container["readinessProbe"]["httpGet"], json!({"path": "/readyz", "port": "metrics", "scheme": "HTTP"}));
    assert_eq!(container["livenessProbe"]["httpGet"], json!({"path": "/healthz", "port": "metrics", "scheme": "HTTP"}));
    let policy = named(&docs, "NetworkPolicy", "kube-fence");
    assert_eq!(
        policy["spec"]["ingress"][0]["ports"],
        json!([{"port": "webhook", "protocol": "TCP"}, {"port": "metrics", "protocol": "TCP"}])
    );
    let rule = named(&docs, "PrometheusRule", "kube-fence");
    assert_eq!(rule["metadata"]["labels"]["release"], "prom");
    let dashboard = named(&docs, "ConfigMap", "kube-fence-dashboard");
    assert_eq!(
        (&dashboard["metadata"]["labels"]["grafana_dashboard"], &dashboard["metadata"]["annotations"]["grafana_folder"]),
        (&json!("1"), &json!("kube-fence"))
    );
    let shipped = std::fs::read_to_string(format!("{CHART}/dashboards/kube-fence.json")).expect("the dashboard");
    assert_eq!(dashboard["data"]["kube-fence.json"], shipped, "the ConfigMap carries the dashboard file as it is");
    // The helm test: hooks in the test namespace, the Pod running the chart's image's selftest.
    let test_pod = named(&docs, "Pod", "kube-fence-selftest");
    assert_eq!(
        (&test_pod["metadata"]["namespace"], &test_pod["metadata"]["annotations"]["helm.sh/hook"]),
        (&json!("kf-system"), &json!("test")),
        "the Pod in the release's namespace (`helm test --logs` reads it there), writing in kf-test"
    );
    assert_eq!(test_pod["spec"]["containers"][0]["image"], format!("registry.example/kf@{digest}"));
    let args: Vec<String> = serde_json::from_value(test_pod["spec"]["containers"][0]["args"].clone()).expect("args");
    assert_eq!(args, ["selftest", "--namespace=kf-test", "--name=cmp-kube-fence-selftest"]);
    for (kind, namespace) in [("ServiceAccount", "kf-system"), ("Role", "kf-test"), ("RoleBinding", "kf-test")] {
        let hook = docs
            .iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == "cmp-kube-fence-selftest" && d["metadata"]["namespace"] == namespace)
            .unwrap_or_else(|| panic!("the test's {kind} in {namespace}"));
        assert_eq!(hook["metadata"]["annotations"]["helm.sh/hook"], "test", "{kind}");
    }
    // Never selected as one of kube-fence's Pods (the Service's and the Deployment's selector).
    let pod_labels = test_pod["metadata"]["labels"].as_object().expect("labels");
    let selected =
        service["spec"]["selector"].as_object().expect("the Service's selector").iter().all(|(k, v)| pod_labels.get(k) == Some(v));
    assert!(!selected, "the test Pod is not one of the Service's endpoints: {pod_labels:?}");
    assert_ne!(pod_labels.get("app.kubernetes.io/instance"), Some(&json!("cmp")), "nor found by instance");
    let binding = named(&docs, "RoleBinding", "kube-fence-selftest");
    assert_eq!(binding["subjects"], json!([{"kind": "ServiceAccount", "name": "cmp-kube-fence-selftest", "namespace": "kf-system"}]));

    // Bad input is refused, with a message saying what.
    let clash = render(&json!({"metrics": {"port": 8443}})).expect_err("metrics.port = webhook.port");
    assert!(clash.contains("metrics.port and webhook.port must differ"), "{clash}");
    for bad in [
        json!({"image": {"digest": "sha256:short"}}),
        json!({"image": {"digest": "latest"}}),
        json!({"tests": {"namespace": "Not_A_Namespace"}}),
        json!({"extraArgs": [""]}),
        json!({"extraEnv": [{"value": "no name"}]}),
        json!({"commonLabels": {"n": 1}}),
        json!({"prometheusRule": {"enable": true}}),
        json!({"metrics": {"port": 0}}),
    ] {
        assert!(render(&bad).is_err(), "values {bad} must be rejected by values.schema.json");
    }
}

/// `tls.selfManaged.lifetime` reaches kube-fence as `--self-managed-tls-lifetime` (parsed by its
/// own command line) in selfManaged mode, 90 days by default as kube-fence's own default; in
/// certManager mode kube-fence makes no certificate and gets no lifetime; values.schema.json
/// refuses what is not a duration kube-fence reads.
#[test]
fn the_self_managed_certificate_lifetime_reaches_kube_fence() {
    use serde_json::json;
    use std::time::Duration;
    let day = Duration::from_secs(24 * 3600);
    let lifetime = |docs: &[serde_json::Value]| parsed_run_args(docs).webhook.self_managed_tls_lifetime;
    let args = |docs: &[serde_json::Value]| -> Vec<String> {
        serde_json::from_value(pod_spec(docs)["containers"][0]["args"].clone()).expect("args")
    };
    let docs = render(&json!({})).expect("defaults render");
    assert!(args(&docs).contains(&"--self-managed-tls-lifetime=2160h".to_string()), "{:?}", args(&docs));
    assert_eq!(lifetime(&docs), 90 * day);
    for (value, expected) in [("30d", 30 * day), ("1d12h", day + 12 * day / 24), ("720h", 30 * day), ("45m", Duration::from_secs(2700))] {
        let docs = render(&json!({"tls": {"selfManaged": {"lifetime": value}}})).unwrap_or_else(|e| panic!("{value}: {e}"));
        assert_eq!(lifetime(&docs), expected, "tls.selfManaged.lifetime={value}");
    }
    let docs = render(&json!({"tls": {"mode": "certManager", "selfManaged": {"lifetime": "30d"}}})).expect("certManager renders");
    let certificate = named(&docs, "Certificate", "kube-fence-webhook");
    assert_eq!(certificate["spec"]["duration"], "2160h", "cert-manager's lifetime is tls.certManager.duration");
    assert!(!args(&docs).iter().any(|a| a.starts_with("--self-managed-tls")), "{:?}", args(&docs));
    for bad in [json!(""), json!("30"), json!("30 days"), json!("1y"), json!("-5h"), json!("1.5h"), json!("30D"), json!(30)] {
        let refused = render(&json!({"tls": {"selfManaged": {"lifetime": bad}}}));
        assert!(refused.is_err(), "tls.selfManaged.lifetime={bad} must be rejected by values.schema.json");
    }
    assert!(render(&json!({"tls": {"selfManaged": {"lifetme": "30d"}}})).is_err(), "a misspelt key is rejected");
}

/// The FlowSchema of `apiPriority`: the API server classifies the webhook's reads of Leases
/// (coordination.k8s.io and kubefence.io, any namespace) into kube-fence's own priority level,
/// and nobody else's requests — another ServiceAccount's reads of the same Leases, the
/// webhook's own writes — into it. Threat case: a tenant (or a busy fenced controller) whose
/// requests fill `workload-low` cannot queue the reads fenced writes wait on. Read from the
/// `X-Kubernetes-PF-FlowSchema-UID` header the API server puts on each classified response.
#[tokio::test]
async fn the_webhooks_lease_reads_have_a_priority_level_of_their_own() {
    use k8s_openapi::api::flowcontrol::v1::FlowSchema;
    let client = common::client().await;
    let ns = common::namespace(&client, "chart-apf").await;
    let mut args: Vec<String> = ["install", "apf", CHART, "-n", &ns].iter().map(|s| s.to_string()).collect();
    args.extend(isolated(&ns));
    ok("helm", &args.iter().map(String::as_str).collect::<Vec<_>>(), None);
    let ours = Api::<FlowSchema>::all(client.clone()).get("apf-kube-fence-lease-reads").await.expect("the chart's FlowSchema");
    let ours = ours.metadata.uid.expect("a uid");

    let webhook = common::identity::client_as(&format!("system:serviceaccount:{ns}:apf-kube-fence")).await;
    let other = common::identity::client_as(&format!("system:serviceaccount:{ns}:default")).await;
    // The FlowSchema the API server classified one request as (its header, whatever the status).
    let classified = async |client: &kube::Client, method: &str, path: &str| -> String {
        let request = http::Request::builder().method(method).uri(path).body(Vec::new()).expect("a request");
        let response = client.send(request.map(kube::client::Body::from)).await.expect("a response");
        response.headers().get("X-Kubernetes-PF-FlowSchema-UID").map(|v| v.to_str().unwrap_or_default().to_string()).unwrap_or_default()
    };
    // The API server may take a moment to see the new FlowSchema.
    let elsewhere = common::namespace(&client, "chart-apf-other").await;
    let reads = [
        format!("/apis/coordination.k8s.io/v1/namespaces/{elsewhere}/leases/any"),
        "/apis/kubefence.io/v1alpha1/namespaces/kube-system/leases/any".to_string(),
    ];
    let deadline = Instant::now() + Duration::from_secs(30);
    for read in &reads {
        while classified(&webhook, "GET", read).await != ours {
            assert!(Instant::now() < deadline, "the webhook's GET {read} is not classified by the chart's FlowSchema");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    assert_ne!(classified(&other, "GET", &reads[0]).await, ours, "another ServiceAccount's read of a Lease is not ours");
    let list = format!("/apis/coordination.k8s.io/v1/namespaces/{elsewhere}/leases");
    assert_ne!(classified(&webhook, "GET", &list).await, ours, "the webhook's lists (its watch caches) are not the quorum reads");
    let status = format!("/apis/kubefence.io/v1alpha1/namespaces/{elsewhere}/leases/any/status");
    assert_ne!(classified(&webhook, "PATCH", &status).await, ours, "its writes are not reads");
    ok("helm", &["uninstall", "apf", "-n", &ns], None);
}
