//! Item 1: the admission decision in-process — the whole per-request path of the server minus
//! the network: parse the AdmissionReview JSON → reduce to facts → the pipeline the server runs
//! (plan, the lease from the cache — the in-memory `FakeLeases` — verdict) → serialize the
//! response. Beside it the same judgement through kube's owned
//! `AdmissionRequest` and `AdmissionResponse` (the webhook's path before its borrowed request
//! type), to show what copying the request's strings costs.

use std::hint::black_box;
use std::time::{Duration, Instant};

use futures::FutureExt;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use kube_fence::admission::http::review::{self as server, Admission, Guardable};
use kube_fence::admission::judge::facts::{LeaseFacts, Operation, Request};
use kube_fence::admission::judge::fake::FakeLeases;
use kube_fence::admission::judge::pipeline::{self, Judging, Sent};
use kube_fence::admission::judge::verdict::Verdict;
use kube_fence_api::denial::Reason;
use kube_fence_api::names::{LEASE_LABEL, TOKEN_ANNOTATION};
use kube_fence_api::token::Token;
use serde_json::json;

use crate::Args;
use crate::report::{Table, rate, us};

/// Object sizes measured: 1 KiB, 64 KiB, 1 MiB.
pub const SIZES: [(usize, &str); 3] = [(1024, "1 KiB"), (64 * 1024, "64 KiB"), (1024 * 1024, "1 MiB")];

/// The lease every bench review is bound to, and the token it issued.
pub const LEASE: &str = "work";
pub const ISSUED: u64 = 1_000_000_000;

