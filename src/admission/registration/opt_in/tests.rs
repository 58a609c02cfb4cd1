//! What a Lease opts in, and what its webhook is sent.

use rstest::rstest;

use super::*;
use crate::admission::judge::fake;

const NS: &str = "team";

fn lease(labels: &[(&str, &str)], annotations: &[(&str, &str)], holder: Option<&str>) -> LeaderElectionLease {
    fake::leader_lease(NS, "ctl", labels, annotations, holder)
}

fn opted_in(writers: &str, holder: Option<&str>) -> LeaderElectionLease {
    fake::opted_in_lease(NS, "ctl", writers, holder)
}

#[rstest]
#[case::none(lease(&[], &[], None), Ok(None))]
#[case::label_only(lease(&[(HOLDER_IDENTITY_LABEL, HOLDER_IS_POD)], &[], None), Ok(None))]
#[case::empty_list(opted_in(" , ", None), Ok(None))]
#[case::annotation_without_label(lease(&[], &[(WRITERS_ANNOTATION, "ctl")], None), Err(OptInError::NotHolderBound))]
#[case::not_an_account(opted_in("ctl,Bad_Name", None), Err(OptInError::NotAServiceAccount("Bad_Name".into())))]
#[case::two(opted_in("ctl, helper", None), Ok(Some(vec!["ctl", "helper"])))]
fn what_a_lease_opts_in(#[case] lease: LeaderElectionLease, #[case] expect: Result<Option<Vec<&str>>, OptInError>) {
    let got = OptIn::of(&lease).map(|o| o.map(|o| o.accounts.into_iter().collect::<Vec<_>>()));
    assert_eq!(got, expect.map(|o| o.map(|v| v.into_iter().map(String::from).collect())));
}

#[rstest]
#[case::core("configmaps", Some(("configmaps", "")))]
#[case::grouped("deployments.apps", Some(("deployments", "apps")))]
#[case::crd("widgets.example.kubefence.io", Some(("widgets", "example.kubefence.io")))]
#[case::upper("ConfigMaps", None)]
#[case::subresource("pods/status", None)]
#[case::empty_group("configmaps.", None)]
fn exempt_resources_are_spelled_as_kubectl_does(#[case] item: &str, #[case] expect: Option<(&str, &str)>) {
    let lease = lease(&[(HOLDER_IDENTITY_LABEL, HOLDER_IS_POD)], &[(WRITERS_ANNOTATION, "ctl"), (WRITERS_EXEMPT_ANNOTATION, item)], None);
    let got = OptIn::of(&lease).map(|o| o.and_then(|o| o.exempt.into_iter().next()).map(|r| (r.resource, r.group)));
    match expect {
        Some((resource, group)) => assert_eq!(got, Ok(Some((resource.to_string(), group.to_string())))),
        None => assert_eq!(got, Err(OptInError::NotAResource(item.to_string()))),
    }
}

#[test]
fn the_match_condition_names_the_accounts_and_leaves_out_what_a_follower_writes() {
    let lease = lease(
        &[(HOLDER_IDENTITY_LABEL, HOLDER_IS_POD)],
        &[(WRITERS_ANNOTATION, "ctl"), (WRITERS_EXEMPT_ANNOTATION, "configmaps,deployments.apps")],
        None,
    );
    let opt_in = OptIn::of(&lease).ok().flatten().expect("opted in");
    assert_eq!(opt_in.path(), "/writer/team/ctl");
    let cel = opt_in.match_condition();
    assert!(cel.starts_with("request.userInfo.username in ['system:serviceaccount:team:ctl']"), "{cel}");
    for part in [
        "request.namespace == 'team' && request.name == 'ctl'",
        "request.resource.resource == 'events'",
        "'authentication.k8s.io', 'authorization.k8s.io'",
        "request.resource.resource == 'configmaps' && request.resource.group == ''",
        "request.resource.resource == 'deployments' && request.resource.group == 'apps'",
    ] {
        assert!(cel.contains(part), "{part} in {cel}");
    }
}
