//! The routing, pure: which writes the writer webhook is sent, for which fences, within bounds.

use k8s_openapi::api::admissionregistration::v1::ServiceReference;
use kube_fence_api::{FenceMode, FencedControllerSpec};

use super::*;

fn fenced(namespace: &str, name: &str, accounts: &[&str], exempt: &[&str], created_s: i64) -> FencedController {
    let mut fc = FencedController::new(
        name,
        FencedControllerSpec {
            lease: name.into(),
            service_accounts: accounts.iter().map(|s| s.to_string()).collect(),
            exempt: exempt.iter().map(|s| s.to_string()).collect(),
            mode: FenceMode::Enforce,
        },
    );
    fc.metadata.namespace = Some(namespace.into());
    fc.metadata.creation_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + created_s).expect("a time")));
    fc
}

const URL: &str = "https://127.0.0.1:8443/validate";

fn url() -> WebhookClientConfig {
    WebhookClientConfig { url: Some(URL.into()), ca_bundle: None, service: None }
}

#[test]
fn one_webhook_at_the_writer_path_with_the_main_client_configuration() {
    let fences = [fenced("team", "ctl", &["ctl"], &[], 0), fenced("ops", "op", &["op", "helper"], &[], 1)];
    let routes = Routes::of(&fences);
    let hooks = configuration("kf-writers", &url(), &routes, 5).webhooks.unwrap_or_default();
    assert_eq!(hooks.len(), 1, "one webhook however many fences");
    assert_eq!(hooks[0].name, WEBHOOK_NAME);
    assert_eq!(hooks[0].client_config.url.as_deref(), Some("https://127.0.0.1:8443/writer"));
    let rule = &hooks[0].rules.as_ref().expect("rules")[0];
    assert_eq!(rule.scope.as_deref(), Some("*"), "cluster-scoped objects too");
    assert!(rule.operations.iter().flatten().any(|o| o == "CONNECT"), "exec, attach, port-forward, proxy too");
    assert_eq!(rule.resources.as_deref(), Some(&["*/*".to_string()][..]), "every subresource too");
    assert_eq!(hooks[0].failure_policy.as_deref(), Some("Fail"));
    assert!(hooks[0].namespace_selector.is_none() && hooks[0].object_selector.is_none());
    let service = WebhookClientConfig {
        url: None,
        ca_bundle: Some(k8s_openapi::ByteString(b"CA".to_vec())),
        service: Some(ServiceReference {
            namespace: "kf".into(),
            name: "kube-fence".into(),
            path: Some("/validate".into()),
            port: Some(443),
        }),
    };
    let by_service = configuration("kf-writers", &service, &routes, 5).webhooks.unwrap_or_default();
    let svc = by_service[0].client_config.service.as_ref().expect("a service");
    assert_eq!((svc.name.as_str(), svc.path.as_deref()), ("kube-fence", Some("/writer")));
    assert_eq!(by_service[0].client_config.ca_bundle, service.ca_bundle);
    assert_eq!(configuration("kf-writers", &url(), &Routes::default(), 5).webhooks.map(|w| w.len()), Some(0), "no fence, no webhook");
}

#[test]
fn the_set_holds_each_fenced_user_and_what_passes_for_it() {
    let fences = [fenced("team", "ctl", &["ctl"], &["configmaps", "deployments.apps"], 0)];
    let routes = Routes::of(&fences);
    let user = "system:serviceaccount:team:ctl";
    assert!(routes.routes(user));
    assert!(!routes.routes("system:serviceaccount:other:ctl"), "a ServiceAccount of the same name elsewhere is not fenced");
    let conditions = routes.match_conditions();
    assert_eq!(conditions.len(), 1);
    let key = "{'team:ctl': ['/configmaps', 'apps/deployments', 'lease:team/ctl']}";
    assert!(conditions[0].contains(key), "{key} in {}", conditions[0]);
    let applied = configuration("kf-writers", &url(), &routes, 5);
    assert!(routes_in(&applied, user));
    assert!(!routes_in(&applied, "system:serviceaccount:team:c"), "a prefix of a routed name is not routed");
    assert!(!routes_in(&applied, "system:serviceaccount:eam:ctl"), "a suffix of a routed name is not routed");
    assert!(!routes_in(&configuration("kf-writers", &url(), &Routes::default(), 5), user));
}

/// Two fences of one ServiceAccount: a write passes unjudged only when both let it pass.
#[test]
fn a_user_of_two_fences_passes_only_what_both_let_pass() {
    let fences = [fenced("team", "a", &["ctl"], &["configmaps", "secrets"], 0), fenced("team", "b", &["ctl"], &["configmaps"], 1)];
    let condition = Routes::of(&fences).match_conditions().concat();
    assert!(
        condition.contains("{'team:ctl': ['/configmaps']}"),
        "only fence a exempts secrets, and each Lease is judged by the other fence: {condition}"
    );
}

#[test]
fn names_that_need_quoting_cannot_break_out_of_the_set() {
    // The schema refuses such names; the quoting holds anyway.
    let mut fc = fenced("team", "ctl", &["ctl"], &[], 0);
    fc.metadata.namespace = Some("te'am".into());
    let routes = Routes::of(&[fc]);
    assert!(routes.match_conditions().concat().contains(r"{'te\'am:ctl': ['lease:te\'am/ctl']}"));
}

