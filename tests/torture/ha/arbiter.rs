//! The PostgreSQL arbiter path of the HA driver (issue 36, item 3): holders acquire kube-fence
//! Leases through either API server and commit effects to PostgreSQL under their tokens, the
//! fence checked by the database in the transaction of the effect — the transaction of
//! `examples/pg_arbiter.rs`:
//!
//! ```sql
//! UPDATE fence SET last_fence = $token WHERE resource = $resource AND last_fence < $token;
//! -- 0 rows: a newer token already wrote this resource — roll back, nothing of ours sticks
//! INSERT INTO effects (resource, token, holder, value) VALUES (...);
//! ```
//!
//! PostgreSQL is Debian's, started by the run as tests/arbiter.rs starts it
//! ([`crate::common::postgres`]): a Unix socket in a temporary directory, no TCP at all, so its
//! traffic touches no network, the host's or the topology's. Network faults reach this path
//! through the grants (acquired and renewed through the API servers the nemesis cuts and kills),
//! not through the database: a holder cut from its API server keeps committing, its lease
//! expires, a successor is granted through the other API server and commits, and the old holder's
//! next commit must find 0 rows.
//!
//! Records: the grants from the Lease watches (as every kube-fence lease's), the effects from the
//! database itself — `effects` read back at the end in commit order (`seq` is taken under the
//! fence row's lock), each an accepted write of object `pg/<resource>` with its token at position
//! `seq`, judged by the token rules of `history::check`. Never what a holder believed.
//!
//! The planted fault for this path (`fenced: false`) is not the webhook — the database fences it
//! whether kube-fence's webhook is registered or not — but the arbiter's own check dropped: the
//! `UPDATE` without `AND last_fence < $token` (`examples/pg_arbiter.rs --unfenced`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::api::{Api, PostParams};
use kube_fence::client::Grant;
use kube_fence_api::token::Token;
use kube_fence_api::{Lease, LeaseSpec};
use kube_fence_test_support::history::Observation;
use tokio_postgres::NoTls;

use super::{Availability, Beat, Path, Plane, World, bounded};
use crate::torture::Rng;

/// Leases `ha-pg-<i>`, resources `ha-pg-<i>-<j>`.
pub const PREFIX: &str = "ha-pg-";
/// The recorded history names a resource's effects `pg/<resource>`.
pub const OBJECT_PREFIX: &str = "pg/";
const LEASES: usize = 2;
const RESOURCES: usize = 2;

fn lease_name(i: usize) -> String {
    format!("{PREFIX}{i}")
}
fn resource(i: usize, j: usize) -> String {
    format!("{PREFIX}{i}-{j}")
}
/// The holder (and user) of arbiter worker `k`.
pub fn holder(k: usize) -> String {
    format!("pg-{k}")
}

/// The arbiter itself, as `examples/pg_arbiter.rs` ships it (its schema and its transaction),
/// compiled in here so that this path judges exactly that code.
#[path = "../../../examples/pg_arbiter.rs"]
#[allow(dead_code)]
mod example;
use example::{Outcome, SCHEMA};

/// What the arbiter decided.
pub enum Committed {
    Written,
    /// 0 rows: a token at least as new already wrote the resource.
    Refused,
    Failed(String),
}