/// A ConfigMap of about `size` bytes as JSON: many 64-byte values, like real configuration (one
/// giant string would flatter the parser). Its fields come in the order the API server writes
/// them (its Go types': `kind`, `apiVersion`, `metadata` with `managedFields`, then `data`), not
/// sorted: a decoder that meets `data` before `metadata` has to keep it, and sorted JSON would
/// make the bench measure a body no API server sends.
pub fn configmap(name: &str, namespace: &str, size: usize, token: u64) -> String {
    let mut data = Vec::new();
    let value = "v".repeat(64);
    let mut i = 0;
    while (i + 1) * 80 < size.saturating_sub(300) || i == 0 {
        data.push(format!(r#""key-{i:06}":"{value}""#));
        i += 1;
    }
    let metadata = format!(
        r#"{{"name":{name},"namespace":{namespace},"uid":"0f0e0d0c-0b0a-0908-0706-050403020100","resourceVersion":"12345","creationTimestamp":"2026-12-03T08:00:00Z","labels":{{"{LEASE_LABEL}":"{LEASE}","app":"bench"}},"annotations":{{"{TOKEN_ANNOTATION}":"{token}"}},"managedFields":[{{"manager":"worker","operation":"Update","apiVersion":"v1","time":"2026-12-03T08:00:00Z","fieldsType":"FieldsV1","fieldsV1":{{"f:data":{{}},"f:metadata":{{"f:annotations":{{".":{{}},"f:{TOKEN_ANNOTATION}":{{}}}},"f:labels":{{".":{{}},"f:app":{{}},"f:{LEASE_LABEL}":{{}}}}}}}}}}]}}"#,
        name = json!(name),
        namespace = json!(namespace),
    );
    format!(r#"{{"kind":"ConfigMap","apiVersion":"v1","metadata":{metadata},"data":{{{}}}}}"#, data.join(","))
}

/// An UPDATE review of a guarded ConfigMap of about `size` bytes (old and new object), whose new
/// token is valid: the common, admitted case. Written field by field in the API server's order.
pub fn review(namespace: &str, size: usize) -> Vec<u8> {
    let request = format!(
        r#"{{"uid":"705ab4f5-6393-11e8-b7cc-42010a800002","kind":{{"group":"","version":"v1","kind":"ConfigMap"}},"resource":{{"group":"","version":"v1","resource":"configmaps"}},"requestKind":{{"group":"","version":"v1","kind":"ConfigMap"}},"requestResource":{{"group":"","version":"v1","resource":"configmaps"}},"name":"bench","namespace":{namespace},"operation":"UPDATE","userInfo":{{"username":"system:serviceaccount:bench:worker","uid":"5a5f9d55-0c4c-4a9e-9b2e-2f1f3c4d5e6f","groups":["system:serviceaccounts","system:serviceaccounts:bench","system:authenticated"]}},"object":{object},"oldObject":{old},"dryRun":false,"options":{{"kind":"UpdateOptions","apiVersion":"meta.k8s.io/v1"}}}}"#,
        namespace = json!(namespace),
        object = configmap("bench", namespace, size, 1_001),
        old = configmap("bench", namespace, size, 1_000),
    );
    format!(r#"{{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1","request":{request}}}"#).into_bytes()
}

/// The bench review's lease, in the watch cache (the fake's).
fn lookup() -> FakeLeases {
    FakeLeases::default().with_cached("bench", LEASE, LeaseFacts { issued: Token::new(ISSUED), ..LeaseFacts::default() })
}

/// The server's per-request path: bytes in, response bytes out, and whether it admitted.
fn judge(body: &[u8], judging: &Judging, leases: &FakeLeases) -> (Vec<u8>, bool) {
    let Ok(request) = server::decode(body) else { return (Vec::new(), false) };
    judge_request(&request, judging, leases)
}

fn judge_request(request: &Admission<'_>, judging: &Judging, leases: &FakeLeases) -> (Vec<u8>, bool) {
    let verdict = judge_facts(&server::request_facts(request), judging, leases);
    (server::response(request, &verdict).to_vec(), verdict.is_allowed())
}

/// The decision from the facts, by the server's pipeline; the benchmark's writes are judged from
/// the cache (the lease is there and has seen the token).
fn judge_facts(facts: &Request, judging: &Judging, leases: &FakeLeases) -> Verdict {
    pipeline::judge(facts, judging, Sent::Objects, leases)
        .now_or_never()
        .unwrap_or_else(|| Verdict::deny(500, Reason::LeaseReadFailed, "the fake answers at once".into()))
}

/// The path before the borrowed request: kube's owned `AdmissionReview` (every string of the
/// request copied, `options` and `userInfo.extra` parsed whole), the same facts, kube's
/// `AdmissionResponse`.
fn judge_owned(body: &[u8], judging: &Judging, leases: &FakeLeases) -> (Vec<u8>, bool) {
    let Ok(review) = serde_json::from_slice::<AdmissionReview<Guardable>>(body) else { return (Vec::new(), false) };
    let Ok(request) = TryInto::<AdmissionRequest<Guardable>>::try_into(review) else { return (Vec::new(), false) };
    let facts = Request {
        operation: match request.operation {
            kube::core::admission::Operation::Create => Operation::Create,
            kube::core::admission::Operation::Update => Operation::Update,
            kube::core::admission::Operation::Delete => Operation::Delete,
            kube::core::admission::Operation::Connect => Operation::Connect,
        },
        namespace: request.namespace.clone().unwrap_or_default(),
        subresource: request.sub_resource.clone().filter(|s| !s.is_empty()),
        old: request.old_object.as_ref().map(server::object_facts),
        new: request.object.as_ref().map(server::object_facts),
        user: request.user_info.username.clone().unwrap_or_default(),
        pod: None,
        delete_precondition: false,
        resource: kube_fence::admission::judge::facts::GroupResource {
            group: request.resource.group.clone(),
            resource: request.resource.resource.clone(),
        },
        name: request.name.clone(),
    };
    let verdict = judge_facts(&facts, judging, leases);
    let mut response = AdmissionResponse::from(&request);
    if let Verdict::Deny { code, reason, message, facts } = &verdict {
        response.allowed = false;
        response.result = kube_fence_api::denial::status(*code, *reason, message, facts);
    }
    (serde_json::to_vec(&response.into_review()).unwrap_or_default(), verdict.is_allowed())
}

/// Runs `f` for about `secs` (after a short warm-up); (calls per second, mean time per call).
fn measure(secs: f64, mut f: impl FnMut() -> bool) -> (f64, Duration) {
    let warm = Instant::now();
    while warm.elapsed() < Duration::from_secs_f64(secs / 5.0) {
        black_box(f());
    }
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < Duration::from_secs_f64(secs) {
        for _ in 0..8 {
            black_box(f());
        }
        n += 8;
    }
    let elapsed = started.elapsed();
    (n as f64 / elapsed.as_secs_f64(), elapsed / u32::try_from(n).unwrap_or(u32::MAX))
}

pub fn run(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    eprintln!("[1] admission decision in-process ({} s per size)", args.decision_secs());
    let judging = Judging::default();
    let leases = lookup();
    for (size, label) in SIZES {
        let body = review("bench", size);
        anyhow::ensure!(judge(&body, &judging, &leases).1, "the bench review of {label} was not admitted");
        let (per_sec, each) = measure(args.decision_secs(), || judge(&body, &judging, &leases).1);
        let (before, before_each) = measure(args.decision_secs(), || judge_owned(&body, &judging, &leases).1);
        let mb_s = per_sec * body.len() as f64 / 1e6;
        table.add(
            "1",
            format!("decision in-process, {label} object (review {} KiB)", body.len() / 1024),
            format!("{} ({} each, {mb_s:.0} MB/s)", rate(per_sec, "req"), us(each)),
            format!("kube's owned AdmissionRequest: {} ({})", rate(before, "req"), us(before_each)),
            format!("{:.2}×", per_sec / before),
            "",
            crate::report::Met::Info,
        );
    }
    Ok(())
}

/// What `cargo test --all-targets` runs: the measured path admits the bench reviews and denies a
/// stale one. No timing.
pub fn smoke() -> anyhow::Result<()> {
    let judging = Judging::default();
    let leases = lookup();
    for (size, label) in SIZES {
        let body = review("bench", size);
        anyhow::ensure!(body.len() >= size, "the {label} review is {} bytes", body.len());
        let (response, allowed) = judge(&body, &judging, &leases);
        anyhow::ensure!(allowed, "the {label} review was not admitted: {}", String::from_utf8_lossy(&response));
        let (owned, owned_allowed) = judge_owned(&body, &judging, &leases);
        let answer = |body: &[u8]| serde_json::from_slice::<serde_json::Value>(body).map(|v| v["response"].clone()).unwrap_or_default();
        anyhow::ensure!(owned_allowed && answer(&owned)["uid"] == answer(&response)["uid"], "the two paths disagree for {label}");
    }
    let stale = String::from_utf8(review("bench", 1024))?.replace(r#""kubefence.io/token":"1001""#, r#""kubefence.io/token":"999""#);
    let (response, allowed) = judge(stale.as_bytes(), &judging, &leases);
    anyhow::ensure!(!allowed && String::from_utf8_lossy(&response).contains("StaleToken"), "a stale token was not denied");
    Ok(())
}
