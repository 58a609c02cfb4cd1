//! The delegated-grant path of the HA driver (issue 36, item 3): a holder ("parent", as a
//! controller that starts Jobs) acquires a kube-fence Lease and hands its grant to a consumer (the
//! Job's Pod: another user, with RBAC on ConfigMaps only — nothing on Leases), which writes
//! token-guarded ConfigMaps with the delegated token ([`Delegated`], what `Delegated::from_env`
//! reads in a Pod started by `Grant::delegate`): no renewal, no release, the parent's token.
//!
//! Each pair cycles: the parent acquires through one API server and keeps the lease alive (by hand
//! with a skewed clock while [`super::HaFault::ClientClockSkewed`] is in place) while the consumer
//! reads and writes each object of the lease through either API server — genuine writes, counted
//! under the fault in place; or, in a pause cycle, the consumer reads, then parent and consumer
//! stop past the lease (the parent crashed, the Job's Pod was paused or cut off) and the consumer
//! sends the delayed write: kube-fence must refuse it once a newer grant of the lease (another
//! parent's, through its own consumer) has written the object.
//!
//! Records, as for the main workers' leases: the Lease statuses and every version of the guarded
//! objects, seen by the watches through both API servers ([`super::record`]), judged by the
//! token rules of `history::check`. Leases and objects are named [`PREFIX`]`…`, which is how
//! [`super::Path::of`] tells this path's violations apart.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube_fence_api::{Lease, LeaseSpec};
use serde_json::json;

use super::{Availability, Beat, Fence, Path, Plane, World, Wrote, bounded, record_object};
use crate::torture::Rng;

/// Leases `ha-deleg-<i>` and their objects `ha-deleg-<i>-<j>`.
pub const PREFIX: &str = "ha-deleg-";
const LEASES: usize = 2;
const OBJECTS: usize = 2;

fn lease_name(i: usize) -> String {
    format!("{PREFIX}{i}")
}
fn object_name(i: usize, j: usize) -> String {
    format!("{PREFIX}{i}-{j}")
}

/// The parent of pair `k` (holds the lease) and its consumer (writes with the delegated token).
pub fn parent(k: usize) -> String {
    format!("parent-{k}")
}
pub fn consumer(k: usize) -> String {
    format!("job-{k}")
}