pub async fn connect(conninfo: &str) -> tokio_postgres::Client {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match tokio_postgres::connect(conninfo, NoTls).await {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                return client;
            }
            Err(err) => {
                assert!(Instant::now() < deadline, "no connection to the arbiter's PostgreSQL within 60 s: {err}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// The tables, and the path's Leases.
pub async fn create(world: &World, db: &tokio_postgres::Client) {
    db.batch_execute(SCHEMA).await.expect("the arbiter's schema");
    let leases: Api<Lease> = Api::namespaced(world.clients[super::ADMIN][0].clone(), &world.ns);
    for i in 0..LEASES {
        let spec = LeaseSpec { lease_duration_seconds: Some(world.config.lease_seconds), ..Default::default() };
        leases.create(&PostParams::default(), &Lease::new(&lease_name(i), spec)).await.expect("create an arbiter lease");
    }
}

/// Commits `holder`'s effect on `resource` under `grant`'s token, in one transaction with the
/// fence (`fenced`: the arbiter's check in place; without it, the planted fault).
async fn commit(db: &mut tokio_postgres::Client, resource: &str, grant: &Grant, note: &str, fenced: bool) -> Committed {
    let value = format!("{} with token {}: {note}", grant.holder, grant.token);
    let run = example::fenced_write(db, resource, grant.token, &grant.holder, &value, fenced);
    match bounded(run).await {
        Some(Ok(Outcome::Written { .. })) => Committed::Written,
        Some(Ok(Outcome::Refused { .. })) => Committed::Refused,
        Some(Err(e)) => Committed::Failed(format!(
            "PostgreSQL: {}",
            e.as_db_error().map_or("connection error".to_string(), |d| d.code().code().to_string())
        )),
        None => Committed::Failed("PostgreSQL: client timeout (8 s)".into()),
    }
}

/// Arbiter worker `k`: acquire, commit an effect on each resource of the lease while holding (a
/// genuine write), or prepare, stop past the lease and commit late (the delayed write); release.
pub async fn worker(world: Arc<World>, k: usize) {
    let mut rng = Rng(world.config.seed ^ 0x0A4B_17E4 ^ (k as u64 + 1).wrapping_mul(0x94D0_49BB_1331_11EB));
    let mut db = connect(&world.conninfo).await;
    let me = world.who_arbiter(k);
    let stats = &world.stats.paths;
    let p = Path::Arbiter;
    let fenced = world.config.fenced;
    while !world.stop.is_cancelled() {
        let lease = rng.below(LEASES as u64) as usize;
        let via_lease = rng.below(2) as usize;
        let Some(grant) = world.acquire(me, via_lease, &lease_name(lease), &holder(k)).await else {
            tokio::time::sleep(rng.millis(100, 500)).await;
            continue;
        };
        if rng.percent(world.config.pause_percent) {
            let target = resource(lease, rng.below(RESOURCES as u64) as usize);
            tokio::time::sleep(Duration::from_secs(u64::from(world.config.lease_seconds)) + rng.millis(300, 1_500)).await;
            let outcome = match commit(&mut db, &target, &grant, "delayed", fenced).await {
                Committed::Written => "accepted",
                Committed::Refused => "refused",
                Committed::Failed(_) => "failed",
            };
            stats.delayed(p, outcome);
        } else {
            let skew = world.skew(&mut rng);
            let beat = Beat::start(&world.clients[me][via_lease], &world.ns, &grant, skew, world.stats.skewed_heartbeats.clone());
            for j in 0..RESOURCES {
                // With a skewed clock the holder writes its last object a lease and a half after its
                // first: by then it holds only by the heartbeats its skewed clock wrote.
                if j > 0 && j + 1 == RESOURCES && skew.is_some() {
                    tokio::time::sleep(grant.duration * 3 / 2).await;
                }
                if !beat.holding() {
                    break;
                }
                let during = world.stats.current();
                let sent = Instant::now();
                let count = |f: fn(&mut Availability) -> &mut u64| stats.count(p, during, f);
                count(|a| &mut a.attempted);
                match commit(&mut db, &resource(lease, j), &grant, "normal", fenced).await {
                    Committed::Written => {
                        count(|a| &mut a.admitted);
                        stats.slowest(p, during, sent.elapsed().as_millis() as u64);
                    }
                    Committed::Refused => {
                        count(|a| &mut a.refused);
                        break;
                    }
                    Committed::Failed(why) => {
                        count(|a| &mut a.failed);
                        world.stats.cause(during, super::NOT_VIA_API, format!("[{}] {why}", p.describe()));
                        break;
                    }
                }
            }
            beat.stop().await;
        }
        let _ = bounded(world.leases(me, via_lease).release(&grant)).await;
        tokio::time::sleep(rng.millis(0, 100)).await;
    }
}

/// The scripted stale write on this path, as [`super::planted`]: holder 0 is granted through A
/// and prepares; a cut keeps it from A past its lease while holder 1 is granted through B and
/// commits; the cut heals and holder 0 commits with its old token. `Some(true)`: the effect
/// landed (fenced: never; the arbiter's check dropped: a violation the checker must report).
pub async fn planted(plane: &Plane, world: &World) -> Option<bool> {
    use kube_fence_testenv::ha::{Partition, Source};
    let mut db = connect(&world.conninfo).await;
    let fenced = world.config.fenced;
    let (lease, target) = (lease_name(0), resource(0, 0));
    let old = world.acquire(world.who_arbiter(0), 0, &lease, &holder(0)).await?;
    plane.call(|ha| ha.partition(Partition::ClientFromApi { api: 0, source: Source::Workers }).map_err(|e| format!("{e:#}"))).await.ok()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let new = loop {
        if let Some(g) = world.acquire(world.who_arbiter(1), 1, &lease, &holder(1)).await {
            break g;
        }
        if Instant::now() > deadline {
            return None;
        }
    };
    let newer = commit(&mut db, &target, &new, "planted-successor", fenced).await;
    let _ = bounded(world.leases(world.who_arbiter(1), 1).release(&new)).await;
    plane.call(|ha| ha.heal().map_err(|e| format!("{e:#}"))).await.ok()?;
    plane.whole(Duration::from_secs(60)).await.ok()?;
    if !matches!(newer, Committed::Written) {
        return None;
    }
    match commit(&mut db, &target, &old, "planted-stale", fenced).await {
        Committed::Written => Some(true),
        Committed::Refused => Some(false),
        Committed::Failed(_) => None,
    }
}

/// The effects the database committed, in commit order: accepted writes of `pg/<resource>`.
pub async fn effects(db: &tokio_postgres::Client) -> Vec<Observation> {
    let rows = db.query("SELECT seq, resource, token FROM effects ORDER BY seq", &[]).await.expect("read the effects back");
    rows.iter()
        .filter_map(|row| {
            let (seq, resource, token): (i64, String, i64) = (row.get(0), row.get(1), row.get(2));
            let lease = resource.rsplit_once('-').map(|(lease, _)| lease.to_string())?;
            let token = u64::try_from(token).ok().and_then(Token::new)?;
            Some(Observation::Write { object: format!("{OBJECT_PREFIX}{resource}"), lease, token, resource_version: seq.unsigned_abs() })
        })
        .collect()
}