#[test]
fn an_invalid_fence_is_left_out_alone() {
    let fences = [fenced("team", "bad", &["Not A Name"], &[], 0), fenced("team", "ctl", &["ctl"], &[], 1)];
    let routes = Routes::of(&fences);
    assert_eq!(routes.routed, [("team".to_string(), "ctl".to_string())].into());
    assert!(matches!(&routes.left_out[..], [((_, name), RouteError::Invalid(_))] if name == "bad"));
}

/// A tenant's thousands of fences cannot crowd out the ones created before them; beyond the
/// bound a fence is left out (`NotRouted`) and the others stay routed; every shard's expression
/// stays within what the API server compiles.
#[test]
fn the_set_is_bounded_and_the_oldest_fences_keep_their_place() {
    let long = "a".repeat(250);
    let mut fences = vec![fenced("team", "first", &["ctl"], &[], 0)];
    for i in 0..4_000 {
        fences.push(fenced(&format!("t{i}"), "f", &[&long, &format!("{long}b")], &[], 10 + i));
    }
    let routes = Routes::of(&fences);
    assert!(routes.routed.contains(&("team".to_string(), "first".to_string())));
    assert!(!routes.left_out.is_empty(), "4,000 fences of two long names do not fit");
    assert!(routes.left_out.iter().all(|(_, why)| *why == RouteError::Full));
    let conditions = routes.match_conditions();
    assert!(conditions.len() <= MAX_SHARDS, "{} shards", conditions.len());
    for condition in &conditions {
        assert!(condition.chars().count() < MAX_EXPRESSION_CODE_POINTS, "{} code points", condition.chars().count());
    }
    // A thousand ordinary fences fit in one webhook; five thousand in a few.
    for (n, shards) in [(1_000, 1), (5_000, 5)] {
        let many: Vec<_> = (0..n).map(|i| fenced(&format!("tenant-{i}"), "operator", &["operator"], &["configmaps"], i)).collect();
        let routes = Routes::of(&many);
        assert_eq!((routes.routed.len(), routes.left_out.len()), (n as usize, 0));
        let conditions = routes.match_conditions();
        assert!(conditions.len() <= shards, "{n} fences: {} webhooks", conditions.len());
        println!(
            "{n} fences: {} webhooks, the longest match condition {} bytes",
            conditions.len(),
            conditions.iter().map(String::len).max().unwrap_or(0)
        );
    }
}

#[test]
fn the_scope_picks_the_namespaces() {
    let fences = [fenced("team", "ctl", &["ctl"], &[], 0), fenced("other", "ctl", &["ctl"], &[], 1)];
    let scope = Scope { configuration_name: "kf".into(), timeout_seconds: 9, only_namespaces: Some(vec!["team".into()]) };
    let routes = routes_in_scope(&scope, &fences);
    assert_eq!(routes.routed, [("team".to_string(), "ctl".to_string())].into());
    let routed = desired(&scope, &url(), &routes);
    assert_eq!(routed.metadata.name.as_deref(), Some("kf-writers"));
    assert_eq!(routed.webhooks.unwrap_or_default()[0].timeout_seconds, Some(9));
    let everywhere = Scope { only_namespaces: None, ..scope };
    assert_eq!(routes_in_scope(&everywhere, &fences).routed.len(), 2);
}

#[test]
fn only_a_list_at_least_as_new_as_the_recorded_one_is_applied() {
    for (revision, recorded, applies) in [
        (10, None, true),
        (10, Some(9), true),
        (10, Some(10), true),
        (10, Some(11), false),
        (0, Some(1), false),
        (u64::MAX, Some(u64::MAX), true),
    ] {
        assert_eq!(supersedes(revision, recorded), applies, "list at {revision}, recorded {recorded:?}");
    }
}

#[test]
fn the_recorded_revision_is_read_from_the_annotation_below_the_objects_own_version() {
    let with = |value: Option<&str>, written: Option<&str>| ValidatingWebhookConfiguration {
        metadata: ObjectMeta {
            annotations: value.map(|v| [(REVISION_ANNOTATION.to_string(), v.to_string())].into()),
            resource_version: written.map(str::to_string),
            ..Default::default()
        },
        webhooks: None,
    };
    assert_eq!(recorded_revision(&with(Some("4711"), Some("4712"))), Some(4711));
    assert_eq!(recorded_revision(&with(None, Some("4712"))), None, "made before the annotation, or by hand");
    assert_eq!(recorded_revision(&with(Some("not-a-revision"), Some("4712"))), None);
    assert_eq!(recorded_revision(&with(Some("-3"), Some("4712"))), None);
    // Copied from another cluster (a restored backup): not below the object's own version here.
    assert_eq!(recorded_revision(&with(Some("900000"), Some("4712"))), None);
    assert_eq!(recorded_revision(&with(Some("4712"), Some("4712"))), None);
    assert_eq!(recorded_revision(&with(Some("4711"), None)), None, "an object never written");
}