/// RBAC for the consumers: ConfigMaps in `ns`, nothing else (a Job's Pod needs no Lease rights to
/// write with a delegated grant).
pub async fn consumer_rbac(admin: &Client, ns: &str, users: &[String]) {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let pp = PatchParams::apply("kube-fence-tests").force();
    let role: Role = serde_json::from_value(json!({"metadata": {"name": "ha-job", "namespace": ns},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch", "patch", "update"]}]}))
    .expect("a literal");
    Api::<Role>::namespaced(admin.clone(), ns).patch("ha-job", &pp, &Patch::Apply(&role)).await.expect("consumer role");
    let subjects: Vec<serde_json::Value> =
        users.iter().map(|u| json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": u})).collect();
    let binding: RoleBinding = serde_json::from_value(json!({"metadata": {"name": "ha-job", "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "ha-job"}, "subjects": subjects}))
    .expect("a literal");
    Api::<RoleBinding>::namespaced(admin.clone(), ns).patch("ha-job", &pp, &Patch::Apply(&binding)).await.expect("consumer binding");
}

/// The path's Leases and their guarded objects (created with a first grant, then released).
pub async fn create(world: &World) {
    let leases: Api<Lease> = Api::namespaced(world.clients[super::ADMIN][0].clone(), &world.ns);
    for i in 0..LEASES {
        let spec = LeaseSpec { lease_duration_seconds: Some(world.config.lease_seconds), ..Default::default() };
        leases.create(&PostParams::default(), &Lease::new(&lease_name(i), spec)).await.expect("create a delegation lease");
        let grant = world.acquire(super::ADMIN, 0, &lease_name(i), "setup").await.expect("first grant");
        for j in 0..OBJECTS {
            let cm = ConfigMap {
                metadata: ObjectMeta { name: Some(object_name(i, j)), ..Default::default() },
                data: Some([("seq".to_string(), "0".to_string())].into()),
                ..Default::default()
            };
            let created = grant.create(&world.objects(super::ADMIN, 0), &cm).await.expect("create a delegated object");
            record_object(&world.recorder, &created);
        }
        let _ = world.leases(super::ADMIN, 0).release(&grant).await;
    }
}

/// Pair `k`: the parent acquires, the consumer writes with the delegated grant; see the module.
pub async fn worker(world: Arc<World>, k: usize) {
    let mut rng = Rng(world.config.seed ^ 0xDE1E_6A7E ^ (k as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let (holder, job) = (world.who_parent(k), world.who_consumer(k));
    let stats = &world.stats.paths;
    let p = Path::Delegated;
    while !world.stop.is_cancelled() {
        let lease = rng.below(LEASES as u64) as usize;
        let (via_lease, via_write) = (rng.below(2) as usize, rng.below(2) as usize);
        let Some(grant) = world.acquire(holder, via_lease, &lease_name(lease), &parent(k)).await else {
            tokio::time::sleep(rng.millis(100, 500)).await;
            continue;
        };
        // What the Job's Pod gets in KUBE_FENCE_GRANT: the lease and the token, nothing to renew.
        let delegated = grant.delegated();
        let fence = Fence::Delegated(&delegated);
        let writer = consumer(k);
        if rng.percent(world.config.pause_percent) {
            let object = object_name(lease, rng.below(OBJECTS as u64) as usize);
            if let Some(Ok(read)) = bounded(world.objects(job, via_write).get(&object)).await {
                tokio::time::sleep(Duration::from_secs(u64::from(world.config.lease_seconds)) + rng.millis(300, 1_500)).await;
                let outcome = match world.write_as(job, via_write, fence, &writer, &object, &read, "delayed").await {
                    Wrote::Accepted => "accepted",
                    Wrote::Stale => "refused",
                    Wrote::Failed(_) => "failed",
                };
                stats.delayed(p, outcome);
            }
        } else {
            let skew = world.skew(&mut rng);
            let beat = Beat::start(&world.clients[holder][via_lease], &world.ns, &grant, skew, world.stats.skewed_heartbeats.clone());
            for j in 0..OBJECTS {
                // With a skewed clock the holder writes its last object a lease and a half after its
                // first: by then it holds only by the heartbeats its skewed clock wrote.
                if j > 0 && j + 1 == OBJECTS && skew.is_some() {
                    tokio::time::sleep(grant.duration * 3 / 2).await;
                }
                if !beat.holding() {
                    break;
                }
                let object = object_name(lease, j);
                let during = world.stats.current();
                let sent = Instant::now();
                let count = |f: fn(&mut Availability) -> &mut u64| stats.count(p, during, f);
                count(|a| &mut a.attempted);
                let read = match bounded(world.objects(job, via_write).get(&object)).await {
                    Some(Ok(read)) => read,
                    other => {
                        count(|a| &mut a.failed);
                        stats.via(p, during, via_write, true);
                        world.stats.cause(during, via_write, format!("[{}] {}", p.describe(), super::read_cause(other)));
                        break;
                    }
                };
                let wrote = world.write_as(job, via_write, fence, &writer, &object, &read, "normal").await;
                stats.via(p, during, via_write, matches!(wrote, Wrote::Failed(_)));
                match wrote {
                    Wrote::Accepted => {
                        count(|a| &mut a.admitted);
                        stats.slowest(p, during, sent.elapsed().as_millis() as u64);
                    }
                    Wrote::Stale => {
                        count(|a| &mut a.refused);
                        break;
                    }
                    Wrote::Failed(why) => {
                        count(|a| &mut a.failed);
                        world.stats.cause(during, via_write, format!("[{}] {why}", p.describe()));
                        break;
                    }
                }
            }
            beat.stop().await;
        }
        let _ = bounded(world.leases(holder, via_lease).release(&grant)).await;
        tokio::time::sleep(rng.millis(0, 100)).await;
    }
}

/// The scripted stale write on this path, as [`super::planted`]: parent 0 acquires through A and
/// its consumer reads through A; a cut keeps both from A past the lease while parent 1 is granted
/// through B and its consumer writes through B; the cut heals and consumer 0's delayed write (the
/// old token) goes to A. `Some(true)`: accepted (a violation the checker must report).
pub async fn planted(plane: &Plane, world: &World) -> Option<bool> {
    use kube_fence_testenv::ha::{Partition, Source};
    let (lease, object) = (lease_name(0), object_name(0, 0));
    let old = world.acquire(world.who_parent(0), 0, &lease, &parent(0)).await?;
    let read = bounded(world.objects(world.who_consumer(0), 0).get(&object)).await?.ok()?;
    plane.call(|ha| ha.partition(Partition::ClientFromApi { api: 0, source: Source::Workers }).map_err(|e| format!("{e:#}"))).await.ok()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let new = loop {
        if let Some(g) = world.acquire(world.who_parent(1), 1, &lease, &parent(1)).await {
            break g;
        }
        if Instant::now() > deadline {
            return None;
        }
    };
    let fresh = bounded(world.objects(world.who_consumer(1), 1).get(&object)).await?.ok()?;
    let handed = new.delegated();
    let newer =
        world.write_as(world.who_consumer(1), 1, Fence::Delegated(&handed), &consumer(1), &object, &fresh, "planted-successor").await;
    let _ = bounded(world.leases(world.who_parent(1), 1).release(&new)).await;
    plane.call(|ha| ha.heal().map_err(|e| format!("{e:#}"))).await.ok()?;
    plane.whole(Duration::from_secs(60)).await.ok()?;
    if !matches!(newer, Wrote::Accepted) {
        return None;
    }
    let stale = old.delegated();
    match world.write_as(world.who_consumer(0), 0, Fence::Delegated(&stale), &consumer(0), &object, &read, "planted-stale").await {
        Wrote::Accepted => Some(true),
        Wrote::Stale => Some(false),
        Wrote::Failed(_) => None,
    }
}
